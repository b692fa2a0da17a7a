"""`tract bench`: the KV path of disaggregated serving, transports side by side."""
from __future__ import annotations

import json
import math
import signal
from typing import List, Optional

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from tract_cli.bench import peers, stats
from tract_cli.bench.engine import configs as engine_configs
from tract_cli.bench.engine import vllm_runs, vllm_workloads
from tract_cli.bench.workload import runner, session, workloads
from tract_cli.bench.workload.transports import TRANSPORTS
from tract_cli.cli import bench_vllm, render
from tract_cli.core.errors import UsageError
from tract_cli.core.geometry import load_device, load_model
from tract_cli.core.units import format_duration, format_size, parse_size
from tract_cli.provision.topology import pin

ALL_TRANSPORTS = list(TRANSPORTS) + list(peers.PEERS)
MIN_QPS = 0.01          # one request in 100 s: slower is a typo, not a workload


def bench(
    input_len: Optional[List[int]] = typer.Option(
        None, "--input-len", help="Prompt tokens of the static workload (repeatable; default: "
                                  "the paper's sweep 1500, 3000, 4500, 6000)."),
    output_len: Optional[int] = typer.Option(None, "--output-len", help="Output tokens (static "
                                             "workload: default 3; with --engine vllm and a "
                                             "synthetic workload or a trace: the cap on each "
                                             "request's, default 16)."),
    requests: Optional[int] = typer.Option(None, "--requests",
                                           help="Requests (static: 8 per input length; "
                                                "synthetic: the preset's)."),
    workload: str = typer.Option("static", "--workload",
                                 help="static | synthetic | a preset (synthetic-a, -b, -c); "
                                      "with --engine vllm, a synthetic one runs under load at "
                                      "each --qps."),
    trace: Optional[str] = typer.Option(None, "--trace", help="Replay a Mooncake-format JSONL trace."),
    limit: Optional[int] = typer.Option(None, "--limit", help="Trace: first N requests."),
    speedup: float = typer.Option(1.0, "--speedup", help="Trace: time compression factor."),
    max_input_len: Optional[int] = typer.Option(None, "--max-input-len",
                                                help="Trace: skip requests longer than this."),
    prefix_ratio: Optional[float] = typer.Option(None, "--prefix-ratio", help="Shared prefix share, 0-1."),
    num_prefix_prompts: Optional[int] = typer.Option(None, "--num-prefix-prompts",
                                                     help="Synthetic: distinct shared prefixes."),
    isl_mean: Optional[int] = typer.Option(None, "--isl-mean", help="Synthetic: mean input tokens."),
    osl_mean: Optional[int] = typer.Option(None, "--osl-mean", help="Synthetic: mean output tokens."),
    qps: Optional[List[float]] = typer.Option(None, "--qps", help="Poisson arrival rate (0: all "
                                              "at once); with --engine vllm, repeatable: a sweep "
                                              "(a trace is rescaled to each rate)."),
    seed: int = typer.Option(0, "--seed", help="Workload seed."),
    model: Optional[str] = typer.Option(None, "--model", help="Model profile (KV geometry; "
                                        "default llama-3-8b, with --compute real tiny-llama)."),
    transports: List[str] = typer.Option(list(TRANSPORTS), "--transport",
                                         help=f"{' | '.join(ALL_TRANSPORTS)} (repeatable)."),
    device: str = typer.Option("a6000", "--device", help="Device profile for modelled compute."),
    compute_mode: str = typer.Option("modelled", "--compute", help="modelled (device profile) or "
                                     "real (the reference engine through tract serve-*)."),
    prefill_workers: int = typer.Option(1, "--prefill-workers", help="Prefill worker processes (node 1)."),
    decode_workers: int = typer.Option(1, "--decode-workers", help="Decode worker processes (node 2)."),
    nodes: int = typer.Option(3, "--nodes", help="Nodes of the temporary region."),
    pool: Optional[str] = typer.Option(None, "--pool", help="An existing region (default: a "
                                                             "temporary one in /dev/shm)."),
    pool_size: Optional[str] = typer.Option(None, "--pool-size", help="Temporary region size "
                                            "(default: the whole workload fits; smaller evicts)."),
    flush_mode: str = typer.Option("none", "--flush-mode", help="For the temporary region."),
    json_file: Optional[str] = typer.Option(None, "--json", help="Write every record here."),
    plot: Optional[str] = typer.Option(None, "--plot", help="TTFT CDF and stage breakdown (PNG)."),
    install_peers: bool = typer.Option(False, "--install-peers", help="Create the virtual "
                                       "environments of the peer transports asked for first."),
    numa_node: Optional[int] = typer.Option(None, "--numa-node", help="Pin to this node's CPUs."),
    cpus: Optional[str] = typer.Option(None, "--cpus", help="Pin to these CPUs."),
    engine: str = typer.Option("reference", "--engine", help="reference (modelled or reference-"
                               "engine compute) or vllm (real vLLM prefill/decode pairs on the "
                               "--model checkpoint; docs/VLLM.md)."),
    vllm_configs: Optional[List[str]] = typer.Option(None, "--vllm-config",
                                           help="With --engine vllm (repeatable): tract, example "
                                                "(vLLM's ExampleConnector on /dev/shm), nixl, "
                                                "nixl-tcp (vLLM's NixlConnector over UCX), "
                                                "mooncake (vLLM's MooncakeConnector; not by "
                                                "default: it stops at start on vLLM's CPU "
                                                "build), mono (one vLLM), prefix (a pool hit "
                                                "after a miss; under load: two vLLMs sharing "
                                                "the region), lmcache (LMCache's shared cache, "
                                                "likewise). Default: all but mooncake; "
                                                "under load also not example (it stores a "
                                                "chunked prompt short). The peers need "
                                                "--install-peers once."),
    load_mode: str = typer.Option("sync", "--load-mode", help="With --engine vllm: the TraCT "
                                  "connector's load_mode, sync (hits copied in the step that "
                                  "computes the rest) or async (on its loader thread)."),
    handoff_publish: str = typer.Option("after_step", "--handoff-publish",
                                        help="With --engine vllm: the TraCT connector's "
                                             "handoff_publish, after_step (a P/D prefill's "
                                             "record reserved in its last step, published "
                                             "after the commit) or in_step (published in "
                                             "that step, which waits for it)."),
    request_gap: Optional[float] = typer.Option(None, "--request-gap",
                                                help="With --engine vllm's static workload: "
                                                     "seconds of quiet before each request, "
                                                     "so it meets idle instances as on their "
                                                     "own hosts (vLLM's workers poll for 1 s "
                                                     "after a step; docs/VLLM.md). Default "
                                                     f"{vllm_runs.DEFAULT_REQUEST_GAP_S:g}; 0: "
                                                     "back to back."),
    mono_beside: bool = typer.Option(False, "--mono-beside",
                                     help="With --engine vllm's static workload: keep one "
                                          "vLLM running and send it every measured prompt "
                                          "too, right beside each configuration's request, "
                                          "so each row's ratio to it is free of the host's "
                                          "drift between configurations (one vLLM's memory "
                                          "more)."),
    interleave: bool = typer.Option(False, "--interleave",
                                    help="With --engine vllm's static workload: start every "
                                         "configuration first and keep them all up, then "
                                         "send each measured prompt to each in turn, so "
                                         "the configurations' requests are seconds apart, "
                                         "not minutes (every configuration's memory at "
                                         "once)."),
    vllm_prefix_caching: bool = typer.Option(False, "--vllm-prefix-caching",
                                             help="With --engine vllm: turn vLLM's own prefix "
                                                  "cache on in every instance (off by default, "
                                                  "so a hit is the KV path's own; one vLLM has "
                                                  "it on either way, for the answers' "
                                                  "reference)."),
    vllm_kv_cache_gib: Optional[float] = typer.Option(None, "--vllm-kv-cache-gib",
                                                      help="With --engine vllm: each vLLM "
                                                           "instance's CPU KV cache, GiB "
                                                           "(default 2; a fraction is fine)."),
) -> None:
    """Run a workload through prefill and decode processes; compare KV transports."""
    # SIGTERM cleans up like Ctrl-C: workers, the agent and the temporary region go
    signal.signal(signal.SIGTERM, _interrupt)
    pin(numa_node, cpus)
    if engine not in ("reference", "vllm"):
        raise UsageError(f"--engine {engine!r} is not reference or vllm", "pass --engine vllm")
    qps_sweep = list(qps or [])
    for q in qps_sweep:
        if not math.isfinite(q) or q < 0 or 0 < q < MIN_QPS:
            raise UsageError(f"--qps {q:g} is not a rate: use 0 (all at once) or at least "
                             f"{MIN_QPS:g}", "e.g. --qps 2")
    if engine == "vllm":
        # the reference engine's flags mean nothing to vLLM's runs: refused, not ignored
        ignored = [flag for flag, given in (
            ("--transport", transports != list(TRANSPORTS)), ("--device", device != "a6000"),
            ("--compute", compute_mode != "modelled"), ("--prefill-workers", prefill_workers != 1),
            ("--decode-workers", decode_workers != 1), ("--nodes", nodes != 3),
            ("--pool", pool is not None), ("--pool-size", pool_size is not None),
            ("--flush-mode", flush_mode != "none")) if given]
        if ignored:
            raise UsageError(f"{', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} for "
                             "the reference engine, not --engine vllm",
                             "drop them (vLLM's runs pick their own region; TRACT_FLUSH_MODE "
                             "sets its flush mode)")
        if trace and workload != "static":
            raise UsageError("--workload and --trace are two workloads", "pass one of them")
        if request_gap is not None and (trace or workload != "static"):
            raise UsageError("--request-gap paces the static workload; a synthetic workload "
                             "or a trace sends on its own clock", "drop --request-gap")
        if mono_beside and (trace or workload != "static"):
            raise UsageError("--mono-beside is for the static workload (one request at a "
                             "time); under load a second vLLM would take the cores the "
                             "configurations share", "drop --mono-beside")
        if interleave and (trace or workload != "static"):
            raise UsageError("--interleave is for the static workload (one request at a "
                             "time); under load the configurations would take each other's "
                             "cores", "drop --interleave")
        if interleave and mono_beside:
            raise UsageError(*vllm_runs.INTERLEAVE_BESIDE)
        if trace or workload != "static":
            bench_vllm.workload(model, workload, trace, limit, speedup, max_input_len,
                                input_len, output_len, requests, prefix_ratio,
                                num_prefix_prompts, isl_mean, osl_mean, qps_sweep, seed,
                                vllm_configs or list(vllm_workloads.DEFAULT), json_file, plot,
                                load_mode, install_peers, vllm_prefix_caching, handoff_publish,
                                vllm_kv_cache_gib)
            return
        if qps_sweep:
            raise UsageError("--qps is for a synthetic workload or a trace with --engine vllm "
                             "(the static experiment sends one request at a time)",
                             "add --workload synthetic-a, or drop --qps")
        bench_vllm.static(model, input_len, requests, 3 if output_len is None else output_len,
                          vllm_configs or list(engine_configs.DEFAULT), seed, json_file,
                          plot, load_mode, install_peers, vllm_prefix_caching, handoff_publish,
                          vllm_runs.DEFAULT_REQUEST_GAP_S if request_gap is None else request_gap,
                          mono_beside, interleave, vllm_kv_cache_gib)
        return
    if vllm_kv_cache_gib is not None:
        raise UsageError("--vllm-kv-cache-gib sizes real vLLM's KV cache",
                         "drop it, or add --engine vllm --model DIR")
    if request_gap is not None or mono_beside or interleave:
        flag = ("--request-gap paces" if request_gap is not None else
                "--mono-beside is for" if mono_beside else "--interleave is for")
        raise UsageError(f"{flag} real vLLM's static workload",
                         "drop it, or add --engine vllm --model DIR")
    if len(qps_sweep) > 1:
        raise UsageError("a --qps sweep runs on real vLLM (--engine vllm)",
                         "pass one --qps, or add --engine vllm --model DIR")
    qps = qps_sweep[0] if qps_sweep else None
    output_len = 3 if output_len is None else output_len
    for t in transports:
        if t not in ALL_TRANSPORTS:
            raise UsageError(f"unknown transport {t!r}", f"use {', '.join(ALL_TRANSPORTS)}")
    if plot:
        bench_vllm.check_plot_dependency()
    if install_peers:
        for t in transports:
            if t in peers.PEERS:
                peers.install(t, render.stderr.file)
    if compute_mode not in ("modelled", "real"):
        raise UsageError(f"--compute {compute_mode!r} is not modelled or real", "e.g. --compute real")
    real = compute_mode == "real"
    if model is None:                 # real compute: the reference engine's CPU model
        model = "tiny-llama" if real else "llama-3-8b"
    profile = load_model(model)       # a model named is run (or refused), never replaced
    dev = load_device(device)
    if dev.prefill_tokens_per_s <= 0:
        raise UsageError(f"device profile {device} has no compute rates", "use --device a6000")
    groups, described = _workload(workload, trace, limit, speedup, max_input_len, input_len,
                                  output_len, requests, prefix_ratio, num_prefix_prompts, isl_mean,
                                  osl_mean, qps, seed)
    reqs = [r for _, g in groups for r in g]
    size = parse_size(pool_size) if pool_size else None
    compute = runner.Compute(dev.prefill_tokens_per_s, dev.decode_s_per_token)
    with Progress(console=render.stderr, transient=True) as prog:
        tasks = {}

        per = {(f"{tr} {label}" if label is not None else tr): len(g)
               for label, g in groups for tr in transports}

        def advance(name):
            if name not in tasks:
                tasks[name] = prog.add_task(name, total=per.get(name, len(reqs)))
            prog.advance(tasks[name])
        with render.byte_progress("reserving the region") as cb:
            res = session.run(reqs, profile, transports, compute, pool=pool, pool_size=size,
                              prefill_workers=prefill_workers, decode_workers=decode_workers,
                              nodes=nodes, flush_mode=flush_mode, progress=advance,
                              reserve_progress=cb, real_compute=real,
                              groups=groups if len(groups) > 1 else None)
    compute_text = (f"real compute (reference engine, {profile.name}, random weights)" if real
                    else f"modelled compute ({dev.description})")
    _render(res, described, profile, compute_text, prefill_workers, decode_workers)
    if json_file:
        try:
            with open(json_file, "w") as f:
                json.dump({"workload": described, "summaries": res.summaries, "records": res.records,
                           "skipped": res.skipped, "memcpy_2x_s": res.memcpy_2x_s,
                           "kv_bytes_mean": res.kv_bytes_mean, "medium": res.medium,
                           "flush_mode": res.flush_mode,
                           "compute": compute_mode, "device": None if real else dev.name,
                           "machine": session.machine(),
                           "sim_hit_rate": res.sim_hit_rate, "pool_slots": res.pool_slots,
                           "unique_blocks": res.unique_blocks,
                           "load_notes": {str(k): v for k, v in res.extra["load_notes"].items()},
                           "peer_logs": res.extra["peer_logs"]}, f, indent=2)
        except OSError as exc:
            raise UsageError(f"cannot write {json_file}: {exc.strerror}", "pick a writable path") from None
    if plot:
        from tract_cli.bench.plot import plot_results
        plot_results(res, plot, described)
    if not all(s["verified"] for s in res.summaries):
        raise typer.Exit(1)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


