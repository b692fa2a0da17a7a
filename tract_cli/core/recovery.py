"""Recovery of a node's dead processes, one call into the core.

What a process that died left on its node -- the lock grants and requests it
held, its journaled pins and unfinished (PENDING) writes, orphaned claims no
journal remembers, half-done handoff releases -- is given back by
`tract_recover` (native/recover.c), in the order docs/PROTOCOLS.md §7 gives.
The node agent calls `recover_node` every heartbeat; these are the Python
wrappers and what they report.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from tract_cli.core.errors import TractError
from tract_cli.core.native import ffi, lib, raise_for
from tract_cli.core.pool import Pool


@dataclass
class Recovered:
    """What one recovery pass gave back from the node's dead processes."""

    processes: int = 0
    pins: int = 0
    claims: int = 0
    slots: int = 0
    partial: int = 0      # journals that had overflowed: the rest needs `tract check --repair`
    pending: bool = False  # a busy stripe lock left work for the next pass

    def describe(self) -> str:
        text = (f"recovered {self.processes} dead process(es): {self.pins} pin(s) released, "
                f"{self.claims} unfinished write(s) dropped, {self.slots} slot(s) freed")
        if self.partial:
            text += (f"; {self.partial} journal(s) had overflowed: run `tract check --repair` "
                     "offline for the rest")
        return text

    @classmethod
    def from_c(cls, rep) -> Recovered:
        """The fields of a `struct tract_recovery` of the same names."""
        return cls(**{f.name: int(getattr(rep, f.name)) for f in fields(cls)
                      if f.name != "pending"})


@dataclass
class NodeRecovery:
    """What one pass of the node's recovery (native/recover.c) did."""

    locks: int = 0            # locks of dead processes taken over (repaired) or withdrawn
    dead: Recovered = None    # what their journals gave back
    orphans: int = 0          # unfinished writes no journal remembers, dropped
    orphans_pending: bool = False   # a stripe was busy: the orphan scan is not done
    handoffs: int = 0         # half-done handoff releases finished
    errors: tuple = ()        # (step, TractError) of steps that failed (a timeout: retried)


def recover_node(pool: Pool, orphans: bool, timeout: float = 1.0) -> NodeRecovery:
    """One pass of the node's recovery, in its documented order: the locks of
    dead processes, their journals, orphaned writes (when ORPHANS), half-done
    handoff releases; one call into the core."""
    rep = ffi.new("struct tract_recovery *")
    flags = lib.TRACT_RECOVER_ORPHANS if orphans else 0
    raise_for(lib.tract_recover(pool._r(), flags, rep, int(timeout * 1e9)), "node recovery")
    errors = []
    for step, rc in (("recovery of dead processes", rep.journal_rc),
                     ("orphaned writes", rep.orphan_rc), ("handoff recovery", rep.handoff_rc)):
        if rc < 0 and rc != lib.TRACT_E_TIMEOUT:      # a busy lock: the next pass resumes
            try:
                raise_for(rc, step)
            except TractError as err:
                errors.append((step, err))
    # (a step that timed out reports what it did before the busy lock)
    dead = replace(Recovered.from_c(rep), pending=rep.journal_rc == lib.TRACT_E_TIMEOUT)
    return NodeRecovery(locks=int(rep.locks), dead=dead, orphans=int(rep.orphans_buried),
                        orphans_pending=bool(rep.orphans_skipped) or rep.orphan_rc != 0,
                        handoffs=int(rep.handoffs), errors=tuple(errors))


def recover_dead_processes(pool: Pool, timeout: float = 1.0) -> Recovered:
    """Gives back what this node's dead processes held in the index: their
    journaled pins and unfinished (PENDING) writes with their slots (the
    journal step of `recover_node` alone)."""
    rep = ffi.new("struct tract_recovery *")
    rc = lib.tract_recover_dead(pool._r(), rep, int(timeout * 1e9))
    if rc == lib.TRACT_E_TIMEOUT:
        # a stripe lock was busy: the next heartbeat retries; what was given
        # back before (or past a journal left whole for it) is reported
        return replace(Recovered.from_c(rep), pending=True)
    raise_for(rc, "recovery of dead processes")
    return Recovered.from_c(rep)


@dataclass
class HostRecovery:
    """What one pass of a dead host's recovery (`tract_recover_host`) did."""

    handoffs: int = 0     # handoff releases its processes left half done, finished
    claims: int = 0       # its unfinished (PENDING) writes, dropped
    records: int = 0      # its handoff records still live: its pins wait for them
    skipped: int = 0      # stripes busy: the next pass resumes
    pins: int = 0         # pins of its dead readers given back
    slots: int = 0        # its slots nothing references any more, returned to the pool
    owned: int = 0        # its slots still referenced (blocks others read, its records)
    done: bool = False    # nothing left but later slot sweeps

    @classmethod
    def from_c(cls, rep) -> HostRecovery:
        return cls(**{f.name: type(f.default)(getattr(rep, f.name)) for f in fields(cls)})


def declare_dead(pool: Pool, node: int, epoch: int, heartbeat_ns: int) -> None:
    """Declares NODE's agent epoch EPOCH dead, if the node still shows that
    epoch and heartbeat (`NodeAlive` if not); only the current lock manager's
    agent may (`Superseded`)."""
    raise_for(lib.tract_node_declare_dead(pool._r(), node, epoch, heartbeat_ns),
              f"declaring node {node} dead")


def recover_host(pool: Pool, node: int, slots: bool, timeout: float = 1.0) -> HostRecovery:
    """One pass of dead host NODE's recovery (native/recover.c): its half-done
    handoff releases, its unfinished writes, its pins once none of its handoff
    records remains, and (SLOTS) its slots nothing references; `NodeAlive`
    once it was restarted."""
    rep = ffi.new("struct tract_host_recovery *")
    flags = lib.TRACT_RECOVER_HOST_SLOTS if slots else 0
    rc = lib.tract_recover_host(pool._r(), node, flags, rep, int(timeout * 1e9))
    if rc == lib.TRACT_E_TIMEOUT:
        return HostRecovery(skipped=1)     # a lock was busy: the next heartbeat resumes
    raise_for(rc, f"recovery of dead node {node}")
    return HostRecovery.from_c(rep)


def rejoin(pool: Pool, prev_epoch: int, line0: bytes, timeout: float = 5.0) -> tuple[bool, int, int]:
    """What an agent starting on a node publishes its entry through
    (`tract_node_rejoin`): LINE0, the node's line 0 with its new epoch; if a
    verdict declared the previous epoch PREV_EPOCH dead, what the dead host's
    recovery gave back is forgotten.  Returns (a verdict named it, journaled
    pins forgotten, free-list entries dropped)."""
    pins, dropped = ffi.new("uint64_t *"), ffi.new("uint64_t *")
    rc = lib.tract_node_rejoin(pool._r(), prev_epoch, line0, pins, dropped, int(timeout * 1e9))
    raise_for(rc if rc < 0 else 0, "publishing the node's entry")
    return rc == 1, int(pins[0]), int(dropped[0])
