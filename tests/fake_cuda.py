"""CUDA stood in for by the CPU, for testing the logic around the GPU path
where no GPU is lent (the GPU itself: tests/test_gpu.py on a GPU host).

`install()` makes `core/gpupages.py` run on CPU tensors: a pitched copy that
is a row-by-row memmove between the same addresses, and no registration.
The gather and scatter are the real torch code; only the device is not.
`batch_copy` stands in for vLLM's `swap_blocks_batch` (the direct mode's
copy): a memmove per (source, destination, bytes), after the checks vLLM's
op makes of its arguments.

Streams: the engine's stream is the eager CPU.  A batched copy queued on a
side stream (under `torch.cuda.stream`) runs late, as a GPU's does: only
when something waits for it (the stream synchronized, an event recorded
after it synchronized or waited for by the engine's stream), so a reader
that does not wait finds the bytes not yet there.  The staging path's
copies stay synchronous: its gathers and scatters are eager torch code,
which a late copy would run out of order with.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading

_lock = threading.Lock()           # a stream's queue runs on whichever thread waits
_current = threading.local()       # the stream torch.cuda.stream made current


class _Stream:
    cuda_stream = 0

    def __init__(self) -> None:
        self.queue: list = []      # late copies, in stream order
        self.done = 0              # how many of them have run

    def run_to(self, end: int) -> None:
        with _lock:
            while self.done < end:
                self.queue[self.done]()
                self.done += 1

    def wait_stream(self, other) -> None:
        pass                       # the engine's work is eager: done already

    def wait_event(self, event) -> None:
        event.synchronize()        # the engine goes on eagerly after the wait

    def synchronize(self) -> None:
        self.run_to(len(self.queue))


_ENGINE = _Stream()


class _Event:
    def __init__(self, **flags) -> None:
        self.at = None

    def record(self, stream=None) -> None:
        stream = stream if stream is not None else getattr(_current, "stream", None)
        if stream is not None:
            self.at = (stream, len(stream.queue))

    def synchronize(self) -> None:
        if self.at is not None:
            stream, end = self.at
            stream.run_to(end)


@contextlib.contextmanager
def _on(stream):
    before = getattr(_current, "stream", None)
    _current.stream = stream
    try:
        yield
    finally:
        _current.stream = before


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
    copies = list(zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()))

    def run() -> None:
        for src, dst, n in copies:
            ctypes.memmove(dst, src, n)
    stream = getattr(_current, "stream", None)
    if stream is None or stream is _ENGINE:
        run()
    else:
        stream.queue.append(run)       # late: until something waits for it


def install() -> None:
    import torch

    import tract_cli.core.gpupages as gpupages
    torch.cuda.stream = _on
    torch.cuda.current_stream = lambda device=None: _ENGINE
    torch.cuda.Event = _Event
    torch.cuda.set_device = lambda device: None
    gpupages.CudaPool = _Registration
    gpupages.CudaRuntime = _Runtime
    gpupages.ON_CUDA_ONLY = False
