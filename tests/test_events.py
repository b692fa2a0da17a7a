"""The region's KV events (docs/PROTOCOLS.md §13): the stripes' event logs and
the slots' block records, tailed by a reader on another node (real processes,
plain and under the non-coherence simulator), a burst that fits the logs read
from them and one that overruns them taken from a snapshot; the feed that
tells a router each change once, parents first; `tract events`."""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np
import pytest

from procs import Worker
from tract_cli.core.errors import UsageError
from tract_cli.core.events import (PARENT_WAIT_S, Block, Feed, RegionView, describe,
                                   event_fields, wire_hash)
from tract_cli.core.hashing import block_hashes, pool_root
from tract_cli.core.pool import Pool

TAG = "ab" * 16
OTHER_TAG = "cd" * 16


def chains(seed: int, count: int, blocks: int = 8) -> list:
    """COUNT prompts of BLOCKS blocks (procs_child's chain specs)."""
    return [[seed * 1000 + i, 0, seed * 1000 + i, blocks] for i in range(count)]


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
def test_a_reader_on_another_node_sees_every_store_and_eviction(managed_region, simulate):
    with Pool.attach(managed_region, node=0) as p:
        slots = p.slot_count
        capacity = p.info.section("events").entry_size // 64 - 1
    # under the simulator both keep private caches that evict lines at random:
    # the writer's lines reach the region out of order (an entry before its
    # head, a line half rewritten), the reader's stale copies linger or not
    writer = Worker(managed_region, 1, simulate=simulate,
                    sim_evict_prob=0.2 if simulate else 0.0, sim_seed=5)
    reader = Worker(managed_region, 2, simulate=simulate,
                    sim_evict_prob=0.05 if simulate else 0.0, sim_seed=3)
    try:
        assert reader.call("events_view_open", tag=TAG) == 0
        # a burst that fits the logs (about a quarter of a ring a stripe): read
        # from them, every block with its hash, parent and tokens
        stored = writer.call("events_put_described", chains=chains(1, 20), tag=TAG)["stored"]
        got = reader.call("events_view_poll")
        truth = reader.call("events_view_fresh", tag=TAG)
        assert stored == 160 and len(got["blocks"]) == 160
        assert got["blocks"] == truth["blocks"]
        assert got["resyncs"] == 0 and got["events_read"] == 160
        # past the pool's slots: its evictions are read as removals
        writer.call("events_put_described", chains=chains(2, slots // 8 + 10), tag=TAG)
        got = reader.call("events_view_poll")
        truth = reader.call("events_view_fresh", tag=TAG)
        assert got["blocks"] == truth["blocks"] and got["resyncs"] == 0
        assert got["events_read"] > 160 + slots         # stores and removals
        # another model's blocks are not this reader's
        writer.call("events_put_described", chains=chains(3, 4), tag=OTHER_TAG)
        got = reader.call("events_view_poll")
        truth = reader.call("events_view_fresh", tag=TAG)
        assert got["blocks"] == truth["blocks"]
        assert len(reader.call("events_view_fresh", tag=OTHER_TAG)["blocks"]) == 32
        # reads while the writer writes (its puts in flight while the reader polls)
        writer.send("events_put_described", chains=chains(6, 60), tag=TAG)
        polls, deadline = 0, time.monotonic() + 120
        while not writer.ready():
            reader.call("events_view_poll")
            polls += 1
            assert time.monotonic() < deadline, "the writer's puts did not finish in 120 s"
        writer.recv("events_put_described")
        got = reader.call("events_view_poll")
        truth = reader.call("events_view_fresh", tag=TAG)
        assert got["blocks"] == truth["blocks"] and polls > 0
        # a burst larger than a stripe's ring between two reads: the reader
        # finds its cursors overrun and takes those stripes from a snapshot
        burst = 4 * capacity // 8 * 2
        writer.call("events_put_described", chains=chains(4, burst), tag=TAG)
        got = reader.call("events_view_poll")
        truth = reader.call("events_view_fresh", tag=TAG)
        assert got["resyncs"] > 0
        assert got["blocks"] == truth["blocks"]
    finally:
        writer.close()
        reader.close()


def test_a_skipped_event_shows_as_a_difference(managed_region):
    """The comparison above can fail: a reader that misses one event differs."""
    with Pool.attach(managed_region, node=1) as p:
        bt = p.geometry.block_tokens
        view = RegionView(p, bytes.fromhex(TAG))
        missed = RegionView(p, bytes.fromhex(TAG))
        toks = np.arange(4 * bt, dtype=np.int32)
        keys = block_hashes(toks, root=pool_root(p.info))
        p.index.put(keys, np.zeros((4, p.info.block_bytes), np.uint8),
                    described=describe(keys, toks, bt, bytes.fromhex(TAG)))
        view.poll()
        fresh = RegionView(p, bytes.fromhex(TAG))
        assert len(view.blocks) == 4 and view.blocks == fresh.blocks
        # the same reads with the first event of one stripe skipped
        stripe = int(np.flatnonzero(view.cursors > missed.cursors)[0])
        missed.cursors[stripe] += 1
        missed.poll()
        assert len(missed.blocks) == 3 and missed.blocks != fresh.blocks


def test_records_tell_the_block_and_refuse_a_reused_slot(managed_region):
    with Pool.attach(managed_region, node=1) as p:
        bt = p.geometry.block_tokens
        toks = np.arange(3 * bt, dtype=np.int32) + 7
        keys = block_hashes(toks, root=pool_root(p.info))
        p.index.put(keys, np.zeros((3, p.info.block_bytes), np.uint8),
                    described=describe(keys, toks, bt, bytes.fromhex(TAG)))
        view = RegionView(p, None)
        blocks = [view.blocks[bytes(k)] for k in keys]
        assert [b.hash for b in blocks] == [bytes(k) for k in keys]
        assert blocks[0].parent is None and blocks[1].parent == bytes(keys[0])
        assert blocks[2].token_ids == toks[2 * bt:].tolist()
        assert {b.node for b in blocks} == {1} and blocks[0].tag == bytes.fromhex(TAG)
        # a block put without a description is not told of (no tokens to tell)
        bare = block_hashes(np.arange(bt, dtype=np.int32) + 99999, root=pool_root(p.info))
        p.index.put(bare, np.zeros((1, p.info.block_bytes), np.uint8))
        assert bytes(bare[0]) not in RegionView(p, None).blocks
        # every slot reused by other blocks: the old key's record is refused
        lookup = p.index.lookup(keys[:1])
        slot = int(lookup.slots[0])
        p.index.unpin(keys[:1])
        p.index.evict(p.slot_count)
        for i in range(p.slot_count // 8 + 1):
            t = np.arange(8 * bt, dtype=np.int32) + 10_000 * (i + 1)
            k = block_hashes(t, root=pool_root(p.info))
            p.index.put(k, np.zeros((8, p.info.block_bytes), np.uint8),
                        described=describe(k, t, bt, bytes.fromhex(OTHER_TAG)))
        rec, ids, ok = view._records(np.ascontiguousarray(keys[:1]), np.array([slot]))
        assert not ok[0]


def test_describe_checks_its_input():
    h = np.zeros((2, 32), np.uint8)
    with pytest.raises(UsageError, match="token ids for 2 blocks"):
        describe(h, np.arange(20), 16, b"t" * 16)
    with pytest.raises(UsageError, match="16 bytes"):
        describe(h, np.arange(32), 16, b"t")
    with pytest.raises(UsageError, match="outside"):
        describe(h, -np.arange(32), 16, b"t" * 16)
    d = describe(h, np.arange(20), 16, b"t" * 16, partial_last=True)
    assert d.records["n_tokens"].tolist() == [16, 4]


class _View:
    """A stand-in for RegionView's `blocks` (the feed reads nothing else)."""

    def __init__(self):
        self.blocks = {}


def _chain(n: int, node: int = 1, start: int = 0) -> list[Block]:
    out, parent = [], None
    for i in range(start, start + n):
        h = bytes([i + 1]) * 32
        out.append(Block(h[:16], h, parent, np.array([i], "<u4").tobytes(), node, b"t" * 16))
        parent = h
    return out


def test_the_feed_tells_parents_first_in_runs_and_each_change_once():
    view = _View()
    feed = Feed(view, node=1)
    chain = _chain(4)
    for b in reversed(chain):               # the order a poll may find them in
        view.blocks[b.key] = b
    feed.note(set(view.blocks))
    out = feed.take(now=0.0)
    assert [(c.kind, [b.hash for b in c.blocks], c.parent, c.local) for c in out] == [
        ("stored", [b.hash for b in chain], None, True)]
    assert feed.take(now=0.0) == []          # told once
    # a block stored and evicted between two takes is never told
    extra = _chain(1, start=40)[0]
    view.blocks[extra.key] = extra
    feed.note({extra.key})
    del view.blocks[extra.key]
    assert feed.take(now=0.0) == []
    # removal: told once, with the hashes told before
    del view.blocks[chain[3].key]
    feed.note({chain[3].key})
    out = feed.take(now=0.0)
    assert [(c.kind, [b.hash for b in c.blocks]) for c in out] == [("removed", [chain[3].hash])]


def test_a_block_whose_parent_was_never_told_waits_then_is_told():
    view = _View()
    feed = Feed(view, node=2)
    orphan = _chain(3)[2]                   # its parent is in no one's view
    view.blocks[orphan.key] = orphan
    feed.note({orphan.key})
    assert feed.take(now=10.0) == []
    out = feed.take(now=10.0 + PARENT_WAIT_S)
    assert [(c.kind, c.parent, c.local) for c in out] == [("stored", orphan.parent, False)]


def test_event_fields_are_vllms():
    blk = _chain(2, node=3)
    from tract_cli.core.events import Change
    kind, f = event_fields(Change("stored", blk, None, False), block_size=16, medium="CPU",
                           ownership="tract:x", locality=True)
    assert kind == "BlockStored" and f["locality"] == "REMOTE" and f["token_ids"] == [0, 1]
    # vLLM's int hashes: the last 8 bytes, big-endian
    assert f["block_hashes"][0] == int.from_bytes(blk[0].hash[-8:], "big")
    assert wire_hash(blk[0].hash, False) == blk[0].hash
    assert f["extra_keys"] == [None, None] and f["group_idx"] == 0     # as vLLM's
    kind, f = event_fields(Change("removed", blk, None, True), block_size=16, medium="CPU",
                           ownership=None, locality=False)
    assert kind == "BlockRemoved" and f["locality"] is None and f["ownership"] is None


def test_tract_events_prints_the_region_blocks(managed_region):
    with Pool.attach(managed_region, node=1) as p:
        bt = p.geometry.block_tokens
        toks = np.arange(2 * bt, dtype=np.int32)
        keys = block_hashes(toks, root=pool_root(p.info))
        p.index.put(keys, np.zeros((2, p.info.block_bytes), np.uint8),
                    described=describe(keys, toks, bt, bytes.fromhex(TAG)))
        uuid = p.info.uuid
    res = subprocess.run([sys.executable, "-m", "tract_cli.cli", "events", managed_region,
                          "--once", "--json", "--node", "2", "--no-start-agent"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = [json.loads(x) for x in res.stdout.splitlines()]
    assert len(lines) == 1 and lines[0]["type"] == "BlockStored"
    ev = lines[0]
    assert ev["token_ids"] == toks.tolist() and ev["block_size"] == bt
    assert ev["block_hashes"] == [int.from_bytes(bytes(k[-8:]), "big") for k in keys]
    assert ev["locality"] == "REMOTE" and ev["ownership"] == f"tract:{uuid}"
    assert ev["medium"] == "CPU" and ev["nodes"] == [1] and ev["tags"] == [TAG]
    res = subprocess.run([sys.executable, "-m", "tract_cli.cli", "events", managed_region,
                          "--once", "--json", "--tag", OTHER_TAG, "--no-start-agent"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and res.stdout == ""
    res = subprocess.run([sys.executable, "-m", "tract_cli.cli", "inspect", managed_region,
                          "--index", "--json"], capture_output=True, text=True, timeout=60)
    assert json.loads(res.stdout)["index"]["events"]["appended"] == 2


def test_a_repair_moves_every_reader_to_a_snapshot(region_path):
    """`tract check --repair` changes READY buckets without events: a reader that
    kept its place finds every log moved on and takes the region from a snapshot."""
    from agents import RunningAgent
    Pool.create(region_path, 16 << 20, "tiny", nodes=3, index_stripes=4).close()
    with RunningAgent(region_path, 0, manager=True), Worker(region_path, 1) as w:
        w.call("events_put_described", chains=chains(5, 3), tag=TAG)
        with Pool.attach(region_path, node=2) as p:
            kept = RegionView(p, bytes.fromhex(TAG)).cursors.copy()
    res = subprocess.run([sys.executable, "-m", "tract_cli.cli", "check", region_path,
                          "--repair"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    with RunningAgent(region_path, 0, manager=True), Pool.attach(region_path, node=2) as p:
        view = RegionView(p, bytes.fromhex(TAG))
        view.cursors[:] = kept
        view.poll()
        assert view.resyncs == 4 and len(view.blocks) == 24


def test_the_tail_polls_on_its_thread_and_stops(managed_region):
    from tract_cli.core.events import Tail
    with Pool.attach(managed_region, node=1) as p:
        tail = Tail(p, bytes.fromhex(TAG), node=1, interval_s=0.01)
        try:
            bt = p.geometry.block_tokens
            toks = np.arange(2 * bt, dtype=np.int32) + 5
            keys = block_hashes(toks, root=pool_root(p.info))
            p.index.put(keys, np.zeros((2, p.info.block_bytes), np.uint8),
                        described=describe(keys, toks, bt, bytes.fromhex(TAG)))
            told = []
            deadline = time.monotonic() + 30
            while len([b for c in told for b in c.blocks]) < 2:
                assert time.monotonic() < deadline, f"not told within 30 s: {tail.error}"
                told += tail.take()
                time.sleep(0.01)      # polling what another thread gathers, bounded
            # (one run, or two when a poll fell between the put's two stripe sections)
            assert {c.kind for c in told} == {"stored"} and all(c.local for c in told)
            assert {b.hash for c in told for b in c.blocks} == {bytes(k) for k in keys}
        finally:
            tail.close()
        assert not tail._thread.is_alive()


def test_a_head_past_an_entry_not_seen_is_waited_for_then_resynchronised(managed_region,
                                                                           monkeypatch):
    """A log whose head is past an entry this host cannot see (its writer died
    between the two lines): read again later, then taken from a snapshot."""
    from tract_cli.core import events
    with Pool.attach(managed_region, node=1) as p:
        view = RegionView(p, bytes.fromhex(TAG))
        ev = p.info.section("events")
        stripe = 1
        head_off = ev.offset + stripe * ev.entry_size
        p.publish_u64(head_off, p.observe_u64(head_off) + 1)   # a head with no entry
        view.poll()
        assert view.resyncs == 0 and stripe in view._behind_since   # behind: waits
        monkeypatch.setattr(events, "BEHIND_LIMIT_S", 0.0)
        view.poll()
        assert view.resyncs == 1 and stripe not in view._behind_since
        assert view.cursors[stripe] == p.observe_u64(head_off)


def test_microbench_events_measures_each_part():
    res = subprocess.run([sys.executable, "-m", "tract_cli.cli", "microbench", "events",
                          "--input-len", "320", "--rounds", "1", "--flush-mode", "none",
                          "--json"], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    (fig,) = json.loads(res.stdout)
    assert fig["blocks"] == 20 and fig["flush_mode"] == "none"
    for name in ("commit_plain_us", "commit_described_us", "describe_us", "poll_us",
                 "poll_idle_us", "snapshot_us", "take_us"):
        assert fig[name] > 0, name


def test_a_salted_prompt_tells_its_salt_on_its_first_block(managed_region):
    """The salt is kept in the prompt's first block's record and told as vLLM
    tells it (that block's extra key); a record whose salt is not UTF-8 is not
    trusted; a salt longer than a record holds is refused by describe."""
    from tract_cli.core.events import Change
    with Pool.attach(managed_region, node=1) as p:
        bt = p.geometry.block_tokens
        toks = np.arange(3 * bt, dtype=np.int32) + 11
        keys = block_hashes(toks, root=pool_root(p.info, "tenant-a"))
        d = describe(keys, toks, bt, bytes.fromhex(TAG), salt="tenant-a")
        assert d.records["salt_len"].tolist() == [8, 0, 0]
        p.index.put(keys, np.zeros((3, p.info.block_bytes), np.uint8), described=d)
        view = RegionView(p, bytes.fromhex(TAG))
        assert [view.blocks[bytes(k)].salt for k in keys] == ["tenant-a", None, None]
        run = [view.blocks[bytes(k)] for k in keys]
        _, f = event_fields(Change("stored", run, None, False), block_size=bt, medium="CPU",
                            ownership=None, locality=True)
        assert f["extra_keys"] == [("tenant-a",), None, None]
        # a later part of the prompt (its first block has a parent) carries no salt
        tail = describe(keys[1:], toks[bt:], bt, bytes.fromhex(TAG), bytes(keys[0]),
                        salt="tenant-a")
        assert tail.records["salt_len"].tolist() == [0, 0]
        # a salt that is not UTF-8 (another host's bytes): the block is not told
        bad = block_hashes(toks + 1, root=pool_root(p.info))
        d = describe(bad, toks + 1, bt, bytes.fromhex(TAG))
        d.records["salt_len"][0] = 2
        d.records["salt"][0] = b"\xff\xfe" + bytes(58)
        p.index.put(bad, np.zeros((3, p.info.block_bytes), np.uint8), described=d)
        view.poll()
        assert bytes(bad[0]) not in view.blocks and bytes(bad[1]) in view.blocks
    with pytest.raises(UsageError, match="does not fit"):
        describe(np.zeros((1, 16), np.uint8), np.arange(16), 16, b"t" * 16, salt="s" * 61)


def test_once_tells_blocks_whose_parent_is_gone():
    """What the region holds now (`tract events --once`): a chain whose first
    block's parent was evicted is told all the same, parents first."""
    view = _View()
    feed = Feed(view, node=1)
    chain = _chain(4)[1:]                  # block 0, their parent, is gone
    for b in chain:
        view.blocks[b.key] = b
    feed.note(set(view.blocks))
    out = feed.take(now=0.0, wait_parents=False)
    assert [[b.hash for b in c.blocks] for c in out] == [[b.hash for b in chain]]


def test_a_retell_tells_removals_first_then_the_whole_view():
    view = _View()
    feed = Feed(view, node=1)
    chain = _chain(3)
    for b in chain:
        view.blocks[b.key] = b
    feed.note(set(view.blocks))
    feed.take(now=0.0)
    del view.blocks[chain[2].key]           # evicted, then a subscriber joins
    feed.note({chain[2].key})
    feed.retell()
    out = feed.take(now=0.0)
    assert [(c.kind, [b.hash for b in c.blocks]) for c in out] == [
        ("removed", [chain[2].hash]), ("stored", [chain[0].hash, chain[1].hash])]
    assert feed.take(now=0.0) == []


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
def test_a_writer_killed_inside_its_section_moves_readers_to_a_snapshot(managed_region,
                                                                         simulate):
    """A writer killed between an event and its log's head: the stripe's next
    holder repairs it and moves the log on, so a reader resynchronises and sees
    the block the dead writer published (never a stale view)."""
    from tract_cli.core.native import lib
    from tract_cli.core.recovery import recover_dead_processes
    reader = Worker(managed_region, 2, simulate=simulate)
    try:
        reader.call("events_view_open", tag=TAG)
        dying = Worker(managed_region, 1, simulate=simulate,
                       env={"TRACT_DIE_AT": str(lib.TRACT_DIE_EVENT_APPENDED)})
        dying.send("events_put_described", chains=chains(7, 1), tag=TAG)
        assert dying.proc.wait(timeout=60) == -9, "the put appended no event"
        dying.close()
        with Pool.attach(managed_region, node=1, simulate=simulate) as p:
            assert vars(recover_dead_processes(p, timeout=30))["processes"] == 1
        # the next holders of the stripes (node 1's) repair them as they enter
        with Worker(managed_region, 1, simulate=simulate) as successor:
            successor.call("events_put_described", chains=chains(8, 12), tag=TAG)
        got = reader.call("events_view_poll")
        truth = reader.call("events_view_fresh", tag=TAG)
        assert got["resyncs"] >= 1 and got["blocks"] == truth["blocks"]
    finally:
        reader.close()
