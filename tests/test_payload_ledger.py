"""KV payload lines under the non-coherence simulator (docs/PROTOCOLS.md §1.1):
a reader on another host never sees a stale line of a reused slot, by a copy
or in place, and the node's payload ledger spares the eviction of a slot
only while its cached lines are of the very payload being read.

The simulator's private cache stands for the reader host's caches: payload
loads go through it (copies, `checksum_slots`), so a missing eviction shows
as stale bytes.  tests/mutation.py removes the eviction
(SITE_PAYLOAD_EVICT) and the claim's new epoch (SITE_INDEX_CLAIM_EPOCH) and
checks these tests fail; and for the sweep that evicts dead payloads off
the request path, its eviction (SITE_PAYLOAD_SWEEP_EVICT), its sparing of
live payloads (SITE_PAYLOAD_SWEEP_LIVE) and the writer's forgetting of a
slot it takes (SITE_PAYLOAD_FORGET)."""
from __future__ import annotations

import pytest

from agents import RunningAgent
from procs import Worker
from tract_cli.core.pool import LEDGER_EVICTED, Pool

CHAIN_A = [7, 0, 70, 6]      # (prefix seed, prefix blocks, suffix seed, blocks)
CHAIN_B = [8, 0, 80, 6]
ONE = [9, 0, 90, 1]


def _put_blocks(p, n: int, fill: int = 0):
    """Puts N blocks of FILL bytes under the chain of tokens 0..N-1 (plain
    mode, one process); returns (keys, kv)."""
    import numpy as np
    from tract_cli.core.hashing import block_hashes, pool_root
    keys = block_hashes(np.arange(n, dtype=np.int32), root=pool_root(p.info))
    kv = np.full((len(keys), p.info.block_bytes), fill, np.uint8)
    p.index.put(keys, kv)
    return keys, kv


def _reuse_slots(writer, reader, zero_copy: bool) -> list:
    """Host 2 reads chain A (its cache keeps A's lines); host 1 evicts A and
    writes chain B, which takes A's slots again; returns A's slots."""
    slots_a = writer.call("index_put_variant", chain=CHAIN_A, variant=1)
    reader.call("index_read_variant", chain=CHAIN_A, variant=1, zero_copy=zero_copy)
    writer.call("index_evict_all")
    slots_b = writer.call("index_put_variant", chain=CHAIN_B, variant=2)
    assert set(slots_a) & set(slots_b), "no slot was reused: the test checks nothing"
    return slots_a


@pytest.fixture
def region(region_path):
    Pool.create(region_path, 16 << 20, "tiny", nodes=3, flush_mode="clflush").close()
    with RunningAgent(region_path, 0, manager=True, simulate=True):
        yield region_path


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "in-place"])
def test_a_reader_never_sees_a_stale_line_of_a_reused_slot(region, zero_copy):
    """Host 2 reads chain A (its cache keeps A's lines); host 1 evicts A and
    writes chain B into the same slots: host 2 must read B, not A."""
    with Worker(region, 1, True) as writer, Worker(region, 2, True) as reader:
        _reuse_slots(writer, reader, zero_copy)
        reader.call("index_read_variant", chain=CHAIN_B, variant=2, zero_copy=zero_copy)


def test_the_same_key_rewritten_in_the_same_slot_is_a_new_payload(region):
    """A block evicted and recomputed (other bytes) lands in the same bucket
    and slot: the claim's new epoch makes it a new payload tag, so host 2,
    which cached the old bytes, evicts them."""
    with Worker(region, 1, True) as writer, Worker(region, 2, True) as reader:
        first = writer.call("index_put_variant", chain=ONE, variant=1)
        reader.call("index_read_variant", chain=ONE, variant=1, zero_copy=True)
        writer.call("index_evict_all")
        second = writer.call("index_put_variant", chain=ONE, variant=2)
        assert first == second, "the block moved to another slot: the test checks nothing"
        reader.call("index_read_variant", chain=ONE, variant=2, zero_copy=True)


def test_a_pinned_payload_read_again_is_not_evicted_again(region):
    """The ledger's saving: the second read of the same payload evicts
    nothing; once the slots hold another payload, they are evicted again."""
    with Worker(region, 1, True) as writer, Worker(region, 2, True) as reader:
        slots_a = writer.call("index_put_variant", chain=CHAIN_A, variant=1)
        first = reader.call("index_read_variant", chain=CHAIN_A, variant=1, zero_copy=True)
        again = reader.call("index_read_variant", chain=CHAIN_A, variant=1, zero_copy=True)
        assert first["evicted"] == len(slots_a)
        assert again["evicted"] == 0 and again["sim_evictions"] == 0
        writer.call("index_evict_all")
        slots_b = writer.call("index_put_variant", chain=CHAIN_B, variant=2)
        moved = reader.call("index_read_variant", chain=CHAIN_B, variant=2, zero_copy=True)
        assert moved["evicted"] == len(slots_b)      # new payloads, whatever slots they took