STATIC_SWEEP = (1500, 3000, 4500, 6000)     # the paper's static experiment


def _workload(workload, trace, limit, speedup, max_input_len, input_len, output_len, requests,
              prefix_ratio, num_prefix_prompts, isl_mean, osl_mean, qps, seed):
    """[(group label, requests)] and a description.  Static: one group per input
    length (--input-len as given, or the paper's sweep); the others: one group."""
    if input_len and (trace or workload != "static"):
        raise UsageError("--input-len is for the static workload",
                         "use --isl-mean for a synthetic one; a trace has its own lengths")
    if trace:
        if max_input_len is not None and max_input_len < 1:
            raise UsageError("--max-input-len must be positive", "e.g. --max-input-len 8192")
        reqs = workloads.trace(trace, limit, speedup, salt=seed, max_input_len=max_input_len)
        return [(None, reqs)], f"trace {trace} ({len(reqs)} requests, speedup {speedup:g}" + \
            (f", <= {max_input_len} tokens" if max_input_len else "") + ")"
    if workload == "static":
        n = requests or 8
        lengths = list(dict.fromkeys(input_len)) if input_len else list(STATIC_SWEEP)
        groups = [(length if len(lengths) > 1 else None,
                   workloads.static(length, n, output_len, prefix_ratio or 0.0, seed,
                                    qps=qps or 0.0))
                  for length in lengths]
        if len(lengths) > 1:    # request ids must differ between groups
            groups = [(label, [workloads.Request(f"{r.rid}-{label}", r.arrival_s, r.tokens,
                                                 r.output_len) for r in reqs])
                      for label, reqs in groups]
        inputs = " / ".join(str(x) for x in lengths)
        return groups, f"static: {n} x {inputs} tokens in, {output_len} out" + \
            (f", {prefix_ratio:g} shared" if prefix_ratio else "") + (f", {qps:g} QPS" if qps else "")
    params = {} if workload == "synthetic" else workloads.load_preset(workload)
    desc = params.pop("description", workload)
    overrides = {"requests": requests, "prefix_ratio": prefix_ratio,
                 "num_prefix_prompts": num_prefix_prompts, "isl_mean": isl_mean,
                 "osl_mean": osl_mean, "qps": qps}
    params.update({k: v for k, v in overrides.items() if v is not None})
    params.setdefault("requests", 16)
    reqs = workloads.synthetic(seed=seed, **params)
    return [(None, reqs)], f"{workload}: {len(reqs)} requests, {desc}"


