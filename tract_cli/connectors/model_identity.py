"""The identity of the model a vLLM instance serves: what enters every pool key
the connector makes, so one model's KV never reaches another's requests.

A region's own fingerprint (`core/geometry.py`) names only a KV *format*
(layers, heads, head size, dtype): a base model and its instruct tune, two
fine-tunes or a quantized variant share it, and would share each other's
blocks.  What makes KV differ is the weights and what the engine does with
them, so the identity is a SHA-256 over:

- the weights (`core/weights.py`: per weight file its name, size, tensor
  headers and samples of every tensor's bytes, or every byte with
  `weights_digest: "full"`);
- the effective model config (vLLM's `hf_config`, overrides applied, less
  its path-dependent private keys), the compute dtype, the KV cache dtype,
  the quantization method, and the operator's `model_id`, if given.

An edit of a handful of weight elements can escape the sampled digest;
`weights_digest: "full"` or a `model_id` that changes with the weights
closes that.  The tokenizer is not part of it: keys are made from token ids,
and KV depends on the ids, not on how text became them.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tract_cli.core.errors import TractError
from tract_cli.core.weights import weights_fingerprint

if TYPE_CHECKING:
    from vllm.config import VllmConfig

# hf_config keys that name where or how a checkpoint was loaded, not what it computes
_PATH_KEYS = ("transformers_version", "name_or_path")


@dataclass(frozen=True)
class ModelIdentity:
    """A served model's identity: DIGEST (32 bytes) and how it was made (for logs)."""

    digest: bytes
    weight_files: int
    tensors: int
    seconds: float
    source: str                   # the directory whose weights were read

    @property
    def tag(self) -> bytes:
        """The 16 bytes the connector mixes into every pool key."""
        return self.digest[:16]

    def short(self) -> str:
        return self.digest.hex()[:16]


def served_model_identity(vllm_config: "VllmConfig", model_id: str | None = None,
                          weights_digest: str = "sampled") -> ModelIdentity:
    """The identity of the model VLLM_CONFIG serves (see the module docstring)."""
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    t0 = time.perf_counter()
    directory = checkpoint_dir(mc.model, getattr(mc, "revision", None))
    files, tensors, weights = weights_fingerprint(directory, weights_digest)
    doc = {
        "format": "tract-model-identity-v1",
        "weights": weights,
        "hf_config": _config_dict(mc.hf_config),
        "dtype": str(mc.dtype),
        "kv_cache_dtype": str(cc.cache_dtype),
        "calculate_kv_scales": bool(getattr(cc, "calculate_kv_scales", False)),
        "quantization": str(mc.quantization),
        "model_id": model_id or "",
    }
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).digest()
    return ModelIdentity(digest, files, tensors, time.perf_counter() - t0, directory)


def checkpoint_dir(model: str, revision: str | None = None) -> str:
    """The local directory of MODEL's weights: MODEL itself, or its snapshot in the
    Hugging Face cache (vLLM downloaded it before the connector starts)."""
    if os.path.isdir(model):
        return os.path.realpath(model)
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, revision=revision, local_files_only=True)
    except Exception:       # any failure of the cache look-up means: not found locally
        raise TractError(f"cannot find the weights of {model} on this host to identify the model",
                         "serve a local checkpoint directory (--model DIR)") from None


def _config_dict(hf_config) -> dict:
    """The model config as it computes, without keys that name a path or a library version."""
    try:
        d = hf_config.to_dict()
    except AttributeError:
        d = dict(vars(hf_config))
    return {k: v for k, v in d.items() if not k.startswith("_") and k not in _PATH_KEYS}
