"""The reference engine's model: a Llama-architecture decoder in torch.

RMSNorm, rotary position embeddings (Hugging Face's half-rotation layout,
with Llama-3 frequency scaling), grouped-query attention and a SwiGLU MLP.
Weights are either seeded random (any model profile; the `tiny` profile runs
anywhere on a CPU) or read from a local Hugging Face checkpoint directory
(`config.json`, `*.safetensors`, `tokenizer.json`).  Nothing is downloaded.

Compute is float32; the KV cache is stored in the profile's KV dtype.
"""
from __future__ import annotations

import math
import pathlib
from dataclasses import dataclass

import torch

from tract_cli.core.errors import UsageError
from tract_cli.core.geometry import (DEFAULT_BLOCK_TOKENS, DTYPES, Geometry, ModelProfile,
                                     normalize_dtype)
from tract_cli.serve.checkpoint import read_safetensors
from tract_cli.serve.tokenizer import read_json

# the KV dtypes the reference engine computes in (of core.geometry.DTYPES; fp8 is not one)
_ENGINE_KV = ("f32", "f16", "bf16")


@dataclass(frozen=True)
class ModelConfig:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_positions: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    kv_dtype: str = "f32"
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    tie_embeddings: bool = False
    rope_scaling: tuple = ()          # sorted (key, value) pairs of a llama3 scaling, or ()

    def __post_init__(self):
        if self.num_heads % self.num_kv_heads:
            raise UsageError(f"{self.num_heads} attention heads are not a multiple of "
                             f"{self.num_kv_heads} KV heads", "fix the model configuration")
        if self.kv_dtype not in _ENGINE_KV:
            raise UsageError(f"the reference engine stores KV as f32, f16 or bf16, not {self.kv_dtype}",
                             "use a profile with one of those dtypes")

    @property
    def geometry(self) -> Geometry:
        return Geometry(self.num_layers, self.num_kv_heads, self.head_dim, self.kv_dtype,
                        self.block_tokens)

    @property
    def kv_torch_dtype(self) -> torch.dtype:
        return getattr(torch, DTYPES[self.kv_dtype].torch)

    @classmethod
    def from_profile(cls, profile: ModelProfile) -> "ModelConfig":
        a, g = profile.arch, profile.geometry
        missing = [k for k in ("hidden_size", "num_attention_heads", "intermediate_size",
                               "vocab_size") if k not in a]
        if missing:
            raise UsageError(f"model profile {profile.name} lacks architecture fields "
                             f"{', '.join(missing)}", "add them to its TOML file")
        return cls(name=profile.name, hidden_size=int(a["hidden_size"]), num_layers=g.num_layers,
                   num_heads=int(a["num_attention_heads"]), num_kv_heads=g.num_kv_heads,
                   head_dim=g.head_dim, intermediate_size=int(a["intermediate_size"]),
                   vocab_size=int(a["vocab_size"]),
                   max_positions=int(a.get("max_position_embeddings", 8192)),
                   rope_theta=float(a.get("rope_theta", 10000.0)),
                   rms_norm_eps=float(a.get("rms_norm_eps", 1e-5)), kv_dtype=g.dtype,
                   block_tokens=g.block_tokens)

    @classmethod
    def from_hf(cls, model_dir: pathlib.Path, config: dict) -> "ModelConfig":
        if config.get("model_type") not in ("llama", "mistral"):
            raise UsageError(f"{model_dir}: model_type {config.get('model_type')!r} is not a "
                             "Llama-family decoder", "pass a Llama or Mistral checkpoint")
        if config.get("sliding_window"):
            raise UsageError(f"{model_dir}: sliding-window attention is not supported",
                             "pass a checkpoint with full attention")
        try:
            heads = int(config["num_attention_heads"])
            hidden = int(config["hidden_size"])
            scaling = config.get("rope_scaling") or {}
            if scaling and scaling.get("rope_type", scaling.get("type")) != "llama3":
                raise UsageError(f"{model_dir}: rope scaling {scaling} is not supported",
                                 "use a checkpoint without rope scaling or with llama3 scaling")
            name = model_dir.resolve().name[:31] or "checkpoint"
            return cls(name=name, hidden_size=hidden, num_layers=int(config["num_hidden_layers"]),
                       num_heads=heads, num_kv_heads=int(config.get("num_key_value_heads", heads)),
                       head_dim=int(config.get("head_dim") or hidden // heads),
                       intermediate_size=int(config["intermediate_size"]),
                       vocab_size=int(config["vocab_size"]),
                       max_positions=int(config.get("max_position_embeddings", 8192)),
                       rope_theta=float(config.get("rope_theta", 10000.0)),
                       rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
                       kv_dtype=normalize_dtype(config.get("torch_dtype", "bf16")),
                       tie_embeddings=bool(config.get("tie_word_embeddings", False)),
                       rope_scaling=tuple(sorted((k, v) for k, v in scaling.items()
                                                 if k in ("factor", "low_freq_factor",
                                                          "high_freq_factor",
                                                          "original_max_position_embeddings"))))
        except KeyError as exc:
            raise UsageError(f"{model_dir}/config.json lacks {exc.args[0]}",
                             "pass a complete Hugging Face config") from None
        except (TypeError, ValueError) as exc:
            raise UsageError(f"{model_dir}/config.json has a malformed field: {exc}",
                             "fix config.json") from None


def _inv_freq(cfg: ModelConfig) -> torch.Tensor:
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    if cfg.rope_scaling:
        s = dict(cfg.rope_scaling)
        factor, lo, hi = s.get("factor", 8.0), s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old = s.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > old / lo, inv / factor, inv)
        smooth = (old / wavelen - lo) / (hi - lo)
        medium = (wavelen >= old / hi) & (wavelen <= old / lo)
        inv = torch.where(medium, (1 - smooth) * scaled / factor + smooth * scaled, scaled)
    return inv.to(torch.float32)


