"""`tract bench --engine vllm`: the paper's static experiment on real vLLM.

The same vLLM, the same checkpoint and the same prompts through each KV path,
one configuration at a time (so they never compete for the CPUs), or with
`--interleave` all up at once and each prompt sent to each in turn (below);
the configurations, and where each runs, are configs.py's.  A configuration whose
peer is not installed is skipped, with the reason and the command that
installs it.

A P/D request is what a proxy does: the prefill request (`max_tokens: 1`,
`do_remote_decode`) then the decode request, streamed; TTFT is from sending
the first to the first streamed token of the second.  Its parts: `prefill`
(the prefill request's latency, KV save included) and `decode` (the rest: KV
load and the decode instance's first step).  The connector's own figures,
`kv save` and `kv load` (from its log lines, with their parts: the copy,
which checksums as it copies, and the pool's metadata calls), are set against
a `memcpy` of as many bytes between vLLM's pages and the region's slots,
which the connector times in the step right before its copies of
REFERENCE_WARMUPS warm-up requests of each measured length (all but the first
of that length), and right after them from cold caches and warm (a request's
kv_transfer_params ask it, kvlog.REFERENCE_PARAM; more copies in a step, so
no measured request pays them).  Prompts are random token ids, a
different prompt per request (no prefix reuse).

On a shared host the configurations' minutes differ by more than the KV
paths do (a 1500-token prompt's TTFT moved by 100-200 ms between neighbouring
requests on the 2-core AMD host of docs/VLLM.md), so a comparison of two rows
measured minutes apart is mostly the host's drift.  `--mono-beside` keeps one
vLLM running the whole time and sends it each measured prompt right beside
the configuration's request (before it on odd requests, after it on even
ones, each after the same quiet): each row's ratio to it compares requests
seconds apart.  Only that one vLLM more runs beside a configuration (the
default configurations all at once would not fit: a vLLM of the test
checkpoint holds 3.3 GiB here), and a `mono` row beside it shows the
method's own spread (its ratio ~1).  The vLLM beside drifts too, so two
rows' ratios have denominators minutes apart.  `--interleave` starts every
configuration first, or none where they would not all fit in the memory
available (`check_room`), and sends each measured prompt to each in turn:
two rows' means are then requests seconds apart, on the same host state.

Every answer is checked against one vLLM's (`verify`).  One vLLM runs with its
own prefix cache on, and each measured prompt, new to it (a miss, timed), is
sent to it once more, untimed: that second answer is computed over vLLM's own
cache of the prompt's whole blocks, the same split of the prompt as a path
that loads those blocks and computes the rest (a prefix hit, a connector that
hands over whole blocks).  An answer is compared with the reference of its
own split: that one where the tokens it took from its KV path are the tokens
vLLM's cache gave (vLLM's own count), the prompt computed whole otherwise.
Another split rounds in another order, by 0.1 nats of a top logprob and more
on a larger checkpoint (docs/VLLM.md, "A larger checkpoint"); the same split
of the same KV rounds alike, so a wrong block stands out the more.  Such a
row's gap to the whole prompt's answer is kept beside ("whole_gap").  The
timed request of one vLLM hashes its prompt's blocks for its cache, which
the other configurations' vLLMs (their own cache off) do not: microseconds
a block.
"""
from __future__ import annotations

import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

from tract_cli.bench.engine import answers as answer_check
from tract_cli.bench.engine import calls
from tract_cli.bench.engine import configs as engine_configs
from tract_cli.bench.engine.configs import CONFIGS, PREFIX, ROWS, TRACT_CONFIGS
from tract_cli.bench.stats import memcpy_reference
from tract_cli.core import kvlog
from tract_cli.core.errors import TractError, UsageError
from tract_cli.serve.client import HttpError

# vLLM's workers keep polling their shared-memory queue for a second after each
# read before they sleep (SpinCondition's busy_loop_s in vllm/distributed/
# device_communicators/shm_broadcast.py; not a setting).  On one small host the
# poll of the instance that answered last takes a core from the next request's
# other instance, which a deployment (prefill and decode on their own hosts)
# does not share: the static workload sends each request once every instance
# polls no more (a gap under a second leaves part of the poll)
DEFAULT_REQUEST_GAP_S = 1.25
VLLM_BLOCK = 128           # vLLM's block size (its CPU default), and the region's
# ANSWERS' key of one vLLM's second answer to a prompt, over its own prefix cache
# (`_over_its_cache`): (the prompt tokens its cache gave, the answer or None)
OVER_ITS_CACHE = "mono over its cache"
# the warm-ups of each measured length TraCT's connector times its memcpy
# reference on: the memcpy in the step is one sample a request, and varied
# 1.7x between runs here with one; the median of three of a length is each
# measured request's of that length
REFERENCE_WARMUPS = 3
# each vLLM instance's KV cache (`tract bench --vllm-kv-cache-gib`): 2 GiB holds
# 16K tokens of Llama-3-8B, the static sweep's longest prompt and then some
DEFAULT_KV_CACHE_GIB = 2.0


def prompts(lengths: list[int], per_length: int, vocab: int, seed: int) -> list[tuple[int, list]]:
    """(length, token ids) of each request: random ids, distinct prompts."""
    rng = np.random.default_rng(seed)
    return [(n, rng.integers(3, vocab, size=n).tolist()) for n in lengths
            for _ in range(per_length)]


