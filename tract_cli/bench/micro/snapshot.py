"""`tract inspect` figures: the time of one snapshot of a 1M-bucket index, and
how much a running workload slows down while `tract inspect --watch` refreshes."""
from __future__ import annotations

import multiprocessing as mp
import statistics
import subprocess
import time
from dataclasses import dataclass

import numpy as np

from tract_cli.bench.regions import temp_region_path
from tract_cli.core.agent_launch import ensure_agent
from tract_cli.core.geometry import Geometry, ModelProfile
from tract_cli.core.hashing import block_hashes, pool_root
from tract_cli.core.pool import Pool
from tract_cli.core.spawn import child_env, module_command
from tract_cli.inspect import snapshot

# 1 KiB blocks: a 400 MiB region holds ~400K slots, hence a 1M-bucket index
SMALL = ModelProfile("inspect-bench", Geometry(1, 1, 16, "f16", 16))


@dataclass
class InspectFigures:
    buckets: int
    ready: int
    snapshot_ms: float
    workload_ops_s: float
    workload_ops_s_watched: float
    interval_s: float
    flush_mode: str = "none"     # the mode the pool ran with (header, or TRACT_FLUSH_MODE)

    @property
    def slowdown(self) -> float:
        return self.workload_ops_s / self.workload_ops_s_watched


def _workload(path: str, seconds: float, q) -> None:
    """Lookups + unpins of one 375-block chain, as fast as possible."""
    with Pool.attach(path, node=2) as pool:
        keys = block_hashes(np.arange(6000, dtype=np.int32), root=pool_root(pool.info))
        n, end = 0, time.monotonic() + seconds
        while time.monotonic() < end:
            pool.index.unpin(pool.index.lookup(keys))
            n += 1
        q.put(n / seconds)


def _run_workload(path: str, seconds: float) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_workload, args=(path, seconds, q))
    p.start()
    rate = q.get(timeout=seconds + 120)
    p.join(timeout=60)
    return rate


def bench_inspect(entries: int = 20000, seconds: float = 3.0,
                  interval: float = 1.0) -> InspectFigures:
    with temp_region_path() as path:
        Pool.create(path, 400 << 20, SMALL, nodes=3, index_stripes=16).close()
        agent = ensure_agent(path, 0, manager=True)
        try:
            with Pool.attach(path, node=1) as pool:
                mode = pool.flush_mode
                root = pool_root(pool.info)
                block = np.zeros(pool.info.block_bytes, np.uint8)
                toks = np.random.default_rng(0).integers(0, 50000, entries * 16).astype(np.int32)
                keys = block_hashes(toks, root=root)
                for i in range(0, entries, 1000):
                    k = keys[i:i + 1000]
                    pool.index.put(k, np.broadcast_to(block, (len(k), block.size)))
                chain = block_hashes(np.arange(6000, dtype=np.int32), root=root)
                pool.index.put(chain, np.broadcast_to(block, (len(chain), block.size)))
            with snapshot.open_pool(path) as ro:
                times = []
                for _ in range(10):
                    t0 = time.perf_counter()
                    snap = snapshot.take(ro)
                    times.append(time.perf_counter() - t0)
                buckets, ready = snap["index"]["buckets"], snap["index"]["states"]["READY"]
            alone = _run_workload(path, seconds)
            watcher = subprocess.Popen(module_command("tract_cli.cli", "inspect", path,
                                                      "--watch", "--interval", str(interval)),
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                       env=child_env())
            try:
                watched = _run_workload(path, seconds)
            finally:
                watcher.terminate()
                watcher.wait(timeout=30)
        finally:
            if agent is not None:
                agent.terminate()
                agent.wait(timeout=30)
    return InspectFigures(buckets, ready, statistics.median(times) * 1e3, alone, watched, interval,
                          mode)
