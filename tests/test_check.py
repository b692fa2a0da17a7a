"""`tract check`: a healthy region passes; planted corruptions are each
reported; `--repair` rebuilds them offline and the region passes again."""
from __future__ import annotations

import json
import struct
import subprocess
import sys

import numpy as np
import pytest

from agents import RunningAgent
from procs import Worker
from tract_cli.core.media import ALLOC_DTYPE
from tract_cli.core.pool import Pool
from tract_cli.inspect.snapshot import ANCHOR_DTYPE, BUCKET_DTYPE


def tract(*args):
    return subprocess.run([sys.executable, "-m", "tract_cli.cli", *args], capture_output=True,
                          text=True, timeout=300)


@pytest.fixture
def used_region(region_path):
    """A region after a workload: 3 chains of 8 blocks with checksums."""
    Pool.create(region_path, 16 << 20, "tiny", nodes=3, index_stripes=4).close()
    with RunningAgent(region_path, 0, manager=True), Worker(region_path, 1) as w:
        w.call("index_put_chains", chains=[[1, 2, 10 + i, 8] for i in range(3)])
    return region_path


def check_json(path):
    res = tract("check", path, "--json")
    return res.returncode, json.loads(res.stdout)


def ready_buckets(path):
    with Pool.attach(path, readonly=True) as p:
        s = p.info.section("buckets")
        raw = np.frombuffer(p.observe(s.offset, s.length), np.uint8).reshape(-1, 64)
        states = raw[:, 16:20].copy().view("<u4").reshape(-1)
        return s.offset, np.flatnonzero(states == 2), raw


def test_a_healthy_region_passes(used_region):
    rc, out = check_json(used_region)
    assert rc == 0 and out["ok"], out
    assert out["stats"]["ready"] == 2 + 3 * 6 and out["stats"]["checksums_verified"] == 20


