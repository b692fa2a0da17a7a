"""The slot allocator as a Python object: one call per batch of slots."""
from __future__ import annotations

import numpy as np

from tract_cli.core.errors import CorruptRegion, PoolFull, UsageError
from tract_cli.core.locks import DEFAULT_TIMEOUT_S
from tract_cli.core.native import ffi, id_array, lib, raise_for


class Allocator:
    """alloc(n) -> slot ids; free(slot ids). Batched: one C call per request."""

    def __init__(self, pool):
        self._pool = pool

    def alloc(self, n: int, timeout: float = DEFAULT_TIMEOUT_S) -> np.ndarray:
        """Allocates N slots (all or nothing) and returns their ids as uint32."""
        if n < 0:
            raise UsageError(f"cannot allocate {n} slots", "ask for zero or more")
        out = np.empty(n, dtype=np.uint32)
        rc = lib.tract_alloc(self._pool._r(), n, ffi.cast("uint32_t *", ffi.from_buffer(out)),
                             int(timeout * 1e9))
        if rc == lib.TRACT_E_FULL:
            raise PoolFull(f"the pool has fewer than {n} free slots",
                           "free or evict blocks, or use a larger region")
        raise_for(rc, f"{self._pool.path} allocator")
        return out

    def free(self, slots, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Frees slot ids (any node's: foreign slots go back through the region)."""
        arr = np.ascontiguousarray(slots, dtype=np.uint32)
        rc = lib.tract_free(self._pool._r(), ffi.cast("uint32_t *", ffi.from_buffer(arr)),
                            arr.size, int(timeout * 1e9))
        if rc == lib.TRACT_E_CORRUPT:
            raise CorruptRegion("a freed slot was not allocated (double free?)",
                             "free each slot exactly once")
        if rc == lib.TRACT_E_RANGE:
            raise UsageError("a slot id is outside the pool", "free only ids alloc() returned")
        raise_for(rc, f"{self._pool.path} allocator")

    def drain(self, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Returns this node's cached free slots to the region."""
        raise_for(lib.tract_alloc_drain(self._pool._r(), int(timeout * 1e9)), "allocator drain")

    def local_free(self) -> np.ndarray:
        """Slot ids on this node's free list (claimed, not in use)."""
        count = ffi.new("uint64_t *")
        raise_for(lib.tract_alloc_local_free(self._pool._r(), ffi.NULL, 0, count), "allocator")
        out = np.empty(count[0] + 64, dtype=np.uint32)
        raise_for(lib.tract_alloc_local_free(self._pool._r(),
                                             ffi.cast("uint32_t *", ffi.from_buffer(out)),
                                             out.size, count), "allocator")
        return out[: count[0]].copy()

    def rebuild(self, keep) -> None:
        """Rewrites the region's allocator state offline from the slots KEEP
        (slot ids, each below the slot count, none twice) and empties the
        transfer and lock tables, in one C call (`tract check --repair`, after
        the index's rebuild): the bitmap holds exactly KEEP, each kept slot
        keeps its owner byte (node 0's where it had none or one naming no
        node), the header counts
        them.  A bad list is refused (UsageError) before anything is written.
        Offline only: it takes no lock, so nobody else may map the region."""
        arr = id_array(keep, np.uint32, "the slots to keep must be a list of slot ids",
                       "pass a 1-D array of integers in 0..2**32-1")
        raise_for(lib.tract_alloc_rebuild(self._pool._r(), ffi.cast("uint32_t *", ffi.from_buffer(arr)),
                                          arr.size), f"{self._pool.path} allocator rebuild")
