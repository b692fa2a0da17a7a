"""Worker metrics in the Prometheus text exposition format (no client library).

Counters, gauges and cumulative histograms, thread-safe; `render()` is what
`/metrics` serves.  Gauges may be backed by a callable read at scrape time
(pool usage, handoffs in flight).
"""
from __future__ import annotations

import bisect
import threading

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0, 30.0)


class Metrics:
    def __init__(self, prefix: str = "tract"):
        self.prefix = prefix
        self._lock = threading.Lock()
        self._counters: dict[str, list] = {}        # name -> [help, value]
        self._gauges: dict[str, list] = {}          # name -> [help, value or callable]
        self._hists: dict[str, list] = {}           # name -> [help, bucket counts, sum, count]

    def counter(self, name: str, help_text: str) -> None:
        self._counters.setdefault(name, [help_text, 0.0])

    def gauge(self, name: str, help_text: str, read=None) -> None:
        self._gauges.setdefault(name, [help_text, read if read is not None else 0.0])

    def histogram(self, name: str, help_text: str) -> None:
        self._hists.setdefault(name, [help_text, [0] * len(LATENCY_BUCKETS_S), 0.0, 0])

    def inc(self, name: str, by: float = 1.0) -> None:
        with self._lock:
            self._counters[name][1] += by

    def set(self, name: str, value: float) -> None:
        with self._lock:
            self._gauges[name][1] = value

    def observe(self, name: str, seconds: float) -> None:
        with self._lock:
            h = self._hists[name]
            i = bisect.bisect_left(LATENCY_BUCKETS_S, seconds)
            if i < len(LATENCY_BUCKETS_S):
                h[1][i] += 1
            h[2] += seconds
            h[3] += 1

    def value(self, name: str) -> float:
        """A counter's value, a gauge's, or a histogram's observation count."""
        with self._lock:
            if name in self._counters:
                return self._counters[name][1]
            if name in self._hists:
                return self._hists[name][3]
            v = self._gauges[name][1]
        return float(v() if callable(v) else v)

    def render(self) -> str:
        p = self.prefix
        lines = []
        with self._lock:
            counters = {k: list(v) for k, v in self._counters.items()}
            gauges = {k: list(v) for k, v in self._gauges.items()}
            hists = {k: [v[0], list(v[1]), v[2], v[3]] for k, v in self._hists.items()}
        for name, (text, value) in counters.items():
            lines += [f"# HELP {p}_{name} {text}", f"# TYPE {p}_{name} counter",
                      f"{p}_{name} {value:g}"]
        for name, (text, value) in gauges.items():
            try:
                value = value() if callable(value) else value
            except Exception:           # a scrape must not fail because the pool is closing
                continue
            lines += [f"# HELP {p}_{name} {text}", f"# TYPE {p}_{name} gauge",
                      f"{p}_{name} {float(value):g}"]
        for name, (text, buckets, total, count) in hists.items():
            lines += [f"# HELP {p}_{name} {text}", f"# TYPE {p}_{name} histogram"]
            acc = 0
            for bound, n in zip(LATENCY_BUCKETS_S, buckets):
                acc += n
                lines.append(f'{p}_{name}_bucket{{le="{bound:g}"}} {acc}')
            lines += [f'{p}_{name}_bucket{{le="+Inf"}} {count}', f"{p}_{name}_sum {total:g}",
                      f"{p}_{name}_count {count}"]
        return "\n".join(lines) + "\n"
