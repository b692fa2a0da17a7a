"""Snapshots of a live region, read without writing to it and without locks.

Each section is observed in bulk (one invalidate pass, one fence, one load)
and decoded with numpy, so a snapshot of a 1M-bucket index costs
milliseconds and never disturbs the workers.  Writers may be mid-update
while we read: every value taken from the region is range-checked, and what
does not add up is reported as "changing" rather than trusted or crashed on.
The JSON schema is documented in docs/INSPECT.md.
"""
from __future__ import annotations

import time
import weakref

import numpy as np

from tract_cli.core.handoff import RECORD_FREE, RECORD_RESERVED, RECORD_STATES
from tract_cli.core.index import BUCKET_PENDING, BUCKET_READY, BUCKET_STATES, BUCKET_TOMBSTONE
from tract_cli.core.locks import SLOT_STATES, SLOT_WAITING, lock_name
from tract_cli.core.media import (ALLOC_DTYPE, ANCHOR_DTYPE, BUCKET_DTYPE, MGR_DTYPE,
                                  RECORD_DTYPE, SLOT_DTYPE, pins_view)
from tract_cli.core.nodes import (NODE_NEVER, NODE_STATES, VERDICT_CLAIMS, VERDICT_PINS,
                                  VERDICT_SLOTS, current_manager, on_this_host, read_nodes,
                                  token_text)
from tract_cli.core.pids import pid_alive
from tract_cli.core.pool import Pool
from tract_cli.core.units import format_duration

SCHEMA_VERSION = 1
VIEWS = ("nodes", "locks", "index", "alloc", "handoffs")


def _age(now: int, ns: int) -> float | None:
    return None if not ns else round(max(0, now - int(ns)) / 1e9, 6)


_BUFFERS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # pool -> {section: buffer}


class Sections:
    """One consistent read of a region: each section observed in bulk, at most
    once, into a buffer reused across reads of the same pool (no page faults
    per refresh).  Make a new one for every snapshot."""

    def __init__(self, pool: Pool):
        self.pool = pool
        self._taken: dict[str, np.ndarray] = {}

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._taken:
            s = self.pool.info.section(name)
            mine = _BUFFERS.setdefault(self.pool, {})
            buf = mine.get(name)
            if buf is None or buf.size != s.length:
                buf = mine[name] = np.empty(s.length, dtype=np.uint8)
            self.pool.observe_into(s.offset, buf)
            self._taken[name] = buf
        return self._taken[name]


def _node_state(state: int) -> str:
    """An attached node's state by name ("unknown" for a value the core does not define)."""
    return NODE_STATES[state] if state in NODE_STATES and state != NODE_NEVER else "unknown"


def nodes_view(pool: Pool, now: int) -> dict:
    table = read_nodes(pool)
    rows = []
    for r in table:
        if r.state == NODE_NEVER and not r.heartbeat_ns:
            continue
        local = on_this_host(r)
        rows.append({"node": r.node,
                     # declared dead by the lock manager (its recovery: `recovered`)
                     "state": "dead" if r.dead else _node_state(r.state),
                     "declared_dead_age_s": _age(now, r.declared_ns) if r.dead else None,
                     "recovered": [name for bit, name in ((VERDICT_CLAIMS, "claims"),
                                                          (VERDICT_PINS, "pins"),
                                                          (VERDICT_SLOTS, "slots"))
                                   if r.recovered & bit] if r.dead else None,
                     "agent_pid": r.agent_pid, "epoch": r.epoch, "hostname": r.hostname,
                     "heartbeat_age_s": _age(now, r.heartbeat_ns), "live": r.alive(),
                     "manager": r.manager, "standby": r.standby,
                     # started by a worker (stops once its node is idle) or by hand
                     "started_by": "worker" if r.autostop else "hand",
                     "claim": token_text(r.token) if r.token else None,
                     "pid_alive": pid_alive(r.agent_pid) if local and r.agent_pid else None})
    managers = [r["node"] for r in rows if r["manager"] and r["live"]]
    cur = current_manager(table)
    return {"nodes": rows, "manager_node": managers[0] if managers else None,
            "current_claim": token_text(cur.token) if cur else None}


