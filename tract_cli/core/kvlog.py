"""The vLLM connector's timing lines (TRACT_CONNECTOR_TIMINGS=1): one per KV
load, per save and per handoff publish, written by the connector
(`connectors/vllm_*.py`) with these formats and read back by
`bench/engine/vllm_runs.py` with `parse`, so the two cannot drift apart.
(Here because both may import core, and bench never imports connectors:
docs/ARCHITECTURE.md §2.)
"""
from __future__ import annotations

import re

# logging's %-formats: (blocks, bytes, request id, ms, copy ms, metadata ms) and
# (blocks, bytes, ms, copy ms, metadata ms, claim wait ms, commit ms, where); the
# copy checksums as it copies, the metadata is the pool's calls around it (lock
# round trips, handoff records); a save's is the part of its claim (reserved
# during the forward) the step waited for, and its commit, IN_STEP (a step that
# publishes a handoff waits for it) or OFF_STEP (on the worker's save thread)
LOADED = ("TraCT: loaded %d blocks (%d bytes) of request %s in %.3f ms (copy %.3f ms, "
          "checksummed as it copied; pool metadata %.3f ms)")
SAVED = ("TraCT: saved %d blocks (%d bytes) in %.3f ms (copy %.3f ms, checksummed as it "
         "copied; pool metadata %.3f ms: claim wait %.3f ms, commit %.3f ms %s)")
IN_STEP, OFF_STEP = "in-step", "off-step"

# (request id, blocks, ms): a prefill instance's publish of a handoff, in its
# step (the key list's slot, the record: lock round trips), or in its scheduler
# loop where two handoffs of a step share a block (with a pin walk)
PUBLISHED = "TraCT: published the handoff of request %s (%d blocks) in %.3f ms"

# (load|save, blocks, ms x 5): with TRACT_CONNECTOR_REFERENCE=1, the connector
# also times a plain memcpy of the same bytes between the same buffers: once
# in the step, right before its own copy, where it meets what the copy meets
# (a forward's leftovers in the TLB and the caches); then, right after its
# copy, from cold caches (every line of the slots and pages evicted first)
# and warm (right after the same kind of copy), and its own copy once more
# both ways, the medians of a few rounds: for a request whose
# kv_transfer_params carry REFERENCE_PARAM true (the bench's warm-up
# requests), so no measured request pays the extra copies in its step
# (a time 0.0000: not timed; a cold one: this CPU cannot evict lines)
REFERENCE = ("TraCT: memcpy of the same bytes as the %s of %d blocks in %.4f ms in the step, "
             "%.4f ms from cold caches, %.4f ms warm (the checksummed copy again: %.4f ms "
             "cold, %.4f ms warm)")

# (the key both the connector and the bench know: here, since bench never
# imports connectors)
REFERENCE_PARAM = "tract_reference"

_FIELDS = {"%d": r"(\d+)", "%s": r"(\S+)", "%.3f": r"([\d.]+)", "%.4f": r"([\d.]+)"}


def _pattern(fmt: str) -> re.Pattern:
    parts = re.split(r"(%d|%s|%\.3f|%\.4f)", fmt)
    return re.compile("".join(_FIELDS.get(p) or re.escape(p) for p in parts))


_LINES = {"load": _pattern(LOADED), "save": _pattern(SAVED)}
_PUBLISHED = _pattern(PUBLISHED)
_REFERENCE = _pattern(REFERENCE)


def parse(line: str) -> tuple[str, dict] | None:
    """("load" or "save", {"blocks", "bytes", "ms", "copy_ms", "meta_ms"}, a save's
    also "claim_wait_ms", "commit_ms" and "commit_in_step"), ("publish", {"blocks", "ms"}), or
    ("load_memcpy" or "save_memcpy", {"blocks", "step_ms" (the memcpy in the step),
    "ms" (the cold memcpy), "warm_ms", "copy_cold_ms", "copy_warm_ms"}), of a timing
    line found in LINE (a log line, whatever its prefix), else None."""
    m = _PUBLISHED.search(line)
    if m:
        return "publish", {"blocks": int(m[2]), "ms": float(m[3])}
    m = _REFERENCE.search(line)
    if m:
        return m[1] + "_memcpy", {"blocks": int(m[2]), "step_ms": float(m[3]),
                                  "ms": float(m[4]), "warm_ms": float(m[5]),
                                  "copy_cold_ms": float(m[6]), "copy_warm_ms": float(m[7])}
    for kind, pattern in _LINES.items():
        m = pattern.search(line)
        if m:
            n = 6 if kind == "load" else 5        # the group of the metadata ms
            row = {"blocks": int(m[1]), "bytes": int(m[2]), "ms": float(m[n - 2]),
                   "copy_ms": float(m[n - 1]), "meta_ms": float(m[n])}
            if kind == "save":
                row |= {"claim_wait_ms": float(m[n + 1]), "commit_ms": float(m[n + 2]),
                        "commit_in_step": m[n + 3] == IN_STEP}
            return kind, row
    return None


def read_since(path: str, offset: int = 0) -> list[tuple[str, dict]]:
    """The timing lines (`parse`) of log PATH past byte OFFSET, whole lines only
    (one still being written is left for a later read)."""
    with open(path, "rb") as f:
        f.seek(offset)
        data = f.read()
    text = data[:data.rfind(b"\n") + 1].decode(errors="replace")
    return [got for line in text.splitlines() if (got := parse(line))]
