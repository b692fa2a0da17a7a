"""A warning the connector may have cause to repeat every engine step (a full
table, a stalled lock manager, a handoff bound reached) is logged at most once
every so many seconds: `Throttle.due()` says whether this one is.

Hand-written: the standard library's logging has no rate limit, and the few
lines here do not justify a dependency.
"""
from __future__ import annotations

import time


class Throttle:
    """Yes at most once every PERIOD_S seconds (monotonic clock), the first
    time always.  Not locked: two threads asking at once may both be told
    yes, which costs one line more, never one less."""

    def __init__(self, period_s: float):
        self.period_s = period_s
        self._last: float | None = None

    def due(self) -> bool:
        now = time.monotonic()
        if self._last is not None and now - self._last < self.period_s:
            return False
        self._last = now
        return True
