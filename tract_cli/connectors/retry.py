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
"""
from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Callable

from tract_cli.core.errors import LockTimeout, OutOfMemory, SystemCallFailed, TractError

log = logging.getLogger("vllm.tract")

TRANSIENT = (LockTimeout, OutOfMemory, SystemCallFailed)
FIRST_PAUSE_S = 0.05
MAX_PAUSE_S = 2.0


class Releases:
    """A FIFO of releases (`submit(what, fn)`; FN(timeout) does one attempt)."""

    def __init__(self, timeout: float):
        self._timeout = timeout
        self._queue: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._busy = 0                      # releases taken off the queue, not finished
        self._retries = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tract-releases", daemon=True)
        self._thread.start()

    def submit(self, what: str, fn: Callable[[float], None]) -> None:
        """Queues FN (it never runs on the caller's thread)."""
        with self._cv:
            self._queue.append((what, fn))
            self._cv.notify()

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
        """Finishes what is queued (bounded by TIMEOUT s), then stops the thread."""
        done = self.drain(timeout)
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        return done

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                what, fn = self._queue.popleft()
                self._busy += 1
            try:
                self._attempt(what, fn)
            finally:
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()

    def _attempt(self, what: str, fn: Callable[[float], None]) -> None:
        pause, tries = FIRST_PAUSE_S, 0
        while True:
            try:
                fn(self._timeout)
                if tries:
                    log.info("TraCT %s done after %d retries", what, tries)
                return
            except TRANSIENT as exc:
                tries += 1
                self._retries += 1
                if tries == 1:
                    log.warning("TraCT %s failed (%s); retrying until it succeeds", what, exc)
                with self._cv:
                    if self._closed:
                        log.error("TraCT %s not done at shutdown; the node agent gives it back "
                                  "once this process exits", what)
                        return
                    self._cv.wait(pause)      # a pause the shutdown can cut short
                pause = min(pause * 2, MAX_PAUSE_S)
            except TractError as exc:
                log.error("TraCT %s failed for good, not retried: %s", what, exc)
                return
            except Exception:               # a bug: logged with its traceback, never silent
                log.exception("TraCT %s failed", what)
                return
