"""Times the transfer table's hot paths: handoff publish + ack with records
already in flight, and the node agent's periodic passes over the table
(`reclaim` with nothing expired, `recover` with nothing to finish).

    .venv/bin/python tools/handoff_table_bench.py [--rounds 2000] [--modes none,clflush]

One process publishes and acknowledges (a decode side's ack costs the same
wherever it runs); the lock manager is a real agent process.  Two shapes of
in-flight records: `stuck` (IN_FLIGHT records never acknowledged, one more
published and acknowledged each round) and `fifo` (IN_FLIGHT in flight, each
round publishes one and acknowledges the oldest).  Figures are medians per
call, the best of --repeat runs of each configuration (a lock grant waits
for the manager thread, which on a busy 2-core machine makes whole runs
slow at random), on the emulated /dev/shm region -- not a claim about CXL
latency.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile
import time

import numpy as np

from tract_cli.core.agent_launch import ensure_agent
from tract_cli.core.pool import Pool
from tract_cli.core.region import remove_region


def _median_us(samples: list[float]) -> float:
    return 1e6 * statistics.median(samples)


def run(mode: str, in_flight: int, shape: str, rounds: int) -> dict:
    path = os.path.join(tempfile.mkdtemp(prefix="tract-hbench-", dir="/dev/shm"), "pool")
    Pool.create(path, 64 << 20, "tiny", nodes=2, flush_mode=mode).close()
    agent = ensure_agent(path, 0, manager=True)
    try:
        with Pool.attach(path, node=1, flush_mode=mode) as p:
            keys = np.arange(4 * 16, dtype=np.uint8).reshape(4, 16)   # 4 blocks, pinned per handoff
            p.index.put(keys, np.zeros((4, p.info.block_bytes), np.uint8))
            live = collections.deque(p.handoffs.publish(f"fill-{i}", keys, 64, ttl=3600)
                                     for i in range(in_flight))
            pub, pair = [], []
            for i in range(rounds):
                t0 = time.perf_counter()
                t = p.handoffs.publish(f"r-{i}", keys, 64, ttl=3600)
                t1 = time.perf_counter()
                if shape == "fifo" and live:
                    live.append(t)
                    t = live.popleft()
                p.handoffs.ack(t)
                t2 = time.perf_counter()
                pub.append(t1 - t0)
                pair.append(t2 - t0)
            scans = []
            for _ in range(200):
                t0 = time.perf_counter()
                p.handoffs.reclaim(now_ns=time.time_ns())      # nothing is expired
                p.handoffs.recover()                           # nothing to finish
                scans.append(time.perf_counter() - t0)
            for t in live:
                p.handoffs.ack(t)
    finally:
        agent.terminate()
        agent.wait(timeout=30)
        remove_region(path)
        os.rmdir(os.path.dirname(path))
    return {"mode": mode, "in_flight": in_flight, "shape": shape,
            "publish_us": _median_us(pub), "publish_ack_us": _median_us(pair),
            "publish_p99_us": 1e6 * float(np.percentile(pub, 99)),
            "agent_pass_us": _median_us(scans)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=2000)
    ap.add_argument("--modes", default="none,clflush")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args(argv)
    import tract_cli
    print(f"transfer table bench ({os.path.dirname(tract_cli.__file__)}), emulated /dev/shm "
          f"region, 1024 records, {a.rounds} rounds, best of {a.repeat}")
    print(f"{'flush':8s} {'in flight':>9s} {'shape':6s} {'publish':>10s} {'p99':>10s} "
          f"{'pub+ack':>10s} {'agent pass':>11s}")
    for mode in a.modes.split(","):
        for in_flight, shape in ((0, "stuck"), (1000, "stuck"), (1000, "fifo")):
            runs = [run(mode, in_flight, shape, a.rounds) for _ in range(a.repeat)]
            r = {k: min(x[k] for x in runs) for k in ("publish_us", "publish_p99_us",
                                                       "publish_ack_us", "agent_pass_us")}
            print(f"{mode:8s} {in_flight:9d} {shape:6s} {r['publish_us']:8.1f}us "
                  f"{r['publish_p99_us']:8.1f}us {r['publish_ack_us']:8.1f}us "
                  f"{r['agent_pass_us']:9.1f}us", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
