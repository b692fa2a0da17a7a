"""A stop request that a signal handler may make.

A handler that calls `threading.Event.set()` deadlocks when the signal lands
while the main thread is inside that same Event's `wait()`: the handler runs
in the main thread, which already holds the Event's (non-reentrant) lock. So
the handler here only sets a flag, and `wait` polls it; the poll period bounds
how late a stop is seen (50 ms).
"""
from __future__ import annotations

import time

POLL_S = 0.05


class StopFlag:
    """`request` (the signal handler: `signal.signal(SIGTERM, flag.request)`),
    `is_set`, and `wait(timeout)` as `threading.Event.wait` answers."""

    def __init__(self):
        self.requested = False

    def request(self, *_signal_args) -> None:
        self.requested = True          # a plain store: no lock, safe in a handler

    def is_set(self) -> bool:
        return self.requested

    def wait(self, timeout: float) -> bool:
        """Whether a stop was requested, waiting up to TIMEOUT seconds for one."""
        end = time.monotonic() + timeout
        while not self.requested:
            left = end - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, POLL_S))
        return True