def expected_shapes(c: ModelConfig) -> dict:
    """Tensor name -> shape of a Llama checkpoint with configuration C."""
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    shapes = {"model.embed_tokens.weight": (c.vocab_size, c.hidden_size),
              "model.norm.weight": (c.hidden_size,)}
    if not c.tie_embeddings:
        shapes["lm_head.weight"] = (c.vocab_size, c.hidden_size)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        shapes.update({p + "input_layernorm.weight": (c.hidden_size,),
                       p + "post_attention_layernorm.weight": (c.hidden_size,),
                       p + "self_attn.q_proj.weight": (q, c.hidden_size),
                       p + "self_attn.k_proj.weight": (kv, c.hidden_size),
                       p + "self_attn.v_proj.weight": (kv, c.hidden_size),
                       p + "self_attn.o_proj.weight": (c.hidden_size, q),
                       p + "mlp.gate_proj.weight": (c.intermediate_size, c.hidden_size),
                       p + "mlp.up_proj.weight": (c.intermediate_size, c.hidden_size),
                       p + "mlp.down_proj.weight": (c.hidden_size, c.intermediate_size)})
    return shapes


class LlamaModel:
    """Weights in Hugging Face names; `forward` runs one chunk of positions."""

    def __init__(self, cfg: ModelConfig, weights: dict):
        self.cfg = cfg
        self._check(weights)
        self.w = weights
        self.inv_freq = _inv_freq(cfg)
        self.lm_head = weights["model.embed_tokens.weight"] if cfg.tie_embeddings \
            else weights["lm_head.weight"]

    def _check(self, weights: dict) -> None:
        for name, shape in expected_shapes(self.cfg).items():
            if name not in weights:
                raise UsageError(f"the checkpoint lacks tensor {name}",
                                 "pass a complete Llama checkpoint")
            if tuple(weights[name].shape) != shape:
                raise UsageError(f"tensor {name} has shape {tuple(weights[name].shape)}, "
                                 f"config.json says {shape}", "the checkpoint and config disagree")

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0) -> "LlamaModel":
        """Seeded random weights: the same seed gives the same model everywhere."""
        gen = torch.Generator().manual_seed(seed)
        weights = {}
        for name, shape in expected_shapes(cfg).items():
            if len(shape) == 1:
                weights[name] = torch.ones(shape)
            else:
                scale = 1.0 if "embed" in name else 1.0 / math.sqrt(shape[1])
                weights[name] = torch.randn(shape, generator=gen) * scale
        return cls(cfg, weights)

    @classmethod
    def from_checkpoint(cls, model_dir: pathlib.Path) -> "LlamaModel":
        model_dir = pathlib.Path(model_dir)
        if not model_dir.is_dir():
            raise UsageError(f"{model_dir} is not a directory",
                             "pass a Hugging Face checkpoint directory (config.json, *.safetensors)")
        cfg = ModelConfig.from_hf(model_dir, read_json(model_dir / "config.json"))
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise UsageError(f"{model_dir} has no .safetensors files",
                             "convert the checkpoint to safetensors")
        weights = {}
        for f in files:
            weights.update(read_safetensors(f))
        return cls(cfg, weights)

    # ---- compute ----

    def _rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.cfg.rms_norm_eps) * w

    def _rope(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        ang = pos[:, None].to(torch.float32) * self.inv_freq[None, :]        # (S, d/2)
        cos = torch.cat([ang.cos(), ang.cos()], -1)[:, None, :]
        sin = torch.cat([ang.sin(), ang.sin()], -1)[:, None, :]
        half = x.shape[-1] // 2
        rot = torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos + rot * sin

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int, table) -> torch.Tensor:
        """Runs positions start..start+S-1 (one block at most), writing their KV
        into TABLE and attending over every earlier position; returns the
        float32 logits of the last position."""
        c, w = self.cfg, self.w
        S = tokens.shape[0]
        n = start + S
        pos = torch.arange(start, n)
        x = w["model.embed_tokens.weight"][tokens]
        group = c.num_heads // c.num_kv_heads
        # causal mask of the chunk's queries over all n keys
        mask = torch.ones(S, n, dtype=torch.bool).tril(diagonal=start)
        scale = 1.0 / math.sqrt(c.head_dim)
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            h = self._rms(x, w[p + "input_layernorm.weight"])
            q = (h @ w[p + "self_attn.q_proj.weight"].T).view(S, c.num_heads, c.head_dim)
            k = (h @ w[p + "self_attn.k_proj.weight"].T).view(S, c.num_kv_heads, c.head_dim)
            v = (h @ w[p + "self_attn.v_proj.weight"].T).view(S, c.num_kv_heads, c.head_dim)
            q, k = self._rope(q, pos), self._rope(k, pos)
            table.write(i, start, k, v)
            K = table.gather(i, 0, n).permute(1, 0, 2).contiguous()         # (kvh, n, d)
            V = table.gather(i, 1, n).permute(1, 0, 2).contiguous()
            # the query heads sharing a KV head, as one (group * S) x d matrix
            qg = q.view(S, c.num_kv_heads, group, c.head_dim).permute(1, 2, 0, 3) \
                .reshape(c.num_kv_heads, group * S, c.head_dim)
            att = torch.bmm(qg, K.transpose(1, 2)) * scale                      # (kvh, g*S, n)
            att = att.view(c.num_kv_heads, group, S, n).masked_fill(~mask, float("-inf"))
            att = att.softmax(-1).view(c.num_kv_heads, group * S, n)
            o = torch.bmm(att, V).view(c.num_kv_heads, group, S, c.head_dim) \
                .permute(2, 0, 1, 3).reshape(S, -1)
            x = x + o @ w[p + "self_attn.o_proj.weight"].T
            h = self._rms(x, w[p + "post_attention_layernorm.weight"])
            gate = h @ w[p + "mlp.gate_proj.weight"].T
            up = h @ w[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
        x = self._rms(x[-1:], w["model.norm.weight"])
        return (x @ self.lm_head.T)[0]
