"""`tract check`: verify every invariant of a region; `--repair` rebuilds what
can be rebuilt (docs/PROTOCOLS.md §11).

Verification reads the region like `tract inspect` (no writes, no locks).
Repair is offline: it refuses while any process maps the region (unless
forced), because it rebuilds the index, the allocator state and the
transfer table from the READY entries alone — every pin, PENDING claim,
in-flight handoff and node-local free list belongs to processes that no
longer run, so they are dropped and the nodes' local segments removed.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from tract_cli.core import medium
from tract_cli.core.errors import TractError
from tract_cli.core.handoff import RECORD_FREE, RECORD_RESERVED
from tract_cli.core.local import remove_segments
from tract_cli.core.index import (AUDIT_CHAIN_BROKEN, AUDIT_OTHER_STRIPE, BUCKET_EMPTY,
                                  BUCKET_F_CHECKSUM, BUCKET_PENDING, BUCKET_READY, BUCKET_TOMBSTONE)
from tract_cli.core.locks import SLOT_LOCKED
from tract_cli.core.media import (ALLOC_DTYPE, ANCHOR_DTYPE, BUCKET_DTYPE, MGR_DTYPE, RECORD_DTYPE,
                                  SLOT_DTYPE, pins_view)
from tract_cli.core.nodes import current_token, token_text
from tract_cli.core.pool import Pool
from tract_cli.inspect.snapshot import Sections

# the bucket states, as the core defines them (native/format.h)
READY, PENDING, TOMB, EMPTY = BUCKET_READY, BUCKET_PENDING, BUCKET_TOMBSTONE, BUCKET_EMPTY


@dataclass(frozen=True)
class Violation:
    check: str
    detail: str
    bucket: int | None = None     # the index bucket it concerns, where one does


def verify(pool: Pool, data: bool = True) -> tuple[list[Violation], dict]:
    """All violations found, and counts of what was checked."""
    info = pool.info
    rd = Sections(pool)
    out: list[Violation] = []
    n = info.slot_count
    bits = np.unpackbits(rd["bitmap"], bitorder="little")[:n].astype(bool)
    owners = rd["owners"][:n]
    used = int(rd["alloc"][:ALLOC_DTYPE.itemsize].view(ALLOC_DTYPE)[0]["used_slots"])
    if used != int(bits.sum()):
        out.append(Violation("allocator", f"header says {used} slots used, bitmap has {int(bits.sum())}"))
    for s in np.flatnonzero(bits != (owners > 0))[:20]:
        out.append(Violation("allocator", f"slot {s}: bitmap {int(bits[s])} but owner byte {owners[s]}"))
    bad_owner = np.flatnonzero(owners > info.max_nodes)
    for s in bad_owner[:20]:
        out.append(Violation("allocator", f"slot {s}: owner byte {owners[s]} > max nodes"))
    alloc_hdr = rd["alloc"][:ALLOC_DTYPE.itemsize].view(ALLOC_DTYPE)[0]
    if int(alloc_hdr["intent_n"]):
        out.append(Violation("allocator", f"a release of {int(alloc_hdr['intent_n'])} slots by node "
                                          f"{int(alloc_hdr['intent_node']) - 1} was cut short inside "
                                          "the allocator lock (its next holder finishes it)"))

    bs = info.section("buckets")
    b = rd["buckets"].view(BUCKET_DTYPE)
    stripes, per = info.index_stripes, bs.count // info.index_stripes
    state = b["state"]
    for i in np.flatnonzero(state > TOMB)[:20]:
        out.append(Violation("index", f"bucket {i}: unknown state {state[i]}"))
    # pins are taken only on READY buckets, and eviction and burial leave
    # none behind: a count on any other bucket would pin the next key put there
    pins = pins_view(rd["pins"], info)
    for node, i in np.argwhere((pins > 0) & (state != READY)[None, :])[:20]:
        out.append(Violation("pins", f"bucket {i}: node {node} holds {pins[node, i]} pin(s) "
                                     f"on a bucket that is not READY"))
    for i in np.flatnonzero(b["reserved"] != 0)[:20]:
        out.append(Violation("index", f"bucket {i}: reserved field is {b['reserved'][i]}, not 0"))
    ready = np.flatnonzero(state == READY)
    slots = b["slot"][ready].astype(np.int64) - 1
    badslot = (slots < 0) | (slots >= n)
    for i in ready[badslot][:20]:
        out.append(Violation("index", f"bucket {i}: READY with slot {int(b['slot'][i]) - 1} out of range"))
    ok_slots = slots[~badslot]
    uniq, counts = np.unique(ok_slots, return_counts=True)
    for s in uniq[counts > 1][:20]:
        out.append(Violation("slots", f"slot {s} is owned by more than one READY entry"))
    for s in ok_slots[~bits[ok_slots]][:20]:
        out.append(Violation("slots", f"slot {s} is READY data but free in the bitmap"))
    live = (state == READY) | (state == PENDING)
    lk = b["key"][live]
    if len(lk):
        _, kc = np.unique(lk, return_counts=True)
        if (kc > 1).any():
            out.append(Violation("index", f"{int((kc > 1).sum())} keys are stored more than once"))
    # probe chains: every live bucket reachable from its home without an
    # EMPTY -- decided by the core, which owns the key rule (stripe, home,
    # probing); this file only reports
    audit = pool.index.audit()
    for i in np.flatnonzero(audit.reach == AUDIT_OTHER_STRIPE)[:20]:
        out.append(Violation("index", f"bucket {i}: key belongs to another stripe"))
    for i in np.flatnonzero(audit.reach == AUDIT_CHAIN_BROKEN)[:20]:
        out.append(Violation("index", f"bucket {i}: probe chain broken at {int(audit.broken[i])}"))
    # LRU lists
    anchors = rd["lru"].view(ANCHOR_DTYPE)[:stripes]
    for s in range(stripes):
        head, tail, count = int(anchors[s]["head"]), int(anchors[s]["tail"]), int(anchors[s]["count"])
        seen, prev, cur, broken = 0, 0, head, False
        members = set()
        while cur:
            if not s * per < cur <= (s + 1) * per or cur in members:
                out.append(Violation("lru", f"stripe {s}: link to bucket {cur - 1} leaves the stripe or loops"))
                broken = True
                break
            x = b[cur - 1]
            if int(x["state"]) != READY or int(x["lru_prev"]) != prev:
                out.append(Violation("lru", f"stripe {s}: bucket {cur - 1} is not READY or has a bad prev link"))
                broken = True
                break
            members.add(cur)
            prev, cur = cur, int(x["lru_next"])
            seen += 1
        ready_here = set((np.flatnonzero(state[s * per:(s + 1) * per] == READY) + s * per + 1).tolist())
        if not broken and (prev != tail or seen != count or members != ready_here):
            out.append(Violation("lru", f"stripe {s}: list has {seen} entries, anchor says {count}, "
                                         f"{len(ready_here)} READY"))
    intents = (anchors["release_keys"] != 0) | (anchors["release_blocks"] != 0) | \
        (anchors["release_owner"] != 0)
    for s in np.flatnonzero(intents)[:20]:
        out.append(Violation("handoff", f"stripe {s}: a handoff release was cut short inside it "
                                        "(the stripe's next holder finishes it)"))
    # transfer records
    rec = rd["transfer"].view(RECORD_DTYPE)
    data_sec = info.section("data")
    handoff_slots = []
    # (a reservation names no key list: its publish is still to come)
    for r_i in np.flatnonzero((rec["state"] != RECORD_FREE) & (rec["state"] != RECORD_RESERVED)):
        r = rec[r_i]
        off = int(r["keys_offset"])
        if not (data_sec.offset <= off < data_sec.offset + data_sec.length) or \
                (off - data_sec.offset) % info.slot_stride:
            out.append(Violation("handoffs", f"record {r_i}: key list offset {off:#x} is not a slot"))
            continue
        handoff_slots.append((off - data_sec.offset) // info.slot_stride)
        if int(r["tail_slot"]):
            handoff_slots.append(int(r["tail_slot"]) - 1)
    for s in set(handoff_slots) & set(ok_slots.tolist()):
        out.append(Violation("slots", f"slot {s} is both READY data and a handoff's"))
    # lock table: every token comes from a claim in the node table
    out.extend(lock_violations(pool, rd))
    # payload checksums
    checked = 0
    if data:
        summed = (b["flags"][ready][~badslot] & BUCKET_F_CHECKSUM) != 0
        buckets = ready[~badslot][summed]
        slots_summed = ok_slots[summed]
        checked = len(slots_summed)
        for k in pool.index.checksum_mismatches(slots_summed, b["checksum"][buckets]):
            bi, s = int(buckets[k]), int(slots_summed[k])
            out.append(Violation("checksum", f"bucket {bi} (slot {s}): payload does not match "
                                             "its checksum", bucket=bi))
    stats = {"slots": n, "slots_taken": int(bits.sum()), "buckets": bs.count,
             "ready": int(len(ready)), "pending": int((state == PENDING).sum()),
             "handoffs": int((rec["state"] != RECORD_FREE).sum()), "checksums_verified": checked}
    return out, stats


def lock_violations(pool: Pool, rd: Sections) -> list[Violation]:
    """Tokens in the lock table that no manager claim accounts for (PROTOCOLS.md §4):
    claims only grow, so a line 0 or a LOCKED slot above the largest is corrupt."""
    info = pool.info
    current = current_token(pool)
    out = []
    stride = info.section("locks").entry_size      # a lock: its manager line, then a slot per node
    line = MGR_DTYPE.itemsize
    raw = rd["locks"][:info.lock_count * stride].reshape(info.lock_count, stride)
    mgr = raw[:, :line].copy().view(MGR_DTYPE).ravel()
    for lid in np.flatnonzero(mgr["token"] > current)[:20]:
        out.append(Violation("locks", f"lock {lid}: grant token {token_text(int(mgr['token'][lid]))} "
                                      f"is above every manager claim ({token_text(current)})"))
    for lid in np.flatnonzero(mgr["inherited"] > info.max_nodes)[:20]:
        out.append(Violation("locks", f"lock {lid}: a repair inherited from node "
                                      f"{int(mgr['inherited'][lid]) - 1}, outside 0..{info.max_nodes - 1}"))
    for lid in np.flatnonzero(mgr["granted_node"] > info.max_nodes)[:20]:
        out.append(Violation("locks", f"lock {lid}: granted to node {int(mgr['granted_node'][lid]) - 1}"
                                      f", outside 0..{info.max_nodes - 1}"))
    slots = raw[:, line:line + info.max_nodes * SLOT_DTYPE.itemsize].copy().view(SLOT_DTYPE)
    slots = slots.reshape(info.lock_count, info.max_nodes)
    bad = np.argwhere((slots["state"] == SLOT_LOCKED) & (slots["grant_token"] > current))
    for lid, node in bad[:20]:
        out.append(Violation("locks", f"lock {lid}: node {node} holds it under token "
                                      f"{token_text(int(slots['grant_token'][lid, node]))}, above "
                                      f"every manager claim"))
    return out


def repair(path: str, force: bool = False) -> dict:
    """Rebuilds index, allocator and transfer table from the valid READY entries (offline)."""
    users = medium.processes_using(path)
    if users and not force:
        raise TractError(f"{path} is mapped by running processes (pids "
                         f"{', '.join(map(str, users[:8]))})",
                         "stop them first: repair rebuilds state they rely on (or --force)")
    with Pool.attach(path, local=False) as pool:
        violations, _ = verify(pool, data=True)
        bad_sum = {v.bucket for v in violations if v.check == "checksum"}
        info = pool.info
        rd = Sections(pool)                  # a fresh read: the one verify made is older
        n = info.slot_count
        b = rd["buckets"].view(BUCKET_DTYPE)
        keys = b["key"]
        # which READY entries survive is decided here, from the audit of the
        # core, which owns the key rule (native/audit.c)
        audit = pool.index.audit()
        keep, seen_keys, seen_slots = [], set(), set()
        for i in np.flatnonzero(b["state"] == READY):
            slot = int(b["slot"][i]) - 1
            key = keys[i].tobytes()
            if not 0 <= slot < n or slot in seen_slots or key in seen_keys or i in bad_sum:
                continue
            if audit.reach[i] == AUDIT_OTHER_STRIPE:
                continue
            seen_keys.add(key)
            seen_slots.add(slot)
            keep.append(i)
        dropped = len(np.flatnonzero(b["state"] != EMPTY)) - len(keep)
        # the index is written by the core alone: placement from each key's
        # home, the LRU lists and anchors, zero pins, a fresh epoch for every
        # bucket (native/audit.c, tract_index_rebuild)
        pool.index.rebuild(np.asarray(keep, np.uint64))
        # then the allocator and the tables no survivor holds anything in, by
        # the core too: bitmap and owner map of the kept slots, the header's
        # count, the transfer and lock tables empty (no holder survives an
        # offline repair; native/audit.c, tract_alloc_rebuild)
        pool.allocator.rebuild(np.asarray(sorted(seen_slots), np.uint32))
        removed = remove_segments(info.uuid)
        after, stats = verify(pool, data=False)
    return {"kept_ready": len(keep),
            "dropped_entries": dropped,
            "local_segments_removed": removed, "remaining_violations": [asdict(v) for v in after],
            "stats": stats}