def run(model_dir: str, lengths: list[int], per_length: int, output_len: int,
        configs: list[str], seed: int = 0, log=sys.stderr,
        kv_cache_gib: float = DEFAULT_KV_CACHE_GIB,
        load_mode: str = "sync", vllm_prefix_caching: bool = False,
        handoff_publish: str = "after_step",
        request_gap: float = DEFAULT_REQUEST_GAP_S, mono_beside: bool = False,
        interleave: bool = False) -> dict:
    """Runs each configuration over the same prompts; returns records and summaries.
    LOAD_MODE, HANDOFF_PUBLISH: the TraCT connector's (docs/VLLM.md, "Configuration").
    REQUEST_GAP: seconds of quiet before each measured request (a prefix hit's
    too), DEFAULT_REQUEST_GAP_S's reason; 0: back to back.  MONO_BESIDE: one
    vLLM runs the whole time, and each measured prompt is also sent to it, just
    before or just after the configuration's request (alternately): each row's
    ratio to it is free of the host's drift between configurations (module
    docstring).  INTERLEAVE: every configuration up at once, each measured
    prompt sent to each in turn (module docstring)."""
    from tract_cli.serve.vllm_engine import check_model_dir
    check_model_dir(model_dir)
    if interleave and mono_beside:
        raise UsageError(*INTERLEAVE_BESIDE)
    for c in configs:
        if c not in CONFIGS:
            raise UsageError(f"unknown vLLM configuration {c!r}", f"use {', '.join(CONFIGS)}")
    configs = list(dict.fromkeys(configs))          # each once, in the order given
    from tract_cli.serve.vllm_engine import model_config
    cfg = model_config(model_dir)
    vocab = cfg["vocab_size"]
    max_len = max(max(lengths), 2 * VLLM_BLOCK + 8) + output_len + 16   # the warm-up too
    if max_len > cfg["max_position_embeddings"]:
        raise UsageError(f"inputs of {max(lengths)} tokens exceed the model's "
                         f"{cfg['max_position_embeddings']} positions", "use shorter --input-len")
    from tract_cli.serve.vllm_engine import vllm_python
    skipped = engine_configs.unavailable_of(configs, vllm_python())
    if interleave:
        check_room(model_dir, [c for c in configs if c not in skipped], lengths, per_length,
                   kv_cache_gib)
    reqs = prompts(lengths, per_length, vocab, seed)
    # the warm-up prompts: other seeds', so they share no block with the measured
    # ones nor with each other; two whole blocks and some (a path's one-time
    # costs), then 1 + REFERENCE_WARMUPS of each measured length (vLLM's first
    # step at a new size is several times its next ones, on every configuration
    # alike: no measured request pays it); each with whether TraCT's connector
    # times its memcpy reference beside its copies (kvlog.REFERENCE_PARAM): all
    # but the first of each measured length, so that each memcpy in the step
    # follows a forward like a measured request's, not the first at its size,
    # and no measured request pays the reference's copies in its steps
    per = 1 + REFERENCE_WARMUPS
    warm = [(t, False) for _, t in prompts([2 * VLLM_BLOCK + 8], 1, vocab, seed + 1)] + \
        [(t, i % per > 0) for i, (_, t) in
         enumerate(prompts(sorted(set(lengths)), per, vocab, seed + 2))]
    cache_bytes = _cache_bytes(model_dir, lengths, per_length)
    args = ("--max-model-len", str(max_len), "--max-num-batched-tokens", str(max_len),
            "--enable-prefix-caching" if vllm_prefix_caching else "--no-enable-prefix-caching",
            "--block-size", str(VLLM_BLOCK))
    work = tempfile.mkdtemp(prefix="tract-bench-vllm-")
    records, answers, kv = [], {}, {}
    pools: dict[str, str] = {}      # a TraCT configuration -> its temporary region
    failed: dict[str, str] = {}     # a configuration that could not run -> why
    keep_logs = True
    beside = None                        # MONO_BESIDE's servers

    def fail(config: str, why: str) -> None:
        """CONFIG (its servers stopped) failed: said, its rows dropped, its region removed."""
        crash = crash_in_logs(work, config)
        failed[config] = why if crash is None else f"{crash} ({why})"
        print(f"{config} failed: {failed[config]}", file=log, flush=True)
        _drop_rows(config, records, answers)
        if config in pools:
            remove_pool(pools.pop(config))

    flush_mode = None

    def region(config: str) -> str:
        """CONFIG's temporary region, new (its flush mode the run's)."""
        nonlocal flush_mode
        pools[config] = _tract_region(model_dir, lengths, per_length + per, config)
        flush_mode = _flush_mode(pools[config])
        return pools[config]

    tract_marks = None       # "tract"'s server logs' sizes once warmed up, if it ran
    try:
        if interleave:
            tract_marks = _run_interleaved(
                to_run(configs, skipped, log), model_dir, work, args, kv_cache_gib, region,
                load_mode, reqs, warm, output_len, cache_bytes, records, answers,
                handoff_publish, request_gap, fail).get("tract")
        else:
            if mono_beside:
                beside = _start_beside(model_dir, work, args, kv_cache_gib, warm, output_len,
                                       request_gap, log)
            for config in to_run(configs, skipped, log):
                # a configuration that fails (a peer that stops vLLM at start, a server
                # that dies, no room for its region) is reported with its reason and the
                # rest run; its rows are dropped
                measured_from: dict[str, int] = {}   # a server log -> its size, warmed up

                def one_config():
                    pool = None
                    if config in TRACT_CONFIGS:       # each from an empty region
                        for old in list(pools):
                            remove_pool(pools.pop(old))
                        pool = region(config)
                    measured_from.update(_run_config(
                        config, model_dir, work, args, kv_cache_gib, pool, load_mode, reqs,
                        warm, output_len, cache_bytes, records, answers, handoff_publish,
                        request_gap, beside))
                why = failure_of(one_config)
                if why is not None:
                    fail(config, why)
                    continue
                if config == "tract":
                    tract_marks = measured_from
        if tract_marks is not None:
            kv = _connector_figures(os.path.join(work, "tract-decode.log"),
                                    os.path.join(work, "tract-prefill.log"), tract_marks)
        verify(records, answers)
        # the logs are kept where a configuration failed or an answer was not verified
        keep_logs = bool(failed) or any(r["verified"] is False for r in records)
    except BesideFailed as exc:
        raise TractError(f"the vLLM beside every configuration (--mono-beside) failed a "
                         f"request: {exc}",
                         f"see its log in {os.path.join(work, 'beside')}; or run without "
                         "--mono-beside") from None
    finally:
        if beside is not None:
            engine_configs.stop_all(beside)
        for path in pools.values():
            remove_pool(path)
        if keep_logs:      # the servers' logs, which an error names, are kept
            print(f"the vLLM servers' logs are kept in {work}", file=log, flush=True)
        else:
            shutil.rmtree(work, ignore_errors=True)
    return {"records": records, "summaries": summarize(records), "kv": kv, "skipped": skipped,
            "failed": failed, "logs": work if keep_logs else None,
            "memcpy": _memcpy_figures(kv), "flush_mode": flush_mode, "load_mode": load_mode,
            "handoff_publish": handoff_publish, "request_gap_s": request_gap,
            "vllm_prefix_caching": vllm_prefix_caching, "mono_beside": mono_beside,
            "interleave": interleave, "kv_cache_gib": kv_cache_gib}


