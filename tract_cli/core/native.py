"""Access to the compiled C core and translation of its error codes.

The C core returns codes and never prints; this module turns a code into a
`TractError` whose message names the problem and the fix.
"""
from __future__ import annotations

import os

from tract_cli.core.errors import (
    CorruptRegion,
    FlushModeError,
    FormatMismatchError,
    HandoffPending,
    LockTimeout,
    NoLocalSegment,
    NodeAlive,
    NotFormattedError,
    NotFound,
    OutOfMemory,
    PoolFull,
    RequestTooLarge,
    Superseded,
    SystemCallFailed,
    TractError,
    TransferTableFull,
    UsageError,
)

try:
    from tract_cli._native import ffi, lib
except ImportError as exc:  # pragma: no cover - only on a broken install
    raise ImportError(
        "the TraCT C core (tract_cli._native) is not built; "
        "reinstall with `pip install .` (it needs a C compiler and cffi)"
    ) from exc

FLUSH_MODES = {"none": lib.TRACT_FLUSH_NONE, "clflush": lib.TRACT_FLUSH_CLFLUSH,
               "clflushopt": lib.TRACT_FLUSH_CLFLUSHOPT, "clwb": lib.TRACT_FLUSH_CLWB}
FLUSH_MODE_NAMES = {v: k for k, v in FLUSH_MODES.items()}

CPU_FEATURES = {"clflush": lib.TRACT_CPU_CLFLUSH, "clflushopt": lib.TRACT_CPU_CLFLUSHOPT,
                "clwb": lib.TRACT_CPU_CLWB, "avx2": lib.TRACT_CPU_AVX2,
                "avx512f": lib.TRACT_CPU_AVX512F, "hypervisor": lib.TRACT_CPU_HYPERVISOR,
                "x86_64": lib.TRACT_CPU_X86_64, "sse4_2": lib.TRACT_CPU_SSE42,
                "pclmulqdq": lib.TRACT_CPU_PCLMUL, "vpclmulqdq_512": lib.TRACT_CPU_VPCLMUL512,
                "vpclmulqdq_256": lib.TRACT_CPU_VPCLMUL256}


def cpu_features() -> set[str]:
    """Names of the CPU features the C core detected (clflush, clwb, avx2, ...)."""
    bits = lib.tract_cpu_features()
    return {name for name, bit in CPU_FEATURES.items() if bits & bit}


def flush_mode_supported(mode: str) -> bool:
    """True if this CPU can run the region accessors in `mode` (the C core's rule)."""
    return bool(lib.tract_flush_mode_supported(FLUSH_MODES[mode]))


# error code -> (error class, problem, fix); "{what}" names the target
_MESSAGES = {
    lib.TRACT_E_NOT_FORMATTED: (NotFormattedError, "{what} holds no TraCT region (no magic at offset 0)",
                                "format it with `tract init {what}`"),
    lib.TRACT_E_VERSION: (FormatMismatchError, "{what} holds a TraCT region of an unknown format version",
                          "use the tract release that wrote it, or reformat with `tract init {what} --force`"),
    lib.TRACT_E_CHECKSUM: (FormatMismatchError,
                           "{what}: the region header checksum does not match (corrupt header)",
                           "run `tract info {what}` on the writer's host, or reformat with `tract init --force`"),
    lib.TRACT_E_SIZE: (FormatMismatchError,
                       "{what} is smaller than the region size recorded in its header (truncated?)",
                       "restore the file or device to its formatted size, or reformat it"),
    lib.TRACT_E_LAYOUT: (FormatMismatchError,
                         "{what}: the region's layout table disagrees with its own parameters (corrupt header)",
                         "reformat with `tract init {what} --force`"),
    lib.TRACT_E_TOO_SMALL: (UsageError, "{what} is too small for the metadata and one KV block slot",
                            "give a larger --size or a model with smaller blocks"),
    lib.TRACT_E_ALIGN: (UsageError, "{what}: size or offset is not a multiple of the alignment",
                        "round --size to the alignment (2 MiB by default)"),
    lib.TRACT_E_RANGE: (CorruptRegion, "{what}: offset or length outside the region",
                        "this is a bug or a corrupt region; run `tract info` on it"),
    lib.TRACT_E_NOMEM: (OutOfMemory, "{what}: out of process memory", "free memory and retry"),
    lib.TRACT_E_TIMEOUT: (LockTimeout, "{what}: timed out waiting for a lock",
                          "check that `tract agent --manager` runs and no process hangs holding it "
                          "(`tract inspect --locks`)"),
    lib.TRACT_E_FULL: (PoolFull, "{what}: no room left",
                       "free or evict entries, or use a larger region"),
    lib.TRACT_E_NOT_FOUND: (NotFound, "{what}: not found", "check the name or key"),
    lib.TRACT_E_TABLE_FULL: (TransferTableFull, "{what}: the transfer table is full",
                             "acknowledge handoffs, or let expired ones be reclaimed"),
    lib.TRACT_E_CORRUPT: (CorruptRegion, "{what}: region metadata is inconsistent",
                          "run `tract inspect` on it; reformat if it persists"),
    lib.TRACT_E_NO_LOCAL: (NoLocalSegment, "{what}: this handle has no node-local segment",
                           "attach without readonly= to take locks"),
    lib.TRACT_E_SUPERSEDED: (Superseded, "{what}: another node holds a later lock-manager claim",
                             "let that node manage; this agent stands by"),
    lib.TRACT_E_ALIVE: (NodeAlive, "{what}: the node heartbeat or restarted since, so it is not dead",
                        "nothing to do: its own agent recovers it"),
    lib.TRACT_E_PENDING: (HandoffPending, "{what}: the handoff is reserved, not yet published",
                          "ask again shortly: its prefill side is committing its blocks"),
    lib.TRACT_E_TOO_LARGE: (RequestTooLarge, "{what}: more slots asked for than the whole pool has",
                            "use a larger region, or shorter requests"),
    lib.TRACT_E_NOT_HELD: (UsageError, "{what}: the lock is not held by this process",
                           "release only what you acquired"),
    lib.TRACT_E_INVAL: (UsageError, "{what}: invalid argument", "check the parameters"),
}


def id_array(values, dtype, problem: str, fix: str):
    """VALUES as a contiguous array of DTYPE ids for a C call: 1-D, integers,
    each in DTYPE's range; anything else is a UsageError (PROBLEM; FIX)."""
    import numpy as np
    arr = np.asarray(values)
    if arr.ndim != 1 or (arr.size and (arr.dtype.kind not in "iu" or arr.min() < 0
                                       or arr.max() > np.iinfo(dtype).max)):
        raise UsageError(problem, fix)
    return np.ascontiguousarray(arr, dtype=dtype)


def raise_for(rc: int, what: str) -> None:
    """Raises the TractError for a non-zero C return code; `what` names the target."""
    if rc == lib.TRACT_OK:
        return
    if rc == lib.TRACT_E_FLUSH_UNSUPPORTED:
        raise FlushModeError(f"{what}: this CPU lacks the requested flush instruction",
                             f"choose one of: {', '.join(m for m in FLUSH_MODES if flush_mode_supported(m))}")
    if rc == lib.TRACT_E_SYS:
        raise SystemCallFailed(f"{what}: {os.strerror(ffi.errno)}",
                               "check the device or file and retry")
    cls, problem, fix = _MESSAGES.get(rc, (TractError, "{what}: C core error " + str(rc),
                                           "this is a bug; please report it"))
    raise cls(problem.format(what=what), fix.format(what=what))