def locks_view(rd: Sections, now: int, hold_warn_s: float) -> dict:
    pool = rd.pool
    info = pool.info
    raw = rd["locks"]
    stride = info.section("locks").entry_size      # a lock: its manager line, then a slot per node
    line = MGR_DTYPE.itemsize
    out = []
    table = read_nodes(pool)
    here_nodes = {r.node for r in table if on_this_host(r)}
    cur = current_manager(table)
    current = cur.token if cur else 0
    for lid in range(info.lock_count):
        entry = raw[lid * stride:(lid + 1) * stride]
        mgr = entry[:line].view(MGR_DTYPE)[0]
        slots = entry[line:line + info.max_nodes * SLOT_DTYPE.itemsize].view(SLOT_DTYPE)
        granted = int(mgr["granted_node"])
        granted = granted if 0 < granted <= info.max_nodes else 0
        row = {"id": lid, "name": lock_name(lid), "grants": int(mgr["grant_seq"]),
               "holder_node": granted - 1 if granted else None, "holder_pid": None,
               "held_s": None, "waiting": [], "flags": []}
        for n in range(info.max_nodes):
            st = int(slots[n]["state"])
            if st not in SLOT_STATES:
                row["flags"].append(f"node {n}: changing")
                continue
            if st == SLOT_WAITING:
                row["waiting"].append({"node": n, "pid": int(slots[n]["pid"]),
                                       "waited_s": _age(now, slots[n]["since_ns"])})
        if granted and int(mgr["token"]) != current:
            # written by a manager that a later claim superseded: never entered
            row["flags"].append(f"grant of superseded manager {token_text(int(mgr['token']))}")
        if granted:
            s = slots[granted - 1]
            pid = int(s["pid"])
            row["holder_pid"] = pid
            row["held_s"] = _age(now, mgr["grant_ns"])
            # pids are checkable here on an emulated (single-host) region, or
            # when the holder node's agent runs on this host
            here = pool.target.kind == "file" or granted - 1 in here_nodes
            if here and pid and not pid_alive(pid):
                row["flags"].append(f"holder pid {pid} is dead")
            if row["held_s"] is not None and row["held_s"] > hold_warn_s:
                row["flags"].append(f"held longer than {format_duration(hold_warn_s)}")
        if row["grants"] or row["waiting"] or row["holder_node"] is not None:
            out.append(row)
    return {"locks": out, "lock_count": info.lock_count}


