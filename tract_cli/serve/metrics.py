"""Worker metrics, exposed through `prometheus_client`.

Each `Metrics` has its own `CollectorRegistry` (never the process-global
one): several workers in one process -- the tests run prefill and decode
side by side -- each register the same names without colliding.  Counters,
gauges and histograms are the library's (thread-safe); `render()` is
`generate_latest`, what `/metrics` serves.

Gauges may be backed by a callable read at scrape time (pool usage, handoffs
in flight).  Those are served by one custom collector rather than
`Gauge.set_function`, so that a gauge whose read fails (the pool is closing)
is left out of that scrape instead of failing the whole scrape.
"""
from __future__ import annotations

import threading

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_PLAIN_0_0_4

# the content type of what `generate_latest` writes (text format 0.0.4)
CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0, 30.0)


class _ReadAtScrape:
    """The callable-backed gauges of one registry, read when it is collected."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.reads: dict[str, tuple[str, object]] = {}     # name -> (help, callable)

    def collect(self):
        for name, (help_text, read) in list(self.reads.items()):
            try:
                value = float(read())
            except Exception:           # a scrape must not fail because the pool is closing
                continue
            yield GaugeMetricFamily(f"{self.prefix}_{name}", help_text, value=value)


class Metrics:
    def __init__(self, prefix: str = "tract"):
        self.prefix = prefix
        self.registry = CollectorRegistry()
        self._lock = threading.Lock()           # registration only; updates are the library's
        self._metrics: dict[str, object] = {}   # name -> Counter, Gauge or Histogram
        self._read = _ReadAtScrape(prefix)
        self.registry.register(self._read)

    def _add(self, name: str, make) -> None:
        with self._lock:
            if name not in self._metrics and name not in self._read.reads:
                self._metrics[name] = make()

    def counter(self, name: str, help_text: str) -> None:
        self._add(name, lambda: Counter(name, help_text, namespace=self.prefix,
                                        registry=self.registry))

    def gauge(self, name: str, help_text: str, read=None) -> None:
        if read is None:
            self._add(name, lambda: Gauge(name, help_text, namespace=self.prefix,
                                          registry=self.registry))
            return
        with self._lock:
            if name not in self._metrics:
                self._read.reads.setdefault(name, (help_text, read))

    def histogram(self, name: str, help_text: str) -> None:
        self._add(name, lambda: Histogram(name, help_text, namespace=self.prefix,
                                          registry=self.registry, buckets=LATENCY_BUCKETS_S))

    def inc(self, name: str, by: float = 1.0) -> None:
        self._metrics[name].inc(by)

    def set(self, name: str, value: float) -> None:
        self._metrics[name].set(value)

    def observe(self, name: str, seconds: float) -> None:
        self._metrics[name].observe(seconds)

    def value(self, name: str) -> float:
        """A counter's value, a gauge's, or a histogram's observation count.

        Read from that one metric's samples, not by collecting the registry: a
        scrape-time gauge (the hit rate) calls this, and collecting would read
        every gauge, itself included."""
        if name in self._read.reads:
            return float(self._read.reads[name][1]())
        metric = self._metrics[name]
        if isinstance(metric, Counter):     # the library names a counter's sample NAME_total
            full = f"{self.prefix}_{name.removesuffix('_total')}_total"
        elif isinstance(metric, Histogram):
            full = f"{self.prefix}_{name}_count"
        else:
            full = f"{self.prefix}_{name}"
        for family in metric.collect():
            for sample in family.samples:
                if sample.name == full:
                    return float(sample.value)
        raise KeyError(name)

    def render(self) -> str:
        return generate_latest(self.registry).decode()
