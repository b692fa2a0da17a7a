"""The two-tier lock as a Python object: `with pool.locks.hold(lock_id): ...`.

Every wait is bounded: a timeout raises LockTimeout naming the lock, the
node and pid holding it and for how long.

The lock ids (docs/FORMAT.md §4) are the core's (tract.h): the fixed locks
-- `TRACT_LOCK_ALLOCATOR`, `TRACT_LOCK_OBJDIR`, `TRACT_LOCK_TRANSFER`, which
the C files that take them use too -- then one lock per index stripe,
`FIRST_STRIPE_LOCK + s` (`TRACT_FIXED_LOCKS + s`).  This module names them.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import NamedTuple

from tract_cli.core.errors import LockTimeout, NoLocalSegment, UsageError
from tract_cli.core.native import ffi, lib, raise_for
from tract_cli.core.units import format_duration

LOCK_ALLOCATOR = lib.TRACT_LOCK_ALLOCATOR       # the allocator: bitmap, owner map, header
LOCK_OBJDIR = lib.TRACT_LOCK_OBJDIR             # the object directory
LOCK_TRANSFER = lib.TRACT_LOCK_TRANSFER         # the handoffs' transfer table
FIRST_STRIPE_LOCK = lib.TRACT_FIXED_LOCKS
_FIXED = {LOCK_ALLOCATOR: "allocator", LOCK_OBJDIR: "object directory",
          LOCK_TRANSFER: "transfer table"}
if sorted(_FIXED) != list(range(FIRST_STRIPE_LOCK)):
    raise RuntimeError(f"the core has {lib.TRACT_FIXED_LOCKS} fixed locks, "
                       f"tract_cli.core.locks names the ids {sorted(_FIXED)}")
FIXED_LOCK_NAMES = tuple(_FIXED[i] for i in range(FIRST_STRIPE_LOCK))   # by lock id

# a node's slot of a lock in the lock table (native/format.h, FORMAT.md §4.1):
# what `tract inspect` and `tract check` read there; SLOT_STATES names them
SLOT_IDLE = lib.TRACT_LOCK_IDLE
SLOT_WAITING = lib.TRACT_LOCK_WAITING
SLOT_LOCKED = lib.TRACT_LOCK_LOCKED
SLOT_STATES = {SLOT_IDLE: "IDLE", SLOT_WAITING: "WAITING", SLOT_LOCKED: "LOCKED"}
DEFAULT_TIMEOUT_S = 30.0


class LockStats(NamedTuple):
    """A node's local lock statistics (a tuple: `acquired, wait_s = ...` works)."""

    acquired: int           # acquisitions by this node
    wait_s: float           # seconds they spent acquiring


def walk_ahead(n: int | None = None) -> int:
    """How many stripe lock requests an index walk of this process keeps ahead
    (docs/PROTOCOLS.md §4); with N (1..32), sets it first.  1 is the one-ahead
    walk of format 7, what `tract microbench lock` measures requesting ahead
    against; TRACT_WALK_AHEAD sets it at start (default 32)."""
    if n is not None and not 1 <= n <= 32:
        raise UsageError(f"a walk keeps 1 to 32 requests ahead, not {n}", "pass 1..32")
    return int(lib.tract_set_walk_ahead(n or 0))


def stripe_lock(stripe: int) -> int:
    """The lock id of index stripe STRIPE."""
    return FIRST_STRIPE_LOCK + stripe


def lock_count(stripes: int) -> int:
    """How many locks a region with STRIPES index stripes has."""
    return FIRST_STRIPE_LOCK + stripes


def lock_name(lock_id: int) -> str:
    """Human name of a lock id."""
    if 0 <= lock_id < FIRST_STRIPE_LOCK:
        return FIXED_LOCK_NAMES[lock_id]
    return f"index stripe {lock_id - FIRST_STRIPE_LOCK}"


class Locks:
    """The global locks of a region, as seen from one attached process."""

    def __init__(self, pool):
        self._pool = pool

    @property
    def count(self) -> int:
        return self._pool.info.lock_count

    def acquire(self, lock_id: int, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
        """Acquires LOCK_ID; returns True if it was taken over from a dead holder (a
        process of this node, or a host declared dead): what it protects needs a
        repair, which the C core's own callers make."""
        self._check(lock_id)
        wait = ffi.new("struct tract_lock_wait *")
        rc = lib.tract_lock_acquire(self._pool._r(), lock_id, int(timeout * 1e9), wait)
        if rc == lib.TRACT_E_TIMEOUT:
            raise LockTimeout(self._describe_timeout(lock_id, timeout, wait),
                              "check `tract agent` runs on the manager node and the holder is alive")
        if rc == lib.TRACT_E_NO_LOCAL:
            raise NoLocalSegment("this pool handle has no node-local segment",
                             "attach without readonly to take locks")
        raise_for(rc if rc < 0 else 0, f"{self._pool.path} lock {lock_name(lock_id)}")
        return rc == lib.TRACT_RECOVERED

    def release(self, lock_id: int) -> None:
        """Releases LOCK_ID, which this process must hold."""
        self._check(lock_id)
        rc = lib.tract_lock_release(self._pool._r(), lock_id)
        if rc == lib.TRACT_E_NOT_HELD:
            raise UsageError(f"lock {lock_name(lock_id)} is not held by this process",
                             "release only what you acquired")
        raise_for(rc, f"{self._pool.path} lock {lock_name(lock_id)}")

    @contextmanager
    def hold(self, lock_id: int, timeout: float = DEFAULT_TIMEOUT_S):
        """Context manager: acquire on entry, release on exit."""
        self.acquire(lock_id, timeout)
        try:
            yield
        finally:
            self.release(lock_id)

    def stats(self, lock_id: int) -> LockStats:
        """This node's acquisitions of LOCK_ID and the seconds they spent acquiring."""
        self._check(lock_id)
        acquired, wait = ffi.new("uint64_t *"), ffi.new("uint64_t *")
        raise_for(lib.tract_lock_stats(self._pool._r(), lock_id, acquired, wait), "lock stats")
        return LockStats(acquired[0], wait[0] / 1e9)

    def totals(self) -> LockStats:
        """This node's acquisitions and seconds spent acquiring, over every lock."""
        stats = [self.stats(i) for i in range(self.count)]
        return LockStats(sum(s.acquired for s in stats), sum(s.wait_s for s in stats))

    def _check(self, lock_id: int) -> None:
        if not 0 <= lock_id < self.count:
            raise UsageError(f"lock id {lock_id} is outside 0..{self.count - 1}",
                             "use an allocator, directory, transfer or stripe lock id")

    @staticmethod
    def _describe_timeout(lock_id: int, timeout: float, wait) -> str:
        what = f"lock {lock_name(lock_id)} (id {lock_id}) not acquired within {format_duration(timeout)}"
        if wait.stage == 1:
            return f"{what}: another process of this node holds its local mutex"
        if wait.granted_node:
            return (f"{what}: held by node {wait.granted_node - 1} pid {wait.holder_pid} "
                    f"for {format_duration(wait.held_ns / 1e9)}")
        return f"{what}: no grant was issued (is the lock manager running?)"
