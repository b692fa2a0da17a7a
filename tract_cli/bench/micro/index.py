"""Prefix-index and handoff figures for one request (docs/PROTOCOLS.md §9, §10):
hashing, put and read bandwidth against memcpy of the same bytes in the same
run, lookup+pin, copying and zero-copy handoff and their metadata share."""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from tract_cli.bench.micro.region import c_pointer, memcpy, release
from tract_cli.bench.regions import need_space, temp_region_path
from tract_cli.core.agent_launch import ensure_agent
from tract_cli.core.errors import UsageError
from tract_cli.core.geometry import load_model
from tract_cli.core.hashing import block_hashes, pool_root
from tract_cli.core.pool import LEDGER_EVICTED, Pool
from tract_cli.core.region import DEFAULT_INDEX_STRIPES
from tract_cli.core.units import format_size


@dataclass
class IndexFigures:
    model: str
    input_len: int
    blocks: int
    bytes: int
    flush_mode: str
    hash_us: float
    put_gbps: float
    put_memcpy_gbps: float
    lookup_pin_us: float
    read_gbps: float
    read_memcpy_gbps: float
    copy_handoff_ms: float
    copy_handoff_metadata_ms: float
    zero_copy_handoff_ms: float
    details: dict = field(default_factory=dict)


def _median(fn, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples)


def _wait_swept(decode: Pool, prefill: Pool, keys, timeout_s: float = 30.0) -> None:
    """Waits (bounded) until the decode node's agent has swept the slots of
    KEYS: the ledger holds EVICTED (or already these payloads' tags) there."""
    hit = prefill.index.lookup(keys)
    try:
        slots, tags = hit.slots.tolist(), hit.tags.tolist()
    finally:
        prefill.index.unpin(hit)
    deadline = time.monotonic() + timeout_s
    while True:
        held = [decode.payload_ledger(s) for s in slots]
        if all(h in (LEDGER_EVICTED, t) for h, t in zip(held, tags)):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the decode node's agent did not sweep {len(slots)} slots "
                               f"within {timeout_s:g} s")
        time.sleep(0.01)   # the agent works in its own process; this only polls


