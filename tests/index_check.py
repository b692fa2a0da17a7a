"""Invariants of the prefix index, read straight from a region (tests only)."""
from __future__ import annotations

import struct

import numpy as np

from tract_cli.core.pool import Pool

BUCKET = struct.Struct("<16sIIIIIIHHIIIQ")
BUCKET_FIELDS = ("key", "state", "slot", "tokens", "reserved", "lru_prev", "lru_next", "owner_node",
                 "flags", "owner_pid", "epoch", "checksum", "last_access_ns")
ANCHOR = struct.Struct("<IIQQQQQQII")
ANCHOR_FIELDS = ("head", "tail", "count", "hits", "inserts", "evictions", "lookups",
                 "release_keys", "release_blocks", "release_owner")
EMPTY, PENDING, READY, TOMB = 0, 1, 2, 3


def payload_for(key: bytes, nbytes: int) -> np.ndarray:
    """The deterministic block tests store under a key: the key, repeated."""
    return np.frombuffer((key * (nbytes // 16 + 1))[:nbytes], dtype=np.uint8)


def check_index(path: str, allow_pending: bool = False) -> dict:
    """Asserts every index invariant; returns {'ready': n, 'keys': set}."""
    with Pool.attach(path, readonly=True) as p:
        info = p.info
        bs, pins_s, lru_s, bm = (info.section(n) for n in ("buckets", "pins", "lru", "bitmap"))
        raw = p.observe(bs.offset, bs.length)
        pins = np.frombuffer(p.observe(pins_s.offset, pins_s.length), np.uint8)
        anchors = p.observe(lru_s.offset, lru_s.length)
        bits = np.unpackbits(np.frombuffer(p.observe(bm.offset, bm.length), np.uint8),
                             bitorder="little")
    nb, stripes = bs.count, info.index_stripes
    per = nb // stripes
    b = [BUCKET.unpack_from(raw, i * 64) for i in range(nb)]
    state = [x[1] for x in b]
    slots_seen: dict[int, int] = {}
    keys = set()
    for i, x in enumerate(b):
        key, st, slot, tokens, reserved, prev, nxt = x[:7]
        node_pins = sum(int.from_bytes(pins[n * pins_s.entry_size + 2 * i:][:2], "little")
                        for n in range(info.max_nodes))
        assert reserved == 0, f"bucket {i}: reserved field {reserved}"
        assert st == READY or node_pins == 0, f"bucket {i}: {node_pins} pin(s) on a state-{st} bucket"
        if st == READY:
            assert 1 <= slot <= info.slot_count, f"bucket {i}: READY without a valid slot"
            assert bits[slot - 1], f"bucket {i}: slot {slot - 1} not taken in the bitmap"
            assert slot not in slots_seen, f"slot {slot - 1} in buckets {slots_seen[slot]} and {i}"
            slots_seen[slot] = i
            assert key not in keys, f"key {key.hex()} stored twice"
            keys.add(key)
        if st == PENDING:
            assert allow_pending, f"bucket {i}: PENDING left behind"
        if st in (PENDING, READY):
            s, home = i // per, int.from_bytes(key[:8], "little") & (per - 1)
            assert int.from_bytes(key[8:], "little") >> 40 & (stripes - 1) == s, "wrong stripe"
            j = home
            while s * per + j != i:      # the probe chain from home reaches i
                assert state[s * per + j] != EMPTY, f"bucket {i}: probe chain broken at {j}"
                j = (j + 1) & (per - 1)
    for s in range(stripes):
        head, tail, count = ANCHOR.unpack_from(anchors, s * 64)[:3]
        seen, prev, cur = 0, 0, head
        while cur:
            x = b[cur - 1]
            assert x[1] == READY, f"stripe {s}: LRU holds a non-READY bucket {cur - 1}"
            assert (cur - 1) // per == s, "LRU crosses stripes"
            assert x[5] == prev, f"stripe {s}: broken prev link at {cur - 1}"
            prev, cur = cur, x[6]
            seen += 1
            assert seen <= per, f"stripe {s}: LRU cycle"
        assert prev == tail and seen == count, f"stripe {s}: LRU count/tail mismatch"
        ready_here = sum(1 for i in range(s * per, (s + 1) * per) if state[i] == READY)
        assert ready_here == count, f"stripe {s}: {ready_here} READY but {count} in LRU"
    return {"ready": len(keys), "keys": keys}


def lru_lists(pool: Pool) -> list[list[bytes]]:
    """Each stripe's LRU list, most recent first, as keys, read from the region."""
    from tract_cli.core.media import ANCHOR_DTYPE, BUCKET_DTYPE
    bs, ls = pool.info.section("buckets"), pool.info.section("lru")
    b = np.frombuffer(pool.observe(bs.offset, bs.count * 64), BUCKET_DTYPE)
    anchors = np.frombuffer(pool.observe(ls.offset, pool.info.index_stripes * 64), ANCHOR_DTYPE)
    lists = []
    for a in anchors:
        keys, cur = [], int(a["head"])
        while cur and len(keys) <= bs.count:
            keys.append(b[cur - 1]["key"].tobytes())
            cur = int(b[cur - 1]["lru_next"])
        lists.append(keys)
    return lists
