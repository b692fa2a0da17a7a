"""`tract devices`: CXL memdevs, regions and DAX devices on this machine."""
from __future__ import annotations

import typer
from rich.table import Table

from tract_cli.cli import render
from tract_cli.core.units import format_size
from tract_cli.provision import tools
from tract_cli.provision.discovery import discover


def devices(json_out: bool = typer.Option(False, "--json", help="Print as JSON.")) -> None:
    """List CXL memdevs, regions and DAX devices (size, alignment, mode, NUMA node, TraCT)."""
    inv = discover()
    if json_out:
        render.print_json(inv.to_dict())
        return
    t = Table(title="CXL memdevs", title_justify="left")
    for c in ("memdev", "pmem", "ram", "serial", "host"):
        t.add_column(c)
    for m in inv.memdevs:
        t.add_row(m.name, format_size(m.pmem_size), format_size(m.ram_size), str(m.serial), str(m.host))
    render.stdout.print(t if inv.memdevs else "no CXL memdevs")
    t = Table(title="CXL regions", title_justify="left")
    for c in ("region", "size", "type", "state"):
        t.add_column(c)
    for r in inv.regions:
        t.add_row(r.name, format_size(r.size), str(r.type or "-"), str(r.decode_state or "-"))
    render.stdout.print(t if inv.regions else "no CXL regions")
    t = Table(title="DAX devices", title_justify="left")
    for c in ("device", "size", "align", "mode", "target node", "TraCT region"):
        t.add_column(c)
    for d in inv.dax:
        holds = {True: "yes", False: "no", None: "-"}[d.holds_tract]
        t.add_row(d.path, format_size(d.size), format_size(d.align), d.mode, str(d.target_node), holds)
    render.stdout.print(t if inv.dax else "no DAX devices")
    for tool in inv.missing_tools:
        render.stderr.print(f"note: `{tool}` is not installed (package {tools.PACKAGES[tool]})")
