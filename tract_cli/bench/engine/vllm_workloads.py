"""`tract bench --engine vllm --workload ... | --trace FILE`: the paper's workloads
under load on real vLLM (its Figs. 6-10): requests arrive on their own clock
(Poisson at each `--qps`, or a trace's timestamps rescaled to each rate), many
in flight at once, through each KV path in turn.

The systems (one at a time, so they never compete for the CPUs):
- P/D (`tract`, `example`, `nixl`, `nixl-tcp`, `mooncake`): every request
  prefilled on one vLLM, decoded on the other, as a proxy runs them
  (`calls.pd_request`).  `tract`'s prefill instance also looks the prompt up
  in the region, the rack's prefix cache (the paper's system); NIXL and the
  others have no cache beyond vLLM's own;
- shared cache (`prefix`: TraCT's region; `lmcache`: LMCache's server): two
  vLLMs on one cache, each serving whole requests, the requests alternating
  between them, so each instance hits what the other stored;
- `mono`: one vLLM on all the CPUs the pairs share, the floor; and, one request
  at a time after its runs, the answer every system must give.

Each rate is its own draw of the workload (seed + k, or the trace salted by k),
so every rate starts from a cold cache, and every system gets the same
requests.  Per system and rate: throughput, TTFT (from each request's
scheduled arrival to its first token: a late send counts against the system),
the prefix-cache hit rate it reached (vLLM's own count of the prompt tokens
the computing instances took from their KV path or their own cache), and the
request's time split (see `breakdown`).
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tract_cli.bench.engine import answers as answer_check
from tract_cli.bench.engine import calls
from tract_cli.bench.engine import configs as engine_configs
from tract_cli.bench.engine.vllm_runs import (DEFAULT_KV_CACHE_GIB, VLLM_BLOCK, _flush_mode,
                                              _kv_bytes, _tract_region, failure_of, prompts,
                                              remove_pool, to_run)
from tract_cli.bench.workload.workloads import Request, arrivals
from tract_cli.core import kvlog
from tract_cli.core.errors import TractError, UsageError
from tract_cli.serve.client import HttpError

# in the order of their rows: the P/D paths, the shared caches, the floor
SYSTEMS = ("tract", "tract-paired", "example", "nixl", "nixl-tcp", "mooncake", "prefix",
           "lmcache", "mono")
PD = ("tract", "tract-paired", "example", "nixl", "nixl-tcp", "mooncake")
SHARED = ("prefix", "lmcache")
# what a run under load compares unless told: not ExampleConnector, which stores
# only a request's first scheduled chunk (vLLM 0.32's `build_connector_meta` adds
# a store for a new request with the blocks it has so far), so a prompt vLLM
# chunks under load is stored short and the decode instance's load stops its
# engine (a shape mismatch); nor Mooncake's connector, which does not start on
# vLLM's CPU build (configs.py).  Asked for, each runs and its failure is reported.
DEFAULT = ("tract", "nixl", "nixl-tcp", "prefix", "lmcache", "mono")

MAX_IN_FLIGHT = 512        # threads of the driver: more requests in flight is an overload
TOKENS = calls.PROMPT_TOKENS
LOGPROBS = answer_check.TOP_LOGPROBS      # top candidates a token: answers are compared by them


def run(model_dir: str, points: list[tuple[float, list[Request]]], configs: list[str],
        log=sys.stderr, kv_cache_gib: float = DEFAULT_KV_CACHE_GIB,
        load_mode: str = "sync",
        vllm_prefix_caching: bool = False, handoff_publish: str = "after_step") -> dict:
    """POINTS: (offered rate, its requests) per rate.  Runs each configuration
    over every point; returns the records, the summaries per (rate, system),
    and what was skipped or failed (as `vllm_runs.run`)."""
    from tract_cli.serve.vllm_engine import check_model_dir, vllm_python
    check_model_dir(model_dir)
    for c in configs:
        if c not in SYSTEMS:
            raise UsageError(f"unknown vLLM configuration {c!r}", f"use {', '.join(SYSTEMS)}")
    configs = list(dict.fromkeys(configs))
    from tract_cli.serve.vllm_engine import model_config
    cfg = model_config(model_dir)
    vocab = cfg["vocab_size"]
    reqs = [r for _, rs in points for r in rs]
    longest = max(len(r.tokens) + r.output_len for r in reqs)
    max_len = max(longest, 2 * VLLM_BLOCK + 8 + 16) + 16
    positions = cfg["max_position_embeddings"]
    if max_len > positions:
        raise UsageError(f"a request of {longest} tokens (prompt and output) exceeds the "
                         f"model's {positions} positions",
                         "use a smaller --isl-mean, or --max-input-len with a trace")
    skipped = engine_configs.unavailable_of(configs, vllm_python())
    warm = prompts([2 * VLLM_BLOCK + 8], 1, vocab, 7919)[0][1]
    # a cache (the region, LMCache's server) holds the largest rate's prompts twice
    # over: the rates' prompts share no block, so an earlier rate's are what its LRU
    # evicts first
    largest = max(([len(r.tokens) for r in rs] for _, rs in points), key=sum)
    cache_bytes = _kv_bytes(model_dir, sum(largest) * 2)
    args = ("--max-model-len", str(max_len), "--max-num-batched-tokens", str(max_len),
            "--enable-prefix-caching" if vllm_prefix_caching else "--no-enable-prefix-caching",
            "--block-size", str(VLLM_BLOCK))
    work = tempfile.mkdtemp(prefix="tract-bench-vllm-")
    records, summaries, answers, reference = [], [], {}, {}
    failed: dict[str, str] = {}
    pool, flush_mode, keep_logs = None, None, True
    try:
        for config in to_run(configs, skipped, log):
            got_records, got_summaries = [], []

            def one_config():
                nonlocal pool, flush_mode
                if config in engine_configs.TRACT_CONFIGS:        # each from an empty region
                    pool = None if pool is None else remove_pool(pool)
                    pool = _tract_region(model_dir, largest, 1)
                    flush_mode = _flush_mode(pool)
                _run_config(config, model_dir, work, args, kv_cache_gib, pool, load_mode,
                            points, warm, cache_bytes, got_records, got_summaries, answers,
                            reference, log, vllm_prefix_caching, handoff_publish)
            why = failure_of(one_config)
            if why is not None:
                failed[config] = why
            if config in failed:
                print(f"{config} failed: {failed[config]}", file=log, flush=True)
                for k in list(answers):
                    if k[0] == config:
                        del answers[k]
                if config == "mono":        # a partial reference checks nothing fairly
                    reference.clear()
                continue
            records += got_records
            summaries += got_summaries
        verify(records, summaries, answers, reference)
        # the logs are kept where a configuration failed or an answer was not verified
        keep_logs = bool(failed) or any(s["verified"] is False for s in summaries)
    finally:
        if pool is not None:
            from tract_cli.core.region import remove_region
            remove_region(pool)
        if keep_logs:
            print(f"the vLLM servers' logs are kept in {work}", file=log, flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return {"records": records, "summaries": summaries, "skipped": skipped, "failed": failed,
            "logs": work if keep_logs else None, "flush_mode": flush_mode,
            "load_mode": load_mode, "vllm_prefix_caching": vllm_prefix_caching,
            "handoff_publish": handoff_publish, "kv_cache_gib": kv_cache_gib}


def _run_config(config, model_dir, work, args, kv_cache_gib, pool, load_mode, points, warm,
                cache_bytes, records, summaries, answers, reference, log,
                vllm_prefix_caching, handoff_publish: str = "after_step") -> None:
    """Starts CONFIG's servers, runs every point through them (and, for mono, the
    reference pass), stops them.  TraCT's connector times its loads and saves
    (log lines) but makes no reference copy beside them: no system here pays
    for a copy the others do not."""
    # with vLLM's prefix cache on, mono's is emptied before each reference request
    # (vLLM's development endpoint /reset_prefix_cache; this server only)
    servers = engine_configs.start(config, model_dir, work, args, kv_cache_gib, pool,
                                   load_mode, VLLM_BLOCK, cache_bytes, mono_all_cpus=True,
                                   reference=False,
                                   mono_env={"VLLM_SERVER_DEV_MODE": "1"}
                                   if vllm_prefix_caching else None,
                                   handoff_publish=handoff_publish)
    try:
        for s in servers.values():
            s.wait_ready()
        engine = calls.mooncake_engine(servers["prefill"]) if config == "mooncake" else None
        # the path's one-time costs (vLLM's first step, a connector's first copy) paid
        # before any measured request: one request through each instance
        _drive(config, servers, [Request(f"warm-{i}", 0.0, np.asarray(warm), 4)
                                 for i in range(1 if config not in SHARED else 2)], engine)
        logs = {role: os.path.join(work, f"{config}-{role}.log") for role in servers
                if role != "cache"}
        _run_points(config, servers, points, engine, logs, records, summaries, answers, reference,
                    log, vllm_prefix_caching)
    finally:
        engine_configs.stop_all(servers)
        store = getattr(servers.get("prefill"), "store", None)
        if store:
            shutil.rmtree(store, ignore_errors=True)


def _run_points(config, servers, points, engine, logs, records, summaries, answers, reference,
                log, vllm_prefix_caching=False) -> None:
    """Every point through CONFIG's running servers (and, for mono, the reference
    pass).  A request that fails because an instance's engine stopped is reported
    with the exception that stopped it (the streamed error only says it stopped)."""
    try:
        for k, (qps, reqs) in enumerate(points):
            print(f"  {config} at {qps:g} QPS: {len(reqs)} requests ...", file=log, flush=True)
            before = {role: calls.metrics(s) for role, s in servers.items() if role != "cache"}
            marks = {role: os.path.getsize(p) for role, p in logs.items()}
            got, wall = _drive(config, servers, reqs, engine)
            after = {role: calls.metrics(s) for role, s in servers.items() if role != "cache"}
            kv = _connector_times(logs, marks) if config in engine_configs.TRACT_CONFIGS else None
            for rec in got:
                answers[(config, k, rec["request"])] = rec.pop("answer")
                records.append({"config": config, "point": k, "qps": qps} | rec)
            summaries.append(summarize(config, k, qps, got, wall, before, after, kv))
            if kv is not None and kv["loads"] == 0 and (summaries[-1]["hit_rate"]
                                                         or summaries[-1]["handed_over"]):
                # vLLM counted tokens taken from the connector, which timed no load: its
                # KV read would read 0 (prompts shorter than a block move none: no error)
                raise TractError(f"{config}: the connector logged no load timing for the KV "
                                 "vLLM took from it", "see the servers' logs")
            if config == "example":          # the next rate starts from empty storage
                store = servers["prefill"].store
                shutil.rmtree(store, ignore_errors=True)
                os.makedirs(store, exist_ok=True)
        if config == "mono":
            # the answer each request must give: one vLLM, one request at a time
            print("  mono, one request at a time (the reference answers) ...", file=log,
                  flush=True)
            for k, (_, reqs) in enumerate(points):
                for r in reqs:
                    if vllm_prefix_caching:      # each computed alone, from nothing
                        calls.reset_prefix_cache(servers["mono"])
                    reference[(k, r.rid)] = calls.complete(servers["mono"], r.tokens.tolist(),
                                                           r.output_len, LOGPROBS)
    except (TractError, HttpError, OSError) as exc:
        for role, s in servers.items():
            path = getattr(s, "log_path", None)
            if role != "cache" and path and "EngineCore encountered a fatal error" in open(
                    path, errors="replace").read():
                raise TractError(f"{exc}; the {role} instance's engine stopped: {s.failure()}",
                                 "see the servers' logs") from None
        raise


def _drive(config: str, servers: dict, reqs: list[Request], engine) -> tuple[list[dict], float]:
    """Sends each request at its arrival time (a thread each, so a slow one holds no
    other back); returns the records and the wall time from the first arrival to
    the last answer.  The first request that fails stops the sending and is
    raised; an interrupt stops the sending at once (the caller then stops the
    servers, which ends the requests in flight)."""
    targets = ([servers["mono"]] if config == "mono" else
               [servers["prefill"], servers["decode"]] if config in SHARED else None)
    out: list[dict] = []
    errors: list[BaseException] = []
    stop = threading.Event()

    def one(seq: int, req: Request, arrival: float) -> None:
        if stop.is_set():                    # queued behind the workers, after a failure
            return
        try:
            tokens = req.tokens.tolist()
            if targets is None:
                answered, got = calls.pd_request(config, servers["prefill"], servers["decode"],
                                                 tokens, req.output_len, engine, LOGPROBS)
            else:
                answered = None
                got = calls.complete(targets[seq % len(targets)], tokens, req.output_len,
                                     LOGPROBS)
            end = time.monotonic()
            out.append({"request": req.rid, "input_len": len(req.tokens),
                        "output_tokens": len(got.tokens) or got.chunks,
                        "arrival_s": arrival - t0, "ttft_s": got.first - arrival,
                        "e2e_s": end - arrival, "end_s": end - t0,
                        "prefill_s": None if answered is None else answered - arrival,
                        "decode_s": None if answered is None else got.first - answered,
                        "answer": got})
        except BaseException as exc:         # raised below, once; the rest are not sent
            errors.append(exc)
            stop.set()

    t0 = time.monotonic()
    ex = ThreadPoolExecutor(max_workers=min(len(reqs), MAX_IN_FLIGHT))
    try:
        for seq, req, arrival in arrivals(reqs, t0, stop):
            ex.submit(one, seq, req, arrival)
        ex.shutdown(wait=True)      # each request ends: answered, failed, or timed out
    except BaseException:
        stop.set()
        ex.shutdown(wait=False, cancel_futures=True)
        raise
    if errors:
        raise errors[0]
    first = min(r["arrival_s"] for r in out)
    return out, max(r["end_s"] for r in out) - first


def _connector_times(logs: dict, marks: dict) -> dict:
    """The TraCT connector's load and save times (ms) logged since MARKS (each
    log's size at a point's start), whole lines only: the point's KV reads
    (handoffs and pool hits) and writes, in the engine's step (a save's commit
    run off the step is not: it adds to no request's time)."""
    out = {"load_ms": 0.0, "save_ms": 0.0, "loads": 0, "saves": 0}
    for role, path in logs.items():
        for kind, row in kvlog.read_since(path, marks[role]):
            if kind in ("load", "save"):
                off_step = kind == "save" and not row["commit_in_step"]
                out[kind + "_ms"] += row["ms"] - (row["commit_ms"] if off_step else 0.0)
                out[kind + "s"] += 1
    return out


