"""`tract check POOL [--repair]`: verify every invariant; rebuild offline."""
from __future__ import annotations

import typer
from rich.table import Table

from tract_cli.cli import render
from tract_cli.inspect import check as checker
from tract_cli.inspect.snapshot import open_pool


def check(
    pool: str = typer.Argument(..., help="Region file or /dev/daxX.Y."),
    repair: bool = typer.Option(False, "--repair", help="Rebuild index, allocator and handoffs "
                                                         "from the valid READY entries (offline)."),
    force: bool = typer.Option(False, "--force", help="Repair even while processes map it."),
    data: bool = typer.Option(True, "--data/--no-data", help="Verify READY blocks' checksums."),
    json_out: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """Verify a region's invariants (exit 1 if any is violated); --repair rebuilds."""
    if repair:
        result = checker.repair(pool, force=force)
        if json_out:
            render.print_json(result)
        else:
            render.stdout.print(
                f"repaired {pool}: kept {result['kept_ready']} READY blocks, dropped "
                f"{result['dropped_entries']} entries, removed {result['local_segments_removed']} "
                f"node-local segments; {len(result['remaining_violations'])} violations remain")
        if result["remaining_violations"]:
            raise typer.Exit(1)
        return
    with open_pool(pool) as p:
        violations, stats = checker.verify(p, data=data)
    if json_out:
        render.print_json({"ok": not violations, "stats": stats,
                           "violations": [v.__dict__ for v in violations]})
    else:
        if violations:
            t = Table(title=f"{len(violations)} violations in {pool}", title_justify="left")
            t.add_column("check")
            t.add_column("detail")
            for v in violations:
                t.add_row(v.check, v.detail)
            render.stdout.print(t)
        render.stdout.print(
            f"{'[red]FAILED[/]' if violations else '[green]OK[/]'}: {stats['ready']} READY blocks "
            f"({stats['checksums_verified']} checksums verified), {stats['pending']} PENDING, "
            f"{stats['slots_taken']}/{stats['slots']} slots taken, {stats['handoffs']} handoffs")
    if violations:
        raise typer.Exit(1)
