"""The CUDA runtime's pitched asynchronous copy, its last error and the
driver's version, from the runtime torch loaded.

Why hand-written: a region block holds every layer of one block, so one
layer's KV of consecutive slots is a row per slot at the slot stride: a
pitched copy (`cudaMemcpy2DAsync`), which torch does not expose (a strided
host destination makes torch bounce through a pageable temporary), and the
CUDA Python bindings are one more package a GPU user may not have.  The
runtime is the one already in the process (torch loaded it), found by its
path in /proc/self/maps, so the copy runs on torch's own context and streams.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

from tract_cli.core.errors import TractError

MEMCPY_DEFAULT = 4          # cudaMemcpyDefault: the direction from the pointers (UVA)


def _loaded_runtime() -> str | None:
    """The path of the libcudart this process mapped (torch's), if any."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith("libcudart.so"):
                    return path
    except OSError:
        return None
    return None


class CudaRuntime:
    """`memcpy2d_async` on a torch stream; load it after torch initialised CUDA."""

    def __init__(self):
        path = _loaded_runtime() or ctypes.util.find_library("cudart")
        if path is None:
            raise TractError("the CUDA runtime library (libcudart) is not loaded in this process",
                             "use a torch build linked to libcudart (the PyTorch wheels are)")
        try:
            lib = ctypes.CDLL(path)
            copy = lib.cudaMemcpy2DAsync
            text = lib.cudaGetErrorString
            last = lib.cudaGetLastError
            driver = lib.cudaDriverGetVersion
        except (OSError, AttributeError) as exc:
            raise TractError(f"the CUDA runtime {path} cannot be used ({exc})",
                             "check the CUDA installation torch uses") from None
        copy.restype = ctypes.c_int
        copy.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t,
                         ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        text.restype = ctypes.c_char_p
        text.argtypes = [ctypes.c_int]
        last.restype = ctypes.c_int
        last.argtypes = []
        driver.restype = ctypes.c_int
        driver.argtypes = [ctypes.POINTER(ctypes.c_int)]
        self.path, self._copy, self._text, self._last = path, copy, text, last
        self._driver = driver

    def driver_version(self) -> int:
        """The CUDA driver's version as the runtime encodes it (12080: 12.8; 0:
        no driver)."""
        out = ctypes.c_int(0)
        return out.value if self._driver(ctypes.byref(out)) == 0 else 0

    def take_last(self) -> int:
        """The thread's last runtime error (0: none), cleared."""
        return int(self._last())

    def describe_last(self, code: int) -> str:
        """The runtime's words for error CODE (e.g. from a call through torch's
        binding), the thread's last error cleared."""
        self._last()
        return f"{self._text(code).decode()} ({code})"

    def memcpy2d_async(self, dst: int, dpitch: int, src: int, spitch: int, width: int,
                       height: int, stream: int) -> None:
        """HEIGHT rows of WIDTH bytes from SRC (rows SPITCH apart) to DST (DPITCH
        apart), queued on STREAM (a `torch.cuda.Stream().cuda_stream`)."""
        rc = self._copy(dst, dpitch, src, spitch, width, height, MEMCPY_DEFAULT, stream)
        if rc != 0:
            # the runtime keeps a failed call's error as the thread's last one,
            # shared with torch (the same libcudart): torch's next kernel launch
            # would raise it inside vLLM's forward; cleared here, raised once
            self._last()
            raise TractError(f"cudaMemcpy2DAsync failed: {self._text(rc).decode()} ({rc})",
                             "check the GPU and that the region is registered (CudaPool)")
