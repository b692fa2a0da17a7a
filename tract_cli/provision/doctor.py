"""`tract doctor`: what on this platform will hurt, each with a remediation.

Checks: CPU flush instructions against the region's flush mode, the block
checksum's CPU path, NUMA
placement of the device and of this process, transparent huge pages for
shared memory, RLIMIT_MEMLOCK for the GPU registration, kernel and CXL/DAX
modules, tool versions, free space behind an emulated region, permissions.
"""
from __future__ import annotations

import os
import platform
import resource
from dataclasses import asdict, dataclass

import psutil

from tract_cli.core import medium
from tract_cli.core.errors import TractError
from tract_cli.core.cpu import checksum_path, cpu_features, flush_mode_supported
from tract_cli.core.units import format_size
from tract_cli.provision import cpu, tools, topology

PASS, WARN, FAIL, INFO = "PASS", "WARN", "FAIL", "INFO"
FLUSH_INSTRUCTIONS = ("clflush", "clflushopt", "clwb")
MODULES = ("cxl_acpi", "cxl_pci", "cxl_mem", "cxl_pmem", "device_dax", "dax_pmem", "kmem")


@dataclass(frozen=True)
class Check:
    name: str
    status: str
    detail: str
    fix: str | None = None


def _target_info(target: str | None):
    """(medium.Target, header RegionInfo or None) for a target, tolerating errors."""
    if not target:
        return None, None
    t = medium.inspect_target(target, for_write=False)
    info = None
    if t.kind != "missing":
        from tract_cli.core.region import probe
        info = probe(target, t)[1] if t.kind == "file" else None
        if t.kind == "devdax":
            from tract_cli.core.pool import Pool
            try:
                with Pool.attach(target, readonly=True, prefault=False, local=False) as p:
                    info = p.info
            except TractError:
                info = None
    return t, info


def check_flush(info) -> Check:
    # the verdict is the C core's (what its accessors will use); the CPU's
    # name and flags shown are py-cpuinfo's, and a disagreement is shown
    native = cpu_features()
    usable = [f for f in FLUSH_INSTRUCTIONS if f in native]
    described = cpu.flags()
    shown = [f for f in FLUSH_INSTRUCTIONS if f in described] if described else usable
    has = f"{cpu.model_name()} has {', '.join(shown) or 'no flush instruction'}"
    if shown != usable:
        has += f" (TraCT's own CPUID check finds {', '.join(usable) or 'none'}: that is what it uses)"
    if "x86_64" not in native:
        return Check("cpu flush", WARN, f"{cpu.model_name()} ({platform.machine()}): no x86 "
                     "flush instructions; only flush mode none works",
                     "use a coherent single-host region")
    if info is not None:
        ok = flush_mode_supported(info.flush_mode)
        return Check("cpu flush", PASS if ok else FAIL,
                     f"region flush mode {info.flush_mode}; {has}",
                     None if ok else "reformat with a supported --flush-mode or override "
                     "TRACT_FLUSH_MODE per process")
    return Check("cpu flush", PASS if "clflush" in usable else FAIL, has,
                 None if "clflush" in usable else "this CPU cannot publish to a shared device")


def check_checksum() -> Check:
    """The block checksum's path (CRC-32C, folded with the widest carry-less
    multiply the CPU has): it bounds an engine connector's checksummed copy
    where the memory reads faster than the fold."""
    path = checksum_path()
    detail = f"block checksums (CRC-32C) on {path}"
    if "VPCLMULQDQ" in path:
        return Check("checksum", PASS, detail)
    measure = "measure a checksummed KV copy against memcpy with `tract microbench kvpages`"
    if "PCLMULQDQ" in path:
        return Check("checksum", INFO, detail + " (a few GB/s a core slower than the "
                     "256-bit fold where the memory outruns it)", measure)
    return Check("checksum", WARN, detail + ": a checksummed KV copy runs well below memory "
                 "speed", measure)


def check_hypervisor() -> Check:
    if "hypervisor" in (cpu.flags() or cpu_features()):
        return Check("virtualization", INFO, "running under a hypervisor",
                     "volatile (ram) CXL regions need the guest started with -cpu max,-hypervisor")
    return Check("virtualization", PASS, "bare metal")


def check_numa(target) -> list[Check]:
    nodes = topology.online_nodes()
    cpu_nodes = [n for n in nodes if topology.node_cpus(n)]
    memory_only = [n for n in nodes if n not in cpu_nodes]
    rows = [Check("numa topology", PASS if nodes else WARN,
                  f"{len(nodes)} node(s): CPUs on {cpu_nodes or 'none'}"
                  + (f", memory-only (CXL?) {memory_only}" if memory_only else ""))]
    affinity = sorted(psutil.Process().cpu_affinity())
    if target is not None and target.kind == "devdax":
        node = medium.read_int(os.path.join(medium.sysfs_root(), "bus", "dax", "devices",
                                             target.dax_name, "target_node"))
        near = topology.nearest_cpu_node(node) if node is not None else None
        near_cpus = set(topology.node_cpus(near)) if near is not None else set()
        ok = near_cpus and set(affinity) <= near_cpus
        rows.append(Check(
            "placement", PASS if ok else WARN,
            f"{target.dax_name} is on node {node}; nearest CPU node {near}; this process may "
            f"run on CPUs {affinity}",
            None if ok else f"pin workers near the device: numactl --cpunodebind={near} "
                            f"--membind={near} tract ..., or --numa-node {near}"))
    else:
        rows.append(Check("placement", PASS if len(cpu_nodes) <= 1 else INFO,
                          f"emulated region in local DRAM; process CPUs {affinity}",
                          None if len(cpu_nodes) <= 1 else
                          "on multi-socket hosts pin workers with --numa-node"))
    return rows


