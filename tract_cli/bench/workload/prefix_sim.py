"""Offline simulation of the prefix index's hit rate (the recency order of
docs/PROTOCOLS.md §9), to check trace-replay hit rates against.

Per request, in arrival order: the hits are the longest run of leading keys
in the cache; they are touched from the last to the first (so the head of a
chain is the most recent); the missing blocks are then inserted, the tail
first; while over capacity, the least recent block not belonging to the
request in flight is evicted.  The index keeps one LRU list per stripe and
evicts round-robin across stripes, so under eviction pressure its hit rate
approximates this global-LRU figure; with no eviction they are equal.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import numpy as np


@dataclass
class SimResult:
    hit_blocks: int
    total_blocks: int
    evictions: int
    per_request: list

    @property
    def hit_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0


def simulate(keys_per_request: list[np.ndarray], capacity_blocks: int) -> SimResult:
    """KEYS_PER_REQUEST: each request's (n, 16) block keys, in arrival order."""
    cache: OrderedDict[bytes, None] = OrderedDict()        # last = most recent
    hits_total = blocks_total = evictions = 0
    per_request = []
    for keys in keys_per_request:
        ks = [k.tobytes() for k in keys]
        h = 0
        while h < len(ks) and ks[h] in cache:
            h += 1
        for k in reversed(ks[:h]):                          # touch tail to head
            cache.move_to_end(k)
        mine = set(ks)
        for k in reversed(ks[h:]):                          # insert tail first
            cache[k] = None
            cache.move_to_end(k)
        while len(cache) > capacity_blocks:
            victim = next((k for k in cache if k not in mine), None)
            if victim is None:
                break
            del cache[victim]
            evictions += 1
        hits_total += h
        blocks_total += len(ks)
        per_request.append(h)
    return SimResult(hits_total, blocks_total, evictions, per_request)