def _start_beside(model_dir, work, args, kv_cache_gib, warm, output_len, request_gap,
                  log) -> dict:
    """MONO_BESIDE's one vLLM, started, ready and warmed up as a configuration's
    servers are (its log under WORK/beside); a vLLM that will not start fails
    the run, since every row is measured against it."""
    print("starting one vLLM to run beside every configuration ...", file=log, flush=True)
    where = os.path.join(work, "beside")
    os.makedirs(where, exist_ok=True)
    # its own prefix cache off whatever the configurations run with: every
    # configuration's prompts reach it, and from the second on they would be hits
    args = prefix_caching(args, False)
    servers = engine_configs.start("mono", model_dir, where, args, kv_cache_gib, None)
    try:
        for s in servers.values():
            s.wait_ready()
        for i, (tokens, _) in enumerate(warm):
            _beside(servers, tokens, output_len, request_gap if i else 0.0)
    except BaseException as exc:
        engine_configs.stop_all(servers)
        if isinstance(exc, (TractError, BesideFailed)):
            raise TractError(f"the vLLM to run beside every configuration (--mono-beside) "
                             f"did not start: {exc}",
                             f"see its log in {where}; or run without --mono-beside") from None
        raise
    return servers


class BesideFailed(Exception):
    """MONO_BESIDE's vLLM failed a request: the run stops (every row is measured
    against it), rather than blaming the configuration it ran beside.  Not a
    TractError, so failure_of lets it through."""


def _beside(servers: dict, tokens: list, output_len: int, gap: float) -> dict:
    """One request of TOKENS through MONO_BESIDE's vLLM, after GAP seconds of
    quiet: its TTFT as the client saw it and as vLLM timed it."""
    if gap:
        time.sleep(gap)                 # pacing the workload (DEFAULT_REQUEST_GAP_S)
    got: dict = {}
    why = failure_of(lambda: got.update(_one(servers, "mono", tokens, output_len)))
    if why is not None:
        raise BesideFailed(why)
    return {"beside_ttft_s": got["ttft_s"], "beside_engine_s": got["engine_s"]}


def remove_pool(path: str) -> None:
    """Removes a run's temporary region (returns None: the caller's pool is gone)."""
    from tract_cli.core.region import remove_region
    remove_region(path)


def to_run(configs: list[str], skipped: dict, log):
    """The configurations to run, in order, each announced on LOG (a skipped one
    with why)."""
    for config in configs:
        if config in skipped:
            print(f"skipping {config}: {skipped[config]}", file=log, flush=True)
            continue
        print(f"starting {config} ...", file=log, flush=True)
        yield config


def failure_of(run_config) -> str | None:
    """Runs RUN_CONFIG(); None if it ran, else why it failed, in one line: a
    configuration that fails (a peer that stops vLLM at start, a server that
    dies, an answer the bench cannot read) is reported and the rest run."""
    try:
        run_config()
    except TractError as exc:
        return str(exc)
    except (HttpError, OSError) as exc:      # a server that failed a request
        return f"a request failed: {exc}; see the servers' logs"
    except (KeyError, IndexError, TypeError, ValueError) as exc:   # an odd answer
        return (f"a server answered what the bench cannot read "
                f"({type(exc).__name__}: {exc}); see the servers' logs")
    return None


def crash_in_logs(work: str, config: str) -> str | None:
    """What killed processes of CONFIG's vLLM servers, as their logs in WORK say
    (Python's fault handler, on in every vLLM started here: serve/vllm_engine.py),
    every instance that says so, e.g. "a process of its decode instance died:
    Illegal instruction"; None where no log says so."""
    deaths = []
    for role in ("prefill", "decode", "mono", "cache"):      # configs.start's log names
        path = os.path.join(work, f"{config}-{role}.log")
        try:
            with open(path, errors="replace") as f:
                whys = [line[len("Fatal Python error: "):].strip()[:120] for line in f
                        if line.startswith("Fatal Python error: ")]
        except OSError:
            continue
        if whys:
            deaths.append(f"a process of its {role} instance died: "
                          + ", ".join(dict.fromkeys(whys)))
    return "; ".join(deaths) or None


def _run_config(config, model_dir, work, args, kv_cache_gib, pool, load_mode, reqs, warm,
                output_len, cache_bytes, records, answers,
                handoff_publish: str = "after_step",
                request_gap: float = DEFAULT_REQUEST_GAP_S,
                beside: dict | None = None) -> dict[str, int]:
    """Starts CONFIG's servers and warms them up (`_start_config`), runs every
    request through them, each after REQUEST_GAP seconds of quiet, stops them.
    BESIDE: MONO_BESIDE's servers (`_measure`).  Returns each server log's size
    once the warm-up was answered: what the connector logged after it is the
    measured requests'."""
    servers, marks = _start_config(config, model_dir, work, args, kv_cache_gib, pool,
                                   load_mode, warm, output_len, cache_bytes, handoff_publish,
                                   request_gap)
    try:
        for i, (n, tokens) in enumerate(reqs):
            _measure(config, servers, i, n, tokens, output_len, request_gap, records, answers,
                     beside)
        return marks
    finally:
        _stop_config(servers)


