"""`tract bench`: the KV path of disaggregated serving, transports side by side."""
from __future__ import annotations

import json
import signal
from typing import List, Optional

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from tract_cli.bench import peers, runner, session, workloads
from tract_cli.cli import render
from tract_cli.core.errors import UsageError
from tract_cli.core.geometry import load_device, load_model
from tract_cli.core.units import format_duration, format_size, parse_size
from tract_cli.provision.topology import pin

ALL_TRANSPORTS = list(runner.TRANSPORTS) + list(peers.PEERS)


def bench(
    input_len: int = typer.Option(6000, "--input-len", help="Prompt tokens (static workload)."),
    output_len: int = typer.Option(3, "--output-len", help="Output tokens (static workload)."),
    requests: Optional[int] = typer.Option(None, "--requests",
                                           help="Requests (static: 8; synthetic: the preset's)."),
    workload: str = typer.Option("static", "--workload",
                                 help="static | synthetic | a preset (synthetic-a, -b, -c)."),
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
    qps: Optional[float] = typer.Option(None, "--qps", help="Poisson arrival rate (0: all at once)."),
    seed: int = typer.Option(0, "--seed", help="Workload seed."),
    model: str = typer.Option("llama-3-8b", "--model", help="Model profile (KV geometry)."),
    transports: List[str] = typer.Option(list(runner.TRANSPORTS), "--transport",
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
) -> None:
    """Run a workload through prefill and decode processes; compare KV transports."""
    # SIGTERM cleans up like Ctrl-C: workers, the agent and the temporary region go
    signal.signal(signal.SIGTERM, _interrupt)
    pin(numa_node, cpus)
    for t in transports:
        if t not in ALL_TRANSPORTS:
            raise UsageError(f"unknown transport {t!r}", f"use {', '.join(ALL_TRANSPORTS)}")
    if plot:
        _check_plot_dependency()
    if install_peers:
        for t in transports:
            if t in peers.PEERS:
                peers.install(t, render.stderr.file)
    if compute_mode not in ("modelled", "real"):
        raise UsageError(f"--compute {compute_mode!r} is not modelled or real", "e.g. --compute real")
    real = compute_mode == "real"
    if real and model == "llama-3-8b":
        model = "tiny-llama"          # the reference engine's CPU model, unless one is named
    profile = load_model(model)
    dev = load_device(device)
    if dev.prefill_tokens_per_s <= 0:
        raise UsageError(f"device profile {device} has no compute rates", "use --device a6000")
    reqs, described = _workload(workload, trace, limit, speedup, max_input_len, input_len, output_len, requests,
                                prefix_ratio, num_prefix_prompts, isl_mean, osl_mean, qps, seed)
    size = parse_size(pool_size) if pool_size else None
    compute = runner.Compute(dev.prefill_tokens_per_s, dev.decode_s_per_token)
    with Progress(console=render.stderr, transient=True) as prog:
        tasks = {}

        def advance(tr):
            if tr not in tasks:
                tasks[tr] = prog.add_task(tr, total=len(reqs))
            prog.advance(tasks[tr])
        with render.byte_progress("reserving the region") as cb:
            res = session.run(reqs, profile, transports, compute, pool=pool, pool_size=size,
                              prefill_workers=prefill_workers, decode_workers=decode_workers,
                              nodes=nodes, flush_mode=flush_mode, progress=advance,
                              reserve_progress=cb, real_compute=real)
    compute_text = (f"real compute (reference engine, {profile.name}, random weights)" if real
                    else f"modelled compute ({dev.description})")
    _render(res, described, profile, compute_text, prefill_workers, decode_workers)
    if json_file:
        try:
            with open(json_file, "w") as f:
                json.dump({"workload": described, "summaries": res.summaries, "records": res.records,
                           "skipped": res.skipped, "memcpy_2x_s": res.memcpy_2x_s,
                           "kv_bytes_mean": res.kv_bytes_mean, "medium": res.medium,
                           "compute": compute_mode, "device": None if real else dev.name,
                           "machine": session.machine(),
                           "sim_hit_rate": res.sim_hit_rate, "pool_slots": res.pool_slots,
                           "unique_blocks": res.unique_blocks}, f, indent=2)
        except OSError as exc:
            raise UsageError(f"cannot write {json_file}: {exc.strerror}", "pick a writable path") from None
    if plot:
        from tract_cli.bench.plot import plot_results
        plot_results(res, plot, described)
    if not all(s["verified"] for s in res.summaries):
        raise typer.Exit(1)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _workload(workload, trace, limit, speedup, max_input_len, input_len, output_len, requests, prefix_ratio,
              num_prefix_prompts, isl_mean, osl_mean, qps, seed):
    if trace:
        if max_input_len is not None and max_input_len < 1:
            raise UsageError("--max-input-len must be positive", "e.g. --max-input-len 8192")
        reqs = workloads.trace(trace, limit, speedup, salt=seed, max_input_len=max_input_len)
        return reqs, f"trace {trace} ({len(reqs)} requests, speedup {speedup:g}" + \
            (f", <= {max_input_len} tokens" if max_input_len else "") + ")"
    if workload == "static":
        n = requests or 8
        reqs = workloads.static(input_len, n, output_len, prefix_ratio or 0.0, seed, qps=qps or 0.0)
        return reqs, f"static: {n} x {input_len} tokens in, {output_len} out" + \
            (f", {prefix_ratio:g} shared" if prefix_ratio else "") + (f", {qps:g} QPS" if qps else "")
    params = {} if workload == "synthetic" else workloads.load_preset(workload)
    desc = params.pop("description", workload)
    overrides = {"requests": requests, "prefix_ratio": prefix_ratio,
                 "num_prefix_prompts": num_prefix_prompts, "isl_mean": isl_mean,
                 "osl_mean": osl_mean, "qps": qps}
    params.update({k: v for k, v in overrides.items() if v is not None})
    params.setdefault("requests", 16)
    reqs = workloads.synthetic(seed=seed, **params)
    return reqs, f"{workload}: {len(reqs)} requests, {desc}"


def _check_plot_dependency():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib", 'pip install "tract-cxl[plot]"') from None


def _render(res, described, profile, compute_text, pw, dw):
    out = render.stdout if render.stdout.is_terminal else Console(width=160)
    t = Table(title=f"{described}; {profile.name}; {pw} prefill + {dw} decode workers; "
                    f"{res.medium}; {compute_text}; {session.machine()}",
              title_justify="left")
    for c in ("transport", "TTFT mean", "p50", "p90", "p99", "KV handoff", "/ 2x memcpy",
              "/ best", "hit rate", "req/s", "KV GB/s", "lock wait", "verified"):
        t.add_column(c, justify="right", no_wrap=True)
    best = min((s["handoff_s"]["mean"] for s in res.summaries), default=0.0)
    for s in res.summaries:
        tt, h = s["ttft_s"], s["handoff_s"]["mean"]
        t.add_row(s["transport"], format_duration(tt["mean"]), format_duration(tt["p50"]),
                  format_duration(tt["p90"]), format_duration(tt["p99"]), format_duration(h),
                  f"{h / res.memcpy_2x_s:.2f}x" if res.memcpy_2x_s else "-",
                  f"{h / best:.1f}x" if best else "-", f"{100 * s['hit_rate_blocks']:.1f}%",
                  f"{s['throughput_rps']:.2f}", f"{s['kv_gbps']:.1f}",
                  format_duration(s["lock_wait_s"]), "yes" if s["verified"] else "[red]NO[/]")
    out.print(t)
    st = Table(title="mean time per stage", title_justify="left")
    st.add_column("transport")
    stages = [k for k in runner.STAGES if any(s["stages_s"][k]["mean"] for s in res.summaries)]
    for k in stages:
        st.add_column(k, justify="right", no_wrap=True)
    for s in res.summaries:
        st.add_row(s["transport"], *(format_duration(s["stages_s"][k]["mean"]) for k in stages))
    out.print(st)
    out.print(f"reference: two memcpy of {format_size(res.kv_bytes_mean)} (a mean request's KV) = "
              f"{format_duration(res.memcpy_2x_s)} (same run). Prefix cache: {res.unique_blocks} "
              f"distinct blocks, {res.pool_slots} slots; offline LRU simulation hit rate "
              f"{100 * res.sim_hit_rate:.1f}% ({res.sim_evictions} evictions).")
    for tr, why in res.skipped.items():
        out.print(f"[yellow]skipped {tr}[/]: {why}")
