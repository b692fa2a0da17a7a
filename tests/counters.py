"""The shared-counter workload of the lock tests: worker processes increment
a counter in the region with a plain read-modify-write, under the object-directory lock (LOCK_OBJDIR) or not;
the total says whether any update was lost."""
from __future__ import annotations

from procs import Worker
from tract_cli.core.pool import Pool


def counter_offset(path: str) -> int:
    with Pool.attach(path, readonly=True, prefault=False) as p:
        return p.info.section("transfer").offset + 64    # an unused line, for the test


def start_counters(path: str, simulate: bool, iterations: int, nodes, use_lock: bool = True):
    """Starts one counting worker per entry of NODES (a node id each)."""
    off = counter_offset(path)
    workers = [Worker(path, node, simulate) for node in nodes]
    for w in workers:
        w.send("counter_loop", off=off, iterations=iterations, use_lock=use_lock)
    return workers


def finish_counters(path: str, workers, iterations: int) -> int:
    """Waits (bounded) for every worker's loop; returns the counter."""
    try:
        for w in workers:
            assert w.recv("counter_loop", timeout=300) == iterations
    finally:
        for w in workers:
            w.close()
    with Pool.attach(path, readonly=True) as p:
        return p.observe_u64(counter_offset(path))
