"""`tract microbench`: the region layer's figures (copies, attach, format)."""
from __future__ import annotations

from typing import List, Optional

import typer
from rich.table import Table

from tract_cli.bench.micro import events as eventbench
from tract_cli.bench.micro import index as indexbench
from tract_cli.bench.micro import snapshot as inspectbench
from tract_cli.bench.micro import locks as lockbench
from tract_cli.bench.micro import paged as pagedbench
from tract_cli.bench.micro import region as micro
from tract_cli.cli import render
from tract_cli.core.cpu import require_flush_mode
from tract_cli.core.errors import UsageError
from tract_cli.core.region import DEFAULT_INDEX_STRIPES
from tract_cli.core.units import format_duration, format_size, parse_size
from tract_cli.provision.topology import pin

app = typer.Typer(help="Micro-benchmarks of the region layer (figures against memcpy in the same run).",
                  no_args_is_help=True)


@app.callback()
def _pinning(
    numa_node: Optional[int] = typer.Option(None, "--numa-node", help="Pin to this node's CPUs."),
    cpus: Optional[str] = typer.Option(None, "--cpus", help="Pin to these CPUs (e.g. 0-3)."),
) -> None:
    """Pins the benchmark (and the processes it starts) before it touches a region."""
    pin(numa_node, cpus)


