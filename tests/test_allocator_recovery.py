"""Online recovery of a process killed inside the allocator (native/alloc.c,
docs/PROTOCOLS.md §5.1): a claim or a release of slots runs under the
allocator lock (0) and records an intent first; a process SIGKILLed at each
point inside it (TRACT_DIE_AT) leaves work that whoever next holds lock 0 --
the node's agent, or the node's next process to need the lock -- finishes or
drops. Afterwards nothing leaks and `tract check` finds the allocator
consistent, with no offline repair. Real processes on emulated nodes, plain
mode and the non-coherence simulator."""
from __future__ import annotations


import numpy as np
import pytest

from procs import Worker
from tract_cli.core.locks import LOCK_ALLOCATOR
from tract_cli.core.native import lib
from tract_cli.core.pids import pid_alive
from tract_cli.core.pool import Pool
from tract_cli.core.recovery import recover_node
from tract_cli.inspect import check

CLAIM = ["CLAIM_STAGED", "CLAIM_HEADER", "CLAIM_BITMAP", "CLAIM_PUSHED"]
RELEASE = ["RELEASE_POPPED", "RELEASE_HEADER", "RELEASE_OWNERS"]
# a put handing slots from the free list to its claims (native/index_put.c)
HANDOVER = ["ALLOC_JOURNALED", "PUT_ALLOCATED", "PUT_CLAIMED"]


@pytest.fixture
def region(managed_region):
    return managed_region


def dying(path: str, node: int, point: str, simulate: bool) -> Worker:
    """A process of NODE that SIGKILLs itself at the allocator's POINT."""
    return Worker(path, node, simulate,
                  env={"TRACT_DIE_AT": str(getattr(lib, f"TRACT_DIE_{point}"))})


def dies_during(worker: Worker, op: str, **args) -> None:
    """Sends OP and waits (bounded) for the worker to kill itself inside it."""
    worker.send(op, **args)
    assert worker.proc.wait(timeout=60) == -9, f"the worker did not die inside {op}"
    worker.close()


def taken_slots(path: str) -> set:
    """Slots the region's bitmap says are taken from the pool."""
    with Pool.attach(path, readonly=True, prefault=False, local=False) as p:
        sec = p.info.section("bitmap")
        bits = np.unpackbits(np.frombuffer(p.observe(sec.offset, sec.length), np.uint8),
                             bitorder="little")[:p.info.slot_count]
    return set(np.flatnonzero(bits).tolist())


def free_lists(path: str, nodes=(1, 2)) -> set:
    out = set()
    for n in nodes:
        with Pool.attach(path, node=n, prefault=False) as p:
            listed = p.allocator.local_free().tolist()
        assert len(listed) == len(set(listed)), f"node {n}'s free list lists a slot twice"
        out |= set(listed)
    return out


def allocator_violations(path: str) -> list:
    with Pool.attach(path, readonly=True, prefault=False, local=False) as p:
        violations, _ = check.verify(p, data=False)
    return [f"{v.check}: {v.detail}" for v in violations]


def recover(path: str, node: int, who: str) -> None:
    """What recovers the dead process's lock 0: the node's agent (one pass of
    its recovery), or the node's next process (a drain takes lock 0)."""
    if who == "agent":
        with Pool.attach(path, node=node) as p:
            got = recover_node(p, orphans=False, timeout=30)
        assert got.locks == 1 and not got.errors, got
    else:
        with Worker(path, node) as successor:
            successor.call("drain")


def agent_pass(path: str, node: int):
    """One pass of the node agent's recovery."""
    with Pool.attach(path, node=node) as p:
        got = recover_node(p, orphans=False, timeout=30)
    assert not got.errors, got
    return got