def _run_interleaved(configs, model_dir, work, args, kv_cache_gib, region, load_mode, reqs,
                     warm, output_len, cache_bytes, records, answers, handoff_publish,
                     request_gap, fail) -> dict[str, dict[str, int]]:
    """--interleave: every configuration of CONFIGS started and warmed up, one
    after another (REGION(config): a TraCT configuration's own region), and
    left up; then each measured prompt sent to each in turn, every one after
    REQUEST_GAP seconds of quiet, the order turned by one each request (each
    goes first as often as the others, to within one request).  A
    configuration that fails, at start or on a request, is stopped and then
    FAIL(config, why)'s (its rows dropped); the rest go on.  All are stopped at
    the end, each even where stopping another failed or was interrupted.
    Returns each configuration's log marks (`_run_config`'s), of those that
    ran to the end."""
    up: dict[str, tuple[dict, dict[str, int]]] = {}
    try:
        for config in configs:
            def start_one():
                pool = region(config) if config in TRACT_CONFIGS else None
                up[config] = _start_config(config, model_dir, work, args, kv_cache_gib, pool,
                                           load_mode, warm, output_len, cache_bytes,
                                           handoff_publish, request_gap)
            why = failure_of(start_one)
            if why is not None:
                fail(config, why)
        for i, (n, tokens) in enumerate(reqs):
            live = list(up)
            for config in live[i % len(live):] + live[:i % len(live)] if live else ():
                why = failure_of(lambda: _measure(config, up[config][0], i, n, tokens,
                                                  output_len, request_gap, records, answers))
                if why is not None:
                    _stop_config(up[config][0])     # stopped, then no longer held
                    del up[config]
                    fail(config, why)
        return {config: marks for config, (_, marks) in up.items()}
    finally:
        _stop_each([servers for servers, _ in up.values()])


def _stop_each(server_sets: list[dict]) -> None:
    """Stops each configuration's servers, every one even where stopping one
    before it failed or was interrupted (a second ^C)."""
    engine_configs.call_each([lambda servers=servers: _stop_config(servers)
                              for servers in server_sets])


def _start_config(config, model_dir, work, args, kv_cache_gib, pool, load_mode, warm,
                  output_len, cache_bytes, handoff_publish, request_gap) -> tuple[dict, dict]:
    """CONFIG's servers started, ready and warmed up with the prompts WARM
    ((tokens, whether TraCT's connector times its memcpy reference beside
    them); one that does after REQUEST_GAP seconds of quiet, so the reference
    meets idle instances as the measured copies do), or stopped if that
    fails; and each server log's size once the warm-up was answered."""
    if config == "mono":
        # one vLLM's own prefix cache on, for its second answer to each prompt
        # (_over_its_cache); each prompt is new to it when its TTFT is measured
        args = prefix_caching(args, True)
    servers = engine_configs.start(config, model_dir, work, args, kv_cache_gib, pool,
                                   load_mode, VLLM_BLOCK, cache_bytes,
                                   handoff_publish=handoff_publish)
    try:
        for s in servers.values():
            s.wait_ready()
        for tokens, reference in warm:
            reference = reference and config in TRACT_CONFIGS
            if reference and request_gap:
                time.sleep(request_gap)     # pacing the reference (DEFAULT_REQUEST_GAP_S)
            _warm(servers, config, tokens, output_len, reference, request_gap)
    except BaseException:
        _stop_config(servers)
        raise
    # each line the connector logs for a request is written before its reply
    # goes out, or (a prefix miss's save, committed off the step) waited for
    # before the hit is asked (_prefix)
    marks = {s.log_path: os.path.getsize(s.log_path) for s in servers.values()
             if getattr(s, "log_path", None) and os.path.exists(s.log_path)}
    return servers, marks


def _measure(config, servers, i, n, tokens, output_len, request_gap, records, answers,
             beside: dict | None = None) -> None:
    """Measured request I (N tokens: TOKENS) through CONFIG's SERVERS after
    REQUEST_GAP seconds of quiet, its records (a row each: a prefix
    configuration's miss and hit) added to RECORDS and its answers to ANSWERS.
    BESIDE: MONO_BESIDE's servers, sent the prompt too, after the same quiet,
    before the configuration's request on odd requests and after it on even
    ones (neither goes first every time); its figures are in each record."""
    mono = (_beside(beside, tokens, output_len, request_gap)
            if beside is not None and i % 2 else {})
    if request_gap:
        time.sleep(request_gap)     # pacing the workload (DEFAULT_REQUEST_GAP_S)
    got = (_prefix(servers, tokens, output_len, PREFIX[config], request_gap)
           if config in PREFIX else
           {config: _one(servers, config, tokens, output_len)})
    if beside is not None and not i % 2:
        mono = _beside(beside, tokens, output_len, request_gap)
    for row, rec in got.items():
        records.append({"config": row, "input_len": n, "request": i} | rec | mono)
        answers.setdefault(i, {})[row] = rec.pop("answer")
    if config == "mono":
        answers[i][OVER_ITS_CACHE] = _over_its_cache(servers["mono"], tokens, output_len)


