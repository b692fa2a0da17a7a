"""The GPU path (docs/ARCHITECTURE.md §12): KV moves by DMA between GPU memory and pool slots.

The whole mapping is registered once with `cudaHostRegister`, so slot views
are page-locked host tensors and `copy_(..., non_blocking=True)` on a stream
is a direct DMA, with no bounce buffer.  Registration is verified (a slot
view must report `is_pinned()`).  Blocks move as runs of consecutive slots
(the allocator hands out slots in batches, so a request's blocks are mostly
a few runs): one copy per run, not per block.

Writing into the pool is a zero-copy put: reserve the slots, DMA into them,
synchronize the stream, commit.  The commit writes the slots back before it
publishes them: with Intel DDIO a device's DMA may leave lines dirty in the
last-level cache (docs/PROTOCOLS.md §1.1).
"""
from __future__ import annotations

import numpy as np

from tract_cli.core.errors import TractError
from tract_cli.core.index import PUT_CLAIMED
from tract_cli.core.native import ffi


def cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _runs(slots: np.ndarray):
    """(start index, first slot, length) of each run of consecutive slot ids."""
    if len(slots) == 0:
        return []
    breaks = np.flatnonzero(np.diff(slots.astype(np.int64)) != 1) + 1
    starts = np.concatenate([[0], breaks])
    ends = np.concatenate([breaks, [len(slots)]])
    return [(int(s), int(slots[s]), int(e - s)) for s, e in zip(starts, ends)]


class CudaPool:
    """A pool whose mapping is registered with CUDA; unregister with close()."""

    def __init__(self, pool, device: str = "cuda"):
        import torch
        if not torch.cuda.is_available():
            raise TractError("CUDA is not available", "run on a GPU host, or use the CPU paths")
        self.pool = pool
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(self.device)
        self._ptr = int(ffi.cast("uintptr_t", pool._base))
        self._size = pool.info.region_size
        cudart = torch.cuda.cudart()
        rc = cudart.cudaHostRegister(self._ptr, self._size, 0)
        code = int(getattr(rc, "value", rc))
        if code != 0:
            # torch's binding names few of the runtime's codes: say the number and
            # the runtime's own words; the failed call's error cleared (torch's next
            # launch would raise it)
            from tract_cli.core.cudart import CudaRuntime
            try:
                why = CudaRuntime().describe_last(code)
            except TractError:
                why = f"CUDA error {code}"
            raise TractError(f"cudaHostRegister of the region ({self._size} bytes, "
                             f"{pool.target.path}) failed: {why}",
                             "check the locked-memory limit (ulimit -l), that the driver "
                             "may pin the region's pages (its medium), and the driver")
        self._registered = True
        self.slots = pool.slots_tensor()
        if not self.slots[0].is_pinned():
            self.close()
            raise TractError("the pool mapping is not page-locked after cudaHostRegister",
                             "check the CUDA driver and the mapping")

    def load(self, slots, out, tags=None) -> None:
        """Copies blocks SLOTS into the CUDA tensor OUT (len(slots), *block_shape);
        asynchronous on self.stream (synchronize before use on another stream).
        The DMA snoops this host's caches, so the slots this host may hold stale
        lines of are evicted first (TAGS: a lookup's payload tags; None: all)."""
        slots = np.asarray(slots, dtype=np.uint32)
        self.pool.acquire_payload(slots, tags)
        import torch
        with torch.cuda.stream(self.stream):
            for i, first, n in _runs(slots):
                out[i:i + n].copy_(self.slots[first:first + n], non_blocking=True)

    def store(self, src, slots) -> None:
        """Copies the CUDA tensor SRC (len(slots), *block_shape) into SLOTS and
        waits for the copies (the caller then publishes them)."""
        slots = np.asarray(slots, dtype=np.uint32)
        import torch
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for i, first, n in _runs(slots):
                self.slots[first:first + n].copy_(src[i:i + n], non_blocking=True)
        self.stream.synchronize()

    def put(self, keys, src) -> np.ndarray:
        """Zero-copy put from GPU memory: reserve, DMA, commit; returns the status."""
        status, slots = self.pool.index.reserve(keys)
        claimed = np.flatnonzero(status == PUT_CLAIMED)
        try:
            if len(claimed):
                import torch
                idx = torch.as_tensor(claimed, device=self.device)
                self.store(src.index_select(0, idx), slots[claimed])
        except BaseException:
            self.pool.index.commit(keys, status, slots, publish=False)
            raise
        return self.pool.index.commit(keys, status, slots).status

    def close(self) -> None:
        import torch
        self.slots = None
        if getattr(self, "_registered", False):
            torch.cuda.cudart().cudaHostUnregister(self._ptr)
            self._registered = False
