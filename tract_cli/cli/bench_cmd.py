"""`tract bench`: the KV path of disaggregated serving, transports side by side."""
from __future__ import annotations

import json
import os
from typing import List, Optional

import typer
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from tract_cli.bench import runner, workloads
from tract_cli.bench.micro import temp_region_path
from tract_cli.cli import render
from tract_cli.core.agent import ensure_agent
from tract_cli.core.errors import UsageError
from tract_cli.core.geometry import load_device, load_model
from tract_cli.core.pool import Pool
from tract_cli.core.units import format_duration, format_size
from tract_cli.provision.topology import pin


def bench(
    input_len: int = typer.Option(6000, "--input-len", help="Prompt tokens (static workload)."),
    output_len: int = typer.Option(3, "--output-len", help="Output tokens."),
    requests: int = typer.Option(8, "--requests", help="Requests per transport."),
    prefix_ratio: float = typer.Option(0.0, "--prefix-ratio", help="Shared prefix share, 0-1."),
    seed: int = typer.Option(0, "--seed", help="Workload seed."),
    model: str = typer.Option("llama-3-8b", "--model", help="Model profile (KV geometry)."),
    transports: List[str] = typer.Option(list(runner.TRANSPORTS), "--transport",
                                         help="tract-copy | tract-zero-copy | tcp (repeatable)."),
    device: str = typer.Option("a6000", "--device", help="Device profile for modelled compute."),
    pool: Optional[str] = typer.Option(None, "--pool", help="An existing region (default: a "
                                                             "temporary one in /dev/shm)."),
    flush_mode: str = typer.Option("none", "--flush-mode", help="For the temporary region."),
    json_file: Optional[str] = typer.Option(None, "--json", help="Write every record here."),
    numa_node: Optional[int] = typer.Option(None, "--numa-node", help="Pin to this node's CPUs."),
    cpus: Optional[str] = typer.Option(None, "--cpus", help="Pin to these CPUs."),
) -> None:
    """Run requests through prefill and decode processes; compare KV transports."""
    pin(numa_node, cpus)
    for t in transports:
        if t not in runner.TRANSPORTS:
            raise UsageError(f"unknown transport {t!r}", f"use {', '.join(runner.TRANSPORTS)}")
    profile = load_model(model)
    dev = load_device(device)
    if dev.prefill_tokens_per_s <= 0:
        raise UsageError(f"device profile {device} has no compute rates", "use --device a6000")
    reqs = workloads.static(input_len, requests, output_len, prefix_ratio, seed)
    g = profile.geometry
    blocks = input_len // g.block_tokens
    kv_bytes = blocks * g.block_bytes
    if pool is not None:
        summaries, records = _run(pool, transports, reqs, dev, None)
        medium = Pool.attach(pool, readonly=True, prefault=False, local=False).medium
    else:
        slots = min(requests, 2) * blocks + 2 * blocks + 64     # a cache of two requests, plus in flight
        size = ((slots * g.block_bytes + (16 << 20)) // (2 << 20) + 1) * (2 << 20)
        with temp_region_path() as path:
            with render.byte_progress(f"reserving a {format_size(size)} region") as cb:
                Pool.create(path, size, profile, nodes=3, flush_mode=flush_mode,
                            progress=cb).close()
            summaries, records = _run(path, transports, reqs, dev, None)
            medium = "emulated /dev/shm region"
    ref = runner.memcpy_reference(kv_bytes)
    best = min(s["handoff_mean_s"] for s in summaries)
    t = Table(title=f"{requests} x {input_len}-token requests, {profile.name} "
                    f"({blocks} blocks, {format_size(kv_bytes)} of KV each); {medium}; "
                    f"modelled compute ({dev.description}); {os.cpu_count()} CPUs",
              title_justify="left")
    for c in ("transport", "TTFT mean", "TTFT p50", "TTFT p99", "KV handoff", "/ 2x memcpy",
              "/ best", "hit rate", "KV verified"):
        t.add_column(c, justify="right", no_wrap=True)
    for s in summaries:
        t.add_row(s["transport"], format_duration(s["ttft_mean_s"]), format_duration(s["ttft_p50_s"]),
                  format_duration(s["ttft_p99_s"]), format_duration(s["handoff_mean_s"]),
                  f"{s['handoff_mean_s'] / ref:.2f}x", f"{s['handoff_mean_s'] / best:.1f}x",
                  f"{100 * s['hit_rate_blocks']:.0f}%", "yes" if s["verified"] else "[red]NO[/]")
    out = render.stdout if render.stdout.is_terminal else Console(width=132)
    out.print(t)
    out.print(f"reference: two memcpy of {format_size(kv_bytes)} = "
                        f"{format_duration(ref)} (same run)")
    if json_file:
        with open(json_file, "w") as f:
            json.dump({"summaries": summaries, "records": records, "memcpy_2x_s": ref,
                       "medium": medium, "compute": "modelled", "device": dev.name}, f, indent=2)
    if not all(s["verified"] for s in summaries):
        raise typer.Exit(1)


def _run(path, transports, reqs, dev, _):
    agent = ensure_agent(path, 0, manager=True)
    summaries, records = [], {}
    try:
        with Progress(console=render.stderr, transient=True) as prog:
            for tr in transports:
                _empty_cache(path)       # every transport starts from an empty prefix cache
                task = prog.add_task(tr, total=len(reqs))
                res = runner.run_transport(path, tr, reqs, dev.prefill_tokens_per_s,
                                           dev.decode_s_per_token,
                                           progress=lambda: prog.advance(task))
                summaries.append(runner.summarize(res))
                records[tr] = res.records
    finally:
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=30)
    return summaries, records


def _empty_cache(path: str) -> None:
    with Pool.attach(path, node=0, prefault=False) as p:
        while p.index.evict(1 << 20):
            pass
        p.allocator.drain()