def lock_0_is_free(path: str, node: int) -> None:
    with Worker(path, node) as w:
        w.call("lock_acquire", lock_id=LOCK_ALLOCATOR, wait=10.0)
        w.call("lock_release", lock_id=LOCK_ALLOCATOR)


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
@pytest.mark.parametrize("who", ["agent", "next-process"])
@pytest.mark.parametrize("point", CLAIM)
def test_a_process_killed_inside_a_claim_leaks_no_slot(region, point, who, simulate):
    """The claim of a node's first batch, killed at each point: the batch ends
    either on the node's free list (claimed) or back in the pool."""
    dies_during(dying(region, 1, point, simulate), "alloc", n=3)
    recover(region, 1, who)
    assert allocator_violations(region) == []
    assert taken_slots(region) == free_lists(region), "a slot leaked"
    if who == "agent" and point in ("CLAIM_BITMAP", "CLAIM_PUSHED"):
        assert len(free_lists(region)) == 64, "the claimed batch is the node's now"
    lock_0_is_free(region, 1)


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
@pytest.mark.parametrize("who", ["agent", "next-process"])
@pytest.mark.parametrize("point", RELEASE)
def test_a_process_killed_inside_a_release_leaks_no_slot(region, point, who, simulate):
    """A release killed at each point is finished: node 2 frees node 1's slots
    (they go back to the pool), or node 1 drains its free list."""
    with Worker(region, 1, simulate) as owner:
        slots = owner.call("alloc", n=5)
        if point == "RELEASE_POPPED":
            owner.call("free", slots=slots)           # all 64 on node 1's list
    if point == "RELEASE_POPPED":
        dies_during(dying(region, 1, point, simulate), "drain")
        recover(region, 1, who)
    else:
        dies_during(dying(region, 2, point, simulate), "free", slots=slots)
        recover(region, 2, who)
    assert allocator_violations(region) == []
    taken = taken_slots(region)
    assert taken == free_lists(region), "a slot leaked"
    assert not taken & set(slots), "the freed slots went back to the pool"
    lock_0_is_free(region, 1)


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
@pytest.mark.parametrize("who", ["agent", "next-process"])
@pytest.mark.parametrize("point", HANDOVER)
def test_a_writer_killed_while_its_claims_take_their_slots_leaks_none(region, point, who,
                                                                      simulate):
    """A put killed between taking its slots off the node's free list and its
    claims naming them (the slots are journaled as the process's own before
    they leave the list): recovery gives every slot back, and none twice,
    whether the node's next process settles alloc_mu first or the agent does
    everything."""
    with Worker(region, 1) as w:
        w.call("free", slots=w.call("alloc", n=1))     # a batch on node 1's list first
        dies_during(dying(region, 1, point, simulate), "index_reserve_chain",
                    chain=[1, 0, 2, 5])
        held = []
        if who == "next-process":
            # takes alloc_mu after the death and keeps what it pops (at
            # ALLOC_JOURNALED: the very slots the dead process journaled)
            held = w.call("alloc", n=8)
        got = agent_pass(region, 1)
        assert got.dead.processes == 1 and got.dead.claims == 5, got
        assert not set(held) & free_lists(region), "the agent freed a slot a live process holds"
        if point == "ALLOC_JOURNALED":
            assert got.dead.slots == 0, got            # it had popped nothing
        else:
            assert got.dead.slots == 5, got            # each popped slot, once
        w.call("free", slots=held)
    assert allocator_violations(region) == []
    assert taken_slots(region) == free_lists(region), "a slot leaked"


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
@pytest.mark.parametrize("evictor", [1, 2], ids=["own-slots", "another-nodes-slots"])
def test_an_evictor_killed_before_its_free_has_the_slots_freed_by_its_agent(region, evictor,
                                                                            simulate):
    """An eviction buries its blocks in their stripe sections and frees their
    slots after, under the allocator's locks: in between, only the evicting
    process names them. It journals each one (with its owner and the owner's
    epoch, which the free checks) as soon as its bucket is buried, so a
    process killed there has them freed by its node's agent: node 1's own
    slots to its free list, node 2 freeing node 1's slots to the pool. They
    used to leak until `tract check --repair`."""
    chain = [7, 0, 8, 6]
    with Worker(region, 1, simulate) as writer:
        assert writer.call("index_put_chains", chains=[chain])["stored"] == 6
    blocks = taken_slots(region) - free_lists(region)
    assert len(blocks) == 6
    dies_during(Worker(region, evictor, simulate,
                       env={"TRACT_DIE_AT": str(lib.TRACT_DIE_EVICTED)}), "index_evict_all")
    assert blocks <= taken_slots(region) - free_lists(region), "the slots are held until the free"
    got = agent_pass(region, evictor)
    assert got.dead.processes == 1 and got.dead.slots == 6, got
    if evictor == 1:
        assert blocks <= free_lists(region), "node 1's own slots go to its free list"
    else:
        assert not blocks & taken_slots(region), "another node's slots go back to the pool"
    assert allocator_violations(region) == []
    assert taken_slots(region) == free_lists(region), "a slot leaked"
    assert agent_pass(region, evictor).dead.processes == 0, "nothing is left to free twice"


