"""Errors of the TraCT library.

Every error carries one line that says what is wrong and what to do; the
command line prints exactly that line (no traceback) and exits non-zero.

Every C core code has its class here (core/native.py `raise_for` maps them),
so a caller catches a kind of failure by type wherever it is raised -- a lock
timeout inside `index.lookup` is a `LockTimeout` -- and no code decides
anything by an error's text.
"""
from __future__ import annotations


class TractError(Exception):
    """A failure the user can act on: `str(err)` is one line, problem then fix."""

    exit_code = 1

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}; {fix}" if fix else problem)


class UsageError(TractError):
    """Bad arguments (exit code 2)."""

    exit_code = 2


class NotFormattedError(TractError):
    """The target holds no TraCT format."""


class FormatMismatchError(TractError):
    """The region's format, version, checksum, size or layout is not usable."""


class GeometryMismatchError(TractError):
    """The region was formatted for a different KV geometry or model."""


class AlreadyFormattedError(TractError):
    """Refusing to overwrite an existing TraCT region (or other data) without --force."""


class NoSpaceError(TractError):
    """The file system behind a region file has too little free space."""


class FlushModeError(TractError):
    """The CPU does not support the requested flush mode."""


class LockTimeout(TractError):
    """A lock was not granted within its timeout (TRACT_E_TIMEOUT)."""


class PoolFull(TractError):
    """Not enough free slots (or directory entries) for an allocation (TRACT_E_FULL)."""


class RequestTooLarge(PoolFull):
    """More slots asked for than the whole pool has: no eviction can make room,
    so retrying is useless (TRACT_E_TOO_LARGE)."""


class NotFound(TractError):
    """No such named object, key or record (TRACT_E_NOT_FOUND)."""


class CorruptRegion(TractError):
    """Region metadata fails a consistency check (TRACT_E_CORRUPT, TRACT_E_RANGE)."""


class NoLocalSegment(TractError):
    """The handle has no node-local segment: a read-only attach (TRACT_E_NO_LOCAL)."""


class Superseded(TractError):
    """Another node holds a later lock-manager claim (TRACT_E_SUPERSEDED)."""


class NodeAlive(TractError):
    """The node heartbeat or restarted: not (or no longer) declared dead
    (TRACT_E_ALIVE)."""


class OutOfMemory(TractError):
    """A process-local allocation failed (TRACT_E_NOMEM)."""


class SystemCallFailed(TractError):
    """A system call failed (TRACT_E_SYS); the message carries its errno text."""


class ChecksumMismatch(TractError):
    """A block read back does not match the checksum recorded at put."""


class HandoffError(TractError):
    """A handoff record is missing, expired, or not what the ticket says."""


class BlocksPending(HandoffError):
    """Publishing a handoff found a block of the request not READY in the pool
    (absent, or still PENDING under another writer)."""


class TransferTableFull(HandoffError):
    """The transfer table has no free record (TRACT_E_TABLE_FULL)."""


class HandoffGone(HandoffError):
    """The handoff's record is not there: acknowledged, expired and reclaimed,
    given back, or never written (TRACT_E_NOT_FOUND on open)."""


class ReservationGone(HandoffError):
    """A publish into a reserved record found the reservation gone: given back
    (by a decode that stopped waiting for it), expired, or freed."""


class HandoffLost(HandoffError):
    """The handoff's record holds no block: its prefill side will not publish
    the handoff (Handoffs.publish_lost), and the decode computes the prompt."""


class HandoffPending(HandoffError):
    """The handoff's record is reserved and not yet published: its prefill side
    is still committing the blocks (TRACT_E_PENDING).  Ask again shortly."""