def test_lookup_tags_name_the_bucket_and_a_new_epoch_per_claim(region_path):
    """Plain mode, one process: a re-put of an evicted key gets another tag."""
    Pool.create(region_path, 16 << 20, "tiny", nodes=2).close()
    with RunningAgent(region_path, 0, manager=True), Pool.attach(region_path, node=1) as p:
        keys, kv = _put_blocks(p, 32)
        hit = p.index.lookup(keys)
        tags1 = hit.tags.copy()
        p.index.unpin(hit)
        assert (tags1 != 0).all() and len(set(tags1.tolist())) == len(keys)
        p.index.evict(p.slot_count)
        p.index.put(keys, kv)
        hit = p.index.lookup(keys)
        tags2 = hit.tags.copy()
        p.index.unpin(hit)
        assert not set(tags1.tolist()) & set(tags2.tolist())
        assert ((tags2 >> 32) > (tags1 >> 32)).any()          # a later epoch


def test_a_handoff_carries_the_payload_tags_of_its_blocks(region_path):
    """The decode side reads a record's tags without a lookup of its own (the
    blocks are pinned by the record): they equal the index's, so a decode
    node that read these payloads before evicts nothing the second time."""
    import numpy as np
    from tract_cli.core.hashing import block_hashes, pool_root
    Pool.create(region_path, 16 << 20, "tiny", nodes=3).close()
    with RunningAgent(region_path, 0, manager=True), Pool.attach(region_path, node=1) as pre, \
            Pool.attach(region_path, node=2) as dec:
        keys = block_hashes(np.arange(80, dtype=np.int32), root=pool_root(pre.info))
        pre.index.put(keys, np.ones((len(keys), pre.info.block_bytes), np.uint8))
        hit = pre.index.lookup(keys)
        want = hit.tags.copy()
        pre.index.unpin(hit)
        for round_ in range(2):
            ticket = pre.handoffs.publish(f"r{round_}", keys, len(keys) * 16)
            rec = dec.handoffs.open(ticket)
            assert rec.tags.tolist() == want.tolist()
            evicted = dec.acquire_payload(rec.slots, rec.tags)
            assert evicted == (len(keys) if round_ == 0 else 0)
            dec.handoffs.ack(ticket)


@pytest.fixture
def paged_region(region_path):
    """As `region`, with 16 KiB blocks (tiny-llama): a reader of an EVICTED
    slot still evicts its first and last 4 KiB, so a slot must be larger than
    two pages for a missing sweep eviction to show in its middle."""
    Pool.create(region_path, 16 << 20, "tiny-llama", nodes=3, flush_mode="clflush").close()
    with RunningAgent(region_path, 0, manager=True, simulate=True):
        yield region_path


@pytest.mark.parametrize("zero_copy", [False, True], ids=["copy", "in-place"])
def test_a_swept_slot_is_read_afresh_without_an_eviction(paged_region, zero_copy):
    """Host 2 reads chain A; host 1 evicts A and writes B into the same
    slots; host 2's sweep (the agent's, off the request path) finds A dead
    and evicts: reading B then evicts nothing and sees B, not A."""
    region = paged_region
    with Worker(region, 1, True) as writer, Worker(region, 2, True) as reader:
        slots_a = _reuse_slots(writer, reader, zero_copy)
        assert reader.call("sweep_payload") >= len(slots_a)
        got = reader.call("index_read_variant", chain=CHAIN_B, variant=2, zero_copy=zero_copy)
        if zero_copy:
            assert got["evicted"] == 0, "a swept slot was evicted again on the request path"