def _grew(before: dict, after: dict, name: str, source=None) -> float:
    """`calls.grew`, 0 where vLLM reports nothing (a counter not yet counted)."""
    return calls.grew(before, after, name, source) or 0.0


def _pooled_mean(before: dict, after: dict, roles, histogram: str) -> float | None:
    """The mean of vLLM histogram HISTOGRAM over the requests the instances ROLES
    served between two scrapes (their sums over their counts)."""
    n = sum(_grew(before[r], after[r], histogram + "_count") for r in roles)
    total = sum(_grew(before[r], after[r], histogram + "_sum") for r in roles)
    return total / n if n else None


def breakdown(config: str, got: list[dict], before: dict, after: dict, kv: dict | None) -> dict:
    """A request's mean time split, per system (seconds; None where the system has
    no such part or does not time it apart):
    - queue: vLLM's queue time (arrival at the engine to first scheduled); P/D: the
      prefill instance's and the decode instance's, added (a request passes both);
      otherwise over the requests of every instance;
    - compute: vLLM's prefill time on the instances that compute prompts (first
      scheduled to first token; a connector's work inside the step is in it: TraCT's
      synchronous load of pool hits and its save, which are also shown apart);
    - kv_read, kv_write: TraCT's connector's own load (handoff, pool hits) and save
      times in the step (a save's commit off the step not counted; the peers do
      not time theirs apart: NIXL writes nothing, the decode side pulls; LMCache
      stores after the answer);
    - decode_leg: P/D, from the prefill's answer to the decode's first token (the
      KV transfer, the decode instance's queue and its first step), as the client
      sees it."""
    queue_of = lambda roles: _pooled_mean(before, after, roles, "vllm:request_queue_time_seconds")
    if config in PD:
        parts = [queue_of([r]) for r in ("prefill", "decode")]
        queue = sum(q for q in parts if q is not None) if any(q is not None for q in parts) \
            else None
    else:
        queue = queue_of(list(before))
    computing = ["prefill"] if config in PD else list(before)
    n = len(got)
    return {"queue_s": queue,
            "compute_s": _pooled_mean(before, after, computing,
                                      "vllm:request_prefill_time_seconds"),
            "kv_read_s": kv["load_ms"] / 1e3 / n if kv is not None else None,
            "kv_write_s": kv["save_ms"] / 1e3 / n if kv is not None else None,
            "decode_leg_s": float(np.mean([r["decode_s"] for r in got]))
            if config in PD else None}


