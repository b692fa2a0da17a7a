"""What the machine has: CXL memdevs, regions, root decoders, namespaces and
DAX devices, from the tools' JSON and from sysfs (`tract devices`)."""
from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field

from tract_cli.core import medium
from tract_cli.provision import tools


@dataclass(frozen=True)
class Memdev:
    name: str
    pmem_size: int
    ram_size: int
    serial: int | None
    host: str | None


@dataclass(frozen=True)
class Region:
    name: str
    size: int
    resource: int | None
    type: str | None
    decode_state: str | None


@dataclass(frozen=True)
class DaxDevice:
    name: str
    size: int
    align: int
    mode: str               # devdax | system-ram
    target_node: int | None
    numa_node: int | None
    path: str
    holds_tract: bool | None = None


@dataclass
class Inventory:
    memdevs: list[Memdev] = field(default_factory=list)
    regions: list[Region] = field(default_factory=list)
    root_decoders: list[dict] = field(default_factory=list)
    namespaces: list[dict] = field(default_factory=list)
    dax: list[DaxDevice] = field(default_factory=list)
    missing_tools: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"memdevs": [asdict(m) for m in self.memdevs],
                "regions": [asdict(r) for r in self.regions],
                "root_decoders": self.root_decoders, "namespaces": self.namespaces,
                "dax": [asdict(d) for d in self.dax], "missing_tools": self.missing_tools}

    def dax_named(self, name: str) -> DaxDevice | None:
        return next((d for d in self.dax if d.name == name), None)


def parse_memdevs(items: list) -> list[Memdev]:
    return [Memdev(m["memdev"], int(m.get("pmem_size", 0)), int(m.get("ram_size", 0)),
                   m.get("serial"), m.get("host")) for m in items if "memdev" in m]


def parse_regions(items: list) -> list[Region]:
    return [Region(r["region"], int(r.get("size", 0)), r.get("resource"), r.get("type"),
                   r.get("decode_state")) for r in items if "region" in r]


def parse_dax(items: list) -> list[DaxDevice]:
    """DAX devices from `daxctl list -D` (or the devices inside `ndctl list -N -X`)."""
    out = []
    for d in items:
        if "chardev" not in d:
            continue
        name = d["chardev"]
        numa = medium.read_int(os.path.join(medium.sysfs_root(), "bus", "dax", "devices", name, "numa_node"))
        out.append(DaxDevice(name, int(d.get("size", 0)), int(d.get("align", 0) or 0),
                             d.get("mode", "devdax"), d.get("target_node"), numa,
                             f"/dev/{name}"))
    return out


def parse_namespaces(items: list) -> list[dict]:
    return [{"dev": n["dev"], "mode": n.get("mode"), "map": n.get("map"),
             "size": n.get("size"), "region": _region_of(n),
             "chardevs": [d["chardev"] for d in n.get("daxregion", {}).get("devices", [])]}
            for n in items if "dev" in n]


def _region_of(ns: dict) -> str | None:
    dev = ns.get("dev", "")
    # namespaceX.Y lives in regionX
    if dev.startswith("namespace") and "." in dev:
        return "region" + dev[len("namespace"):].split(".")[0]
    return None


def _dax_from_sysfs() -> list[DaxDevice]:
    """DAX devices from /sys/bus/dax/devices, for machines without daxctl."""
    base = os.path.join(medium.sysfs_root(), "bus", "dax", "devices")
    out = []
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        d = os.path.join(base, name)
        driver = os.path.basename(os.path.realpath(os.path.join(d, "driver")))
        out.append(DaxDevice(name, medium.read_int(os.path.join(d, "size")) or 0,
                             medium.read_int(os.path.join(d, "align")) or 0,
                             "system-ram" if driver == "kmem" else "devdax",
                             medium.read_int(os.path.join(d, "target_node")),
                             medium.read_int(os.path.join(d, "numa_node")), f"/dev/{name}"))
    return out


def holds_tract(path: str, align: int) -> bool | None:
    """True if the device-DAX at PATH starts with a TraCT header (None: cannot tell)."""
    try:
        return medium.read_head(path, 8, align, devdax=True) == b"TRACTPOL"
    except (OSError, ValueError):
        return None


def discover(probe_headers: bool = True) -> Inventory:
    """Everything the tools and sysfs report; missing tools are listed, not fatal."""
    inv = Inventory()
    if tools.which("cxl"):
        inv.memdevs = parse_memdevs(tools.list_json(["cxl", "list", "-M"]))
        inv.regions = parse_regions(tools.list_json(["cxl", "list", "-R"]))
        inv.root_decoders = tools.list_json(["cxl", "list", "-D", "-d", "root"])
    else:
        inv.missing_tools.append("cxl")
    if tools.which("ndctl"):
        inv.namespaces = parse_namespaces(tools.list_json(["ndctl", "list", "-N", "-X"]))
    else:
        inv.missing_tools.append("ndctl")
    if tools.which("daxctl"):
        inv.dax = parse_dax(tools.list_json(["daxctl", "list", "-D"]))
    else:
        inv.missing_tools.append("daxctl")
        inv.dax = _dax_from_sysfs()
    if probe_headers:
        inv.dax = [DaxDevice(**{**asdict(d), "holds_tract": holds_tract(d.path, d.align)})
                   if d.mode == "devdax" and os.path.exists(d.path) else d for d in inv.dax]
    return inv