def test_the_sweep_spares_a_payload_that_is_being_read(paged_region):
    """The sweep runs while host 2 holds views of A (pinned, live): it must
    leave A's slots alone, since host 2 goes on loading A's lines; had it
    marked them EVICTED, host 2 would read B (written later into the same
    slots) from those stale lines without evicting them."""
    region = paged_region
    with Worker(region, 1, True) as writer, Worker(region, 2, True) as reader:
        slots_a = writer.call("index_put_variant", chain=CHAIN_A, variant=1)
        got = reader.call("index_read_variant", chain=CHAIN_A, variant=1, zero_copy=True,
                          sweep_while_pinned=True)
        assert got["swept"] == 0, f"the sweep evicted {got['swept']} slots of live payloads"
        writer.call("index_evict_all")
        slots_b = writer.call("index_put_variant", chain=CHAIN_B, variant=2)
        assert set(slots_a) & set(slots_b), "no slot was reused: the test checks nothing"
        reader.call("index_read_variant", chain=CHAIN_B, variant=2, zero_copy=True)


def test_a_slot_taken_by_a_writer_of_the_node_is_no_longer_evicted(region_path):
    """Plain mode, one process: a free slot the sweep evicted is EVICTED in
    the node's ledger; once a writer of the node takes it, it is not (the
    writer's lines may stay in the node's caches: clwb, partial lines)."""
    from tract_cli.core.native import lib
    Pool.create(region_path, 16 << 20, "tiny", nodes=2, flush_mode="clflush").close()
    with RunningAgent(region_path, 0, manager=True), Pool.attach(region_path, node=1) as p:
        keys, kv = _put_blocks(p, 32)
        hit = p.index.lookup(keys)
        slots = hit.slots.tolist()
        p.index.unpin(hit)
        p.index.evict(p.slot_count)                   # the slots go back to node 1's list
        assert p.sweep_payload(0, p.slot_count, 1 << 40)[1] == p.slot_count
        assert all(lib.tract_payload_ledger(p._r(), s) == lib.TRACT_LEDGER_EVICTED
                   for s in range(p.slot_count))
        p.index.put(keys, kv)
        hit = p.index.lookup(keys)
        again = hit.slots.tolist()
        p.index.unpin(hit)
        assert set(again) & set(slots), "no slot was reused: the test checks nothing"
        stale = [s for s in again if lib.tract_payload_ledger(p._r(), s) == lib.TRACT_LEDGER_EVICTED]
        assert not stale, f"slots {stale} were written by this node and are still EVICTED"


def test_the_agent_sweeps_so_a_first_handoff_read_evicts_nothing(region_path):
    """Plain mode, real agents: the decode node's agent sweeps the free slots
    of a fresh region off the request path, so the first read of a handoff's
    blocks there evicts nothing (bounded wait, then the assertion)."""
    import time
    import numpy as np
    from tract_cli.core.hashing import block_hashes, pool_root
    from tract_cli.core.native import lib
    Pool.create(region_path, 16 << 20, "tiny", nodes=3, flush_mode="clflush").close()
    with RunningAgent(region_path, 0, manager=True), RunningAgent(region_path, 2, manager=False), \
            Pool.attach(region_path, node=1) as pre, Pool.attach(region_path, node=2) as dec:
        deadline = time.monotonic() + 60
        while not all(lib.tract_payload_ledger(dec._r(), s) == lib.TRACT_LEDGER_EVICTED
                      for s in range(dec.slot_count)):
            assert time.monotonic() < deadline, "node 2's agent did not sweep its free slots in 60 s"
            time.sleep(0.05)
        keys = block_hashes(np.arange(80, dtype=np.int32), root=pool_root(pre.info))
        pre.index.put(keys, np.ones((len(keys), pre.info.block_bytes), np.uint8))
        ticket = pre.handoffs.publish("r0", keys, len(keys) * 16)
        rec = dec.handoffs.open(ticket)
        assert dec.acquire_payload(rec.slots, rec.tags) == 0
        assert dec.acquire_payload(rec.slots, rec.tags) == 0
        dec.handoffs.ack(ticket)


