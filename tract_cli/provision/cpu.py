"""What `tract doctor` and benchmark reports say about the CPU, from py-cpuinfo.

Only what is shown comes from here (model name, flags).  Whether a flush
mode may be used is decided by the C core (`native/cpu.c`, through
`core.cpu.cpu_features`/`flush_mode_supported`): the same CPUID bits its
accessors are built on, checked where they are used.
"""
from __future__ import annotations

import functools
import platform


@functools.lru_cache(maxsize=1)
def cpu_info() -> dict:
    """py-cpuinfo's description of this CPU ({} where it cannot tell).

    It runs a helper process (about a second), once per process."""
    try:
        import cpuinfo
        return cpuinfo.get_cpu_info() or {}
    except Exception:               # a description only: never fail a report for it
        return {}


def model_name() -> str:
    """E.g. "Intel(R) Xeon(R) Platinum 8480+"; the architecture where unknown."""
    return cpu_info().get("brand_raw") or platform.machine() or "unknown CPU"


def flags() -> set[str]:
    """The CPU's feature flags as py-cpuinfo names them (clflush, clwb, hypervisor, ...)."""
    return set(cpu_info().get("flags") or ())