def test_an_evictor_that_exits_cleanly_leaves_nothing_journaled_however_many_it_evicted(
        region_path):
    """An eviction's journal entries are forgotten by its free, and a bulk
    eviction frees as it goes (1024 slots at a time): a process that evicted
    more blocks than its journal holds (8192 keys) and exited leaves its
    node's agent nothing to recover and nothing overflowed (which would say
    "run tract check --repair"), and every slot is back on a free list."""
    from agents import RunningAgent
    Pool.create(region_path, 96 << 20, "tiny", nodes=4, index_stripes=8).close()
    agent = RunningAgent(region_path, 0, manager=True)
    try:
        with Worker(region_path, 1) as writer:
            chains = [[0, 0, 900 + c, 500] for c in range(18)]
            assert writer.call("index_put_chains", chains=chains, checksum=False,
                               timeout=600)["stored"] == 9000
        with Worker(region_path, 2) as evictor:
            assert evictor.call("index_evict_all", timeout=600) == 9000
        got = agent_pass(region_path, 2)
        assert got.dead.processes == 0 and got.dead.partial == 0, got
        assert taken_slots(region_path) == free_lists(region_path, nodes=(1, 2))
    finally:
        agent.stop()


def test_slots_a_process_allocated_and_freed_are_not_freed_again_after_it_exits(region):
    """The public allocation journals nothing (what a caller does with raw
    slots the core cannot know): a process that allocated and freed a slot,
    then exited, leaves the agent nothing to free -- not the slot another
    process took since."""
    with Worker(region, 1) as a:
        slots = a.call("alloc", n=3)
        a.call("free", slots=slots)
    with Worker(region, 1) as b:
        held = b.call("alloc", n=3)
        assert set(held) == set(slots)                 # the list hands them out again
        got = agent_pass(region, 1)
        assert got.dead.slots == 0, got
        assert not set(held) & free_lists(region), "the agent freed a slot a live process holds"
        b.call("free", slots=held)
    assert taken_slots(region) == free_lists(region)


def test_a_handoff_killed_taking_its_slots_leaks_none(region):
    """A handoff publish killed after journaling the key-list and tail slots
    it takes, before they leave the free list: the slots stay on the list and
    nothing frees them again; the chain's pins come back."""
    point = f"{lib.TRACT_DIE_ALLOC_JOURNALED}:1"        # the put's allocation passes
    with Worker(region, 1) as w:
        dies_during(Worker(region, 1, env={"TRACT_DIE_AT": point}), "handoff_publish",
                    chain=[3, 0, 4, 4], request="r-killed")
        got = agent_pass(region, 1)
        assert got.dead.pins == 4 and got.dead.slots == 0, got
        ready = set(w.call("index_reserve_chain", chain=[3, 0, 4, 4])["slots"])
        assert not ready, "the chain was put before the handoff: nothing left to reserve"
    assert allocator_violations(region) == []
    assert len(taken_slots(region) - free_lists(region)) == 4, "only the chain's slots are held"


def test_a_handoff_killed_after_finding_no_record_gives_its_pins_back(region_path):
    """A handoff publish that finds the transfer table full gives its blocks'
    pins back: until it has, they stay in its journal, so a process killed
    on the way leaves them to the agent (the chaos run leaked them when the
    journal forgot them before the table was searched)."""
    from agents import RunningAgent
    Pool.create(region_path, 8 << 20, "tiny", nodes=4, index_stripes=4,
                transfer_entries=1).close()
    agent = RunningAgent(region_path, 0, manager=True)
    try:
        with Worker(region_path, 1) as holder:
            holder.call("handoff_publish", chain=[3, 0, 4, 4], request="r-holds-the-record")
            point = str(lib.TRACT_DIE_HANDOFF_NO_RECORD)
            dies_during(Worker(region_path, 1, env={"TRACT_DIE_AT": point}), "handoff_publish",
                        chain=[5, 0, 6, 4], request="r-finds-it-full")
            got = agent_pass(region_path, 1)
            assert got.dead.pins == 4, got
            assert got.dead.slots == 2, got                # its key-list and tail slots
        with Pool.attach(region_path, readonly=True, prefault=False, local=False) as p:
            from tract_cli.inspect import snapshot
            assert snapshot.take(p, views=("index",))["index"]["pins_total"] == 4, \
                "only the published handoff's pins are left"
        assert allocator_violations(region_path) == []
    finally:
        agent.stop()