def _cell(v, fmt) -> str:
    return "—" if v is None else fmt(v)


def _render(res, described, profile, compute_text, pw, dw):
    out = render.stdout if render.stdout.is_terminal else Console(width=200)
    sweep = any(s.get("group") is not None for s in res.summaries)
    t = Table(title=f"{described}; {profile.name}; {pw} prefill + {dw} decode workers; "
                    f"{res.medium}, flush mode {res.flush_mode}; {compute_text}; "
                    f"{session.machine()}",
              title_justify="left")
    cols = (["input"] if sweep else []) + [
        "transport", "TTFT mean", "p50", "p90", "p99", "KV handoff", "/ 2x memcpy", "/ best",
        "hit rate", "req/s", "KV GB/s", "lock wait", "verified"]
    for c in cols:
        t.add_column(c, justify="right", no_wrap=True)
    best = {}
    for s in res.summaries:
        h = s["handoff_s"]["mean"] if s["handoff_s"] else None
        if h is not None:
            best[s.get("group")] = min(best.get(s.get("group"), h), h)
    for s in res.summaries:
        tt, h = s["ttft_s"], s["handoff_s"]["mean"] if s["handoff_s"] else None
        b, m = best.get(s.get("group")), s.get("memcpy_2x_s")
        gbps = "bytes not moved" if s["transport"] == "tract-zero-copy" else \
            _cell(s["kv_gbps"], lambda v: f"{v:.1f}")
        row = [format_duration(tt["mean"]), format_duration(tt["p50"]),
               format_duration(tt["p90"]), format_duration(tt["p99"]),
               _cell(h, format_duration), f"{h / m:.2f}x" if h is not None and m else "—",
               f"{h / b:.1f}x" if h is not None and b else "—",
               _cell(s["hit_rate_blocks"], lambda v: f"{100 * v:.1f}%"),
               f"{s['throughput_rps']:.2f}", gbps, _cell(s["lock_wait_s"], format_duration),
               "yes" if s["verified"] else "[red]NO[/]"]
        t.add_row(*([str(s["group"])] if sweep else []), s["transport"], *row)
    out.print(t)
    st = Table(title="mean time per stage (— : the transport has no such stage)",
               title_justify="left")
    if sweep:
        st.add_column("input")
    st.add_column("transport")
    stages = [k for k in stats.STAGES if any(s["stages_s"][k] for s in res.summaries)]
    for k in stages:
        st.add_column(k, justify="right", no_wrap=True)
    st.add_column("modelled compute", justify="right", no_wrap=True)
    for s in res.summaries:
        st.add_row(*([str(s["group"])] if sweep else []), s["transport"],
                   *(_cell(s["stages_s"][k], lambda v: format_duration(v["mean"])) for k in stages),
                   _cell(s.get("modelled_compute_s"), format_duration))
    out.print(st)
    out.print(f"reference: two memcpy of {format_size(res.kv_bytes_mean)} (a mean request's KV"
              f"{' of the longest input' if sweep else ''}) = "
              f"{format_duration(res.memcpy_2x_s)} (same run). Prefix cache: {res.unique_blocks} "
              f"distinct blocks, {res.pool_slots} slots; offline LRU simulation hit rate "
              f"{100 * res.sim_hit_rate:.1f}% ({res.sim_evictions} evictions).")
    checked = [s for s in res.summaries if s.get("verify_s")]
    if checked:
        worst = max(checked, key=lambda s: s["verify_s"]["mean"])
        out.print("verified: every block and the tail of every request hold exactly what its "
                  "prefill side made (byte for byte; zero-copy: each slot's CRC-32C, in place), "
                  "checked after its first token, in no timed stage: at most "
                  f"{format_duration(worst['verify_s']['mean'])} a request on average "
                  f"({worst['transport']}"
                  f"{'' if worst.get('group') is None else ' at input ' + str(worst['group'])}).")
    notes = res.extra.get("load_notes", {})
    if notes:
        (label, note), rest = next(iter(notes.items())), list(notes)[1:]
        where = f"input {label}: " if label is not None else ""
        also = f" (likewise at input {', '.join(map(str, rest))})" if rest else ""
        out.print(f"[yellow]load[/]: {where}{note}{also}")
    for tr, path in res.extra.get("peer_logs", {}).items():
        out.print(f"{tr}: the peer's own log is {path}")
    for tr, why in res.skipped.items():
        out.print(f"[yellow]skipped {tr}[/]: {why}")
