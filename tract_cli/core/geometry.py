"""KV block geometry and model profiles (tract_cli/profiles/models/*.toml).

A block slot's payload is layer-major: [layer][K|V][token][kv_head][head_dim],
so one layer of one block is one contiguous range (docs/FORMAT.md §5).
"""
from __future__ import annotations

import dataclasses
import hashlib
import pathlib
from dataclasses import dataclass, field
from typing import NamedTuple

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from tract_cli.core.errors import UsageError
from tract_cli.core.native import lib


class KVDType(NamedTuple):
    """One KV element type: the core's code and size, and how numpy and torch view it."""

    code: int       # TRACT_DTYPE_* (tract.h), recorded in the header
    size: int       # bytes per element, the core's tract_dtype_size
    numpy: str      # the numpy dtype of a view (bf16 as its raw uint16)
    torch: str      # the torch dtype of a view (fp8 as its raw uint8)


def _kv_dtype(code: int, numpy: str, torch: str) -> KVDType:
    return KVDType(code, lib.tract_dtype_size(code), numpy, torch)


# the one dtype table of the package, by the names profiles use
DTYPES = {"f16": _kv_dtype(lib.TRACT_DTYPE_F16, "float16", "float16"),
          "bf16": _kv_dtype(lib.TRACT_DTYPE_BF16, "uint16", "bfloat16"),
          "f32": _kv_dtype(lib.TRACT_DTYPE_F32, "float32", "float32"),
          "fp8": _kv_dtype(lib.TRACT_DTYPE_FP8, "uint8", "uint8")}
DTYPE_NAMES = {d.code: name for name, d in DTYPES.items()}
_DTYPE_ALIASES = {"float16": "f16", "fp16": "f16", "half": "f16", "bfloat16": "bf16",
                  "float32": "f32", "fp32": "f32", "float": "f32", "float8": "fp8",
                  "fp8_e4m3": "fp8"}

# the shipped profiles, KIND/NAME.toml: package data, so they lie beside the code
# in a checkout, an editable install and a wheel alike
PROFILES_DIR = pathlib.Path(__file__).resolve().parents[1] / "profiles"


# tokens per KV block unless a profile or config says otherwise (vLLM's default too)
DEFAULT_BLOCK_TOKENS = 16


@dataclass(frozen=True)
class Geometry:
    """The shape of one KV block: what a slot holds and how it is laid out."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bf16"
    block_tokens: int = DEFAULT_BLOCK_TOKENS

    def __post_init__(self):
        object.__setattr__(self, "dtype", normalize_dtype(self.dtype))
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise UsageError(f"geometry field {name} must be a positive integer, got {value!r}",
                                 "fix the model profile")

    @property
    def dtype_code(self) -> int:
        return DTYPES[self.dtype].code

    @property
    def dtype_bytes(self) -> int:
        return DTYPES[self.dtype].size

    @property
    def bytes_per_token(self) -> int:
        """KV bytes of one token across all layers (K and V)."""
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def block_bytes(self) -> int:
        """KV bytes of one full block of `block_tokens` tokens."""
        return self.bytes_per_token * self.block_tokens

    @property
    def layer_bytes(self) -> int:
        """Bytes of one layer (K and V) of one block: one contiguous range."""
        return self.block_bytes // self.num_layers

    @property
    def block_shape(self) -> tuple[int, ...]:
        """Shape of a slot's payload: (layer, K|V, token, kv_head, head_dim)."""
        return (self.num_layers, 2, self.block_tokens, self.num_kv_heads, self.head_dim)

    def describe(self) -> str:
        return (f"{self.num_layers} layers x {self.num_kv_heads} KV heads x {self.head_dim} dim "
                f"{self.dtype}, {self.block_tokens} tokens/block")


@dataclass(frozen=True)
class ModelProfile:
    """A model's name, KV geometry and (for the reference engine) architecture."""

    name: str
    geometry: Geometry
    aliases: tuple[str, ...] = ()
    arch: dict = field(default_factory=dict, compare=False)

    def fingerprint(self) -> bytes:
        """32-byte identity of the model's KV format; regions of different models never mix."""
        g = self.geometry
        text = (f"tract-model-v1|{self.name}|{g.num_layers}|{g.num_kv_heads}|{g.head_dim}|"
                f"{g.dtype}|{g.block_tokens}")
        return hashlib.sha256(text.encode()).digest()


def normalize_dtype(name: str) -> str:
    """Returns the canonical dtype name (f16, bf16, f32, fp8) or raises UsageError."""
    key = str(name).lower()
    key = _DTYPE_ALIASES.get(key, key)
    if key not in DTYPES:
        raise UsageError(f"unknown KV dtype {name!r}", f"use one of {', '.join(DTYPES)}")
    return key


def model_names() -> list[str]:
    """Names of the model profiles shipped with TraCT."""
    return sorted(p.stem for p in (PROFILES_DIR / "models").glob("*.toml"))


