"""`tract bench`'s figures from the records of a run: the stages a record
times, a request's KV handoff, the per-transport summary (TTFT, handoff and
stage statistics, hit rate, bytes moved and their rate, lock wait) and the
memcpy reference the handoff is compared with.

A record is what a decode side reports per request (runner.py's workers, the
peers' receivers, the serving path's answers): `t` maps a stage (STAGES) to
its seconds, a stage the transport does not have is absent; with `ttft`,
`e2e`, `blocks`, `hits`, `tokens`, `output_len`, `ok` (every block and the
tail as the prefill side made them) and, for modelled compute,
`modelled_compute` and `verify_s` (the check's own seconds: after the first
token, in no stage).
"""
from __future__ import annotations

import statistics
import time

import numpy as np

STAGES = ("queue", "hash", "lookup", "kv_load", "compute", "kv_write", "handoff_publish",
          "handoff_open", "kv_read", "first_token", "ack")


def handoff_s(rec: dict) -> float:
    """Moving the KV from prefill to decode: writing it to the pool (or sending),
    the handoff record, reading it out (or receiving)."""
    t = rec["t"]
    return sum(t.get(k, 0.0) for k in ("kv_write", "handoff_publish", "handoff_open", "kv_read"))


def memcpy_reference(nbytes: int, rounds: int = 3, copies: int = 2) -> float:
    """The memcpy reference of `tract bench` (and of `--engine vllm`): seconds
    for COPIES chained copies of NBYTES (private -> buffer -> private, numpy's
    copyto: memcpy of contiguous bytes), the buffers faulted in first, best of
    ROUNDS.  (`tract microbench copy` measures its own: glibc memcpy per block
    into the pool's slots, `bench.micro.memcpy`.)"""
    bufs = [np.random.default_rng(0).integers(0, 255, max(nbytes, 1), dtype=np.uint8)]
    for _ in range(copies):
        bufs.append(np.empty_like(bufs[0]))
    copy_all = lambda: [np.copyto(dst, src) for src, dst in zip(bufs, bufs[1:])]
    copy_all()                                   # fault them all in before timing
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        copy_all()
        best = min(best, time.perf_counter() - t0)
    return best


def pct(v, q) -> float:
    return float(np.percentile(v, q)) if len(v) else 0.0


def _stats(v):
    if not v:
        return None
    return {"mean": statistics.fmean(v), "p50": pct(v, 50), "p90": pct(v, 90), "p99": pct(v, 99)}


def summarize(r, block_bytes: int, block_tokens: int, *, prefix_cache: bool,
              kv_bytes_moved) -> dict:
    """Per transport (R: its run's TransportResult): TTFT, handoff and stage
    statistics (a stage no request went through is None, not 0), hit rate (None
    without a PREFIX_CACHE: tcp and the peers), KV bytes moved
    (KV_BYTES_MOVED(record, block_bytes): the caller's transport says, see
    transports.kv_accounting) and their rate (None when nothing moves:
    zero-copy)."""
    ttft = [x["ttft"] for x in r.records]
    e2e = [x["e2e"] for x in r.records]
    hand = [handoff_s(x) for x in r.records]
    blocks = sum(x["blocks"] for x in r.records)
    hits = sum(x["hits"] for x in r.records)
    tokens = sum(x["tokens"] for x in r.records)
    moved = sum(kv_bytes_moved(x, block_bytes) for x in r.records)
    move_s = sum(x["t"].get("kv_write", 0.0) + x["t"].get("kv_read", 0.0) for x in r.records)
    modelled = [x["modelled_compute"] for x in r.records if "modelled_compute" in x]
    verify = [x["verify_s"] for x in r.records if "verify_s" in x]
    return {"transport": r.transport, "requests": len(r.records),
            "verified": bool(r.records) and all(x["ok"] for x in r.records),
            "verify_s": _stats(verify),
            "ttft_s": _stats(ttft), "e2e_s": _stats(e2e), "handoff_s": _stats(hand),
            "stages_s": {k: _stats(r.stage(k)) for k in STAGES},
            "modelled_compute_s": statistics.fmean(modelled) if modelled else None,
            "hit_rate_blocks": (hits / blocks if blocks else 0.0) if prefix_cache else None,
            "hit_rate_tokens": ((hits * block_tokens / tokens if tokens else 0.0) if prefix_cache
                                else None),
            "throughput_rps": len(r.records) / r.wall_s if r.wall_s else 0.0,
            "output_tokens_per_s": sum(x["output_len"] for x in r.records) / r.wall_s if r.wall_s else 0.0,
            "kv_bytes_moved": moved,
            "kv_gbps": moved / move_s / 1e9 if moved and move_s else None,
            "lock_wait_s": r.lock_wait_s if r.lock_acquisitions else None,
            "lock_acquisitions": r.lock_acquisitions,
            "wall_s": r.wall_s}
