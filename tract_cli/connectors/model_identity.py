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
- the checkpoint's `config.json` (less its path and library-version keys)
  and vLLM's `hf_overrides`, the load format (`dummy` weights are not the
  files'), the compute dtype, the KV cache dtype, the quantization method,
  and the operator's `model_id`, if given.

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
    load = getattr(vllm_config, "load_config", None)
    load_format = str(getattr(load, "load_format", "auto"))
    t0 = time.perf_counter()
    directory = checkpoint_dir(mc.model, getattr(mc, "revision", None),
                               getattr(load, "download_dir", None))
    if load_format == "dummy":
        # random weights, not the files': their own identity (vLLM draws them from a
        # fixed seed, on the device, so the device kind tells them apart)
        files, tensors, weights = 0, 0, f"dummy|{vllm_config.device_config.device_type}"
    else:
        files, tensors, weights = weights_fingerprint(directory, weights_digest)
    doc = {
        "format": "tract-model-identity-v2",
        "weights": weights,
        "load_format": load_format,
        "config": checkpoint_config(_config_dir(mc, directory),
                                    str(getattr(mc, "config_format", "auto"))),
        "hf_overrides": _overrides(getattr(mc, "hf_overrides", None), model_id),
        "dtype": str(mc.dtype),
        "kv_cache_dtype": str(cc.cache_dtype),
        "calculate_kv_scales": bool(getattr(cc, "calculate_kv_scales", False)),
        "quantization": str(mc.quantization),
        "model_id": model_id or "",
    }
    digest = hashlib.sha256(json.dumps(doc, sort_keys=True, default=str).encode()).digest()
    return ModelIdentity(digest, files, tensors, time.perf_counter() - t0, directory)


def checkpoint_dir(model: str, revision: str | None = None,
                   download_dir: str | None = None) -> str:
    """The local directory of MODEL's weights: MODEL itself, or its snapshot in the
    Hugging Face cache, or vLLM's --download-dir (vLLM downloaded it before the
    connector starts)."""
    if os.path.isdir(model):
        return os.path.realpath(model)
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(model, revision=revision, cache_dir=download_dir,
                                 local_files_only=True)
    except Exception:       # any failure of the cache look-up means: not found locally
        raise TractError(f"cannot find the weights of {model} on this host to identify the model",
                         "serve a local checkpoint directory (--model DIR)") from None


def _overrides(ov, model_id: str | None):
    """vLLM's hf_overrides as identity: a dict as it is; a function cannot be told
    apart from another (its name is no content), so it needs a model_id."""
    if callable(ov):
        if not model_id:
            raise TractError("vLLM's hf_overrides is a function, which the model's identity "
                             "cannot see into", 'set kv_connector_extra_config "model_id" to a '
                             "name that changes whenever the overrides or weights do")
        return "function"
    return ov or {}


def _config_dir(mc, weights_dir: str) -> str:
    """Where vLLM reads the model's config: --hf-config-path when set (a directory,
    or a hub name in the local cache), else the weights' directory."""
    path = getattr(mc, "hf_config_path", None)
    if not path or path == mc.model:
        return weights_dir
    return checkpoint_dir(path)


def checkpoint_config(directory: str, config_format: str = "auto") -> dict:
    """The checkpoint's config.json as it computes: the file, the same on every host
    that holds the checkpoint (vLLM's runtime config adds defaults that change with
    library versions), less its keys that name a path or a library version; the
    overrides vLLM applies enter the identity on their own (`hf_overrides`)."""
    # Mistral's format keeps it in params.json (vLLM's config_format "mistral", or
    # "auto" with no config.json)
    path = os.path.join(directory, "config.json")
    if "mistral" in config_format or not os.path.isfile(path):
        path = os.path.join(directory, "params.json")
    try:
        with open(path) as f:
            d = json.load(f)
        if not isinstance(d, dict):
            raise ValueError
    except (OSError, ValueError):
        raise TractError(f"cannot read {path} to identify the model",
                         "serve a checkpoint directory with its config.json (or params.json)") \
            from None
    return {k: v for k, v in d.items() if not k.startswith("_") and k not in _PATH_KEYS}
