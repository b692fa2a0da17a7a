"""CUDA stood in for by the CPU, for testing the logic around the GPU path
where no GPU is lent (the GPU itself: tests/test_gpu.py on a GPU host).

`install()` makes `core/gpupages.py` run on CPU tensors: streams and events
that are already done (every copy here is synchronous), a pitched copy that
is a row-by-row memmove between the same addresses, and no registration.
The gather and scatter are the real torch code; only the device is not.
`batch_copy` stands in for vLLM's `swap_blocks_batch` (the direct mode's
copy): a memmove per (source, destination, bytes), after the checks vLLM's
op makes of its arguments.
"""
from __future__ import annotations

import contextlib
import ctypes


class _Stream:
    cuda_stream = 0

    def wait_stream(self, other) -> None:
        pass

    def wait_event(self, event) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Event:
    def __init__(self, **flags) -> None:
        pass

    def record(self, stream=None) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Registration:
    def __init__(self, pool, device="cuda"):
        self.stream = _Stream()

    def close(self) -> None:
        pass


class _Runtime:
    # the runtime error the next take_last reports (a test sets it, as a failed
    # cudaMemcpyAsync in vLLM's unchecked loop would leave it)
    pending = 0

    def take_last(self) -> int:
        code, _Runtime.pending = _Runtime.pending, 0
        return code

    def describe_last(self, code: int) -> str:
        _Runtime.pending = 0
        return f"a stand-in error ({code})"

    def driver_version(self) -> int:
        return 0

    def memcpy2d_async(self, dst, dpitch, src, spitch, width, height, stream) -> None:
        for row in range(height):
            ctypes.memmove(dst + row * dpitch, src + row * spitch, width)


def leave_error(code: int) -> None:
    """The runtime's last error is CODE from now (until taken)."""
    _Runtime.pending = code


def batch_copy(src_ptrs, dst_ptrs, sizes) -> None:
    import torch
    for t in (src_ptrs, dst_ptrs, sizes):
        # what vLLM's op checks (csrc/cache_kernels.cu): CPU int64 tensors alike
        if t.device.type != "cpu" or t.dtype != torch.int64 or t.dim() != 1 \
                or len(t) != len(src_ptrs):
            raise RuntimeError(f"swap_blocks_batch: {t.dtype} {t.device} {tuple(t.shape)}")
    for src, dst, n in zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()):
        ctypes.memmove(dst, src, n)


def install() -> None:
    import torch

    import tract_cli.core.gpupages as gpupages
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    torch.cuda.current_stream = lambda device=None: _Stream()
    torch.cuda.Event = _Event
    torch.cuda.set_device = lambda device: None
    gpupages.CudaPool = _Registration
    gpupages.CudaRuntime = _Runtime
    gpupages.ON_CUDA_ONLY = False