def _parse_model(path: pathlib.Path) -> ModelProfile:
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise UsageError(f"cannot read model profile {path}: {exc}",
                         "fix the TOML file or pick a shipped model") from None
    try:
        geometry = Geometry(num_layers=data["num_layers"], num_kv_heads=data["num_kv_heads"],
                            head_dim=data["head_dim"], dtype=data.get("dtype", "bf16"),
                            block_tokens=data.get("block_tokens", DEFAULT_BLOCK_TOKENS))
        name = str(data.get("name", path.stem))
    except KeyError as exc:
        raise UsageError(f"model profile {path} lacks field {exc.args[0]}",
                         "add num_layers, num_kv_heads and head_dim") from None
    if len(name.encode()) > 31:
        raise UsageError(f"model name {name!r} is longer than 31 bytes", "shorten it in the profile")
    arch = {k: v for k, v in data.items()
            if k not in ("name", "aliases", "num_layers", "num_kv_heads", "head_dim", "dtype",
                         "block_tokens")}
    return ModelProfile(name=name, geometry=geometry, aliases=tuple(data.get("aliases", ())),
                        arch=arch)


def checkpoint_profile(model_dir: pathlib.Path) -> ModelProfile:
    """The KV geometry of a Hugging Face checkpoint directory (its config.json);
    named after the directory, so a region formatted from it matches the
    serving engine that loads it."""
    import json
    try:
        cfg = json.loads((model_dir / "config.json").read_text())
        heads = int(cfg["num_attention_heads"])
        geometry = Geometry(num_layers=int(cfg["num_hidden_layers"]),
                            num_kv_heads=int(cfg.get("num_key_value_heads", heads)),
                            head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads),
                            dtype=cfg.get("torch_dtype") or cfg.get("dtype") or "bf16",
                            block_tokens=DEFAULT_BLOCK_TOKENS)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise UsageError(f"cannot read the KV geometry of {model_dir}/config.json ({exc})",
                         "pass a Hugging Face checkpoint directory with a complete config.json") \
            from None
    return ModelProfile(name=model_dir.resolve().name[:31] or "checkpoint", geometry=geometry)


def with_block_tokens(profile: ModelProfile, block_tokens: int) -> ModelProfile:
    """PROFILE with BLOCK_TOKENS tokens per block (1..4096)."""
    if not 1 <= block_tokens <= 4096:
        raise UsageError(f"--block-tokens {block_tokens} is out of range", "use 1 to 4096 tokens")
    return dataclasses.replace(profile, geometry=dataclasses.replace(profile.geometry,
                                                                     block_tokens=block_tokens))


def load_model(name_or_path: str) -> ModelProfile:
    """Loads a shipped model profile by name or alias, a TOML file by path, or the
    KV geometry of a Hugging Face checkpoint directory."""
    path = pathlib.Path(name_or_path)
    if path.is_dir() and (path / "config.json").is_file():
        return checkpoint_profile(path)
    if name_or_path.endswith(".toml") or path.is_file():
        if not path.is_file():
            raise UsageError(f"model profile {name_or_path} does not exist",
                             "give a shipped name or an existing .toml")
        return _parse_model(path)
    key = name_or_path.lower()
    for candidate in (PROFILES_DIR / "models").glob("*.toml"):
        profile = _parse_model(candidate)
        if key == profile.name or key in (a.lower() for a in profile.aliases):
            return profile
    raise UsageError(f"unknown model {name_or_path!r}",
                     f"use one of {', '.join(model_names())} or a path to a .toml profile")


@dataclass(frozen=True)
class DeviceProfile:
    """Latency and bandwidth of a memory device or link, for modelled paths and reports."""

    name: str
    kind: str
    description: str
    latency_ns: float
    bandwidth_gbps: float
    prefill_tokens_per_s: float = 0.0
    decode_s_per_token: float = 0.0


def named_profile(kind: str, name: str, what: str) -> dict:
    """The TOML data of tract_cli/profiles/KIND/NAME.toml; an unknown NAME is a UsageError
    listing the WHAT profiles there are."""
    path = PROFILES_DIR / kind / f"{name}.toml"
    if not path.is_file():
        names = sorted(p.stem for p in (PROFILES_DIR / kind).glob("*.toml"))
        raise UsageError(f"unknown {what} {name!r}", f"use one of {', '.join(names)}")
    return tomllib.loads(path.read_text())


def load_device(name: str) -> DeviceProfile:
    """Loads a shipped device profile (tract_cli/profiles/devices/NAME.toml)."""
    data = named_profile("devices", name, "device profile")
    return DeviceProfile(name=data["name"], kind=data["kind"], description=data["description"],
                         latency_ns=float(data["latency_ns"]),
                         bandwidth_gbps=float(data["bandwidth_gbps"]),
                         prefill_tokens_per_s=float(data.get("prefill_tokens_per_s", 0.0)),
                         decode_s_per_token=float(data.get("decode_s_per_token", 0.0)))