def test_corrupted_payload_header_and_lru_are_found_and_repaired(used_region):
    off, ready, raw = ready_buckets(used_region)
    with Pool.attach(used_region, local=False) as p:
        # 1. a stray write into a block's payload
        slot = int(raw[ready[0], 20:24].view("<u4")[0]) - 1
        view = p.slot_bytes(slot)
        view[5] ^= 0x5A
        del view
        # 2. the allocator header lies
        p.publish_u64(p.info.section("alloc").offset, 999)
        # 3. a broken LRU link
        line = bytearray(raw[ready[1]].tobytes())
        struct.pack_into("<I", line, 32, 4095)
        p.publish(off + int(ready[1]) * 64, bytes(line))
    rc, out = check_json(used_region)
    assert rc == 1
    kinds = {v["check"] for v in out["violations"]}
    assert {"checksum", "allocator", "lru"} <= kinds, out["violations"]
    res = tract("check", used_region, "--repair", "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    rep = json.loads(res.stdout)
    assert rep["remaining_violations"] == [] and rep["kept_ready"] == 19   # the bad block dropped
    rc, out = check_json(used_region)
    assert rc == 0 and out["stats"]["ready"] == 19


def test_repaired_region_still_serves_its_blocks(used_region):
    tract("check", used_region, "--repair")
    with RunningAgent(used_region, 0, manager=True), Worker(used_region, 2) as w:
        assert w.call("index_lookup_verify", chains=[[1, 2, 10 + i, 8] for i in range(3)]) == [8, 8, 8]


def test_repair_refuses_while_the_region_is_in_use(used_region):
    with RunningAgent(used_region, 0, manager=True) as agent:
        res = tract("check", used_region, "--repair")
        assert res.returncode == 1
        assert f"mapped by running processes (pids {agent.proc.pid}" in res.stderr


def test_a_lock_token_above_every_manager_claim_is_reported_and_repair_clears_it(used_region):
    """Claims only grow (PROTOCOLS.md §4): a grant or a holder under a token no
    claim accounts for is corrupt; --repair empties the lock table."""
    with Pool.attach(used_region, local=False) as p:
        sec = p.info.section("locks")
        forged = (7 << 32) | 2
        p.publish(sec.offset + 1 * sec.entry_size,
                  struct.pack("<IIQQQQ", 2, 2, 1, 0, 1, forged).ljust(64, b"\0"))
        p.publish(sec.offset + 1 * sec.entry_size + 64 * 2,      # node 1's slot, LOCKED
                  struct.pack("<IIQQQQ", 2, 1, 1, 1, 0, forged).ljust(64, b"\0"))
    rc, out = check_json(used_region)
    assert rc == 1
    details = [v["detail"] for v in out["violations"] if v["check"] == "locks"]
    assert any("lock 1: grant token 7.2 is above every manager claim" in d for d in details), out
    assert any("lock 1: node 1 holds it under token 7.2" in d for d in details), out
    res = tract("check", used_region, "--repair", "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["remaining_violations"] == [], res.stdout


def test_a_key_out_of_its_probe_chain_or_stripe_is_found_by_the_cores_audit(used_region):
    """The key rule (stripe, home, linear probing) is decided by the core
    (native/audit.c), not re-implemented here: a READY bucket moved one place
    on, with an EMPTY left where it was, is unreachable from its home; one
    moved into another stripe is in the wrong stripe."""
    off, ready, raw = ready_buckets(used_region)
    states = raw[:, 16:20].copy().view("<u4").reshape(-1)
    n = len(states)
    per = n // 4
    # a READY bucket followed by an EMPTY one in the same stripe
    i = next(int(b) for b in ready if (b + 1) % per and states[b + 1] == 0)
    # a copy of another READY bucket, k, into an EMPTY bucket of another stripe than k's
    k = next(int(b) for b in ready if b != i)
    j = next(int(b) for b in np.flatnonzero(states == 0) if b // per != k // per and b != i + 1)
    with Pool.attach(used_region, local=False) as p:
        p.publish(off + (i + 1) * 64, raw[i].tobytes())       # moved on ...
        p.publish(off + i * 64, bytes(64))                    # ... leaving an EMPTY behind
        p.publish(off + j * 64, raw[k].tobytes())             # a copy in another stripe
    rc, out = check_json(used_region)
    details = [v["detail"] for v in out["violations"]]
    assert rc != 0
    assert f"bucket {i + 1}: probe chain broken at {i}" in details, details
    assert f"bucket {j}: key belongs to another stripe" in details, details


def test_the_cores_rebuild_refuses_a_bad_keep_list_and_writes_nothing(used_region):
    """The index is rebuilt by the core (`Index.rebuild`, native/audit.c), the
    one writer of its format: a bucket that is not READY, one kept twice, one
    past the index, one naming no slot or another kept bucket's slot, or a
    keep list that is not of bucket indices is refused before anything is
    written."""
    from tract_cli.core.errors import UsageError
    off, ready, raw = ready_buckets(used_region)
    states = raw[:, 16:20].copy().view("<u4").reshape(-1)
    empty = int(np.flatnonzero(states == 0)[0])
    a, b, c = (int(x) for x in ready[:3])
    slot_a = raw[a, 20:24].tobytes()
    with open(used_region, "r+b") as f:        # offline: nothing maps the region
        f.seek(off + b * 64 + 20)
        f.write(slot_a)                         # b names a's slot
        f.seek(off + c * 64 + 20)
        f.write(bytes(4))                       # c names no slot
    with Pool.attach(used_region, local=False) as p:
        before = p.observe(0, p.info.section("data").offset)
        for keep in ([empty], [a, a], [len(states)], [a, b], [c], [[a]], [-1], [0.5]):
            with pytest.raises(UsageError):
                p.index.rebuild(keep)
        assert p.observe(0, p.info.section("data").offset) == before


def test_the_cores_rebuild_keeps_recency_and_gives_fresh_epochs(used_region):
    """Rebuilt from every READY bucket: the same keys, each stripe's LRU list
    oldest to newest as before, no pins, every epoch above all the old ones."""
    off, ready, raw = ready_buckets(used_region)
    old = raw.copy().view(BUCKET_DTYPE).reshape(-1)
    with Pool.attach(used_region, local=False) as p:
        pins_s = p.info.section("pins")
        p.publish(pins_s.offset + pins_s.entry_size + (int(ready[0]) & ~31) * 2, b"\x01" * 64)
        assert np.frombuffer(p.observe(pins_s.offset, pins_s.length), np.uint8).any()
        p.index.rebuild(ready)
        new = np.frombuffer(p.observe(off, len(old) * 64), BUCKET_DTYPE)
        lru = np.frombuffer(p.observe(p.info.section("lru").offset, 4 * 64), ANCHOR_DTYPE)
        pins = np.frombuffer(p.observe(pins_s.offset, pins_s.length), np.uint8)
    assert sorted(new["key"][new["state"] == 2].tolist()) == sorted(old["key"][ready].tolist())
    assert not pins.any() and (new["reserved"] == 0).all()
    assert (new["epoch"] == int(old["epoch"].max()) + 1).all()
    per = len(old) // 4
    for s in range(4):
        chain, cur = [], int(lru[s]["tail"])
        while cur:
            chain.append(cur - 1)
            cur = int(new[cur - 1]["lru_prev"])
        assert len(chain) == lru[s]["count"] == ((ready >= s * per) & (ready < (s + 1) * per)).sum()
        ages = new["last_access_ns"][chain]
        assert (np.diff(ages.astype(np.int64)) >= 0).all()
    rc, out = check_json(used_region)
    assert rc == 0, out["violations"]


def test_the_cores_allocator_rebuild_refuses_a_bad_slot_list_and_writes_nothing(used_region):
    """The allocator state is rebuilt by the core too (`Allocator.rebuild`,
    native/audit.c): a slot past the pool, one kept twice, or a list that is
    not of slot ids is refused before anything is written."""
    from tract_cli.core.errors import UsageError
    with Pool.attach(used_region, local=False) as p:
        n = p.info.slot_count
        before = p.observe(0, p.info.section("data").offset)
        for keep in ([n], [0, n + 5], [3, 3], [1, 2, 1], [2 ** 32], [-1], [0.5], [[1]]):
            with pytest.raises(UsageError):
                p.allocator.rebuild(keep)
        assert p.observe(0, p.info.section("data").offset) == before


def test_the_cores_allocator_rebuild_writes_the_kept_slots_and_empties_the_tables(used_region):
    """Exactly the kept slots taken, each keeping its owner byte (node 0's
    where it had none or one naming no node), the header's count of them (its
    other fields kept), the transfer and lock tables all zero."""
    with Pool.attach(used_region, local=False) as p:
        info = p.info
        n = info.slot_count
        sec = {name: info.section(name) for name in ("bitmap", "owners", "alloc", "transfer",
                                                     "locks")}
        owners_old = np.frombuffer(p.observe(sec["owners"].offset, n), np.uint8)
        taken, free = np.flatnonzero(owners_old), np.flatnonzero(owners_old == 0)
        p.publish(sec["owners"].offset + int(free[1]), bytes([200]))   # names no node
        keep = np.array([taken[0], taken[-1], free[0], free[1]], np.uint32)  # free[0]: no byte
        hdr_old = np.frombuffer(p.observe(sec["alloc"].offset, 64), ALLOC_DTYPE)[0]
        p.allocator.rebuild(keep)
        bits = np.unpackbits(np.frombuffer(p.observe(sec["bitmap"].offset, sec["bitmap"].length),
                                           np.uint8), bitorder="little")
        owners = np.frombuffer(p.observe(sec["owners"].offset, sec["owners"].length), np.uint8)
        hdr = np.frombuffer(p.observe(sec["alloc"].offset, 64), ALLOC_DTYPE)[0]
        tables = p.observe(sec["transfer"].offset, sec["transfer"].length) + \
            p.observe(sec["locks"].offset, sec["locks"].length)
    assert np.flatnonzero(bits).tolist() == sorted(keep.tolist())
    assert np.flatnonzero(owners).tolist() == sorted(keep.tolist())
    assert owners[keep].tolist() == [owners_old[taken[0]], owners_old[taken[-1]], 1, 1]
    assert int(hdr["used_slots"]) == 4
    assert [int(hdr[f]) for f in ("next_hint", "claims", "releases")] == \
        [int(hdr_old[f]) for f in ("next_hint", "claims", "releases")]
    assert tables == bytes(len(tables))
