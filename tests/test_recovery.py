"""Recovery of what dead processes held in the index (native/journal.c):
pins a reader took and never gave back, and keys a writer reserved (PENDING,
with a slot) and never published. Real processes on emulated nodes are
killed with SIGKILL; the node's recovery (what the agent runs every
heartbeat) gives back exactly what they held, never what live processes
hold. Plain mode and the non-coherence simulator."""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from agents import RunningAgent
from index_check import check_index, lru_lists
from procs import Worker
from tract_cli.core.locks import LOCK_ALLOCATOR, stripe_lock
from tract_cli.core.native import ffi, lib
from tract_cli.core.pool import Pool
from tract_cli.core.recovery import recover_dead_processes
from tract_cli.inspect import snapshot

CHAIN = [0, 0, 11, 12]          # prefix_seed, prefix_blocks, suffix_seed, blocks


@pytest.fixture
def region(managed_region):
    return managed_region


def pins_of(path: str) -> dict:
    with Pool.attach(path, readonly=True, prefault=False, local=False) as p:
        ix = snapshot.take(p, views=("index",))["index"]
    return {"total": ix["pins_total"], "by_node": ix["pinned_by_node"],
            "pending": ix["states"]["PENDING"]}


def lock_slot_state(path: str, lock_id: int, node: int) -> tuple[int, int]:
    """(state, pid) of NODE's slot of lock LOCK_ID (FORMAT.md §4.1)."""
    import numpy as np
    from tract_cli.core.media import SLOT_DTYPE
    with Pool.attach(path, readonly=True, prefault=False, local=False) as p:
        sec = p.info.section("locks")
        at = sec.offset + lock_id * sec.entry_size + (1 + node) * 64
        slot = np.frombuffer(p.observe(at, 64), SLOT_DTYPE)[0]
    return int(slot["state"]), int(slot["pid"])


def test_an_agent_killed_waiting_to_give_back_a_dead_readers_pins_leaves_them_journaled(region):
    """A dead reader's journaled pins are given back by its node's agent a key
    at a time, each in that key's stripe section. The journal entry is
    forgotten only once the stripe lock is held: an agent killed while it
    waits for the lock (held by a live process on another node here; a dead
    host's, until its verdict, in the chaos run that found this) leaves the
    entry for the next agent. It used to be forgotten before the wait, and
    that key's pins leaked."""
    with Worker(region, 3) as writer:
        writer.call("index_put_chains", chains=[CHAIN])
    with Worker(region, 1) as reader:
        assert reader.call("index_pin_chain", chain=CHAIN) == 12
        reader.kill()
    stripes = [stripe_lock(s) for s in range(4)]
    with Worker(region, 2) as holder:
        for lock in stripes:                    # ascending: every stripe is busy
            holder.call("lock_acquire", lock_id=lock)
        recoverer = Worker(region, 1)
        try:
            recoverer.send("recover_dead", timeout=60)
            waiting = lambda: any(lock_slot_state(region, lock, 1) == (1, recoverer.proc.pid)
                                  for lock in stripes)
            deadline = time.monotonic() + 60
            while not waiting():
                assert time.monotonic() < deadline, "the recovery never waited for a stripe"
                assert recoverer.proc.poll() is None, "the recovery ended without waiting"
                time.sleep(0.01)      # polling the lock table, bounded
            recoverer.kill()                     # killed while it waits
        finally:
            recoverer.close()
        for lock in reversed(stripes):
            holder.call("lock_release", lock_id=lock)
    assert pins_of(region)["total"] == 12
    with Pool.attach(region, node=1) as p:
        from tract_cli.core.recovery import recover_node
        got = recover_node(p, orphans=False, timeout=30)
        assert not got.errors, got
    assert pins_of(region)["total"] == 0


def node_free_list(path: str, node: int) -> set:
    with Pool.attach(path, node=node, prefault=False) as p:
        return set(p.allocator.local_free().tolist())


def killed(worker: Worker) -> None:
    """SIGKILL, and wait (bounded) until the process is gone."""
    worker.proc.kill()
    worker.proc.wait(timeout=30)
    worker.close()