def test_a_process_killed_inside_a_claim_does_not_block_the_node(region):
    """The node's next allocation after a death inside a claim takes lock 0
    from the dead holder and goes on: no agent needed, nothing lost."""
    dies_during(dying(region, 1, "CLAIM_BITMAP", False), "alloc", n=3)
    with Worker(region, 1) as successor:
        got = successor.call("alloc", n=100)          # more than the batch: takes lock 0
        assert len(set(got)) == 100
        successor.call("free", slots=got)
    assert allocator_violations(region) == []
    assert taken_slots(region) == free_lists(region)


def test_a_death_point_passes_count(region):
    """TRACT_DIE_AT=<point>:<passes> dies only on the (passes + 1)-th pass."""
    w = Worker(region, 2, env={"TRACT_DIE_AT": f"{lib.TRACT_DIE_CLAIM_HEADER}:1"})
    w.call("alloc", n=64)                              # the first claim passes
    dies_during(w, "alloc", n=64)                      # the second dies


def test_after_a_death_inside_a_claim_the_next_allocation_settles_it_first(region):
    """A claim's staged slots sit past the end of the node's free list: the
    node's next process to take alloc_mu settles the open intent (taking lock
    0 from the dead holder) before it pops from the list, so what it pops is
    never listed again (a cold review's repro: it was)."""
    with Worker(region, 1) as a:
        a.call("alloc", n=60)                          # claims 64, the list keeps 4
        dies_during(dying(region, 1, "CLAIM_HEADER", False), "alloc", n=10)
        with Worker(region, 1) as p:
            got = p.call("alloc", n=3)                 # from the list
            p.call("alloc", n=100)
            assert not set(p.call("local_free")) & set(got), "a held slot is listed again"
    assert allocator_violations(region) == []


def test_a_free_after_a_death_inside_a_claim_does_not_overwrite_its_slots(region):
    """A free that pushes onto the list after a death inside a claim settles
    the claim first: the push cannot land on the staged slots."""
    with Worker(region, 1) as a:
        held = a.call("alloc", n=60)
        dies_during(dying(region, 1, "CLAIM_HEADER", False), "alloc", n=10)
        a.call("free", slots=held[:8])                 # settles it: nothing left to the agent
        assert agent_pass(region, 1).locks == 0
        assert allocator_violations(region) == []
        assert taken_slots(region) == free_lists(region, nodes=(1,)) | set(held[8:])


def test_a_slot_reallocated_after_a_death_inside_a_drain_stays_its_holders(region):
    """A drain's slots are staged where the list's next push lands: after a
    death inside the drain, the next free settles it first, so a slot freed
    and taken again is not released to the pool under its holder."""
    with Worker(region, 1) as a:
        held = a.call("alloc", n=5)
        dies_during(dying(region, 1, "RELEASE_POPPED", False), "drain")
        a.call("free", slots=[held[0]])
        assert a.call("alloc", n=1) == [held[0]]
        assert agent_pass(region, 1).locks == 0
        with Worker(region, 2) as b:
            assert held[0] not in b.call("alloc", n=64), "a held slot went to another node"
    assert allocator_violations(region) == []


def test_a_holder_that_died_but_is_not_reaped_yet_counts_as_dead(region):
    """A process that died inside a claim and that its parent has not reaped
    (a zombie: it holds nothing any more) is recovered by the agent at once,
    not once the parent gets round to it."""
    import time
    w = dying(region, 1, "CLAIM_BITMAP", False)
    w.send("alloc", n=3)
    deadline = time.monotonic() + 60
    # polling a process the test does not reap: once dead it stays a zombie
    while pid_alive(w.proc.pid):
        assert time.monotonic() < deadline, "the worker did not die inside the claim"
        time.sleep(0.01)
    try:
        assert agent_pass(region, 1).locks == 1
        assert allocator_violations(region) == []
        assert taken_slots(region) == free_lists(region)
    finally:
        w.proc.wait(timeout=30)
        w.close()