def _over_its_cache(servers_mono, tokens: list, output_len: int,
                    log=sys.stderr) -> tuple[int, object]:
    """One vLLM's answer to TOKENS sent once more, right after its measured
    request (untimed): computed over its own prefix cache of the prompt's whole
    blocks, the split of a path that loads those blocks and computes the rest;
    with how many prompt tokens its cache gave (vLLM's count; 0 where it
    reports none, and the prompt was then computed whole again).  Where that
    request fails, (0, None), said on LOG: every row of the prompt is then
    held to the whole prompt's answer, and one vLLM's timed rows stand."""
    got: dict = {}

    def ask():
        before = calls.metrics(servers_mono)
        got["answer"] = calls.complete(servers_mono, tokens, output_len,
                                       logprobs=answer_check.TOP_LOGPROBS)
        got["cached"] = calls.grew(before, calls.metrics(servers_mono), calls.PROMPT_TOKENS,
                                   "local_cache_hit")
    why = failure_of(ask)
    if why is not None:
        print(f"one vLLM's second answer to a prompt failed ({why}); its rows are held to "
              "the prompt computed whole", file=log, flush=True)
        return 0, None
    return int(got["cached"] or 0), got["answer"]


def prefix_caching(args: tuple, on: bool) -> tuple:
    """vLLM's arguments ARGS with its own prefix cache turned ON or off."""
    flags = ("--no-enable-prefix-caching", "--enable-prefix-caching")
    return tuple(flags[on] if a in flags else a for a in args)


def _stop_config(servers: dict) -> None:
    """Stops a configuration's servers and removes ExampleConnector's storage."""
    engine_configs.stop_all(servers)
    store = getattr(servers.get("prefill"), "store", None)
    if store:
        shutil.rmtree(store, ignore_errors=True)


def _drop_rows(config: str, records: list, answers: dict) -> None:
    """Drops every row of CONFIG (a prefix configuration's two) from RECORDS and
    ANSWERS: a configuration that failed has no rows."""
    rows = PREFIX.get(config, (config,))
    for rec in records:
        if rec["config"] in rows:
            answers[rec["request"]].pop(rec["config"], None)
            if rec["config"] == "mono":
                answers[rec["request"]].pop(OVER_ITS_CACHE, None)
    records[:] = [rec for rec in records if rec["config"] not in rows]


# what one vLLM instance holds beside its KV cache and its model's weights (its
# API server, engine core and worker processes: Python, torch, vLLM), measured:
# five instances of the test checkpoint, 2 GiB of KV cache each, held 17.3 GB
INSTANCE_BYTES = 5 << 28                # 1.25 GiB
INTERLEAVE_BESIDE = ("--interleave already sends each prompt to every configuration in turn; "
                     "--mono-beside would add one vLLM beside them",
                     "add --vllm-config mono instead of --mono-beside")


def room_needed(model_dir: str, configs: list[str], lengths: list[int], per_length: int,
                kv_cache_gib: float) -> tuple[int, int]:
    """What --interleave holds at once for CONFIGS: (vLLM instances, bytes): each
    instance's KV cache, weights and processes, LMCache's cache server (its
    memory and a process), and each TraCT configuration's region (in /dev/shm,
    every page reserved)."""
    weights = sum(e.stat().st_size for e in os.scandir(model_dir)
                  if e.is_file() and e.name.endswith((".safetensors", ".bin", ".pt")))
    instances = sum(1 if c == "mono" else 2 for c in configs)
    need = instances * (int(kv_cache_gib * (1 << 30)) + INSTANCE_BYTES + weights)
    for c in configs:
        if c in TRACT_CONFIGS:
            need += _region_bytes(model_dir, lengths, per_length + 1 + REFERENCE_WARMUPS)
        if c == "lmcache":
            gib = engine_configs.cache_server_gib(_cache_bytes(model_dir, lengths, per_length))
            need += (gib << 30) + INSTANCE_BYTES
    return instances, need


def check_room(model_dir: str, configs: list[str], lengths: list[int], per_length: int,
               kv_cache_gib: float = DEFAULT_KV_CACHE_GIB) -> None:
    """--interleave: refuses, before anything starts, configurations that would
    not all fit in the memory available at once (a host pushed into swap or
    the OOM killer measures nothing)."""
    from tract_cli.core.medium import mem_available
    from tract_cli.core.units import format_size
    instances, need = room_needed(model_dir, configs, lengths, per_length, kv_cache_gib)
    have = mem_available()
    if have is not None and need > have:
        raise UsageError(f"--interleave keeps {instances} vLLM instances up at once, "
                         f"{format_size(need)} with their KV caches, weights and regions, and "
                         f"{format_size(have)} of memory is available",
                         "compare fewer configurations at once (--vllm-config), or drop "
                         "--interleave to run them one at a time")


def _flush_mode(path: str) -> str:
    """The flush mode the connectors attach with: the header's, or TRACT_FLUSH_MODE
    (which the vLLM processes inherit)."""
    from tract_cli.core.pool import Pool
    with Pool.attach(path, readonly=True, prefault=False, local=False) as p:
        return p.flush_mode


def _tract_region(model_dir: str, lengths: list[int], requests: int,
                  config: str = "tract") -> str:
    """CONFIG's temporary region in /dev/shm for the checkpoint's KV (4 nodes,
    blocks of VLLM_BLOCK tokens), large enough for every prompt of the run twice
    over: a save is never skipped for room."""
    from tract_cli.core.geometry import load_model, with_block_tokens
    from tract_cli.core.region import FormatOptions, format_region
    # one region block per vLLM page (VLLM_BLOCK tokens): a block's layer is one
    # contiguous run of the page, and a handoff's key list (one slot) holds the
    # longest prompt (docs/VLLM.md, "The data path")
    profile = with_block_tokens(load_model(model_dir), VLLM_BLOCK)
    path = f"/dev/shm/tract-bench-vllm-{os.getpid()}-{config}.pool"
    format_region(path, _region_bytes(model_dir, lengths, requests),
                  FormatOptions(model=profile, max_nodes=4), force=True)
    return path


