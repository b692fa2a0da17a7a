"""Pool releases that must happen, done off the engine's request path.

The connector gives back what it took from the pool (a lookup's pins, a
handoff's acknowledgement, a failed save's PENDING claims) through this
queue: one daemon thread per process runs each release, and one that fails
transiently (a lock not granted in time: a busy or stalled lock manager) is
tried again, with a growing pause, until it succeeds or the process dies
(then the node's agent gives back what a dead process held).  A release is
never dropped because a lock was slow: a live vLLM would otherwise keep the
pins, or leave keys PENDING for every writer in the rack, until it exits.
It also keeps vLLM's scheduler loop from waiting on a pool lock to release.

A release that fails for good (the record is already gone, the region is
corrupt) is logged once and dropped: trying again cannot help.

A connector's releases wait RELEASE_DEFER_S before their first try.  None is
urgent (a pin or a record held some milliseconds longer costs nothing), and
the step that asks for one is still running when it does: a handoff's
acknowledgement is asked for by the load before the step's forward, a hit's
unpin by the step's output.  Tried at once, the release shared the worker's
core with that forward (vLLM binds the worker to its cores) and the GIL with
the step's sampling and output: measured inside vLLM on 2 cores, the decode
step of a 1500-token handoff took 1.2 ms longer and its first token left
later (docs/VLLM.md, "Releases wait for the step").
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

from tract_cli.connectors.throttle import Throttle
from tract_cli.core.errors import LockTimeout, OutOfMemory, SystemCallFailed, TractError

log = logging.getLogger("vllm.tract")

TRANSIENT = (LockTimeout, OutOfMemory, SystemCallFailed)
FIRST_PAUSE_S = 0.05
MAX_PAUSE_S = 2.0
WARN_QUEUED = 1000          # releases waiting: worth a warning (a stalled lock manager)
# how long a connector's release waits before its first try (above): past the
# step that asked for it and that step's output, a few to tens of ms
RELEASE_DEFER_S = 0.05


class _Release:
    __slots__ = ("what", "fn", "due", "pause", "tries")

    def __init__(self, what: str, fn: Callable[[float], None], due: float):
        self.what, self.fn = what, fn
        self.due, self.pause, self.tries = due, FIRST_PAUSE_S, 0


class Releases:
    """Releases (`submit(what, fn)`; FN(timeout) does one attempt), done in order of
    submission, each DEFER seconds after it was submitted at the soonest; one
    that fails transiently goes to the back with its own pause, so a release
    stuck behind one busy lock does not hold up the others beyond one attempt's
    timeout at a time."""

    def __init__(self, timeout: float, defer: float = 0.0):
        self._timeout = timeout
        self._defer = defer
        self._queue: collections.deque[_Release] = collections.deque()
        self._cv = threading.Condition()
        self._busy = 0                      # releases taken off the queue, being tried
        self._retries = 0
        self._closed = False
        self._warned = False
        self._thread = threading.Thread(target=self._run, name="tract-releases", daemon=True)
        self._thread.start()

    def submit(self, what: str, fn: Callable[[float], None]) -> None:
        """Queues FN (it never runs on the caller's thread)."""
        with self._cv:
            if self._closed:
                log.error("TraCT %s asked for after shutdown: not done; the node agent gives "
                          "it back once this process exits", what)
                return
            self._queue.append(_Release(what, fn, time.monotonic() + self._defer))
            if len(self._queue) >= WARN_QUEUED and not self._warned:
                self._warned = True
                log.warning("TraCT: %d pool releases wait (a stalled lock manager?); they are "
                            "tried until they succeed", len(self._queue))
            self._cv.notify_all()         # the worker, not only a drain() waiter

    def pending(self) -> int:
        """Releases not yet done (queued or being tried)."""
        with self._cv:
            return len(self._queue) + self._busy

    @property
    def retries(self) -> int:
        """Attempts that failed transiently and were tried again, so far."""
        return self._retries

    def drain(self, timeout: float) -> bool:
        """Waits up to TIMEOUT s until every release queued so far is done."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout: float) -> bool:
        """Finishes what is queued (bounded by TIMEOUT s), then stops the thread: what
        is left is logged, for the node agent once this process exits."""
        done = self.drain(timeout)
        with self._cv:
            self._closed = True
            left = len(self._queue)
            self._queue.clear()
            self._cv.notify_all()
        if left:
            log.error("TraCT: %d pool releases not done at shutdown; the node agent gives "
                      "them back once this process exits", left)
        return done

    def _next(self) -> _Release | None:
        """The first release whose time has come, waiting for one (None: closed)."""
        with self._cv:
            while True:
                if self._closed:
                    return None
                now = time.monotonic()
                for i, rel in enumerate(self._queue):
                    if rel.due <= now:
                        del self._queue[i]
                        self._busy += 1
                        return rel
                wait = min((rel.due for rel in self._queue), default=now + 3600) - now
                self._cv.wait(max(wait, 0.001))

    def _run(self) -> None:
        while (rel := self._next()) is not None:
            again = False
            try:
                again = self._attempt(rel)
            finally:
                with self._cv:
                    self._busy -= 1
                    if again and not self._closed:
                        self._queue.append(rel)
                    self._cv.notify_all()

    def _attempt(self, rel: _Release) -> bool:
        """One try of REL; whether to try it again."""
        try:
            rel.fn(self._timeout)
            if rel.tries:
                log.info("TraCT %s done after %d retries", rel.what, rel.tries)
            return False
        except TRANSIENT as exc:
            rel.tries += 1
            self._retries += 1
            if rel.tries == 1:
                log.warning("TraCT %s failed (%s); retrying until it succeeds", rel.what, exc)
            rel.due = time.monotonic() + rel.pause
            rel.pause = min(rel.pause * 2, MAX_PAUSE_S)
            return True
        except TractError as exc:
            log.error("TraCT %s failed for good, not retried: %s", rel.what, exc)
            return False
        except Exception:               # a bug: logged with its traceback, never silent
            log.exception("TraCT %s failed", rel.what)
            return False


def queue_ack(releases: Releases, pool, ticket, read=None, reserved: bool = False) -> None:
    """Queues the acknowledgement of handoff TICKET on RELEASES (READ: the slots a
    worker loaded; None: an instance that will not load it), each attempt resuming
    the one before it that timed out partway; a record already gone is logged.
    RESERVED: the record may still be reserved, not yet published; if so its
    reservation is given back instead (its owner's publish is then refused)."""
    from tract_cli.core.errors import HandoffError

    def attempt(timeout: float) -> None:
        if reserved and pool.handoffs.unreserve(ticket.record, bytes.fromhex(ticket.request_id),
                                                timeout=timeout):
            log.info("TraCT handoff %d: its reservation given back", ticket.record)
            return
        try:
            pool.handoffs.ack(ticket, timeout=timeout, read=read, resume=True)
        except HandoffError as exc:            # gone already: expired and reclaimed
            log.warning("TraCT handoff %d not acknowledged: %s", ticket.record, exc)

    releases.submit(f"acknowledgement of handoff {ticket.record}", attempt)


# a lost-handoff record with no room for it is said at most this often
NO_ROOM_LOG_S = 10.0
_no_room_said = Throttle(NO_ROOM_LOG_S)


def queue_pair_lost(releases: Releases, pool, name: bytes, ttl: float, request_id: str) -> None:
    """Queues on RELEASES the record of no blocks under pair NAME
    (Handoffs.publish_lost) that tells request REQUEST_ID's paired decode its
    handoff will not be published: that decode, which has no ticket to find a
    record gone, computes the prompt at once instead of after pair_wait_s.
    Where the pool has no room for one, said (at most every NO_ROOM_LOG_S:
    a full table fails every one) and dropped: that decode then computes after
    pair_wait_s.  A lock not granted is retried."""
    from tract_cli.core.errors import PoolFull, TransferTableFull

    def attempt(timeout: float) -> None:
        try:
            pool.handoffs.publish_lost(name, ttl, timeout=timeout)
        except (PoolFull, TransferTableFull) as exc:
            if _no_room_said.due():
                log.warning("TraCT: no record could tell paired request %s's decode that its "
                            "handoff is lost (%s); it computes the prompt after pair_wait_s "
                            "(said at most every %.0f s)", request_id, exc.problem,
                            NO_ROOM_LOG_S)

    releases.submit(f"lost-handoff record of request {request_id}", attempt)
