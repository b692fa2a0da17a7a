"""The vLLM connector's configuration: `kv_connector_extra_config`, validated.

Every key is checked when vLLM starts, so a mistake stops the engine with one
line naming the key and the fix, never a failure at the first request.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, fields

from tract_cli.core.errors import UsageError
from tract_cli.core.cpu import FLUSH_MODES
from tract_cli.core.gpupages import GPU_COPIES
from tract_cli.core.handoff import HANDOFF_PUBLISH
from tract_cli.core.kvpages import LOAD_MODES
from tract_cli.core.weights import WEIGHTS_DIGESTS

ROLES = ("kv_producer", "kv_consumer", "kv_both")
# the longest an idle engine step may wait for paired decodes' records: a
# request arriving meanwhile waits that long
MAX_PAIR_IDLE_S = 0.1



@dataclass(frozen=True)
class ConnectorSettings:
    """What `kv_connector_extra_config` may say (docs/VLLM.md lists each key)."""

    pool: str                      # region file or /dev/daxX.Y, formatted for the model
    node: int                      # this instance's node id in the region
    prefix_cache: bool = True      # look prompts up in the pool (and, saving, share them)
    save: bool | None = None       # write computed prompt KV to the pool (default: not kv_consumer)
    checksums: bool = True         # record and verify each block's CRC-32C
    handoff_ttl_s: float = 30.0    # a P/D handoff's blocks stay pinned this long unacknowledged
    lookup_timeout_s: float = 5.0  # bound on one pool lock wait off the engine's path
    step_timeout_s: float = 1.0    # ... and for its saves and publishes (claim, commit, publish)
    claim_wait_s: float = 0.1      # a step waits this long for its claim (a P/D prefill's: and
                                   # its records), or for a commit it waits for (in_step)
    lookup_wait_s: float = 0.002   # the scheduler loop's wait for a lookup before "not yet"
    lookup_patience_s: float = 0.5  # a lookup not back by then: the request is computed
    handoff_wait_s: float = 4.0    # a decode's wait for a reserved handoff's publish
    pair_wait_s: float = 30.0      # a paired decode's wait for its prefill to take a record
    pair_idle_s: float = 0.005     # an idle engine step's wait for a paired decode's record
    start_agent: bool = True       # start this node's agent if none runs
    flush_mode: str | None = None  # override the region header's flush mode
    simulate: bool = False         # run metadata through the non-coherence simulator
    max_handoffs: int = 64         # this instance's P/D handoffs in flight at once (past it: none)
    model_id: str | None = None    # the operator's name for the weights, mixed into every key
    weights_digest: str = "sampled"  # how the weights enter the model's identity: sampled | full
    load_mode: str = "sync"        # copy hits in the step that computes the rest | on a thread
    gpu_copy: str = "auto"         # the GPU path's copy: auto | direct | staging
    # a P/D prefill's handoff: its record reserved in the step, published after its
    # commit, off the step | published in the step, which waits for the commit
    handoff_publish: str = "after_step"
    # KV events (vLLM's --kv-events-config): the region's blocks this instance can load
    kv_events: bool = True         # published with vLLM's own, when vLLM publishes KV events
    kv_events_medium: str = "CPU"  # their `medium`
    kv_events_ownership: str | None = None   # their `ownership` (None: "tract:<uuid>"; "": none)
    kv_events_locality: bool = True  # `locality` LOCAL/REMOTE (this node wrote it or not)
    kv_events_interval_s: float = 0.05   # how often the region's event logs are read

    @classmethod
    def parse(cls, extra: dict | None, role: str) -> "ConnectorSettings":
        """From vLLM's `kv_connector_extra_config` and `kv_role`; UsageError on anything wrong."""
        if role not in ROLES:
            raise UsageError(f"kv_role {role!r} is not one of {', '.join(ROLES)}",
                             "set kv_role in --kv-transfer-config")
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise UsageError(f"kv_connector_extra_config has unknown key(s) {', '.join(unknown)}",
                             f"use only {', '.join(sorted(known))} (docs/VLLM.md)")
        for key in ("pool", "node"):
            if key not in extra:
                raise UsageError(f"kv_connector_extra_config lacks {key!r}",
                                 'add e.g. "pool": "/dev/shm/tract.pool", "node": 1')
        pool = extra["pool"]
        if not isinstance(pool, str) or not pool:
            raise UsageError("kv_connector_extra_config pool must be a path",
                             'e.g. "pool": "/dev/shm/tract.pool"')
        out = {"pool": pool, "node": _int(extra, "node", 0)}
        for key in ("prefix_cache", "checksums", "start_agent", "simulate", "kv_events",
                    "kv_events_locality"):
            if key in extra:
                out[key] = _bool(extra, key)
        if "simulate" not in extra:
            out["simulate"] = os.environ.get("TRACT_SIMULATE", "") not in ("", "0")
        out["save"] = _bool(extra, "save") if "save" in extra else role != "kv_consumer"
        for key in ("handoff_ttl_s", "lookup_timeout_s", "step_timeout_s", "claim_wait_s",
                    "lookup_wait_s", "lookup_patience_s", "handoff_wait_s", "pair_wait_s",
                    "kv_events_interval_s"):
            if key in extra:
                value = extra[key]
                if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                    raise UsageError(f"kv_connector_extra_config {key} must be a positive number "
                                     f"of seconds, got {value!r}", f'e.g. "{key}": 30')
                out[key] = float(value)
        if "pair_idle_s" in extra:
            value = extra["pair_idle_s"]
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not 0 <= value <= MAX_PAIR_IDLE_S):
                raise UsageError(f"kv_connector_extra_config pair_idle_s must be between 0 "
                                 f"(off) and {MAX_PAIR_IDLE_S} seconds, got {value!r}",
                                 '"pair_idle_s": 0.005')
            out["pair_idle_s"] = float(value)
        for key, example in (("kv_events_medium", "CPU"), ("kv_events_ownership", "tract")):
            if key in extra:
                value = extra[key]
                empty_ok = key == "kv_events_ownership"
                if not isinstance(value, str) or len(value) > 256 or (not value and not empty_ok):
                    raise UsageError(f"kv_connector_extra_config {key} must be a string of at "
                                     f"most 256 characters{'' if empty_ok else ', not empty'}, "
                                     f"got {value!r}", f'e.g. "{key}": "{example}"')
                out[key] = value
        if "max_handoffs" in extra:
            out["max_handoffs"] = _int(extra, "max_handoffs", 0)
        if "model_id" in extra:
            value = extra["model_id"]
            if not isinstance(value, str) or not value or len(value) > 1024:
                raise UsageError("kv_connector_extra_config model_id must be a non-empty string "
                                 "of at most 1024 characters", 'e.g. "model_id": "llama-3-8b@a1b2c3"')
            out["model_id"] = value
        for key, choices in (("weights_digest", WEIGHTS_DIGESTS), ("flush_mode", FLUSH_MODES),
                             ("load_mode", LOAD_MODES), ("handoff_publish", HANDOFF_PUBLISH),
                             ("gpu_copy", GPU_COPIES)):
            if key in extra:
                out[key] = _choice(extra, key, choices)
        return cls(**out)


def _choice(extra: dict, key: str, choices) -> str:
    value = extra[key]
    if value not in choices:
        raise UsageError(f"kv_connector_extra_config {key} {value!r} is unknown",
                         f"use one of {', '.join(choices)}")
    return value


def _int(extra: dict, key: str, minimum: int) -> int:
    value = extra[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise UsageError(f"kv_connector_extra_config {key} must be an integer >= {minimum}, "
                         f"got {value!r}", f'e.g. "{key}": 1')
    return value


def _bool(extra: dict, key: str) -> bool:
    value = extra[key]
    if not isinstance(value, bool):
        raise UsageError(f"kv_connector_extra_config {key} must be true or false, got {value!r}",
                         f'e.g. "{key}": true')
    return value