def recover(path: str, node: int) -> dict:
    with Pool.attach(path, node=node) as p:
        return vars(recover_dead_processes(p, timeout=30))


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
def test_a_dead_readers_pins_are_given_back_and_a_live_ones_kept(region, simulate):
    with Worker(region, 1, simulate) as writer:
        assert writer.call("index_put_chains", chains=[CHAIN])["stored"] == 12
    live, dead = Worker(region, 2, simulate), Worker(region, 2, simulate)
    try:
        assert live.call("index_pin_chain", chain=CHAIN) == 12
        assert dead.call("index_pin_chain", chain=CHAIN) == 12
        assert dead.call("index_pin_chain", chain=CHAIN) == 12      # twice: 2 pins per key
        assert pins_of(region)["total"] == 36
        killed(dead)
        got = recover(region, 2)
        assert got["processes"] == 1 and got["pins"] == 24 and got["claims"] == 0
        assert pins_of(region)["total"] == 12                       # the live reader's
        assert recover(region, 2)["processes"] == 0                 # nothing twice
    finally:
        live.close()
    check_index(region)


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
def test_a_dead_writers_reserved_keys_are_dropped_and_their_slots_freed(region, simulate):
    w = Worker(region, 1, simulate)
    got = w.call("index_reserve_chain", chain=CHAIN)
    assert got["claimed"] == 12 and len(got["slots"]) == 12
    killed(w)
    assert pins_of(region)["pending"] == 12
    assert not set(got["slots"]) & node_free_list(region, 1)
    # nobody else can write those keys while the dead writer's claims stand
    with Worker(region, 3, simulate) as other:
        assert other.call("index_put_chains", chains=[CHAIN])["already_pending"] == 12
    rec = recover(region, 1)
    assert rec == {"processes": 1, "pins": 0, "claims": 12, "slots": 12, "partial": 0,
                   "pending": False}
    assert pins_of(region)["pending"] == 0
    assert set(got["slots"]) <= node_free_list(region, 1)      # back to the node's free list
    with Worker(region, 3, simulate) as other:
        assert other.call("index_put_chains", chains=[CHAIN])["stored"] == 12
        assert other.call("index_lookup_verify", chains=[CHAIN]) == [12]
    check_index(region)


def test_a_dead_prefill_workers_pinned_put_is_unpinned(region):
    w = Worker(region, 1)
    assert w.call("index_put_pinned_chain", chain=CHAIN) == 12
    killed(w)
    assert pins_of(region)["total"] == 12
    assert recover(region, 1)["pins"] == 12
    assert pins_of(region)["total"] == 0
    check_index(region)


# where a process dies inside a pin move: (what it does, how many pin moves it
# makes before the one it dies inside, blocks written before it and pinned by
# a live reader of its node). A lookup takes 12 pins then gives 12 back; a
# pinning put over 6 READY blocks pins those 6 as it claims, then 6 as it commits.
PIN_MOVE_DEATHS = {"lookup's pin": ("index_lookup_verify", 5, 12),
                   "unpin": ("index_lookup_verify", 12 + 5, 12),
                   "pinned put's pin of a READY block": ("index_put_pinned_chain", 2, 6),
                   "pinned put's pin as it commits": ("index_put_pinned_chain", 6 + 2, 6)}
PIN_MOVE_POINTS = {"named": lib.TRACT_DIE_PIN_NAMED, "between": lib.TRACT_DIE_PIN_MOVED,
                   "both": lib.TRACT_DIE_PIN_BOTH}


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
@pytest.mark.parametrize("point", list(PIN_MOVE_POINTS))
@pytest.mark.parametrize("where", list(PIN_MOVE_DEATHS))
def test_a_process_killed_inside_a_pin_move_is_recovered_exactly(region, simulate, where,
                                                                 point):
    """A pin is a store of the node's count and an entry in the process's
    journal; killed between the two, the process used to leave one pin no
    journal named (the journal may say less than the process held, never
    more), for `tract check --repair`. The move is now named in the journal
    first, and the repair of the stripe it died inside tells from the count
    whether the move reached it: recovery gives back exactly what it held
    (killed with the move named and nothing moved, between the two stores,
    or with both made), and a live reader of the same node keeps exactly its
    own pins."""
    live = Worker(region, 1, simulate)
    try:
        op, passes, n = PIN_MOVE_DEATHS[where]
        with Worker(region, 3, simulate) as writer:
            assert writer.call("index_put_chains", chains=[CHAIN[:3] + [n]])["stored"] == n
        assert live.call("index_pin_chain", chain=CHAIN) == n
        dying = Worker(region, 1, simulate,
                       env={"TRACT_DIE_AT": f"{PIN_MOVE_POINTS[point]}:{passes}"})
        dying.send(op, **({"chains": [CHAIN]} if op == "index_lookup_verify" else {"chain": CHAIN}))
        assert dying.proc.wait(timeout=60) == -9, f"it never died inside a pin move ({where})"
        dying.close()
        got = recover(region, 1)
        assert got["processes"] == 1, got
        assert pins_of(region)["total"] == n, (where, point, got, pins_of(region))
        assert pins_of(region)["pending"] == 0
        assert _pin_violations(region) == []
        assert recover(region, 1)["processes"] == 0                 # nothing twice
    finally:
        live.close()
    recover(region, 1)                     # the live reader's, once it is gone
    assert pins_of(region)["total"] == 0
    check_index(region)