def _region_bytes(model_dir: str, lengths: list[int], requests: int) -> int:
    """`_tract_region`'s size: REQUESTS prompts of each length twice over and
    256 MiB, in whole 2 MiB pages."""
    need = sum(lengths) * requests * _kv_bytes(model_dir, 1) * 2 + (256 << 20)
    return -(-need // (2 << 20)) * (2 << 20)


def _cache_bytes(model_dir: str, lengths: list[int], per_length: int) -> int:
    """What a configuration's own cache server must hold: every prompt's KV twice
    over, PER_LENGTH measured ones of each length and the warm-ups (`run`'s:
    one of two blocks and some, 1 + REFERENCE_WARMUPS of each length)."""
    tokens = (sum(lengths) * per_length + 2 * VLLM_BLOCK + 8
              + (1 + REFERENCE_WARMUPS) * sum(set(lengths)))
    return _kv_bytes(model_dir, tokens * 2)


def _kv_bytes(model_dir: str, tokens: int) -> int:
    """The KV bytes of TOKENS tokens of the checkpoint (a cache server's size)."""
    from tract_cli.core.geometry import load_model
    return tokens * load_model(model_dir).geometry.bytes_per_token


def _warm(servers: dict, config: str, tokens: list, output_len: int,
          reference: bool = False, gap: float = 0.0) -> None:
    """One warm-up request through the path, of TOKENS, answered before any
    measured request: the path's one-time costs (vLLM's first step at a size, a
    connector's first copy) are paid here.  REFERENCE: TraCT's connector times
    a memcpy of the same bytes beside its copies of this request (a prefix
    hit's, asked GAP seconds after its miss, as a measured one is)."""
    params = {kvlog.REFERENCE_PARAM: True} if reference else None
    if config in PREFIX:
        _prefix(servers, tokens, output_len, PREFIX[config], gap if reference else 0.0,
                params=params)
    else:
        _one(servers, config, tokens, output_len, params=params)


def _prefix(servers: dict, tokens: list, output_len: int, rows: tuple[str, str],
            gap: float = 0.0, params: dict | None = None) -> dict:
    """A miss (the prefill instance computes the prompt, and saves it) and then the hit
    (the decode instance, another node, loads it from the pool or the cache), asked
    GAP seconds after the miss was answered and saved: TTFT of each, as ROWS (miss,
    hit); PARAMS: both requests' kv_transfer_params, if any."""
    out = {}
    cache = servers.get("cache")
    stored = cache.stored_chunks() if cache else None
    # TraCT commits a save on the worker's save thread, off the step, so the miss
    # may answer before its blocks are READY: the hit is asked once the prefill
    # instance has logged them saved (its timing lines, past this mark)
    tract_log = servers["prefill"].log_path if rows == PREFIX["prefix"] else None
    mark = os.path.getsize(tract_log) if tract_log else 0
    for row, s in zip(rows, (servers["prefill"], servers["decode"])):
        # LMCache stores asynchronously too: the hit is asked once the server holds
        # the miss's whole chunks
        if row == rows[1] and cache:
            out[rows[0]]["store_wait_s"] = cache.wait_stored(
                stored + len(tokens) // cache.chunk_tokens)
        if row == rows[1] and tract_log:
            out[rows[0]]["store_wait_s"] = _wait_saved(tract_log, mark,
                                                       len(tokens) // VLLM_BLOCK)
        if row == rows[1] and gap:
            time.sleep(gap)             # pacing the workload (DEFAULT_REQUEST_GAP_S)
        before = calls.metrics(s)
        t0 = time.monotonic()
        got = calls.complete(s, tokens, output_len, logprobs=answer_check.TOP_LOGPROBS,
                             params=params)
        after = calls.metrics(s)
        out[row] = {"ttft_s": got.first - t0, "prefill_s": None, "decode_s": None,
                    "engine_s": calls.grew(before, after, calls.TTFT), "answer": got}
        if row == rows[1]:   # a hit: the prompt tokens it took from its connector
            taken = int(calls.grew(before, after, calls.PROMPT_TOKENS, "external_kv_transfer")
                        or 0)
            out[row] |= {"handed_over": taken > 0, "hit_tokens": taken, "kv_tokens": taken}
    return out


def _wait_saved(log_path: str, mark: int, blocks: int, timeout: float = 5) -> float | None:
    """Waits (bounded) until the TraCT instance logging to LOG_PATH has logged
    saves of BLOCKS blocks past byte MARK (a save's line follows its commit);
    returns the seconds waited, or None past TIMEOUT (a save skipped or given
    up, pool full or a lock timeout, logs no line: the hit is then asked
    anyway, and its report shows what it took from the pool)."""
    t0 = time.monotonic()
    while True:
        saved = sum(row["blocks"] for kind, row in kvlog.read_since(log_path, mark)
                    if kind == "save")
        if saved >= blocks:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            print(f"tract bench: the prefill instance logged {saved} of {blocks} blocks saved "
                  f"{timeout:g} s after a prefix miss; the hit is asked anyway (see "
                  f"{log_path})", file=sys.stderr, flush=True)
            return None
        time.sleep(0.002)   # polling another process's commit, bounded


def _one(servers: dict, config: str, tokens: list, output_len: int,
         params: dict | None = None) -> dict:
    """One request through CONFIG: its TTFT and parts as the client saw them, and
    `engine_s`, the same path as vLLM's front ends time it (a P/D request's parts
    `engine_prefill_s`, `engine_decode_s`; None where vLLM reports none); PARAMS:
    the prefill request's kv_transfer_params besides, if any (not one vLLM's)."""
    if config == "mono":
        m = servers["mono"]
        before = calls.metrics(m)
        t0 = time.monotonic()
        got = calls.complete(m, tokens, output_len, logprobs=answer_check.TOP_LOGPROBS)
        return {"ttft_s": got.first - t0, "prefill_s": None, "decode_s": None,
                "engine_s": calls.grew(before, calls.metrics(m), calls.TTFT), "answer": got}
    p, d = servers["prefill"], servers["decode"]
    before = {s: calls.metrics(s) for s in (p, d)}
    engine = calls.mooncake_engine(p) if config == "mooncake" else None
    t0 = time.monotonic()
    t1, got = calls.pd_request(config, p, d, tokens, output_len, engine,
                               logprobs=answer_check.TOP_LOGPROBS, params=params)
    first = got.first
    # read once the decode has answered in full: the prefill's request ended long before
    after = {s: calls.metrics(s) for s in (p, d)}
    if config == "example":
        shutil.rmtree(p.store, ignore_errors=True)    # the next prompt starts from empty storage
        os.makedirs(p.store, exist_ok=True)
    # handed over: the decode instance took prompt tokens from its KV connector (a
    # ticket for TraCT; ExampleConnector returns none and finds its files by prompt)
    taken = int(calls.grew(before[d], after[d], calls.PROMPT_TOKENS, "external_kv_transfer") or 0)
    parts = (calls.grew(before[p], after[p], calls.E2E), calls.grew(before[d], after[d], calls.TTFT))
    # in vLLM: the prefill's whole request, then the decode's time to first token;
    # a paired decode was in vLLM from the start, beside its prefill, so its own
    # time to first token is the whole path
    engine = parts[1] if config in calls.PAIRED else (None if None in parts else sum(parts))
    # paired: what was left once the prefill had answered (none, should the
    # decode's first token have come first; the two-step flow sends it after)
    leg = max(0.0, first - t1) if config in calls.PAIRED else first - t1
    return {"ttft_s": first - t0, "prefill_s": t1 - t0, "decode_s": leg,
            "engine_s": engine,
            "engine_prefill_s": parts[0], "engine_decode_s": parts[1],
            "handed_over": taken > 0, "kv_tokens": taken, "answer": got}


def _connector_figures(decode_log: str, prefill_log: str, marks: dict[str, int]) -> dict:
    """The connector's own load and save timings (its INFO lines), per request, of
    the measured requests: what each log holds past its mark (MARKS, its size
    once the warm-up was answered), whole lines; and its memcpy of the same
    bytes between the same buffers (the reference), which it timed beside the
    copies of the warm-ups of the measured lengths only (`_run_config`):
    every such line in the logs."""
    rows = {"load": [], "save": [], "load_memcpy": [], "save_memcpy": [], "publish": []}
    for path, kinds in ((decode_log, ("load", "load_memcpy")),
                        (prefill_log, ("save", "save_memcpy", "publish"))):
        for kind, row in kvlog.read_since(path, marks.get(path, 0)):
            if kind in kinds and not kind.endswith("_memcpy"):
                rows[kind].append(row)
        for kind, row in kvlog.read_since(path):
            if kind in kinds and kind.endswith("_memcpy"):
                rows[kind].append(row)
    return {"loads": rows["load"], "saves": rows["save"], "loads_memcpy": rows["load_memcpy"],
            "saves_memcpy": rows["save_memcpy"], "publishes": rows["publish"]}


def _memcpy_figures(kv: dict) -> dict:
    """Per kind (loads, saves): the connector's time, its parts (the copy, which
    checksums as it copies, and the pool's metadata calls) and the memcpy of the same
    bytes between the same buffers it timed beside the copies of the warm-ups of
    the measured lengths, in the step where the copy runs, from cold caches and
    warm (each request's from the lines of its length, `_row_references`; a
    save's partial blocks had none; None where not timed);
    the warm-ups' copies again against their memcpy, both cold and both warm;
    also a memcpy of the byte count between private buffers in this process
    (`stats.memcpy_reference`).  The times (*_ms) are sums over the COUNT loads
    or saves measured; the ratios hold for the mean one as for the sum."""
    out = {}
    for kind in ("loads", "saves"):
        rows = kv.get(kind) or []
        if not rows:
            continue
        tract = sum(r["ms"] for r in rows)
        copy = sum(r.get("copy_ms", 0.0) for r in rows)
        refs = kv.get(kind + "_memcpy") or []
        ref_ms = sum(r["ms"] for r in refs)
        warm = sum(r["warm_ms"] for r in refs)
        private = sum(memcpy_reference(r["bytes"], rounds=1, copies=1) * 1e3 for r in rows)
        ratio = lambda a, b: a / b if a and b else None
        # each request's memcpy of its blocks: in the step, from cold caches, warm
        step_each, cold_each, warm_each = (_row_references(rows, refs, f)
                                           for f in ("step_ms", "ms", "warm_ms"))
        total = lambda each: sum(each) if each and None not in each else None
        step_same, same, warm_same = total(step_each), total(cold_each), total(warm_each)

        def each_ratio(each):
            """Each request's copy against its memcpy, sorted: a mean of a few
            requests is one preempted copy's as much as the rest's."""
            return sorted(r.get("copy_ms", 0.0) / m for r, m in zip(rows, each) if m)
        cold_each, step_each = each_ratio(cold_each), each_ratio(step_each)
        out[kind] = {"count": len(rows), "tract_ms": tract, "copy_ms": copy,
                     "meta_ms": tract - copy,
                     "memcpy_ms": same, "memcpy_warm_ms": warm_same,
                     "memcpy_step_ms": step_same,
                     "private_memcpy_ms": private,
                     "ratio": ratio(tract, same), "copy_ratio": ratio(copy, same),
                     "step_ratio": ratio(tract, step_same),
                     "copy_vs_warm_ratio": ratio(copy, warm_same),
                     "copy_vs_step_ratio": ratio(copy, step_same),
                     "copy_ratio_median": statistics.median(cold_each) if cold_each else None,
                     "copy_ratio_max": cold_each[-1] if cold_each else None,
                     "step_ratio_median": statistics.median(step_each) if step_each else None,
                     "step_ratio_max": step_each[-1] if step_each else None,
                     # the warm-ups' checksummed copies against their memcpy, both
                     # from cold caches and both warm
                     "cold_copy_ratio": ratio(sum(r["copy_cold_ms"] for r in refs), ref_ms),
                     "warm_copy_ratio": ratio(sum(r["copy_warm_ms"] for r in refs), warm),
                     "bytes": sum(r["bytes"] for r in rows)}
        if kind == "saves":      # its metadata: the claim's wait past the forward, the commit
            out[kind] |= {"claim_wait_ms": sum(r["claim_wait_ms"] for r in rows),
                          "commit_ms": sum(r["commit_ms"] for r in rows),
                          # the part of it steps waited for (a step that publishes
                          # its handoffs in it: handoff_publish in_step)
                          "commit_in_step_ms": sum(r["commit_ms"] for r in rows
                                                   if r["commit_in_step"])}
    return out


def _row_references(rows: list[dict], refs: list[dict], field: str) -> list[float | None]:
    """For each of ROWS (loads or saves), the memcpy of as many blocks as it
    copied: FIELD's time per block in the reference lines REFS of the size
    nearest its own (the warm-ups of its length: a small copy's time per block
    is not a large one's), their median, times its blocks (0 for a row of no
    block: a load that failed); None where no line timed FIELD (0: not timed)."""
    timed = [r for r in refs if r.get(field) and r["blocks"]]
    out: list[float | None] = []
    for row in rows:
        if not timed or not row["blocks"]:
            out.append(0.0 if timed else None)
            continue
        gap = min(abs(r["blocks"] - row["blocks"]) for r in timed)
        per_block = statistics.median(r[field] / r["blocks"] for r in timed
                                      if abs(r["blocks"] - row["blocks"]) == gap)
        out.append(per_block * row["blocks"])
    return out


def verify(records: list[dict], answers: dict) -> None:
    """Sets each record's "verified": its answer (ANSWERS[request][config]) is one
    vLLM's (the `mono` configuration's) for the same prompt, within
    `answers.TOLERANCE` nats on every token's top logprobs up to a near-tie that
    parts them, as the workloads and the connector's tests compare answers (a
    prompt partly loaded and partly computed rounds in another order than one
    computed whole: with vLLM's AMX attention a 6000-token answer parted from
    one vLLM's at a near-tie; a wrong KV block moves them far more); None
    where mono did not run.  A record that took from its KV path the tokens
    one vLLM's own prefix cache gave its second answer (OVER_ITS_CACHE) is
    compared with that answer, of the same split of the prompt; any other with
    the answer of the prompt computed whole.  The record keeps the comparison
    ("answer", with "reference": "over its cache" or "whole", and for the
    first "whole_gap", its gap to the prompt computed whole)."""
    for rec in records:
        mine = answers[rec["request"]]
        mono = mine.get("mono")
        rec.pop("answer", None)
        if mono is None:
            rec["verified"] = None
            continue
        cached, over_cache = mine.get(OVER_ITS_CACHE, (0, None))
        split = (rec["config"] != "mono" and over_cache is not None and cached > 0
                 and rec.get("kv_tokens") == cached)
        got = answer_check.compare(mine[rec["config"]], over_cache if split else mono)
        rec["verified"] = got["gap"] is not None and got["gap"] <= answer_check.TOLERANCE
        rec["answer"] = got | {"reference": "over its cache" if split else "whole"}
        if split:        # beside it, the gap to the prompt computed whole (not judged)
            rec["answer"]["whole_gap"] = answer_check.compare(mine[rec["config"]], mono)["gap"]


def summarize(records: list[dict]) -> list[dict]:
    """Per configuration and input length: TTFT percentiles and the parts' means."""
    out = []
    keys = sorted({(r["config"], r["input_len"]) for r in records},
                  key=lambda k: (k[1], ROWS.index(k[0])))
    for config, n in keys:
        rows = [r for r in records if r["config"] == config and r["input_len"] == n]
        ttft = np.array([r["ttft_s"] for r in rows])
        part = lambda k: (float(np.mean([r[k] for r in rows]))
                          if all(r.get(k) is not None for r in rows) else None)
        handed = [r.get("handed_over") for r in rows if "handed_over" in r]
        taken = [r["kv_tokens"] for r in rows if "kv_tokens" in r]
        checked = [r["verified"] for r in rows if r["verified"] is not None]
        engine = part("engine_s")
        beside = part("beside_ttft_s")
        beside_engine = part("beside_engine_s")
        out.append({"config": config, "input_len": n, "requests": len(rows),
                    "handed_over": sum(map(bool, handed)) if handed else None,
                    # the prompt tokens a request took from its KV path (mean)
                    "kv_tokens_mean": float(np.mean(taken)) if taken else None,
                    "ttft_mean_s": float(ttft.mean()), "ttft_p50_s": float(np.percentile(ttft, 50)),
                    "ttft_p90_s": float(np.percentile(ttft, 90)),
                    "ttft_p99_s": float(np.percentile(ttft, 99)),
                    "prefill_s": part("prefill_s"), "decode_s": part("decode_s"),
                    # the same path as vLLM's front ends time it, without the HTTP
                    # and the client around it (None where vLLM reports none)
                    "engine_mean_s": engine,
                    "engine_prefill_s": part("engine_prefill_s"),
                    "engine_decode_s": part("engine_decode_s"),
                    # --mono-beside: one vLLM's TTFT for the same prompts, each
                    # measured beside the row's, and the row's mean over it
                    # (client and engine side)
                    "beside_ttft_mean_s": beside,
                    "beside_engine_mean_s": beside_engine,
                    "vs_beside": None if beside is None else float(ttft.mean()) / beside,
                    "engine_vs_beside": (None if beside_engine is None or engine is None
                                         else engine / beside_engine),
                    "verified": all(checked) if checked else None,
                    # answers verified that parted from one vLLM's at a near-tie,
                    # and the largest logprob gap of those compared (an unverified
                    # answer's counts when it is finite)
                    "near_ties": sum(r["answer"]["parts_at"] is not None for r in rows
                                     if r["verified"]),
                    "answer_gap": max((r["answer"]["gap"] for r in rows
                                       if r["verified"] is not None
                                       and r["answer"]["gap"] is not None), default=None)})
    return out
