"""`tract inspect POOL`: who holds what, from the region itself."""
from __future__ import annotations

import signal
import sys

import typer
from rich.live import Live

from tract_cli.cli import render
from tract_cli.core.errors import UsageError
from tract_cli.core.stopflag import StopFlag
from tract_cli.core.units import format_duration
from tract_cli.inspect import snapshot
from tract_cli.inspect.render import render as render_snapshot


def inspect(
    pool: str = typer.Argument(..., help="Region file or /dev/daxX.Y."),
    locks: bool = typer.Option(False, "--locks", help="Locks: holders, waiters, grants."),
    index: bool = typer.Option(False, "--index", help="Index: states, probes, pins, LRU."),
    alloc: bool = typer.Option(False, "--alloc", help="Allocator: slots by node."),
    nodes: bool = typer.Option(False, "--nodes", help="Nodes: agents and heartbeats."),
    handoffs: bool = typer.Option(False, "--handoffs", help="In-flight handoffs."),
    watch: bool = typer.Option(False, "--watch", "-w", help="Refresh live until Ctrl-C."),
    interval: float = typer.Option(1.0, "--interval", help="Seconds between refreshes."),
    count: int = typer.Option(0, "--count", help="With --watch: stop after N refreshes."),
    hold_warn: float = typer.Option(1.0, "--hold-warn", help="Flag locks held longer (s)."),
    json_out: bool = typer.Option(False, "--json", help="Print the snapshot as JSON."),
) -> None:
    """A read-only view of locks, index, allocator, nodes and handoffs (no locks taken)."""
    if interval <= 0:
        raise UsageError("--interval must be positive", "e.g. --interval 0.5")
    if count < 0:
        raise UsageError("--count must be 0 (no limit) or more", "e.g. --count 10")
    if count and not watch:
        raise UsageError("--count goes with --watch", "add --watch, or drop --count")
    views = [v for v, on in zip(snapshot.VIEWS, (nodes, locks, index, alloc, handoffs)) if on]
    views = views or list(snapshot.VIEWS)
    with snapshot.open_pool(pool) as p:
        if not watch:
            snap = snapshot.take(p, views, hold_warn)
            if json_out:
                render.print_json(snap)
            else:
                render.stdout.print(render_snapshot(snap))
            return
        # Ctrl-C (and SIGTERM) set a flag the loop waits on, instead of raising
        # KeyboardInterrupt wherever the main thread happens to be: raised
        # inside Rich's locking, it left the refresh thread blocked on a lock
        # never released, and the view hung instead of exiting
        stop = StopFlag()           # (an Event set in the handler could deadlock)
        old = {s: signal.signal(s, stop.request) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            print(f"tract inspect: watching {pool} every {format_duration(interval)}; "
                  "Ctrl-C to stop", file=sys.stderr, flush=True)
            with Live(render_snapshot(snapshot.take(p, views, hold_warn)),
                      console=render.stdout, refresh_per_second=4, transient=False) as live:
                shown = 1
                # the refresh period of a live view, cut short by Ctrl-C
                while (not count or shown < count) and not stop.wait(interval):
                    live.update(render_snapshot(snapshot.take(p, views, hold_warn)))
                    shown += 1
        finally:
            for s, h in old.items():
                signal.signal(s, h)