def test_what_the_node_loads_outside_acquire_is_no_longer_evicted(region_path):
    """A handoff's key list and partial tail are loaded by the decode node
    without a payload tag (open, copy_tail, ack: tract_copy_out); so are
    objects kept in slots (observe/publish).  Once loaded they must leave the
    EVICTED state, or the slot's next payload would be read from those lines
    without an eviction (found by the cold review)."""
    import numpy as np
    from tract_cli.core.hashing import block_hashes, pool_root
    from tract_cli.core.media import RECORD_DTYPE
    from tract_cli.inspect.snapshot import Sections
    Pool.create(region_path, 16 << 20, "tiny", nodes=3, flush_mode="clflush").close()
    with RunningAgent(region_path, 0, manager=True), Pool.attach(region_path, node=1) as pre, \
            Pool.attach(region_path, node=2) as dec:
        assert dec.sweep_payload(0, dec.slot_count, 1 << 40)[1] == dec.slot_count
        nbytes = pre.info.block_bytes
        keys = block_hashes(np.arange(48, dtype=np.int32), root=pool_root(pre.info))
        pre.index.put(keys, np.ones((len(keys), nbytes), np.uint8))
        tail = np.full(nbytes, 7, np.uint8)
        ticket = pre.handoffs.publish("r", keys, len(keys) * 16 + 3, tail=tail, tail_tokens=3)
        rec = Sections(pre)["transfer"].view(RECORD_DTYPE)[ticket.record]
        data = pre.info.section("data")
        key_slot = (int(rec["keys_offset"]) - data.offset) // pre.info.slot_stride
        tail_slot = int(rec["tail_slot"]) - 1
        got = dec.handoffs.open(ticket)
        out = np.empty(nbytes, np.uint8)
        dec.handoffs.copy_tail(got, out)
        assert np.array_equal(out, tail)
        dec.handoffs.ack(ticket)
        for what, slot in (("key list", key_slot), ("tail", tail_slot)):
            assert dec.payload_ledger(slot) != LEDGER_EVICTED, \
                f"the {what} slot {slot} was loaded on node 2 and is still EVICTED there"
        # an object kept in a slot, read with observe
        slot = int(pre.allocator.alloc(1)[0])
        assert dec.payload_ledger(slot) == LEDGER_EVICTED
        dec.observe(pre.slot_offset(slot), 64)
        assert dec.payload_ledger(slot) != LEDGER_EVICTED


def test_a_sweep_in_mode_none_vouches_for_nothing(region_path):
    """Flush mode none evicts nothing, and the mode is per process: a sweep
    there must not tell the node's clflush readers that a slot is EVICTED."""
    Pool.create(region_path, 16 << 20, "tiny", nodes=2).close()
    with Pool.attach(region_path, node=1, flush_mode="none") as lazy:
        assert lazy.sweep_payload(0, lazy.slot_count, 1 << 40)[1] == 0
        assert all(lazy.payload_ledger(s) == 0 for s in range(lazy.slot_count))


def test_a_read_that_outlived_its_handoff_is_forgotten(region_path):
    """The decode side acknowledges after the handoff expired and was
    reclaimed: its loads may have outlived the record, so its node's ledger
    forgets the slots (their next payloads get evicted before any read)."""
    import numpy as np
    from tract_cli.core.errors import HandoffError
    from tract_cli.core.hashing import block_hashes, pool_root
    Pool.create(region_path, 16 << 20, "tiny", nodes=3, flush_mode="clflush").close()
    with RunningAgent(region_path, 0, manager=True), Pool.attach(region_path, node=1) as pre, \
            Pool.attach(region_path, node=2) as dec:
        keys = block_hashes(np.arange(48, dtype=np.int32), root=pool_root(pre.info))
        pre.index.put(keys, np.ones((len(keys), pre.info.block_bytes), np.uint8))
        # a long TTL: the manager's agent (real time) never reclaims it first;
        # the reclaim below runs with a clock far past any expiry
        ticket = pre.handoffs.publish("r", keys, len(keys) * 16, ttl=60)
        rec = dec.handoffs.open(ticket)
        dec.handoffs.views(rec)
        assert all(dec.payload_ledger(int(s)) == int(t) for s, t in zip(rec.slots, rec.tags))
        assert pre.handoffs.reclaim(now_ns=2**62) == 1
        with pytest.raises(HandoffError):
            dec.handoffs.ack(ticket, read=dec.handoffs.read_slots(rec))
        assert all(dec.payload_ledger(int(s)) == 0 for s in rec.slots)


def test_a_copying_read_leaves_the_ledger_vouching_for_its_payload(region_path):
    """index.read acquires the slots with their tags, then copies: the copy
    itself must not make the node forget them (a re-read evicts nothing)."""
    import numpy as np
    Pool.create(region_path, 16 << 20, "tiny", nodes=2, flush_mode="clflush").close()
    with RunningAgent(region_path, 0, manager=True), Pool.attach(region_path, node=1) as p:
        keys, kv = _put_blocks(p, 32, fill=1)
        hit = p.index.lookup(keys)
        out = np.empty_like(kv)
        p.index.read(hit, out)
        assert [p.payload_ledger(int(s)) for s in hit.slots] == [int(t) for t in hit.tags]
        assert p.acquire_payload(hit.slots, hit.tags) == 0
        p.index.unpin(hit)
