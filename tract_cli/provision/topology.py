"""NUMA topology from sysfs, and pinning a process to CPUs before it touches
the region (the paper pins every thread, the lock manager included, to the
CXL-attached socket)."""
from __future__ import annotations

import os

from tract_cli.core import medium
from tract_cli.core.errors import UsageError


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's cpulist format)."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        part = part.strip()
        if not part:
            continue
        try:
            if "-" in part:
                lo, hi = (int(x) for x in part.split("-", 1))
                if hi < lo:
                    raise ValueError
                cpus.extend(range(lo, hi + 1))
            else:
                cpus.append(int(part))
        except ValueError:
            raise UsageError(f"cannot read CPU list {text!r}", "write it like 0-3,8") from None
    return sorted(set(cpus))


def _node_dir(node: int) -> str:
    return os.path.join(medium.sysfs_root(), "devices", "system", "node", f"node{node}")


def online_nodes() -> list[int]:
    path = os.path.join(medium.sysfs_root(), "devices", "system", "node", "online")
    try:
        with open(path) as f:
            return parse_cpu_list(f.read())
    except OSError:
        return [0]


def node_cpus(node: int) -> list[int]:
    try:
        with open(os.path.join(_node_dir(node), "cpulist")) as f:
            return parse_cpu_list(f.read())
    except OSError:
        return []


def node_distances(node: int) -> list[int]:
    try:
        with open(os.path.join(_node_dir(node), "distance")) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def nearest_cpu_node(node: int) -> int | None:
    """The node with CPUs closest to NODE (itself if it has CPUs)."""
    nodes = online_nodes()
    if node_cpus(node):
        return node
    dist = node_distances(node)
    with_cpus = [n for n in nodes if node_cpus(n)]
    if not with_cpus:
        return None
    if len(dist) != len(nodes):
        return with_cpus[0]
    return min(with_cpus, key=lambda n: dist[nodes.index(n)])


def pin(numa_node: int | None = None, cpus: str | None = None) -> list[int] | None:
    """Restricts this process to CPUS or to the CPUs of NUMA_NODE; returns the set."""
    if numa_node is None and cpus is None:
        return None
    if numa_node is not None and cpus is not None:
        raise UsageError("give --numa-node or --cpus, not both", "pick one")
    if numa_node is not None:
        if numa_node not in online_nodes():
            raise UsageError(f"NUMA node {numa_node} is not online (online: {online_nodes()})",
                             "pick an online node (see `tract doctor`)")
        chosen = node_cpus(numa_node)
        if not chosen:
            near = nearest_cpu_node(numa_node)
            raise UsageError(f"NUMA node {numa_node} has no CPUs (a CXL memory node?)",
                             f"pin to its nearest CPU node: --numa-node {near}")
    else:
        chosen = parse_cpu_list(cpus)
    available = os.sched_getaffinity(0) | set(range(os.cpu_count() or 1))
    bad = [c for c in chosen if c not in available]
    if bad:
        raise UsageError(f"CPUs {bad} do not exist here", f"use CPUs among 0-{(os.cpu_count() or 1) - 1}")
    os.sched_setaffinity(0, chosen)
    return chosen
