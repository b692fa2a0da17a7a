"""`tract doctor`: platform checks with a remediation each."""
from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from tract_cli.cli import render
from tract_cli.provision.doctor import FAIL, run_doctor, to_json

STYLE = {"PASS": "green", "WARN": "yellow", "FAIL": "red", "INFO": "cyan"}


def doctor(
    target: Optional[str] = typer.Argument(None, help="A region file or /dev/daxX.Y (optional)."),
    json_out: bool = typer.Option(False, "--json", help="Print as JSON."),
) -> None:
    """Check CPU flush support, the checksum path, NUMA placement, huge pages, memlock, kernel,
    tools, space."""
    rows = run_doctor(target)
    if json_out:
        render.print_json(to_json(target, rows))
    else:
        t = Table(title=f"tract doctor{' ' + target if target else ''}", title_justify="left")
        for c in ("check", "status", "detail", "fix"):
            t.add_column(c)
        for r in rows:
            t.add_row(r.name, f"[{STYLE[r.status]}]{r.status}[/]", r.detail, r.fix or "")
        render.stdout.print(t)
    if any(r.status == FAIL for r in rows):
        raise typer.Exit(1)
