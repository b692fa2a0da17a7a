"""What KV events cost (docs/PROTOCOLS.md §13): the commit of one request's
blocks described (records with hashes, parents, token ids) against the same
commit with key-only records, in the same run -- every commit writes a record
and appends an event per block, so this is what describing adds; a reader's
log read per event and its snapshot of the region; the feed's take, with the
conversion to vLLM's event fields, per block told."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from tract_cli.bench.regions import need_space, temp_region_path
from tract_cli.core.agent_launch import ensure_agent
from tract_cli.core.events import Feed, RegionView, describe, event_fields
from tract_cli.core.geometry import load_model
from tract_cli.core.hashing import block_hashes, pool_root
from tract_cli.core.pool import Pool

TAG = b"microbench-tag-1"


@dataclass
class EventFigures:
    model: str
    input_len: int
    blocks: int
    flush_mode: str
    commit_plain_us: float        # the commit of the request's blocks, key-only records
    commit_described_us: float    # the same, described (hashes, parents, token ids)
    describe_us: float            # core.events.describe of the request (Python, numpy)
    poll_us: float                # a reader's read of the request's events and records
    poll_idle_us: float           # a reader's read when nothing changed
    snapshot_us: float            # a reader's snapshot of the region holding the request
    take_us: float                # the feed's take of the request's blocks, as vLLM's fields


def _median(samples: list[float]) -> float:
    return statistics.median(samples) * 1e6


def bench_events(model: str = "tiny", input_len: int = 6000, flush_mode: str = "clflush",
                 rounds: int = 9) -> EventFigures:
    profile = load_model(model)
    g = profile.geometry
    blocks = input_len // g.block_tokens
    size = ((4 * blocks * g.block_bytes + (64 << 20)) // (2 << 20) + 1) * (2 << 20)
    with temp_region_path() as path:
        need_space(path, size, "a shorter --input-len")
        Pool.create(path, size, profile, nodes=3, flush_mode=flush_mode).close()
        agent = ensure_agent(path, 0, manager=True, flush_mode=flush_mode)
        try:
            with Pool.attach(path, node=1) as writer, Pool.attach(path, node=2) as reader:
                root = pool_root(writer.info)
                view = RegionView(reader, TAG)
                feed = Feed(view, 2)
                plain, described, describe_s, poll_s, idle_s, take_s, snaps = ([] for _ in
                                                                                range(7))
                for r in range(rounds):
                    for with_desc in ((False, True) if r % 2 else (True, False)):
                        writer.index.evict(writer.slot_count)
                        feed.note(view.poll())
                        feed.take(wait_parents=False)
                        toks = np.random.default_rng(2 * r + with_desc).integers(
                            0, 128000, blocks * g.block_tokens).astype(np.int32)
                        keys = block_hashes(toks, root=root)
                        t0 = time.perf_counter()
                        d = describe(keys, toks, g.block_tokens, TAG) if with_desc else None
                        t1 = time.perf_counter()
                        status, slots = writer.index.reserve(keys)
                        t2 = time.perf_counter()
                        writer.index.commit(keys, status, slots, described=d)
                        t3 = time.perf_counter()
                        (described if with_desc else plain).append(t3 - t2)
                        if not with_desc:
                            continue
                        describe_s.append(t1 - t0)
                        t0 = time.perf_counter()
                        changed = view.poll()
                        t1 = time.perf_counter()
                        view.poll()
                        t2 = time.perf_counter()
                        feed.note(changed)
                        t3 = time.perf_counter()
                        for change in feed.take():
                            event_fields(change, block_size=g.block_tokens, medium="CPU",
                                         ownership="tract", locality=True)
                        t4 = time.perf_counter()
                        RegionView(reader, TAG)
                        t5 = time.perf_counter()
                        poll_s.append(t1 - t0)
                        idle_s.append(t2 - t1)
                        take_s.append(t4 - t3)
                        snaps.append(t5 - t4)
        finally:
            if agent is not None:
                agent.terminate()
                agent.wait(30)
    return EventFigures(model, input_len, blocks, flush_mode, _median(plain),
                        _median(described), _median(describe_s), _median(poll_s),
                        _median(idle_s), _median(snaps), _median(take_s))