def test_a_pin_move_is_told_by_the_next_process_to_enter_its_stripe(region):
    """Killed inside a pin move, a process leaves its stripe's lock to the
    node's next process that asks for it, which takes it over and repairs the
    stripe -- and tells the move there, from the count nobody has changed
    since (the holding's sequence names the move, not the dead pid: the
    mutex hands the lock over while the dying process may still be
    exiting). The successor then pins and unpins the same blocks; the dead
    process's recovery afterwards still gives back exactly what it held."""
    with Worker(region, 3) as writer:
        assert writer.call("index_put_chains", chains=[CHAIN])["stored"] == 12
    live = Worker(region, 1)
    try:
        assert live.call("index_pin_chain", chain=CHAIN) == 12
        dying = Worker(region, 1, env={"TRACT_DIE_AT": f"{lib.TRACT_DIE_PIN_MOVED}:5"})
        dying.send("index_lookup_verify", chains=[CHAIN])
        assert dying.proc.wait(timeout=60) == -9, "it never died inside a pin move"
        dying.close()
        with Worker(region, 1) as successor:    # takes the dead holder's stripe over
            assert successor.call("index_lookup_verify", chains=[CHAIN]) == [12]
        assert pins_of(region)["total"] == 12 + 6   # the dead one's 6, journaled or told
        got = recover(region, 1)
        assert got["processes"] == 1 and got["pins"] == 6, got
        assert pins_of(region)["total"] == 12
    finally:
        live.close()
    recover(region, 1)
    assert pins_of(region)["total"] == 0
    check_index(region)


def test_a_handoffs_pins_belong_to_its_record_not_to_the_dead_publisher(region):
    """The publisher dies after publishing: its handoff's pins stay for the
    decode side, which reads every byte and acknowledges; nothing is left."""
    pub = Worker(region, 1)
    ticket = pub.call("handoff_publish", chain=CHAIN, request="r-1")
    killed(pub)
    assert recover(region, 1)["pins"] == 0
    assert pins_of(region)["total"] == 12
    with Worker(region, 2) as dec:
        dec.call("handoff_receive", ticket=ticket, chain=CHAIN, request="r-1")
    assert pins_of(region)["total"] == 0
    check_index(region)


def test_the_agent_recovers_a_dead_reader_by_itself(region):
    with Worker(region, 1) as writer:
        writer.call("index_put_chains", chains=[CHAIN])
    agent = RunningAgent(region, 2, manager=False)
    try:
        reader = Worker(region, 2)
        assert reader.call("index_pin_chain", chain=CHAIN) == 12
        killed(reader)
        deadline = time.monotonic() + 30
        while pins_of(region)["total"] and time.monotonic() < deadline:
            time.sleep(0.05)            # polling the region, bounded: the agent's heartbeat
        assert pins_of(region)["total"] == 0, "the node agent did not release the dead pins"
    finally:
        agent.stop()


def test_a_clean_exit_leaves_nothing_to_recover(region):
    with Worker(region, 1) as w:
        w.call("index_put_chains", chains=[CHAIN])
        assert w.call("index_lookup_verify", chains=[CHAIN]) == [12]
    assert recover(region, 1)["processes"] == 0


