"""This CPU as the C core sees it: the features `native/cpu.c` detected (CPUID,
once per process, with the `TRACT_*` test overrides) and the flush modes the
region accessors can run with.

The layers above core (`tract doctor`, the vLLM connector's settings) take
these from here: `core/native.py`, where they are defined beside the error
translation, is the binding to the C library and only core imports it
(tests/test_layering.py).
"""
from __future__ import annotations

import os

import psutil

from tract_cli.core.errors import FlushModeError, UsageError
from tract_cli.core.medium import sysfs_root
from tract_cli.core.native import (CPU_FEATURES, FLUSH_MODES, cpu_features,
                                   flush_mode_supported, lib)

__all__ = ["CPU_FEATURES", "FLUSH_MODES", "allowed_cpus", "cpu_features", "checksum_path",
           "flush_mode_supported", "format_cpu_list", "online_cpus", "parse_cpu_list",
           "require_flush_mode"]


def require_flush_mode(mode: str) -> None:
    """Refuses a flush mode that is not one, or that this CPU cannot run."""
    if mode not in FLUSH_MODES:
        raise UsageError(f"unknown flush mode {mode!r}", f"use one of {', '.join(FLUSH_MODES)}")
    if not flush_mode_supported(mode):
        raise FlushModeError(f"this CPU does not support flush mode {mode}",
                             "choose another (see `tract doctor`)")


# the block checksum's paths (native/crc.c, tract_crc_path)
CHECKSUM_PATHS = {lib.TRACT_CRC_BITWISE: "bit by bit",
                  lib.TRACT_CRC_INSTRUCTION: "the crc32 instruction",
                  lib.TRACT_CRC_FOLD128: "128-bit PCLMULQDQ folding",
                  lib.TRACT_CRC_FOLD256: "256-bit VPCLMULQDQ folding",
                  lib.TRACT_CRC_FOLD512: "512-bit VPCLMULQDQ folding"}


def checksum_path() -> str:
    """What the block checksum (CRC-32C) runs on here, as native/crc.c chooses
    it (its own choice, reported): the widest carry-less multiply fold the
    CPU has (it bounds a checksummed copy), else the crc32 instruction, else
    bit by bit."""
    return CHECKSUM_PATHS[lib.tract_crc_path()]


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


def format_cpu_list(cpus) -> str:
    """[0, 1, 2, 3, 8] -> '0-3,8' (parse_cpu_list's inverse)."""
    runs: list[list[int]] = []
    for c in sorted(set(cpus)):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


def _read_cpu_list(path: str) -> set[int]:
    """The CPUs a sysfs/cgroup cpulist file names; empty if it is absent or unreadable."""
    try:
        with open(path) as f:
            return set(parse_cpu_list(f.read()))
    except (OSError, UsageError):
        return set()


def online_cpus() -> set[int]:
    """The ids of the online CPUs.  Not range(cpu_count): ids need not be
    contiguous (a CPU taken offline leaves a hole), and psutil only counts
    them, so sysfs's cpu/online; else the CPUs this process may use."""
    online = _read_cpu_list(os.path.join(sysfs_root(), "devices", "system", "cpu", "online"))
    return online or set(psutil.Process().cpu_affinity())


def allowed_cpus() -> set[int]:
    """Every CPU a process here may run on: its cgroup's cpuset, else all online.

    The cpuset is read by hand: psutil does not read cgroup cpusets (its
    cpu_affinity is the calling thread's mask, which a parent's pinning has
    narrowed -- the very thing a caller of this wants to undo).
    """
    cpuset = _read_cpu_list(os.path.join(sysfs_root(), "fs", "cgroup", "cpuset.cpus.effective"))
    return cpuset or online_cpus()