def summarize(config: str, point: int, qps: float, got: list[dict], wall: float,
              before: dict, after: dict, kv: dict | None) -> dict:
    """One system at one rate: throughput, TTFT percentiles, hit rate, breakdown."""
    ttft = np.array([r["ttft_s"] for r in got])
    computing = ["prefill"] if config in PD else list(before)
    sources = ("local_compute", "local_cache_hit", "external_kv_transfer")
    prompt = {r: {s: _grew(before[r], after[r], TOKENS, s) for s in sources} for r in before}
    total = sum(sum(prompt[r].values()) for r in computing)
    cached = sum(prompt[r]["local_cache_hit"] + prompt[r]["external_kv_transfer"]
                 for r in computing)
    handed = None
    if config in PD:        # the prompt tokens the decode instance took over
        d = sum(prompt["decode"].values())
        handed = prompt["decode"]["external_kv_transfer"] / d if d else None
    return {"config": config, "point": point, "qps": qps, "requests": len(got),
            "throughput_rps": len(got) / wall if wall > 0 else None,
            "output_tps": sum(r["output_tokens"] for r in got) / wall if wall > 0 else None,
            "ttft_mean_s": float(ttft.mean()), "ttft_p50_s": float(np.percentile(ttft, 50)),
            "ttft_p90_s": float(np.percentile(ttft, 90)),
            "ttft_p99_s": float(np.percentile(ttft, 99)),
            "e2e_mean_s": float(np.mean([r["e2e_s"] for r in got])),
            "hit_rate": cached / total if total else None, "handed_over": handed,
            "local_hits": sum(prompt[r]["local_cache_hit"] for r in computing),
            "breakdown": breakdown(config, got, before, after, kv)}


