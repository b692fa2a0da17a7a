"""The identity of the model a vLLM instance serves: what enters every pool key
the connector makes, so one model's KV never reaches another's requests.

A region's own fingerprint (`core/geometry.py`) names only a KV *format*
(layers, heads, head size, dtype): a base model and its instruct tune, two
fine-tunes or a quantized variant share it, and would share each other's
blocks.  What makes KV differ is the weights and what the engine does with
them, so the identity is a SHA-256 over:

- the weights: per weight file (sorted by name), its name and size and, for
  a safetensors file, its header (every tensor's name, dtype, shape) and
  `SAMPLES` evenly spaced `SAMPLE_BYTES`-byte samples of every tensor's bytes
  (`weights_digest: "full"`: every byte instead); other weight files
  (`.bin`, `.pt`, `.gguf`) are sampled over the whole file;
- the effective model config (vLLM's `hf_config`, overrides applied, less
  its path-dependent private keys), the compute dtype, the KV cache dtype,
  the quantization method, and the operator's `model_id`, if given.

Sampling reads ~2 KiB per tensor (well under a second for an 8B checkpoint,
whose pages vLLM has just read) and tells apart any two checkpoints whose
tensors differ in more than a few bytes: any fine-tune or merge changes
almost every element of the tensors it touches.  An edit of a handful of
elements can escape it; `weights_digest: "full"` or a `model_id` that changes
with the weights closes that.  The tokenizer is not part of it: keys are
made from token ids, and KV depends on the ids, not on how text became them.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tract_cli.connectors.settings import WEIGHTS_DIGESTS
from tract_cli.core.errors import TractError

if TYPE_CHECKING:
    from vllm.config import VllmConfig

SAMPLES = 8                      # per tensor (sampled digest)
SAMPLE_BYTES = 256
FILE_SAMPLES = 64                # per non-safetensors weight file
FILE_SAMPLE_BYTES = 4096
FULL_CHUNK = 16 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAFETENSORS_MAX_HEADER = 100 << 20       # the safetensors format's own bound
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


def weights_fingerprint(directory: str, mode: str = "sampled") -> tuple[int, int, str]:
    """(weight files, tensors, hex digest) of the weight files in DIRECTORY."""
    if mode not in WEIGHTS_DIGESTS:
        raise TractError(f"weights_digest {mode!r} is unknown",
                         f"use {' or '.join(WEIGHTS_DIGESTS)}")
    names = sorted(n for n in os.listdir(directory) if n.endswith(WEIGHT_SUFFIXES))
    if not names:
        raise TractError(f"{directory} has no weight files ({', '.join(WEIGHT_SUFFIXES)})",
                         "serve a checkpoint directory with its weights")
    h = hashlib.sha256()
    tensors = 0
    for name in names:
        path = os.path.join(directory, name)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                h.update(f"{name}\0{size}\0".encode())
                if name.endswith(".safetensors"):
                    tensors += _safetensors(f, size, path, h, mode)
                else:
                    _spans(f, 0, size, h, mode, FILE_SAMPLES, FILE_SAMPLE_BYTES)
        except OSError as exc:
            raise TractError(f"cannot read {path} to identify the model: {exc.strerror}",
                             "check the checkpoint's files and permissions") from None
    return len(names), tensors, h.hexdigest()


def _safetensors(f, size: int, path: str, h, mode: str) -> int:
    """Hashes a safetensors file's header and its tensors' samples; returns the
    tensor count.  The header is parsed here (8-byte length, JSON) because the
    safetensors library gives tensors' values but not their byte ranges, and
    sampling needs the ranges without reading the tensors."""
    head = f.read(8)
    if len(head) < 8:
        raise TractError(f"{path} is shorter than a safetensors header", "check the checkpoint")
    (length,) = struct.unpack("<Q", head)
    if length > min(SAFETENSORS_MAX_HEADER, size - 8):
        raise TractError(f"{path} has a safetensors header length past its end",
                         "check the checkpoint")
    raw = f.read(length)
    try:
        header = json.loads(raw)
        entries = sorted((k, v) for k, v in header.items() if k != "__metadata__")
        data = 8 + length
        ranges = []
        for key, v in entries:
            start, end = (int(x) for x in v["data_offsets"])
            if not 0 <= start <= end <= size - data:
                raise ValueError(key)
            h.update(f"{key}\0{v['dtype']}\0{v['shape']}\0".encode())
            ranges.append((data + start, data + end))
    except (ValueError, TypeError, KeyError, AttributeError):
        raise TractError(f"{path} has a safetensors header that does not parse",
                         "check the checkpoint") from None
    for start, end in ranges:
        _spans(f, start, end, h, mode, SAMPLES, SAMPLE_BYTES)
    return len(ranges)


def _spans(f, start: int, end: int, h, mode: str, samples: int, span: int) -> None:
    """Hashes bytes [START, END) of F: all of them ("full"), or SAMPLES spans of SPAN
    bytes evenly spaced over the range, its first and last bytes included."""
    length = end - start
    if mode == "full" or length <= samples * span:
        f.seek(start)
        left = length
        while left:
            chunk = f.read(min(left, FULL_CHUNK))
            if not chunk:
                raise TractError(f"{f.name} ends before its tensors do", "check the checkpoint")
            h.update(chunk)
            left -= len(chunk)
        return
    step = (length - span) / (samples - 1)
    for i in range(samples):
        f.seek(start + int(i * step))
        h.update(f.read(span))


def _config_dict(hf_config) -> dict:
    """The model config as it computes, without keys that name a path or a library version."""
    try:
        d = hf_config.to_dict()
    except AttributeError:
        d = dict(vars(hf_config))
    return {k: v for k, v in d.items() if not k.startswith("_") and k not in _PATH_KEYS}