def test_a_new_agent_resumes_the_duties_of_a_killed_one(region):
    """SIGKILL the node's agent, then one of its processes: the agent started
    next takes the node over (its robust agent mutex) and gives back what the
    dead process held, and what the dead agent's own journal held."""
    with Worker(region, 1) as writer:
        writer.call("index_put_chains", chains=[CHAIN])
    first = RunningAgent(region, 2, manager=False)
    first.proc.kill()
    first.proc.wait(timeout=30)
    reader = Worker(region, 2)
    assert reader.call("index_pin_chain", chain=CHAIN) == 12
    killed(reader)
    assert pins_of(region)["total"] == 12             # nobody recovers a node without an agent
    # started at once (the dead agent's heartbeat still looks fresh): the new
    # agent takes the node through its robust mutex, not by waiting for staleness
    second = subprocess.Popen([sys.executable, "-m", "tract_cli.cli", "agent", "--pool", region,
                               "--node", "2"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while pins_of(region)["total"] and time.monotonic() < deadline:
            assert second.poll() is None, f"the new agent exited with {second.returncode}"
            time.sleep(0.05)            # polling the region, bounded: the new agent's heartbeat
        assert pins_of(region)["total"] == 0, "the new agent did not take the node's duties over"
    finally:
        second.terminate()
        second.wait(timeout=30)
    assert recover(region, 2)["processes"] == 0        # the dead agent's entry was recovered too


def test_a_restarted_hosts_unfinished_writes_are_dropped_by_its_next_agent(region):
    """A host that restarts loses its node-local segment, journal and all: its
    dead writers' PENDING claims are remembered nowhere. The node's next agent
    finds them (PENDING, its node, a dead pid no journal names) and buries
    them, so their keys are writable again; a live writer's claim stays."""
    live = Worker(region, 1)
    dead = Worker(region, 1)
    try:
        assert live.call("index_reserve_chain", chain=[0, 0, 21, 4])["claimed"] == 4
        assert dead.call("index_reserve_chain", chain=CHAIN)["claimed"] == 12
        killed(dead)
        with Pool.attach(region, readonly=True, prefault=False) as p:
            seg = f"/dev/shm/tract-{p.info.uuid}-node1.local"
        # the restart: the live writer is of the host's next life (its journal
        # entry goes with the segment too, but its pid is alive)
        import os
        os.unlink(seg)
        assert pins_of(region)["pending"] == 16
        agent = RunningAgent(region, 1, manager=False)
        try:
            deadline = time.monotonic() + 30
            while pins_of(region)["pending"] > 4 and time.monotonic() < deadline:
                time.sleep(0.05)        # polling the region, bounded: the agent's first sweep
            assert pins_of(region)["pending"] == 4, "the new agent did not drop the orphans"
        finally:
            agent.stop()
        with Worker(region, 3) as other:
            assert other.call("index_put_chains", chains=[CHAIN])["stored"] == 12
            assert other.call("index_lookup_verify", chains=[CHAIN]) == [12]
    finally:
        live.close()


def _stray_pin(path: str, stripe: int, node: int) -> None:
    """Plants a pin count of NODE on the stripe's first EMPTY bucket: what a
    pin taken on a bucket that is not READY would leave."""
    import struct
    with Pool.attach(path, node=0) as p:
        per = p.info.section("buckets").count // p.info.index_stripes
        bs = p.info.section("buckets")
        b = next(i for i in range(stripe * per, (stripe + 1) * per)
                 if struct.unpack_from("<I", p.observe(bs.offset + i * 64 + 16, 4))[0] == 0)
        pins = p.info.section("pins")
        off = pins.offset + node * pins.entry_size + b * 2
        line = off & ~63
        raw = bytearray(p.observe(line, 64))
        struct.pack_into("<H", raw, off - line, 1)
        p.publish(line, bytes(raw))


def _pin_violations(path: str) -> list:
    from tract_cli.inspect import check
    with Pool.attach(path, readonly=True, prefault=False, local=False) as p:
        violations, _ = check.verify(p, data=False)
    return [v for v in violations if v.check == "pins"]


def test_tract_check_reports_a_pin_on_a_bucket_that_is_not_ready(region):
    """Pins are taken on READY buckets only and eviction takes none with it:
    a count left on any other bucket would pin the next key put there."""
    assert _pin_violations(region) == []
    _stray_pin(region, 1, 2)
    got = _pin_violations(region)
    assert len(got) == 1 and "node 2" in got[0].detail and "not READY" in got[0].detail, got


@pytest.mark.parametrize("who", ["agent", "next-process"])
def test_a_holder_killed_inside_a_stripe_leaves_exactly_the_live_pins(region, who):
    """A pin is one store of the node's count (format 4: no total beside it
    to tear), so a holder SIGKILLed inside a stripe section leaves no count
    to reconcile: whoever recovers its stripe lock -- the node's agent, or
    the node's next process to take the lock -- lets the stripe go, a live
    reader's pins stay exactly as they were, the stripe is usable, tract
    check is clean. (That the dead holder's stores reach the region through
    its node's recovery is shown under the simulator by the LRU test below.)"""
    with Worker(region, 3) as writer:
        writer.call("index_put_chains", chains=[CHAIN])
    reader = Worker(region, 3)
    try:
        assert reader.call("index_lookup_verify", chains=[CHAIN], hold=True) == [12]
        before = pins_of(region)
        assert before["total"] == 12, before
        holder = Worker(region, 2)
        holder.call("lock_acquire", lock_id=stripe_lock(1))
        killed(holder)
        if who == "agent":
            with Pool.attach(region, node=2) as p:
                count = ffi.new("uint32_t *")
                assert lib.tract_lock_recover(p._r(), count) == 0 and count[0] == 1
        else:
            with Worker(region, 2) as successor:
                assert successor.call("index_lookup_verify", chains=[CHAIN]) == [12]
        assert pins_of(region) == before
        assert _pin_violations(region) == []
        with Worker(region, 2) as other:     # every stripe enterable again
            assert other.call("index_lookup_verify", chains=[CHAIN]) == [12]
        assert reader.call("index_release_held") == 1
    finally:
        reader.close()
    assert pins_of(region)["total"] == 0


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
@pytest.mark.parametrize("who", ["agent", "next-process"])
def test_a_lookup_killed_between_lru_moves_leaves_lists_that_are_made_whole(region, who,
                                                                            simulate):
    """A lookup moves its hits to their LRU heads link by link; the stripe's
    anchor (head, tail, count) is its own until it leaves the stripe. Killed
    after the first move, it leaves links and anchor disagreeing: whoever
    recovers its stripe lock relinks the list from the READY buckets before
    anyone else enters, so tract check finds nothing and every block is
    still found and evictable. Under the simulator the dead lookup's link
    stores are still in its node's cache (the node's processes share it, as
    a host's do), never written back by the dead process: the recovery, on
    the same node, writes them back (its observes of the stripe's lines
    under clflush semantics do, and so does its explicit write-back), so the
    region holds the moved links the checks below read. With a cache per
    process the moves died with the process and this test failed."""
    other = [0, 0, 13, 12]
    with Worker(region, 3) as writer:
        writer.call("index_put_chains", chains=[CHAIN, other])   # CHAIN no longer heads
    dying = Worker(region, 2, simulate,
                   env={"TRACT_DIE_AT": str(lib.TRACT_DIE_LRU_MOVED)})
    dying.send("index_lookup_verify", chains=[CHAIN])
    assert dying.proc.wait(timeout=60) == -9, "the lookup moved nothing"
    dying.close()
    expect = _lists_after_one_move(region, CHAIN, other)
    if who == "agent":
        with Pool.attach(region, node=2, simulate=simulate) as p:
            count = ffi.new("uint32_t *")
            # the stripe it held, and the next one its walk had requested
            assert lib.tract_lock_recover(p._r(), count) == 0 and count[0] >= 1
    else:
        with Worker(region, 2, simulate) as successor:   # enters every stripe, moves nothing
            assert successor.call("index_lookup_verify", chains=[[0, 0, 99, 12]]) == [0]
    with Pool.attach(region, node=2, simulate=simulate) as p:   # its journaled pins
        assert vars(recover_dead_processes(p, timeout=30))["processes"] == 1
    assert check_index(region)["ready"] == 24
    assert _lru_violations(region) == []
    with Pool.attach(region, readonly=True, prefault=False, local=False) as p:
        # the death fell between two whole moves: the links alone are whole,
        # and the order they hold is kept exactly
        assert lru_lists(p) == expect
    with Worker(region, 2) as other_reader:
        assert other_reader.call("index_lookup_verify", chains=[CHAIN, other]) == [12, 12]
        other_reader.call("index_evict_all")
    assert check_index(region)["ready"] == 0


def _lists_after_one_move(path: str, chain: list, other: list) -> list:
    """Each stripe's LRU list as exact LRU has it after CHAIN then OTHER were
    put and a lookup of CHAIN made its first move (LRU_MOVED: in the lowest
    stripe where it moves anything, its hits spliced as one run when there
    are three or more of them, else its first hit, the chain's last block
    there, moved alone). The region's hash seed places the keys."""
    from procs_child import _chain_keys
    with Pool.attach(path, readonly=True, prefault=False, local=False) as p:
        per = p.info.section("buckets").count // p.info.index_stripes
        lists = [[] for _ in range(p.info.index_stripes)]
        keys = {}
        for name, spec in (("chain", chain), ("other", other)):
            keys[name] = _chain_keys(p, *spec)
            stripes = p.index.key_homes(keys[name]) // per
            keys[name + "_stripes"] = stripes
            for i in reversed(range(len(keys[name]))):         # a put: the last block first
                lists[int(stripes[i])].insert(0, keys[name][i].tobytes())
    st = keys["chain_stripes"]
    # the first stripe (the walk goes up) where the lookup moves anything:
    # where OTHER's blocks, put later, head the list before CHAIN's
    s0 = min(int(s) for s in set(st.tolist()) if s in set(keys["other_stripes"].tolist()))
    hits = [keys["chain"][i].tobytes() for i in reversed(range(len(st))) if st[i] == s0]
    moved = hits if len(hits) > 2 else hits[:1]
    for k in moved:
        lists[s0].remove(k)
        lists[s0].insert(0, k)
    return lists


def _lru_violations(path: str) -> list:
    from tract_cli.inspect import check
    with Pool.attach(path, readonly=True, prefault=False, local=False) as p:
        violations, _ = check.verify(p, data=False)
    return [v for v in violations if v.check in ("lru", "index", "pins")]


def test_draining_the_free_list_after_the_allocator_holder_died(region):
    """A process killed holding the allocator lock (0): the node's next
    process inherits it (TRACT_RECOVERED) and its drain still gives the
    free list back and releases the lock, instead of failing with the
    recovery code and keeping the lock."""
    with Worker(region, 1) as first:
        slots = first.call("alloc", n=4)
        first.call("free", slots=slots)                 # in node 1's free list now
        assert set(slots) <= set(first.call("local_free"))   # with the rest of its batch
    holder = Worker(region, 1)
    holder.call("lock_acquire", lock_id=LOCK_ALLOCATOR)
    killed(holder)
    with Worker(region, 1) as successor:
        successor.call("drain")
        assert successor.call("local_free") == []
        successor.call("lock_acquire", lock_id=LOCK_ALLOCATOR, timeout=5.0)   # released: free again
        successor.call("lock_release", lock_id=LOCK_ALLOCATOR)


def _node_pins_on_ready(path: str, node: int) -> list[int]:
    """NODE's pin count of every READY bucket."""
    import numpy as np
    from tract_cli.core.media import BUCKET_DTYPE, pins_view
    with Pool.attach(path, readonly=True, prefault=False, local=False) as p:
        bs, ps = p.info.section("buckets"), p.info.section("pins")
        b = np.frombuffer(p.observe(bs.offset, bs.count * 64), BUCKET_DTYPE)
        pins = pins_view(np.frombuffer(p.observe(ps.offset, ps.length), np.uint8), p.info)
        return pins[node][b["state"] == 2].tolist()


def test_a_process_killed_while_its_journal_moves_a_key_has_each_pin_given_back_once(region_path):
    """Forgetting a key shifts later keys of its probe run back, one copy at
    a time; killed right after a copy, the process leaves that key at two
    places of its journal. Recovery must give its pin back once: a second
    give-back would take a pin a live process of the node holds. (The
    region's hash seed places the keys in the journal: 2000 of them in its
    8192 places collide by the hundreds, so some forgetting moves a key.)"""
    n = 2000
    Pool.create(region_path, 64 << 20, "tiny", nodes=4, index_stripes=4).close()
    region = region_path
    chain = [0, 0, 21, n]
    agent = RunningAgent(region, 0, manager=True)
    holder = None
    try:
        with Worker(region, 3) as writer:
            assert writer.call("index_put_chains", chains=[chain])["stored"] == n
        holder = Worker(region, 1)                   # holds every block, alive throughout
        assert holder.call("index_lookup_verify", chains=[chain], hold=True) == [n]
        dying = Worker(region, 1, env={"TRACT_DIE_AT": str(lib.TRACT_DIE_JOURNAL_MOVED)})
        dying.send("index_lookup_verify", chains=[chain])   # its unpin forgets every key
        assert dying.proc.wait(timeout=60) == -9, "no journal move happened: pick another chain"
        dying.close()
        assert recover(region, 1)["processes"] == 1
        counts = _node_pins_on_ready(region, 1)
        assert len(counts) == n
        # the holder's pin on every block is there, and none of the dead one's:
        # the pin it was giving back when it died (forgotten first) is given
        # back too, its move named in the journal (journal.c, "Pin moves")
        assert min(counts) >= 1 and sum(counts) == n, (sorted(counts)[-3:], sum(counts) - n)
        assert holder.call("index_release_held") == 1
    finally:
        if holder is not None:
            holder.close()
        agent.stop()
