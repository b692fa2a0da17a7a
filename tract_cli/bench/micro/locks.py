"""Lock and allocator figures: uncontended latency, contended throughput and
fairness, allocation of one request's slots, and a request's walk over the
index stripes with its locks requested ahead against the one-ahead walk, in
the same run.  Real processes on emulated nodes, a real `tract agent` running
the lock manager."""
from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass

import numpy as np
import psutil

from tract_cli.bench.regions import temp_region_path
from tract_cli.core.agent_launch import ensure_agent
from tract_cli.core.cpu import allowed_cpus
from tract_cli.core.locks import LOCK_ALLOCATOR, walk_ahead
from tract_cli.core.pool import Pool

WALK_KEYS = 375            # a 6000-token request of 16-token blocks: every stripe


@dataclass
class LockFigures:
    flush_mode: str
    uncontended_us: float              # median acquire+release, one node
    contention: dict                   # nodes -> {"per_s": .., "min": .., "max": ..}
    alloc_375_cold_us: float           # first allocation: claims from the region
    alloc_375_warm_us: float           # from the node's free list
    free_375_us: float
    # a request's walks over the stripes (claim, commit of WALK_KEYS keys), medians
    # in microseconds: {"claim": {"ahead": .., "one_ahead": ..}, "commit": {...}}; on
    # a busy core: the same with the manager, the walker and one CPU-bound process
    # sharing one core, as inside a busy engine (each grant then waits for the
    # scheduler to run the manager, then the walker)
    walks: dict
    walks_busy: dict
    stripes: int


def _spin() -> None:
    while True:
        pass


def _walks_on_a_busy_core(pool: Pool, agent_pid: int, rounds: int) -> dict:
    """_walks with this process, the lock manager's agent (every thread) and one
    CPU-bound process on one core (one this process may run on); every
    affinity restored after."""
    mine = psutil.Process().cpu_affinity()
    core = min(set(mine) & allowed_cpus() or mine)
    threads = {}
    for t in psutil.Process(agent_pid).threads():
        try:
            threads[t.id] = psutil.Process(t.id).cpu_affinity()
        except psutil.NoSuchProcess:      # a thread that ended meanwhile
            pass
    spinner = mp.get_context("spawn").Process(target=_spin, daemon=True)
    spinner.start()
    try:
        psutil.Process(spinner.pid).cpu_affinity([core])
        psutil.Process().cpu_affinity([core])
        for tid in threads:
            try:
                psutil.Process(tid).cpu_affinity([core])
            except psutil.NoSuchProcess:
                pass
        return _walks(pool, rounds)
    finally:
        spinner.terminate()
        spinner.join(timeout=30)
        psutil.Process().cpu_affinity(mine)
        for tid, cpus in threads.items():
            try:
                psutil.Process(tid).cpu_affinity(cpus)
            except psutil.NoSuchProcess:
                pass


def _walks(pool: Pool, rounds: int) -> dict:
    """Claim and commit of WALK_KEYS new keys, each one walk over the stripes,
    with the walk's locks requested ahead and one ahead (the walk of format 7),
    alternating round by round; the pool emptied between rounds (not timed)."""
    default = walk_ahead()         # as the process had it (TRACT_WALK_AHEAD), restored after
    out = {"claim": {"ahead": [], "one_ahead": []}, "commit": {"ahead": [], "one_ahead": []}}
    rng = np.random.default_rng(0)
    try:
        for r in range(rounds):
            for mode in (("ahead", "one_ahead") if r % 2 else ("one_ahead", "ahead")):
                walk_ahead(32 if mode == "ahead" else 1)
                keys = rng.integers(0, 256, (WALK_KEYS, 16), np.uint8)
                t0 = time.perf_counter()
                status, slots = pool.index.reserve(keys)
                t1 = time.perf_counter()
                # (nothing written into the slots: streamed, so the commit writes
                # no payload back and times the walk, not the flush mode's payload)
                pool.index.commit(keys, status, slots, streamed=True)
                t2 = time.perf_counter()
                out["claim"][mode].append(t1 - t0)
                out["commit"][mode].append(t2 - t1)
                pool.index.evict(pool.slot_count)
    finally:
        walk_ahead(default)
    return {walk: {mode: statistics.median(v) * 1e6 for mode, v in modes.items()}
            for walk, modes in out.items()}


def _contend(path: str, node: int, flush_mode: str, start_at: float, seconds: float, q) -> None:
    with Pool.attach(path, node=node, flush_mode=flush_mode) as pool:
        count = 0
        while time.time() < start_at:      # start together (a bounded wait)
            pass
        end = start_at + seconds
        while time.time() < end:
            pool.locks.acquire(LOCK_ALLOCATOR, timeout=30)
            pool.locks.release(LOCK_ALLOCATOR)
            count += 1
        q.put((node, count))


def bench_locks(flush_mode: str = "clflush", nodes=(1, 2, 4), seconds: float = 2.0,
                iterations: int = 2000, walk_rounds: int = 31) -> LockFigures:
    with temp_region_path() as path:
        Pool.create(path, 1 << 30, "llama-3-8b", nodes=max(nodes, default=1) + 1,
                    flush_mode=flush_mode).close()
        agent = ensure_agent(path, 0, manager=True, flush_mode=flush_mode)
        try:
            with Pool.attach(path, node=1, flush_mode=flush_mode) as pool:
                samples = []
                for _ in range(iterations):
                    t0 = time.perf_counter()
                    pool.locks.acquire(LOCK_ALLOCATOR)
                    pool.locks.release(LOCK_ALLOCATOR)
                    samples.append(time.perf_counter() - t0)
                uncontended = statistics.median(samples) * 1e6

                t0 = time.perf_counter()
                slots = pool.allocator.alloc(375)
                cold = (time.perf_counter() - t0) * 1e6
                t0 = time.perf_counter()
                pool.allocator.free(slots)
                free_us = (time.perf_counter() - t0) * 1e6
                warm = []
                for _ in range(50):
                    t0 = time.perf_counter()
                    slots = pool.allocator.alloc(375)
                    warm.append((time.perf_counter() - t0) * 1e6)
                    pool.allocator.free(slots)
                walks = _walks(pool, walk_rounds)
                # (an agent already running was not started here: its threads are
                # not this benchmark's to pin)
                busy = (_walks_on_a_busy_core(pool, agent.pid, walk_rounds)
                        if agent is not None else {})
                stripes = pool.info.index_stripes

            contention = {}
            ctx = mp.get_context("spawn")
            for k in nodes:
                q = ctx.Queue()
                start_at = time.time() + 1.5
                procs = [ctx.Process(target=_contend,
                                     args=(path, 1 + i, flush_mode, start_at, seconds, q))
                         for i in range(k)]
                for p in procs:
                    p.start()
                counts = dict(q.get(timeout=60) for _ in procs)
                for p in procs:
                    p.join(timeout=60)
                total = sum(counts.values())
                contention[k] = {"per_s": total / seconds, "min": min(counts.values()),
                                 "max": max(counts.values()),
                                 "fairness": max(counts.values()) / max(1, min(counts.values()))}
        finally:
            if agent is not None:
                agent.terminate()
                agent.wait(timeout=30)
    return LockFigures(flush_mode, uncontended, contention, cold, statistics.median(warm), free_us,
                       walks, busy, stripes)
