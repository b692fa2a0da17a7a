"""The request driver every `tract bench` transport shares: the workload's
clock, dispatch, the records' collection and the result they make.

One run of one transport is: each request issued at its arrival time
(`workloads.arrivals`, on the monotonic clock) through the transport's
DISPATCH; its record, as the decode side reports it, taken by RECEIVE on a
collector thread, one per request, with PROGRESS called for each; the wall
time from the first arrival to the last record.  A failure RECEIVE raises
(a `TractError`) stops the arrivals and is raised once the collector ends.
What dispatch and receive are is each driver's own: pipes and queues to the
worker processes (runner.py), JSON lines to a peer's processes (bench/peers/),
HTTP requests to the serving path (real.py).
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable

from tract_cli.bench.workload.workloads import arrivals
from tract_cli.core.errors import TractError


@dataclass
class TransportResult:
    transport: str
    records: list = field(default_factory=list)
    wall_s: float = 0.0
    lock_wait_s: float = 0.0
    lock_acquisitions: int = 0
    log_path: str | None = None       # where a peer's own processes logged

    def stage(self, name: str) -> list[float]:
        """The stage's times of the requests that went through it."""
        return [r["t"][name] for r in self.records if name in r["t"]]


def drive(transport: str, requests: list, dispatch: Callable, receive: Callable[[], dict],
          progress=None, *, stop: threading.Event | None = None,
          join_timeout: float | None = None, why: Callable[[], str] = lambda: "",
          hint: str = "check the workers") -> TransportResult:
    """Runs REQUESTS through TRANSPORT and returns its result (records, wall time).

    DISPATCH(seq, request, arrival) issues a request (returns False to stop
    issuing: its worker is gone, RECEIVE says why); RECEIVE() blocks for the
    next record, or raises TractError.  STOP (made here if not given) is set
    once the collector ends, by failure or with every record in: a dispatch
    that waits can watch it.  JOIN_TIMEOUT bounds the wait for the collector
    (None: RECEIVE bounds itself).  A run that ends short says how many
    requests finished, with WHY() appended and HINT as the fix."""
    stop = stop or threading.Event()
    res = TransportResult(transport)
    failure: list[BaseException] = []

    def collect():
        try:
            while len(res.records) < len(requests):
                res.records.append(receive())
                if progress:
                    progress()
        except TractError as exc:
            failure.append(exc)
        finally:
            stop.set()

    collector = threading.Thread(target=collect, daemon=True)
    t0 = time.monotonic()
    collector.start()
    for seq, req, arrival in arrivals(requests, t0, stop):
        if dispatch(seq, req, arrival) is False:
            break
    collector.join(join_timeout)
    res.wall_s = time.monotonic() - t0
    if failure:
        raise failure[0]
    if len(res.records) != len(requests):
        raise TractError(f"{transport}: {len(res.records)} of {len(requests)} requests finished"
                         + why(), hint)
    return res
