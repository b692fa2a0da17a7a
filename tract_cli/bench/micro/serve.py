"""`tract microbench serve`: TTFT and handoff time of the real serving path.

A prefill worker (node 1) and a decode worker (node 2) run as processes on a
temporary region; cold prompts (no prefix hit) of each length go through
`/v1/completions` with max_tokens=1.  The reference is the same engine in
this process: prefill and first token, no pool, no handoff.  Reported per
length and KV mode: medians of the single-process TTFT, the disaggregated
TTFT (measured by the decode worker from request in to first token), the
KV movement (prefill's pool write + handoff publish, decode's open + read +
acknowledge) and its share of the TTFT.
"""
from __future__ import annotations

import statistics
import time

import numpy as np

from tract_cli.bench.regions import temp_region_path
from tract_cli.core.agent_launch import ensure_agent
from tract_cli.core.pool import Pool
from tract_cli.serve.client import post_json
from tract_cli.serve.engine import Engine, Sampling
from tract_cli.serve.launch import WorkerProcess

MODES = ("copy", "zero-copy")


def bench_serving(lengths: list[int], rounds: int, profile: str = "tiny-llama",
                  threads: int | None = None, progress=None) -> list[dict]:
    engine = Engine.load(None, profile)
    bt = engine.block_tokens
    need = sum(rounds * len(MODES) * (-(-n // bt) + 2) for n in lengths) * engine.cfg.geometry.block_bytes
    size = -(-max(64 << 20, int(need * 1.5) + (16 << 20)) // (2 << 20)) * (2 << 20)
    rng = np.random.default_rng(0)
    out = []
    extra = ["--threads", str(threads)] if threads else []
    with temp_region_path() as path:
        with Pool.create(path, size, profile, nodes=4) as p:
            mode = p.flush_mode          # the workers attach with the same (header or env)
        agents, workers = [], []
        try:
            agents = [ensure_agent(path, 0, manager=True), ensure_agent(path, 1), ensure_agent(path, 2)]
            pre = WorkerProcess("serve-prefill", "--pool", path, "--node", "1",
                                "--model-profile", profile, *extra)
            workers.append(pre)
            dec = WorkerProcess("serve-decode", "--pool", path, "--node", "2", "--prefill", pre.url,
                                "--model-profile", profile, *extra)
            workers.append(dec)
            post_json(dec.url + "/v1/completions", {"prompt": "warm up", "max_tokens": 2})
            for n in lengths:
                base = []
                for _ in range(rounds):
                    tokens = [int(t) for t in rng.integers(0, 256, n)]
                    t0 = time.perf_counter()
                    table = engine.new_table(n)
                    engine.grow(table, n, [0])
                    engine.sample(engine.prefill(tokens, table), Sampling(1), 0)
                    base.append(time.perf_counter() - t0)
                    if progress:
                        progress()
                row = {"input_len": n, "flush_mode": mode,
                       "single_process_ttft_s": statistics.median(base)}
                for mode in MODES:
                    ttft, move, client = [], [], []
                    for _ in range(rounds):
                        tokens = [int(t) for t in rng.integers(0, 256, n)]   # cold: no hit
                        c = time.perf_counter()
                        r = post_json(dec.url + "/v1/completions",
                                  {"prompt": tokens, "max_tokens": 1, "temperature": 0,
                                   "kv_mode": mode})
                        client.append(time.perf_counter() - c)
                        tr = r["tract"]
                        pt = tr["prefill_timings"]
                        ttft.append(tr["ttft_s"])
                        move.append(pt["kv_write"] + pt["handoff_publish"] + tr["handoff_s"])
                        if progress:
                            progress()
                    row[mode] = {"ttft_s": statistics.median(ttft),
                                 "client_s": statistics.median(client),
                                 "kv_movement_s": statistics.median(move),
                                 "kv_share": statistics.median(m / t for m, t in zip(move, ttft))}
                out.append(row)
        finally:
            for w in reversed(workers):
                w.stop()
            for a in agents:
                if a is not None:
                    a.terminate()
                    a.wait(timeout=30)
    return out
