"""`tract info POOL`: print a region's header, layout and slot usage."""
from __future__ import annotations

import time

import typer
from rich.table import Table

from tract_cli.cli import render
from tract_cli.core.header import RegionInfo
from tract_cli.core.pool import Pool
from tract_cli.core.units import format_size


def info(
    pool: str = typer.Argument(..., help="Region file or /dev/daxX.Y."),
    json_out: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """Show the header of a region: version, UUID, geometry, flush mode, sections, usage."""
    # read-only, no pre-fault: looking must not fault in a whole device
    with Pool.attach(pool, readonly=True, prefault=False) as p:
        usage = p.slot_usage()
        medium = p.medium
        region_info = p.info
    if json_out:
        data = region_info.to_dict()
        data["slot_usage"] = usage
        data["medium"] = medium
        render.print_json(data)
        return
    render_info(pool, region_info, usage, medium)


def render_info(path: str, info: RegionInfo, usage: dict | None, medium: str | None = None) -> None:
    """Prints a header summary and the section table."""
    g = info.geometry
    created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.created_ns / 1e9))
    summary = Table.grid(padding=(0, 2))
    summary.add_column(style="bold")
    summary.add_column()
    rows = [
        ("region", f"{path}" + (f" ({medium})" if medium else "")),
        ("format", f"TraCT v{info.format_version}, uuid {info.uuid}, created {created}"),
        ("size", f"{format_size(info.region_size)} (alignment {format_size(info.alignment)}, "
                 f"metadata {format_size(info.metadata_bytes)})"),
        ("model", f"{info.model_name} (fingerprint {info.model_fingerprint[:16]}…)"),
        ("geometry", f"{g.describe()}; {format_size(info.bytes_per_token)}/token, "
                     f"{format_size(info.block_bytes)}/block"),
        ("slots", f"{info.slot_count} x {format_size(info.slot_stride)}"),
        ("flush mode", info.flush_mode),
        ("nodes", str(info.max_nodes)),
        ("index", f"{info.section('buckets').count} buckets in {info.index_stripes} stripes, "
                  f"hash {info.hash_scheme}"),
        ("locks", str(info.lock_count)),
        ("freed slots", "zeroed before reuse" if info.zero_on_free else "reused as they are "
                        "(tract init --zero-on-free clears them)"),
    ]
    if usage is not None:
        claimed = ", ".join(f"node {n}: {c}" for n, c in usage["claimed_by_node"].items()) or "none"
        rows.append(("usage", f"{usage['used']} used, {usage['free']} free; claimed {claimed}"))
    for k, v in rows:
        summary.add_row(k, v)
    render.stdout.print(summary)
    table = Table(title="sections", title_justify="left")
    for col in ("section", "offset", "length", "count", "entry"):
        table.add_column(col, justify="right" if col != "section" else "left")
    for s in info.sections:
        table.add_row(s.name, f"{s.offset:#x}", format_size(s.length), str(s.count),
                      str(s.entry_size) if s.entry_size else "1 bit")
    render.stdout.print(table)
