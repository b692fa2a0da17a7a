"""What identifies a checkpoint's weights: a digest over its weight files, cheap
enough for every start-up (the vLLM connector's model identity,
connectors/model_identity.py, and the reference engine's, serve/engine.py).

Per weight file (sorted by name): its name and size and, for a safetensors
file, its header (every tensor's name, dtype, shape) and `SAMPLES` evenly
spaced `SAMPLE_BYTES`-byte samples of every tensor's bytes, its first and last
included (mode "full": every byte instead); other weight files (`.bin`,
`.pt`, `.gguf`) are sampled over the whole file.  Sampling reads ~2 KiB per
tensor and tells apart any two checkpoints whose tensors differ in more than
a few bytes (a fine-tune or a merge changes almost every element of what it
touches); an edit of a handful of elements can escape it, "full" cannot.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct

from tract_cli.core.errors import TractError

SAMPLES = 8                      # per tensor (sampled digest)
SAMPLE_BYTES = 256
FILE_SAMPLES = 64                # per non-safetensors weight file
FILE_SAMPLE_BYTES = 4096
FULL_CHUNK = 16 << 20
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
SAFETENSORS_MAX_HEADER = 100 << 20       # the safetensors format's own bound
WEIGHTS_DIGESTS = ("sampled", "full")


def weight_files(directory: str) -> list[str]:
    """The weight files a loader reads from DIRECTORY, sorted: those a safetensors
    index (`model.safetensors.index.json`) names, else every `.safetensors` file,
    else every other weight file; never what lies beside them (`training_args.bin`,
    an optimizer state, a second format), so a host holding the whole repository
    and one holding what the loader downloaded agree."""
    present = sorted(n for n in os.listdir(directory) if n.endswith(WEIGHT_SUFFIXES))
    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index) as f:
                named = set(json.load(f)["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise TractError(f"{index} is not a safetensors index (no weight_map)",
                             "check the checkpoint") from None
        missing = sorted(n for n in named if n not in present)
        if missing:
            raise TractError(f"{directory} lacks {', '.join(missing[:3])}, which its "
                             "safetensors index names", "complete the checkpoint's download")
        return sorted(named)
    safetensors = [n for n in present if n.endswith(".safetensors")]
    return safetensors or [n for n in present if n not in ("training_args.bin",)
                           and not n.startswith(("optimizer", "scheduler", "rng_state"))]


def weights_fingerprint(directory: str, mode: str = "sampled") -> tuple[int, int, str]:
    """(weight files, tensors, hex digest) of the weight files in DIRECTORY."""
    if mode not in WEIGHTS_DIGESTS:
        raise TractError(f"weights digest {mode!r} is unknown",
                         f"use {' or '.join(WEIGHTS_DIGESTS)}")
    names = weight_files(directory)
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
