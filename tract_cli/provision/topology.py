"""NUMA topology from sysfs, and pinning a process to CPUs before it touches
the region (the paper pins every thread, the lock manager included, to the
CXL-attached socket)."""
from __future__ import annotations

import os

import psutil

from tract_cli.core import medium
from tract_cli.core.cpu import format_cpu_list, online_cpus, parse_cpu_list
from tract_cli.core.errors import UsageError


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
        if not chosen:             # psutil reads an empty list as "every CPU": refuse it
            raise UsageError(f"--cpus {cpus!r} names no CPU", "give a list such as 0-3,8")
    online = online_cpus()
    bad = [c for c in chosen if c not in online]
    if bad:
        raise UsageError(f"CPUs {bad} are not online here",
                         f"use CPUs among {format_cpu_list(online)}")
    psutil.Process().cpu_affinity(chosen)
    return chosen