def verify(records: list[dict], summaries: list[dict], answers: dict, reference: dict) -> None:
    """Each record's "verified": its answer is one vLLM's, one request at a time (the
    mono configuration's reference pass), within `answers.TOLERANCE` nats on every
    top logprob (a batch's other arithmetic order rounds otherwise; a wrong KV
    block moves them far more), up to a near-tie that parts them; None where mono
    did not run.  The record keeps the comparison ("answer": gap, where a near-tie
    parted them, what differs).  Each summary's: all of its records' (None
    likewise), how many parted at a near-tie, and the largest gap."""
    for rec in records:
        want = reference.get((rec["point"], rec["request"]))
        rec.pop("answer", None)
        if want is None:
            rec["verified"] = None
            continue
        got = answer_check.compare(answers[(rec["config"], rec["point"], rec["request"])], want)
        rec["verified"] = got["gap"] is not None and got["gap"] <= answer_check.TOLERANCE
        rec["answer"] = got
    for s in summaries:
        rows = [r for r in records if r["config"] == s["config"] and r["point"] == s["point"]
                and r["verified"] is not None]
        s["verified"] = all(r["verified"] for r in rows) if rows else None
        s["near_ties"] = sum(r["answer"]["parts_at"] is not None for r in rows
                             if r["verified"])
        gaps = [r["answer"]["gap"] for r in rows if r["answer"]["gap"] is not None]
        s["answer_gap"] = max(gaps) if gaps else None