@app.command("copy")
def copy(
    model: str = typer.Option("llama-3-8b", "--model", help="Model profile: sets the block size."),
    size: str = typer.Option("1G", "--size", help="Temporary region size in /dev/shm."),
    rounds: int = typer.Option(15, "--rounds", help="Measured rounds (median reported)."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Block copy into and out of slots: the core's routine against glibc memcpy."""
    r = micro.bench_copy(model, parse_size(size), rounds)
    if json_out:
        render.print_json(r.__dict__)
        return
    t = Table(title=f"{format_size(r.block_bytes)} block copies, {r.blocks_per_round} distinct "
                    f"slots x {r.rounds} rounds, flush mode {r.flush_mode} (emulated /dev/shm "
                    "region)", title_justify="left")
    for c in ("direction", "memcpy GB/s", "tract GB/s", "tract / memcpy"):
        t.add_column(c, justify="right")
    t.add_row("private -> slot", f"{r.gbps['memcpy_in']:.1f}", f"{r.gbps['tract_in']:.1f}",
              f"{r.ratio('tract_in', 'memcpy_in'):.2f}x")
    t.add_row("slot -> private", f"{r.gbps['memcpy_out']:.1f}", f"{r.gbps['tract_out']:.1f}",
              f"{r.ratio('tract_out', 'memcpy_out'):.2f}x")
    render.stdout.print(t)


@app.command("kvpages")
def kvpages(
    model: str = typer.Option("llama-3-8b", "--model",
                              help="Model profile or checkpoint directory (KV geometry)."),
    input_len: int = typer.Option(1500, "--input-len", help="Prompt tokens."),
    page_tokens: int = typer.Option(128, "--page-tokens",
                                    help="Tokens per engine page (vLLM's CPU block size)."),
    flush_modes: list[str] = typer.Option(["none", "clflush"], "--flush-mode",
                                          help="Flush modes to measure (repeatable)."),
    rounds: int = typer.Option(15, "--rounds", help="Measured rounds (median reported)."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """An engine connector's KV save and load (one C call, checksummed as it
    copies) against memcpy of the same runs, warm and cold."""
    if rounds < 1:
        raise UsageError("--rounds must be at least 1", "e.g. --rounds 15")
    if not 2 <= page_tokens <= 4096 or page_tokens % 2:
        raise UsageError(f"--page-tokens {page_tokens} is not an even count from 2 to 4096 "
                         "(vLLM's CPU page packs V in token pairs)",
                         "use an even count, e.g. vLLM's CPU block size, 128")
    for mode in flush_modes:            # all of them before the first is measured
        require_flush_mode(mode)
    results = [pagedbench.bench_paged(model, input_len, page_tokens, m, rounds)
               for m in flush_modes]
    if json_out:
        render.print_json([r.__dict__ for r in results])
        return
    for r in results:
        t = Table(title=f"{r.model}, {r.input_len} tokens: {r.blocks} pages of KV, "
                        f"{format_size(r.bytes)} ({format_size(r.run_bytes)} runs), flush mode "
                        f"{r.flush_mode}, checksum on {r.crc_path} (emulated /dev/shm region, "
                        f"median of {r.rounds})", title_justify="left")
        for c in ("copy", "caches", "memcpy of the same runs", "TraCT, checksummed",
                  "TraCT / memcpy"):
            t.add_column(c, justify="right")
        for op, name in (("save", "save: pages -> slots"), ("load", "load: slots -> pages")):
            for state in ("cold", "warm"):
                t.add_row(name, state,
                          f"{format_duration(r.us[f'{op}_{state}_memcpy'] / 1e6)} "
                          f"({r.gbps(op, state, 'memcpy'):.1f} GB/s)",
                          f"{format_duration(r.us[f'{op}_{state}_tract'] / 1e6)} "
                          f"({r.gbps(op, state, 'tract'):.1f} GB/s)",
                          f"{r.ratio(op, state):.2f}x")
        render.stdout.print(t)


@app.command("attach")
def attach(
    size: str = typer.Option("8G", "--size", help="Temporary region size in /dev/shm."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Attach time with and without pre-fault, and the first copies each then pays."""
    r = micro.bench_attach(parse_size(size))
    if json_out:
        render.print_json(r.__dict__)
        return
    t = Table(title=f"attach of a {format_size(r.region_size)} region, flush mode {r.flush_mode} "
                    "(emulated /dev/shm)", title_justify="left")
    for c in ("attach", "time", "first 64 block copies"):
        t.add_column(c, justify="right")
    t.add_row("no pre-fault", format_duration(r.attach_s), f"{r.first_copy_cold_gbps:.1f} GB/s")
    t.add_row("pre-fault", format_duration(r.attach_prefault_s), f"{r.first_copy_warm_gbps:.1f} GB/s")
    render.stdout.print(t)


@app.command("format")
def format_(
    sizes: list[str] = typer.Option(["1G", "16G"], "--size", help="Region sizes (repeatable)."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Format time at several sizes: metadata only, so it does not grow with the data area."""
    results = [micro.bench_format(parse_size(s)) for s in sizes]
    if json_out:
        render.print_json([r.__dict__ for r in results])
        return
    modes = ", ".join(dict.fromkeys(r.flush_mode for r in results))
    t = Table(title=f"format (metadata only, sparse file in /dev/shm), flush mode {modes}",
              title_justify="left")
    for c in ("size", "slots", "metadata", "format time"):
        t.add_column(c, justify="right")
    for r in results:
        t.add_row(format_size(r.region_size), str(r.slot_count), format_size(r.metadata_bytes),
                  format_duration(r.format_s))
    render.stdout.print(t)


@app.command("lock")
def lock(
    flush_modes: list[str] = typer.Option(["none", "clflush"], "--flush-mode",
                                          help="Flush modes to measure (repeatable)."),
    seconds: float = typer.Option(2.0, "--seconds", help="Contended run length per node count."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Two-tier lock latency, contended throughput and fairness; 375-slot allocation."""
    results = [lockbench.bench_locks(m, seconds=seconds) for m in flush_modes]
    if json_out:
        render.print_json([r.__dict__ for r in results])
        return
    for r in results:
        t = Table(title=f"two-tier lock, flush mode {r.flush_mode} (emulated /dev/shm region, "
                        f"manager in `tract agent`)", title_justify="left")
        for c in ("nodes contending", "acquisitions/s", "per node min", "per node max",
                  "max/min"):
            t.add_column(c, justify="right")
        for k, c in r.contention.items():
            t.add_row(str(k), f"{c['per_s']:.0f}", str(c["min"]), str(c["max"]),
                      f"{c['fairness']:.2f}")
        render.stdout.print(t)
        render.stdout.print(
            f"uncontended acquire+release: {format_duration(r.uncontended_us / 1e6)} (median); "
            f"alloc 375 slots: {format_duration(r.alloc_375_cold_us / 1e6)} claiming from the "
            f"region, {format_duration(r.alloc_375_warm_us / 1e6)} from the node's free list; "
            f"free 375: {format_duration(r.free_375_us / 1e6)}")
        for where, walks in (("", r.walks), (" on a busy core", r.walks_busy)):
            for walk, w in walks.items():
                render.stdout.print(
                    f"{walk} of a 6000-token request's {lockbench.WALK_KEYS} blocks (one walk "
                    f"over {r.stripes} stripes){where}: {format_duration(w['ahead'] / 1e6)} with "
                    f"its locks requested ahead, {format_duration(w['one_ahead'] / 1e6)} one "
                    f"ahead (the walk of format 7, same run): "
                    f"{w['one_ahead'] / w['ahead']:.2f}x the time")
        render.stdout.print("(on a busy core: the lock manager's agent, the walker and one "
                            "CPU-bound process share one core, as inside a busy engine)")


# the options of the one-request benchmarks (events, index): one request's
# prompt, measured in each flush mode
INPUT_LEN = typer.Option(6000, "--input-len", help="Prompt tokens.")
FLUSH_MODES = typer.Option(["none", "clflush"], "--flush-mode",
                           help="Flush modes to measure (repeatable).")


def _figures(title: str) -> Table:
    """A table of one request's figures, each beside its reference in the same run."""
    t = Table(title=title, title_justify="left")
    t.add_column("figure")
    t.add_column("value", justify="right")
    t.add_column("reference (same run)", justify="right")
    return t


@app.command("events")
def events(
    model: str = typer.Option("tiny", "--model", help="Model profile (KV geometry)."),
    input_len: int = INPUT_LEN,
    flush_modes: list[str] = FLUSH_MODES,
    rounds: int = typer.Option(9, "--rounds"),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """What KV events cost: a request's commit with its blocks described against
    key-only records (every commit writes records and events); a reader's log
    read and snapshot; the feed's take."""
    if rounds < 1 or input_len < 1:
        raise UsageError("--rounds and --input-len must be at least 1", "e.g. --rounds 9")
    results = [eventbench.bench_events(model, input_len, m, rounds) for m in flush_modes]
    if json_out:
        render.print_json([r.__dict__ for r in results])
        return
    for r in results:
        t = _figures(f"KV events of a {r.input_len}-token request, {r.model} ({r.blocks} "
                     f"blocks), flush mode {r.flush_mode}, emulated /dev/shm region "
                     f"(median of {rounds})")
        added = r.commit_described_us - r.commit_plain_us
        t.add_row("commit, blocks described (hash, parent, tokens)",
                  format_duration(r.commit_described_us / 1e6),
                  f"key-only records {format_duration(r.commit_plain_us / 1e6)} "
                  f"({r.commit_described_us / r.commit_plain_us:.2f}x; "
                  f"{added / r.blocks:+.2f} µs a block)")
        t.add_row("describe (numpy, before the commit)", format_duration(r.describe_us / 1e6),
                  f"{r.describe_us / r.blocks:.2f} µs a block")
        t.add_row("reader: log and records read", format_duration(r.poll_us / 1e6),
                  f"{r.poll_us / r.blocks:.2f} µs an event; idle read "
                  f"{format_duration(r.poll_idle_us / 1e6)}")
        t.add_row("reader: snapshot of the region", format_duration(r.snapshot_us / 1e6),
                  "every stripe locked in turn")
        t.add_row("feed: take, as vLLM's event fields", format_duration(r.take_us / 1e6),
                  f"{r.take_us / r.blocks:.2f} µs a block")
        render.stdout.print(t)


@app.command("index")
def index(
    model: str = typer.Option("llama-3-8b", "--model", help="Model profile (KV geometry)."),
    input_len: int = INPUT_LEN,
    flush_modes: list[str] = FLUSH_MODES,
    rounds: int = typer.Option(5, "--rounds"),
    stripes: int = typer.Option(DEFAULT_INDEX_STRIPES, "--stripes", help="Index stripes of the temporary region."),
    region_size: Optional[str] = typer.Option(
        None, "--region-size", help="Size of the temporary region (default: what the request needs); "
                                    "more buckets spread a request's pins over more lines."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """One request through the index: hash, put, lookup+pin, read, handoffs."""
    size = parse_size(region_size) if region_size is not None else None
    results = [indexbench.bench_index(model, input_len, m, rounds, stripes, size) for m in flush_modes]
    if json_out:
        render.print_json([r.__dict__ for r in results])
        return
    for r in results:
        t = _figures(f"{r.input_len}-token request, {r.model} ({r.blocks} blocks, "
                     f"{format_size(r.bytes)}), flush mode {r.flush_mode}, {r.details['stripes']} stripes, emulated /dev/shm "
                     f"region of {format_size(r.details['region_size'])}")
        t.add_row("block hashes", format_duration(r.hash_us / 1e6), "")
        t.add_row("put (claim, allocate, NT copy, publish)", f"{r.put_gbps:.1f} GB/s",
                  f"memcpy {r.put_memcpy_gbps:.1f} GB/s ({r.put_gbps / r.put_memcpy_gbps:.2f}x)")
        t.add_row("lookup + pin + unpin", format_duration(r.lookup_pin_us / 1e6),
                  f"lookup + pin alone {format_duration(r.details['lookup_pin_only_us'] / 1e6)}")
        t.add_row("lookup + pin, other blocks touched since",
                  format_duration(r.details["lookup_pin_moved_us"] / 1e6),
                  "its runs spliced to the LRU heads")
        t.add_row("read into a private buffer", f"{r.read_gbps:.1f} GB/s",
                  f"memcpy {r.read_memcpy_gbps:.1f} GB/s ({r.read_gbps / r.read_memcpy_gbps:.2f}x)")
        t.add_row("copying handoff (publish, open, copy, ack)",
                  format_duration(r.copy_handoff_ms / 1e3),
                  f"metadata {format_duration(r.copy_handoff_metadata_ms / 1e3)} "
                  f"({100 * r.copy_handoff_metadata_ms / r.copy_handoff_ms:.0f}%)")
        t.add_row("zero-copy handoff (publish, open, views, ack)",
                  format_duration(r.zero_copy_handoff_ms / 1e3),
                  "metadata only")
        d = r.details
        for kind, what in (("first", "not swept: every slot evicted"),
                           ("swept", "swept by the node's agent")):
            if d[kind + "_read_gbps"] is None:
                t.add_row(f"first reads by this node, {what}", "—",
                          "flush mode none evicts nothing: as above")
                continue
            t.add_row(f"first read by this node, {what}", f"{d[kind + '_read_gbps']:.1f} GB/s",
                      f"memcpy {r.read_memcpy_gbps:.1f} GB/s "
                      f"({d[kind + '_read_gbps'] / r.read_memcpy_gbps:.2f}x)")
            t.add_row(f"first copying handoff, {what}",
                      format_duration(d[kind + '_copy_handoff_ms'] / 1e3), "")
            t.add_row(f"first zero-copy handoff, {what}",
                      format_duration(d[kind + '_zero_copy_handoff_ms'] / 1e3), "")
        render.stdout.print(t)
        render.stdout.print("Rows above the \"first\" ones read payloads this node read "
                            "before (prefix hits, a re-read): its payload ledger spares their "
                            "eviction. \"First\" rows read payloads new to the node; \"swept\": "
                            "its agent evicted the dead payloads' slots in the background "
                            "between requests (docs/PROTOCOLS.md §1.1).")


@app.command("inspect")
def inspect_(
    seconds: float = typer.Option(3.0, "--seconds", help="Workload run length, each way."),
    interval: float = typer.Option(1.0, "--interval", help="The watcher's refresh interval."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """Snapshot time of a 1M-bucket index; workload slowdown under `inspect --watch`."""
    r = inspectbench.bench_inspect(seconds=seconds, interval=interval)
    if json_out:
        render.print_json({**r.__dict__, "slowdown": r.slowdown})
        return
    render.stdout.print(
        f"flush mode {r.flush_mode}: snapshot of every view, {r.buckets} buckets ({r.ready} "
        f"READY): {format_duration(r.snapshot_ms / 1e3)} (median of 10)\n"
        f"lookup+unpin of a 375-block chain: {r.workload_ops_s:.0f}/s alone, "
        f"{r.workload_ops_s_watched:.0f}/s while `tract inspect --watch --interval {r.interval_s:g}` runs "
        f"({100 * (r.slowdown - 1):+.1f}% time per op); emulated /dev/shm region, 2 cores")


@app.command("serve")
def serve(
    input_len: List[int] = typer.Option([1500, 3000, 6000], "--input-len", help="Prompt lengths."),
    rounds: int = typer.Option(3, "--rounds", help="Requests per length and KV mode (median)."),
    model: str = typer.Option("tiny-llama", "--model-profile", help="Random-weight model profile."),
    threads: Optional[int] = typer.Option(None, "--threads", help="torch threads per process."),
    json_out: bool = typer.Option(False, "--json"),
) -> None:
    """TTFT and handoff of serve-prefill -> pool -> serve-decode against the same engine
    in one process (real compute of the reference engine)."""
    from rich.progress import Progress

    from tract_cli.bench.micro import serve as serving
    if rounds < 1 or any(n < 1 for n in input_len):
        raise UsageError("--rounds and --input-len must be positive", "e.g. --input-len 1500")
    with Progress(console=render.stderr, transient=True) as prog:
        task = prog.add_task("serving", total=len(input_len) * rounds * 3)
        rows = serving.bench_serving(list(input_len), rounds, model, threads,
                                     progress=lambda: prog.advance(task))
    if json_out:
        render.print_json(rows)
        return
    modes = ", ".join(dict.fromkeys(r["flush_mode"] for r in rows))
    t = Table(title=f"TTFT, {model} (random weights, real CPU compute), max_tokens=1, median of "
                    f"{rounds}; flush mode {modes}; emulated /dev/shm region", title_justify="left")
    for c in ("input", "1 process", "copy TTFT", "KV moved", "share", "zero-copy TTFT",
              "KV moved", "share"):
        t.add_column(c, justify="right")
    for r in rows:
        cells = [str(r["input_len"]), format_duration(r["single_process_ttft_s"])]
        for mode in serving.MODES:
            m = r[mode]
            cells += [f"{format_duration(m['ttft_s'])} ({m['ttft_s'] / r['single_process_ttft_s']:.2f}x)",
                      format_duration(m["kv_movement_s"]), f"{100 * m['kv_share']:.1f}%"]
        t.add_row(*cells)
    render.stdout.print(t)
