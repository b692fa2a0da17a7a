"""Lock and allocator figures: uncontended latency, contended throughput and
fairness, allocation of one request's slots.  Real processes on emulated
nodes, a real `tract agent` running the lock manager."""
from __future__ import annotations

import multiprocessing as mp
import statistics
import time
from dataclasses import dataclass

from tract_cli.bench.regions import temp_region_path
from tract_cli.core.agent_launch import ensure_agent
from tract_cli.core.locks import LOCK_ALLOCATOR
from tract_cli.core.pool import Pool


@dataclass
class LockFigures:
    flush_mode: str
    uncontended_us: float              # median acquire+release, one node
    contention: dict                   # nodes -> {"per_s": .., "min": .., "max": ..}
    alloc_375_cold_us: float           # first allocation: claims from the region
    alloc_375_warm_us: float           # from the node's free list
    free_375_us: float


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
                iterations: int = 2000) -> LockFigures:
    with temp_region_path() as path:
        Pool.create(path, 1 << 30, "llama-3-8b", nodes=max(nodes) + 1, flush_mode=flush_mode).close()
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
    return LockFigures(flush_mode, uncontended, contention, cold, statistics.median(warm), free_us)