def check_thp(target) -> Check:
    path = os.path.join(medium.sysfs_root(), "kernel", "mm", "transparent_hugepage", "shmem_enabled")
    try:
        with open(path) as f:
            text = f.read()
        current = text[text.index("[") + 1:text.index("]")]
    except (OSError, ValueError):
        return Check("huge pages", INFO, "cannot read shmem THP setting")
    if target is not None and target.kind == "devdax":
        return Check("huge pages", PASS, f"device-DAX maps at its {format_size(target.alignment)} "
                     "alignment (shmem THP does not apply)")
    if current in ("never", "deny"):
        return Check("huge pages", WARN, f"shmem transparent huge pages: {current}; an emulated "
                     "region is mapped with 4 KiB pages (slower pre-fault, more TLB misses)",
                     "echo within_size > /sys/kernel/mm/transparent_hugepage/shmem_enabled, "
                     "or put the region on hugetlbfs")
    return Check("huge pages", PASS, f"shmem transparent huge pages: {current}")


def check_memlock(size: int | None) -> Check:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unlimited = soft == resource.RLIM_INFINITY
    shown = "unlimited" if unlimited else format_size(soft)
    if os.geteuid() == 0 or unlimited or (size is not None and soft >= size):
        return Check("memlock", PASS, f"RLIMIT_MEMLOCK {shown}"
                     + (" (root)" if os.geteuid() == 0 else ""))
    need = format_size(size) if size else "the region size"
    return Check("memlock", WARN, f"RLIMIT_MEMLOCK {shown} < {need}: registering the whole "
                 "mapping with CUDA (cudaHostRegister) may fail",
                 "raise it: `ulimit -l unlimited` or memlock in /etc/security/limits.conf")


def check_kernel(target) -> Check:
    # read by hand: psutil has nothing for kernel modules (nor does the
    # standard library); one name per line, the first field
    try:
        with open("/proc/modules") as f:
            loaded = {line.split()[0] for line in f}
    except OSError:
        loaded = set()
    builtin_dir = "/sys/bus/cxl"
    present = [m for m in MODULES if m in loaded]
    detail = f"kernel {platform.release()}; CXL/DAX modules loaded: {', '.join(present) or 'none'}"
    if target is not None and target.kind == "devdax":
        return Check("kernel", PASS, detail)
    if not present and not os.path.isdir(builtin_dir):
        return Check("kernel", INFO, detail + " (no CXL device here: an emulated region is used)")
    return Check("kernel", PASS, detail)


def check_tools() -> Check:
    found, missing = [], []
    for tool in ("cxl", "ndctl", "daxctl"):
        if tools.which(tool):
            res = tools.run([tool, "--version"], check=False)
            found.append(f"{tool} {res.stdout.strip() or '?'}")
        else:
            missing.append(tool)
    if missing:
        pkgs = sorted({tools.PACKAGES[t] for t in missing})
        return Check("tools", WARN, f"missing {', '.join(missing)}"
                     + (f"; found {', '.join(found)}" if found else ""),
                     f"install {' '.join(pkgs)} to provision devices (not needed for emulated regions)")
    return Check("tools", PASS, ", ".join(found))


def check_space(target, info) -> Check | None:
    if target is None or target.kind != "file":
        return None
    st = os.stat(target.path)
    reserved = st.st_blocks * 512 >= st.st_size
    free = medium.free_bytes(target.path)
    fs = medium.filesystem_type(target.path)
    if not reserved:
        return Check("space", WARN, f"{target.path} on {fs} is not fully reserved "
                     f"({format_size(st.st_blocks * 512)} of {format_size(st.st_size)}); "
                     f"{format_size(free)} free", "reformat with `tract init --force` (it reserves)")
    return Check("space", PASS, f"{target.path} on {fs}: fully reserved; {format_size(free)} free")


def check_permissions(target) -> Check | None:
    if target is None:
        return None
    ok = os.access(target.path, os.R_OK | os.W_OK)
    return Check("permissions", PASS if ok else FAIL,
                 f"{target.path}: {'read/write' if ok else 'not read/write'} for uid {os.geteuid()}",
                 None if ok else "add this user to the device's group or chmod the file")


def run_doctor(target_path: str | None = None) -> list[Check]:
    """All checks, in a stable order."""
    target, info = _target_info(target_path)
    rows = [check_flush(info), check_checksum(), check_hypervisor(), *check_numa(target),
            check_thp(target), check_memlock(info.region_size if info else None),
            check_kernel(target), check_tools()]
    for extra in (check_space(target, info), check_permissions(target)):
        if extra is not None:
            rows.append(extra)
    return rows


def to_json(target: str | None, rows: list[Check]) -> dict:
    counts = {s.lower(): sum(r.status == s for r in rows) for s in (PASS, WARN, FAIL, INFO)}
    return {"target": target, "checks": [asdict(r) for r in rows], "summary": counts}
