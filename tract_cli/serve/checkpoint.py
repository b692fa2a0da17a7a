"""Reading (and, for tests and exports, writing) `.safetensors` files, with
the `safetensors` library.

The library checks everything read from the file (header length and JSON,
dtypes, byte ranges inside the data and matching the shapes) before a byte
of it is used; what is added here is turning its errors into ours: one line
that says what is wrong with which file, and what to do.
"""
from __future__ import annotations

import pathlib

from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from tract_cli.core.errors import UsageError

# what the model reads as float32; the rest (FP8 without its scales, bool,
# complex, packed FP4) would be read wrongly, so it is refused
_DTYPES = {"F32", "F16", "BF16", "F64", "I64", "I32"}
_PREFIX = "Error while deserializing header: "    # wording of safetensors >= 0.6
# the library's wording of a damaged file -> ours (the first match wins);
# anything else is passed on in the library's words
_REWORDED = (("header too small", "shorter than its 8-byte header length"),
             ("header too large", "header length exceeds the 100 MB limit"),
             ("invalid header length", "header length exceeds the file"),
             ("invalid JSON in header: ", "header is not JSON the format accepts: "),
             ("invalid UTF-8 in header", "header is not JSON (not UTF-8)"),
             ("incomplete metadata", "tensor bytes do not match the shapes and the data size"),
             ("invalid shape, data type, or offset",
              "tensor bytes do not match the shapes and the data size"),
             ("invalid offset", "tensor bytes do not match the shapes and the data size"))


def _bad(path, exc: Exception) -> UsageError:
    what = str(exc).removeprefix(_PREFIX).splitlines()[0] if str(exc) else type(exc).__name__
    for theirs, ours in _REWORDED:
        if what.startswith(theirs):
            what = ours + what[len(theirs):] if ours.endswith(": ") else ours
            break
    return UsageError(f"{path} is not a valid safetensors file: {what}",
                      "re-export the checkpoint (safetensors format)")


def read_safetensors(path: pathlib.Path) -> dict:
    """Returns {name: float32 torch tensor} for every tensor in PATH."""
    import torch
    try:
        # opened here first for the OS's own words (the library's repeat the path)
        open(path, "rb").close()
        with safe_open(str(path), framework="pt") as f:
            out = {}
            for name in f.keys():
                dtype = f.get_slice(name).get_dtype()
                if dtype not in _DTYPES:
                    raise UsageError(f"{path} is not a valid safetensors file: tensor {name!r} "
                                     f"has unsupported dtype {dtype}",
                                     "re-export the checkpoint in F32, F16 or BF16")
                # copy=True: the library's tensors are views of a private
                # mapping of the file, which a later rewrite of it (a
                # truncation) would turn into SIGBUS; weights own their memory
                out[name] = f.get_tensor(name).to(torch.float32, copy=True)
            return out
    except OSError as exc:
        raise UsageError(f"cannot open {path}: {exc.strerror or exc}",
                         "check the checkpoint path") from None
    except SafetensorError as exc:
        raise _bad(path, exc) from None


def write_safetensors(path: pathlib.Path, tensors: dict, dtype: str = "F32") -> None:
    """Writes {name: torch tensor} as one safetensors file (F32, F16 or BF16)."""
    import torch
    torch_dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[dtype]
    # copy=True: save_file refuses tensors that share memory (tied weights, views)
    save_file({name: t.detach().to(torch_dtype, copy=True).contiguous()
               for name, t in tensors.items()}, str(path))