def index_view(rd: Sections, now: int) -> dict:
    pool = rd.pool
    info = pool.info
    bs = info.section("buckets")
    b = rd["buckets"].view(BUCKET_DTYPE)
    stripes = info.index_stripes
    per = bs.count // stripes
    state = b["state"]
    counts = {name: int((state == i).sum()) for i, name in BUCKET_STATES.items()}
    counts["changing"] = int((state > BUCKET_TOMBSTONE).sum())
    live = (state == BUCKET_PENDING) | (state == BUCKET_READY)
    # probe length: distance from the key's home bucket inside its stripe
    # (of live buckets only: the others' key bytes are not a key)
    home = pool.index.key_homes(b["key"][live]).astype(np.int64) % per
    dist = (np.flatnonzero(live) % per - home) % per
    hist = np.bincount(dist, minlength=1) if live.any() else np.zeros(1, np.int64)
    pins = pins_view(rd["pins"], info)
    pinned_by_node = {n: int((pins[n] > 0).sum()) for n in range(info.max_nodes) if pins[n].any()}
    anchors = rd["lru"].view(ANCHOR_DTYPE)[:stripes]
    oldest = []
    for s in range(stripes):
        tail = int(anchors[s]["tail"])
        age = _age(now, b[tail - 1]["last_access_ns"]) if 0 < tail <= bs.count else None
        oldest.append({"stripe": s, "entries": int(anchors[s]["count"]), "oldest_age_s": age})
    width = 64
    chunk = max(1, bs.count // width)
    occ = live[: chunk * width].reshape(width, chunk).mean(axis=1) if bs.count >= width else live
    occupancy = "".join(" .:-=+*#%@"[min(9, int(np.ceil(f * 9)))] for f in occ)
    ev = info.section("events")
    # each stripe's head line only (the logs themselves are as large as the buckets)
    heads = np.array([pool.observe_u64(ev.offset + s * ev.entry_size) for s in range(stripes)],
                     np.uint64)
    cap = ev.entry_size // 64 - 1
    return {
        "buckets": bs.count, "stripes": stripes, "states": counts,
        # the stripes' KV event logs (docs/PROTOCOLS.md §13): events appended since
        # format (stored + removed) and what each ring keeps
        "events": {"appended": int(heads.sum()), "per_stripe_capacity": cap,
                   "kept": int(np.minimum(heads, cap).sum()),
                   "busiest_stripe": int(heads.max()) if stripes else 0},
        "load_factor": round(float(live.sum()) / bs.count, 6),
        "probe_length_histogram": hist.tolist()[:32],
        "max_probe_length": int(dist.max()) if live.any() else 0,
        "pinned_blocks": int(((pins.sum(axis=0) > 0) & (state == BUCKET_READY)).sum()),
        "pins_total": int(pins.sum()), "pinned_by_node": pinned_by_node,
        "counters": {k: int(anchors[k].sum()) for k in ("hits", "inserts", "evictions", "lookups")},
        "lru": oldest, "occupancy_map": occupancy,
    }


def alloc_view(rd: Sections) -> dict:
    pool = rd.pool
    info = pool.info
    n = info.slot_count
    bits = np.unpackbits(rd["bitmap"], bitorder="little")[:n].astype(bool)
    owners = rd["owners"][:n]
    hdr = rd["alloc"][:ALLOC_DTYPE.itemsize].view(ALLOC_DTYPE)[0]
    b = rd["buckets"].view(BUCKET_DTYPE)
    ready_slots = b["slot"][(b["state"] == BUCKET_READY) & (b["slot"] > 0) & (b["slot"] <= n)] - 1
    in_use = np.zeros(n, bool)
    in_use[ready_slots] = True
    rec = rd["transfer"].view(RECORD_DTYPE)
    data = info.section("data")
    for r in rec[(rec["state"] != RECORD_FREE) & (rec["state"] != RECORD_RESERVED)]:
        off = int(r["keys_offset"])
        if data.offset <= off < data.offset + data.length:
            in_use[(off - data.offset) // info.slot_stride] = True
        if 0 < int(r["tail_slot"]) <= n:
            in_use[int(r["tail_slot"]) - 1] = True
    per_node = {}
    for node in range(info.max_nodes):
        mine = owners == node + 1
        if mine.any():
            per_node[node] = {"claimed": int(mine.sum()), "in_use": int((mine & in_use).sum())}
    free = ~bits
    edges = np.flatnonzero(np.diff(np.concatenate([[0], free.astype(np.int8), [0]])))
    runs = edges[1::2] - edges[0::2] if len(edges) else np.zeros(0, np.int64)
    return {"slots": n, "taken": int(bits.sum()), "free": int(free.sum()),
            "in_use": int(in_use.sum()), "claimed_not_in_use": int((bits & ~in_use).sum()),
            "by_node": per_node, "header_used_slots": int(hdr["used_slots"]),
            "batches_claimed": int(hdr["claims"]), "batches_released": int(hdr["releases"]),
            "free_runs": int(len(runs)), "largest_free_run": int(runs.max()) if len(runs) else 0,
            "consistent": int(hdr["used_slots"]) == int(bits.sum()) and bool((bits == (owners > 0)).all())}


def handoffs_view(rd: Sections, now: int) -> dict:
    rec = rd["transfer"].view(RECORD_DTYPE)
    out = []
    for i in np.flatnonzero(rec["state"] != RECORD_FREE):
        r = rec[i]
        st = int(r["state"])
        out.append({"record": int(i), "state": RECORD_STATES.get(st, f"changing({st})"),
                    "owner_node": int(r["owner_node"]) - 1, "owner_pid": int(r["owner_pid"]),
                    "request_id": bytes(r["request_id"]).hex(), "blocks": int(r["block_count"]),
                    "tokens": int(r["token_count"]), "age_s": _age(now, r["created_ns"]),
                    "expires_in_s": round((int(r["expiry_ns"]) - now) / 1e9, 6)})
    return {"in_flight": out, "capacity": len(rec)}


def take(pool: Pool, views=VIEWS, hold_warn_s: float = 1.0) -> dict:
    """One snapshot of the selected views."""
    t0 = time.perf_counter()
    now = time.time_ns()
    info = pool.info
    rd = Sections(pool)
    snap = {"schema": SCHEMA_VERSION, "region": pool.path, "medium": pool.medium,
            "uuid": info.uuid, "model": info.model_name, "taken_ns": now}
    if "nodes" in views:
        snap["nodes"] = nodes_view(pool, now)
    if "locks" in views:
        snap["locks"] = locks_view(rd, now, hold_warn_s)
    if "index" in views:
        snap["index"] = index_view(rd, now)
    if "alloc" in views:
        snap["alloc"] = alloc_view(rd)
    if "handoffs" in views:
        snap["handoffs"] = handoffs_view(rd, now)
    snap["snapshot_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
    return snap


def open_pool(path: str) -> Pool:
    """Attaches for reading only: no writes, no local segment, no pre-fault."""
    return Pool.attach(path, readonly=True, prefault=False, local=False)
