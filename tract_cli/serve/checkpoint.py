"""Reading (and, for tests and exports, writing) `.safetensors` files.

The format is small enough to read without the `safetensors` package: an
8-byte little-endian header length, a JSON header naming each tensor's dtype,
shape and byte range, then the raw data.  Everything read from the file is
checked (header length, ranges inside the data, sizes matching shapes)
before a byte of it is used.
"""
from __future__ import annotations

import json
import mmap
import pathlib
import struct

import numpy as np

from tract_cli.core.errors import UsageError

# safetensors dtype -> (numpy dtype of the raw elements, torch dtype name)
_DTYPES = {"F32": (np.float32, "float32"), "F16": (np.float16, "float16"),
           "BF16": (np.uint16, "bfloat16"), "F64": (np.float64, "float64"),
           "I64": (np.int64, "int64"), "I32": (np.int32, "int32")}
_MAX_HEADER = 100 << 20


def _bad(path, what: str) -> UsageError:
    return UsageError(f"{path} is not a valid safetensors file: {what}",
                      "re-export the checkpoint (safetensors format)")


def read_safetensors(path: pathlib.Path) -> dict:
    """Returns {name: float32 torch tensor} for every tensor in PATH."""
    import torch
    try:
        f = open(path, "rb")
    except OSError as exc:
        raise UsageError(f"cannot open {path}: {exc.strerror}", "check the checkpoint path") from None
    with f:
        size = pathlib.Path(path).stat().st_size
        if size < 8:
            raise _bad(path, "shorter than its 8-byte header length")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            (hlen,) = struct.unpack_from("<Q", mm, 0)
            if hlen > min(_MAX_HEADER, size - 8):
                raise _bad(path, f"header length {hlen} exceeds the file")
            try:
                header = json.loads(bytes(mm[8:8 + hlen]))
            except (UnicodeDecodeError, json.JSONDecodeError):
                raise _bad(path, "header is not JSON") from None
            if not isinstance(header, dict):
                raise _bad(path, "header is not a JSON object")
            data_start, data_len = 8 + hlen, size - 8 - hlen
            out = {}
            for name, meta in header.items():
                if name == "__metadata__":
                    continue
                try:
                    dtype, shape, (begin, end) = meta["dtype"], list(meta["shape"]), meta["data_offsets"]
                    shape = [int(d) for d in shape]
                    begin, end = int(begin), int(end)
                except (KeyError, TypeError, ValueError):
                    raise _bad(path, f"tensor {name!r} has a malformed entry") from None
                if dtype not in _DTYPES:
                    raise _bad(path, f"tensor {name!r} has unsupported dtype {dtype}")
                np_dtype, torch_name = _DTYPES[dtype]
                count = int(np.prod(shape)) if shape else 1
                if any(d < 0 for d in shape) or not 0 <= begin <= end <= data_len or \
                        end - begin != count * np.dtype(np_dtype).itemsize:
                    raise _bad(path, f"tensor {name!r}: bytes {begin}..{end} do not match "
                                     f"shape {shape} inside {data_len} data bytes")
                raw = np.frombuffer(mm, dtype=np_dtype, count=count, offset=data_start + begin).copy()
                t = torch.from_numpy(raw)
                if torch_name == "bfloat16":
                    t = t.view(torch.bfloat16)
                out[name] = t.reshape(shape).to(torch.float32)
            return out


def write_safetensors(path: pathlib.Path, tensors: dict, dtype: str = "F32") -> None:
    """Writes {name: torch tensor} as one safetensors file (F32, F16 or BF16)."""
    import torch
    torch_dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[dtype]
    header, blobs, offset = {}, [], 0
    for name, t in tensors.items():
        raw = t.detach().to(torch_dtype).contiguous()
        raw = raw.view(torch.int16) if torch_dtype == torch.bfloat16 else raw
        data = raw.numpy().tobytes()
        header[name] = {"dtype": dtype, "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(data)]}
        blobs.append(data)
        offset += len(data)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(head)))
        f.write(head)
        for b in blobs:
            f.write(b)