def bench_index(model: str = "llama-3-8b", input_len: int = 6000, flush_mode: str = "clflush",
                rounds: int = 5, stripes: int = DEFAULT_INDEX_STRIPES,
                region_size: int | None = None) -> IndexFigures:
    """REGION_SIZE (None: what the request needs) sets how many buckets the
    index has: a larger region spreads a request's blocks over more pin
    lines (docs/BENCHMARKS.md)."""
    profile = load_model(model)
    g = profile.geometry
    blocks = input_len // g.block_tokens
    nbytes = blocks * g.block_bytes
    size = ((2 * nbytes + (64 << 20)) // (2 << 20) + 1) * (2 << 20)
    if region_size is not None:
        if region_size % (2 << 20):
            raise UsageError(f"--region-size {format_size(region_size)} is not a whole number "
                             "of 2 MiB pages", "round it, e.g. 4G or 1536M")
        if region_size < size:
            raise UsageError(f"--region-size {format_size(region_size)} is too small for a "
                             f"{input_len}-token request of {model}",
                             f"give at least {format_size(size)}, or leave it out")
        size = region_size
    tokens = np.random.default_rng(0).integers(0, 128000, input_len).astype(np.int32)
    kv = np.random.default_rng(1).integers(0, 255, (blocks, g.block_bytes), dtype=np.uint8)
    out = np.empty_like(kv)
    with temp_region_path() as path:
        need_space(path, size, "a shorter --input-len or a smaller --region-size")
        Pool.create(path, size, profile, nodes=3, flush_mode=flush_mode,
                    index_stripes=stripes).close()
        agent = ensure_agent(path, 0, manager=True, flush_mode=flush_mode)
        try:
            with Pool.attach(path, node=1) as prefill, Pool.attach(path, node=2) as decode:
                root = pool_root(prefill.info)
                hash_s = _median(lambda: block_hashes(tokens, root=root), 200)
                keys = block_hashes(tokens, root=root)

                # put: fresh slots every round (evict first), against memcpy into the same
                # slots (through their zero-copy views, taken off the clock)
                put_s, memcpy_s = [], []
                src = c_pointer(kv)
                for _ in range(rounds):
                    prefill.index.evict(10 * blocks)
                    t0 = time.perf_counter()
                    prefill.index.put(keys, kv)
                    put_s.append(time.perf_counter() - t0)
                    hit = prefill.index.lookup(keys)
                    dsts = [c_pointer(prefill.slot_bytes(s), writable=True)
                            for s in hit.slots.tolist()]
                    prefill.index.unpin(hit)
                    t0 = time.perf_counter()
                    for i, d in enumerate(dsts):
                        memcpy(d, src + i * g.block_bytes, g.block_bytes)
                    memcpy_s.append(time.perf_counter() - t0)
                    release(*dsts)
                    del dsts
                    # restore the real payload so reads below see what put wrote
                    prefill.index.evict(10 * blocks)
                    prefill.index.put(keys, kv)

                def lookup_unpin():
                    r = decode.index.lookup(keys)
                    decode.index.unpin(r)
                lookup_s = _median(lookup_unpin, 20)
                only = []
                for _ in range(20):
                    t0 = time.perf_counter()
                    r = decode.index.lookup(keys)
                    only.append(time.perf_counter() - t0)
                    decode.index.unpin(r)
                lookup_only = statistics.median(only)
                # the same, after another request's lookup took the heads of
                # most stripes' LRU lists: each lookup moves its blocks back
                # (spliced as runs), where a hot prefix hit again in the same
                # order moves none
                other = block_hashes(tokens[::-1].copy(), root=root)[:64]
                decode.index.put(other, kv[:len(other)])
                moved = []
                for _ in range(20):
                    decode.index.unpin(decode.index.lookup(other))     # off the clock
                    t0 = time.perf_counter()
                    r = decode.index.lookup(keys)
                    moved.append(time.perf_counter() - t0)
                    decode.index.unpin(r)
                lookup_moved = statistics.median(moved)
                r = decode.index.lookup(keys)
                read_s = _median(lambda: decode.index.read(r, out), rounds)
                dst = c_pointer(out, writable=True)
                srcs = [c_pointer(decode.slot_bytes(s)) for s in r.slots.tolist()]

                def memcpy_out():
                    for i, p in enumerate(srcs):
                        memcpy(dst + i * g.block_bytes, p, g.block_bytes)
                read_memcpy_s = _median(memcpy_out, rounds)
                release(*srcs)
                del srcs        # the pool closes only once no view of it is left
                decode.index.unpin(r)
                assert np.array_equal(out, kv), "read back different bytes"

                def handoff(zero_copy: bool) -> tuple[float, float]:
                    t0 = time.perf_counter()
                    ticket = prefill.handoffs.publish("bench", keys, input_len)
                    rec = decode.handoffs.open(ticket)
                    t1 = time.perf_counter()
                    if zero_copy:
                        decode.handoffs.views(rec)      # the views themselves are the read
                    else:
                        decode.handoffs.copy_blocks(rec, out, verify=False)
                    t2 = time.perf_counter()
                    decode.handoffs.ack(ticket)
                    t3 = time.perf_counter()
                    return t3 - t0, (t1 - t0) + (t3 - t2)
                copies = [handoff(False) for _ in range(rounds)]
                zeros = [handoff(True) for _ in range(rounds)]

                # the same, for payloads the decode node has not read yet: before
                # each round (off the clock) the blocks are evicted and put again,
                # so their tags are new and the decode node's ledger vouches for
                # none of them.  With no agent on the decode node, every slot is
                # evicted before it is read; with one, its payload sweep evicts
                # the dead payloads' slots in the background, between requests
                # (waited for here, off the clock), and the read evicts nothing
                sweeper = None

                def renewed(fn):
                    out_s = []
                    for _ in range(rounds):
                        prefill.index.evict(10 * blocks)
                        prefill.index.put(keys, kv)
                        if sweeper is not None:
                            _wait_swept(decode, prefill, keys)
                        out_s.append(fn())
                    return out_s

                def fresh_read() -> float:
                    hit = decode.index.lookup(keys)
                    t0 = time.perf_counter()
                    decode.index.read(hit, out)
                    dt = time.perf_counter() - t0
                    decode.index.unpin(hit)
                    return dt
                fresh_reads = renewed(fresh_read)
                fresh_copies = renewed(lambda: handoff(False))
                fresh_zeros = renewed(lambda: handoff(True))
                # (flush mode none evicts nothing, so nothing is swept either)
                swept_reads = swept_copies = swept_zeros = None
                if flush_mode != "none":
                    sweeper = ensure_agent(path, 2, manager=False, flush_mode=flush_mode)
                    try:
                        swept_reads = renewed(fresh_read)
                        swept_copies = renewed(lambda: handoff(False))
                        swept_zeros = renewed(lambda: handoff(True))
                    finally:
                        if sweeper is not None:
                            sweeper.terminate()
                            sweeper.wait(timeout=30)
                release(src, dst)
        finally:
            if agent is not None:
                agent.terminate()
                agent.wait(timeout=30)
    med = statistics.median
    return IndexFigures(
        model, input_len, blocks, nbytes, flush_mode, hash_s * 1e6,
        nbytes / med(put_s) / 1e9, nbytes / med(memcpy_s) / 1e9, lookup_s * 1e6,
        nbytes / read_s / 1e9, nbytes / read_memcpy_s / 1e9,
        med(c[0] for c in copies) * 1e3, med(c[1] for c in copies) * 1e3,
        med(z[0] for z in zeros) * 1e3,
        {"lookup_pin_only_us": lookup_only * 1e6, "stripes": stripes, "region_size": size,
         "lookup_pin_moved_us": lookup_moved * 1e6,
         "first_read_gbps": nbytes / med(fresh_reads) / 1e9,
         "first_copy_handoff_ms": med(c[0] for c in fresh_copies) * 1e3,
         "first_zero_copy_handoff_ms": med(z[0] for z in fresh_zeros) * 1e3,
         "swept_read_gbps": swept_reads and nbytes / med(swept_reads) / 1e9,
         "swept_copy_handoff_ms": swept_copies and med(c[0] for c in swept_copies) * 1e3,
         "swept_zero_copy_handoff_ms": swept_zeros and med(z[0] for z in swept_zeros) * 1e3})
