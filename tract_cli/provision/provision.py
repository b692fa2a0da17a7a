"""`tract init /dev/daxX.Y --provision`: walk the steps from a bare CXL memdev
to a device-DAX device, each printed before it runs (`--dry-run` prints the
exact commands and changes nothing).

Steps, as needed: `cxl create-region` on a memdev with no region;
`ndctl create-namespace -m devdax -a 2M --map=mem` on a region with no
namespace (`--map=mem`: the default `--map=dev` makes every kernel write its
page metadata into the shared device); `daxctl reconfigure-device
--mode=devdax --force` for a device the kernel onlined as system RAM (only
with --force: the kernel may hold data there).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

from tract_cli.core.errors import AlreadyFormattedError, TractError
from tract_cli.core.units import format_size
from tract_cli.provision import tools
from tract_cli.provision.discovery import Inventory, discover


@dataclass(frozen=True)
class Step:
    argv: tuple[str, ...]
    why: str

    @property
    def command(self) -> str:
        return " ".join(self.argv)


def plan(dax_name: str, inv: Inventory, force: bool = False) -> list[Step]:
    """The steps that turn what INV shows into a devdax DAX_NAME (empty: ready)."""
    if inv.missing_tools:
        pkgs = sorted({tools.PACKAGES[t] for t in inv.missing_tools})
        raise tools.ToolError(f"provisioning needs {', '.join(inv.missing_tools)}, not installed",
                              f"install the package(s) {' '.join(pkgs)}")
    dax = inv.dax_named(dax_name)
    if dax is not None:
        if dax.mode == "devdax":
            return []
        if not force:
            raise AlreadyFormattedError(
                f"{dax_name} is onlined as system RAM ({format_size(dax.size)}): the kernel may "
                f"hold data in it",
                f"pass --force to take it back (daxctl reconfigure-device --mode=devdax --force "
                f"{dax_name})")
        return [Step(("daxctl", "reconfigure-device", "--mode=devdax", "--force", dax_name),
                     f"{dax_name} is onlined as system RAM")]
    with_ns = {ns["region"] for ns in inv.namespaces}
    free_regions = [r for r in inv.regions if r.name not in with_ns]
    if free_regions:
        r = free_regions[0]
        return [Step(("ndctl", "create-namespace", "-m", "devdax", "-a", "2M", "--map=mem",
                      "-r", r.name),
                     f"{r.name} ({format_size(r.size)}) has no namespace")]
    if inv.regions:
        raise TractError(f"{dax_name} does not exist, and every CXL region already has a "
                         "namespace", "see `tract devices` for the DAX devices there are")
    if not inv.memdevs:
        raise TractError(f"no CXL memdev found to provision {dax_name} from",
                         "check `cxl list -M`; load cxl_acpi, cxl_pci and cxl_mem")
    m = inv.memdevs[0]
    kind = "pmem" if m.pmem_size else "ram"
    cap = "pmem_capable" if kind == "pmem" else "volatile_capable"
    decoders = [d for d in inv.root_decoders if d.get(cap, True)]
    if not decoders:
        raise TractError(f"no root decoder can map {kind} memory for {m.name}",
                         "check `cxl list -D -d root` and the platform's CFMWS")
    steps = [Step(("cxl", "create-region", "-m", "-d", decoders[0]["decoder"], "-w", "1", "-t", kind,
                   m.name), f"{m.name} ({format_size(m.pmem_size or m.ram_size)} {kind}) has no region")]
    if kind == "pmem":
        # the kernel names the new region; region0 on a machine without one
        steps.append(Step(("ndctl", "create-namespace", "-m", "devdax", "-a", "2M", "--map=mem",
                           "-r", f"region{len(inv.regions)}"), "the new region needs a namespace"))
    return steps


def provision(path: str, force: bool = False, dry_run: bool = False,
              echo: Callable[[str], None] = print,
              inventory: Callable[[], Inventory] = lambda: discover(probe_headers=False)) -> list[Step]:
    """Runs (or, with dry_run, prints) the steps until PATH is a devdax device."""
    name = os.path.basename(path)
    if not name.startswith("dax"):
        raise TractError(f"--provision needs a device-DAX path like /dev/dax0.0, not {path}",
                         "give /dev/daxX.Y")
    done: list[Step] = []
    for _ in range(4):                      # at most: region, namespace, reconfigure, check
        steps = plan(name, inventory(), force)
        if not steps:
            return done
        if dry_run:
            for s in steps:
                echo(f"would run: {s.command}    # {s.why}")
            return steps
        step = steps[0]
        echo(f"running: {step.command}    # {step.why}")
        tools.run(list(step.argv), device=name)
        done.append(step)
    raise TractError(f"{name} did not appear after {len(done)} provisioning steps",
                     "check `tract devices` and `dmesg`")
