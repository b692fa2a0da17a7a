"""`tract init PATH`: create and format a region on a file or a device-DAX device."""
from __future__ import annotations

from typing import Optional

import typer

from tract_cli.cli import render
from tract_cli.cli.info_cmd import render_info
from tract_cli.core.geometry import DEFAULT_BLOCK_TOKENS, load_model, with_block_tokens
from tract_cli.core.region import DEFAULT_INDEX_STRIPES, FormatOptions, format_region
from tract_cli.core.errors import UsageError
from tract_cli.core.units import format_duration, parse_size
from tract_cli.provision.provision import provision as provision_device


def init(
    path: str = typer.Argument(..., help="Region file (e.g. /dev/shm/tract.pool) or /dev/daxX.Y."),
    size: Optional[str] = typer.Option(None, "--size", "-s",
                                       help="Region size, e.g. 8G (default on a device: all of it)."),
    nodes: int = typer.Option(4, "--nodes", "-n", help="Maximum nodes (hosts) attaching, 1-64."),
    model: str = typer.Option("llama-3-8b", "--model", "-m",
                              help="Model profile name or .toml path: sets the KV block geometry."),
    flush_mode: Optional[str] = typer.Option(
        None, "--flush-mode", help="clflush|clflushopt|clwb|none (default: clflush on a "
                                   "device, none on a file)."),
    block_tokens: Optional[int] = typer.Option(
        None, "--block-tokens", help="Tokens per KV block (default: the profile's, "
                                     f"{DEFAULT_BLOCK_TOKENS} for a checkpoint directory; an engine's block size must be a "
                                     "multiple of it, docs/VLLM.md)."),
    hash_scheme: str = typer.Option("tract", "--hash-scheme", help="Block hash: tract|vllm."),
    stripes: int = typer.Option(DEFAULT_INDEX_STRIPES, "--stripes", help="Index stripes (a power of two; each lookup of a long prompt takes every stripe lock once)."),
    force: bool = typer.Option(False, "--force", "-f",
                               help="Overwrite an existing TraCT region or other data."),
    provision: bool = typer.Option(False, "--provision",
                                   help="Create the CXL region / namespace / devdax mode first."),
    provision_only: bool = typer.Option(
        False, "--provision-only", help="Provision and stop without formatting (a host attaching "
                                        "to a device another host already formatted)."),
    dry_run: bool = typer.Option(False, "--dry-run",
                                 help="With --provision: print the commands, change nothing."),
    zero_on_free: bool = typer.Option(
        False, "--zero-on-free", help="Clear every freed slot before it is reused, so no "
                                      "tenant ever reads another's KV (costs a write of "
                                      "each evicted block)."),
    group: Optional[str] = typer.Option(
        None, "--group", "-g", help="Share the region file with this group (mode 0660; "
                                    "default 0600, its owner only)."),
    json_out: bool = typer.Option(False, "--json", help="Print the new header as JSON."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
) -> None:
    """Create and format a TraCT region (metadata only: time does not grow with the data area)."""
    profile = load_model(model)
    if block_tokens is not None:
        profile = with_block_tokens(profile, block_tokens)
    opts = FormatOptions(model=profile, max_nodes=nodes, flush_mode=flush_mode,
                         hash_scheme=hash_scheme, index_stripes=stripes,
                         zero_on_free=zero_on_free)
    size_bytes = parse_size(size) if size is not None else None
    if dry_run and not (provision or provision_only):
        raise UsageError("--dry-run goes with --provision", "add --provision")
    if provision or provision_only:
        steps = provision_device(path, force=force, dry_run=dry_run,
                                 echo=lambda line: render.stderr.print(line, highlight=False))
        if dry_run:
            if not steps:
                render.stderr.print(f"{path} is ready: nothing to provision")
            if not provision_only:
                render.stderr.print(f"would format {path} (--dry-run: nothing changed)")
            return
        if provision_only:
            if not steps:
                render.stderr.print(f"{path} is ready: nothing to provision")
            render.stdout.print(f"{path} is provisioned (not formatted: --provision-only)")
            return
    timings: dict = {}
    with render.byte_progress(f"reserving {path}", enabled=not quiet and not json_out) as cb:
        info = format_region(path, size_bytes, opts, force=force, progress=cb, timings=timings,
                             group=group)
    if json_out:
        data = info.to_dict()
        data["timings"] = timings
        render.print_json(data)
        return
    render.stdout.print(f"[green]formatted[/] {path}: metadata written in "
                        f"{format_duration(timings['format_s'])}, pages reserved in "
                        f"{format_duration(timings['reserve_s'])}")
    render_info(path, info, usage=None)
