"""A dead host recovered online (docs/PROTOCOLS.md §7, "A dead host").

Emulated hosts: TRACT_HOSTNAME makes node 0 ("host-a", the lock manager's
agent) and node 1 ("host-b") separate hosts on this machine.  Host B dies
with everything a host can hold: a process killed inside an index stripe
(between two LRU moves), one killed inside the allocator (giving another
node's slots back: header and owner bytes written, bits not yet), pins,
unfinished writes; then its agent
is killed and its node-local segment removed, as a power cut would.  The
manager's agent declares it dead once its heartbeat stood still; the locks it
held are taken back and repaired by their next holders on host A, its
unfinished writes dropped, its pins given back, its slots returned (those
that lived only in its DRAM, and those its blocks held once host A evicted
them), and `tract check` finds the region clean.
Real processes, plain mode and the non-coherence simulator."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from agents import RunningAgent
from index_check import check_index
from procs import Worker, wait_for
from tract_cli.core.errors import LockTimeout
from tract_cli.core.local import local_path
from tract_cli.core.locks import LOCK_ALLOCATOR, LOCK_OBJDIR
from tract_cli.core.native import lib
from tract_cli.core.nodes import VERDICT_CLAIMS, VERDICT_PINS, VERDICT_SLOTS, read_nodes
from tract_cli.core.pool import Pool

CHAIN = [0, 0, 11, 12]          # prefix_seed, prefix_blocks, suffix_seed, blocks
OTHER = [0, 0, 13, 12]
UNFINISHED = [0, 0, 17, 6]      # host B reserves these and dies before it writes them
DEAD_AFTER = 3.0                # --host-dead-after of the manager's agent here


@pytest.fixture
def region(region_path):
    Pool.create(region_path, 8 << 20, "tiny", nodes=4, index_stripes=4).close()
    return region_path



def node_record(path: str, node: int):
    with Pool.attach(path, readonly=True, prefault=False, local=False) as p:
        return read_nodes(p)[node]


def on_host(monkeypatch, host: str, region: str, node: int, **opts) -> RunningAgent:
    """An agent of NODE on emulated host HOST."""
    monkeypatch.setenv("TRACT_HOSTNAME", host)
    try:
        return RunningAgent(region, node, **opts)
    finally:
        monkeypatch.delenv("TRACT_HOSTNAME")


def gone(*procs) -> None:
    """Makes sure these processes are gone (a test that failed midway may
    leave one stopped with SIGSTOP, or running with no idle exit)."""
    for p in procs:
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait(timeout=30)


def kill_host_b(region: str, agent: RunningAgent, workers: list) -> None:
    """Host B loses power: its agent and workers die, its DRAM (the node's
    local segment) is gone."""
    for w in workers:
        if w.proc.poll() is None:
            w.proc.kill()
        w.proc.wait(timeout=30)
        w.close()
    agent.proc.send_signal(signal.SIGKILL)        # (stopped: it never runs again)
    agent.proc.wait(timeout=30)
    with Pool.attach(region, readonly=True, prefault=False, local=False) as p:
        os.unlink(local_path(p.info.uuid, 1))


def slot_violations(path: str) -> list:
    from tract_cli.inspect import check
    with Pool.attach(path, readonly=True, prefault=False, local=False) as p:
        violations, _ = check.verify(p, data=True)
    return violations


def node_row(path: str, node: int) -> dict:
    """NODE's row of `tract inspect --nodes`."""
    from tract_cli.inspect import snapshot
    with Pool.attach(path, readonly=True, prefault=False, local=False) as p:
        rows = snapshot.take(p, views=("nodes",))["nodes"]["nodes"]
    return next(r for r in rows if r["node"] == node)


def pinned_by_node(path: str) -> dict:
    """{node: how many buckets it pins}."""
    from tract_cli.inspect import snapshot
    with Pool.attach(path, readonly=True, prefault=False, local=False) as p:
        return snapshot.take(p, views=("index",))["index"]["pinned_by_node"]


def taken_slots(path: str, node: int) -> int:
    """Slots the allocator's owner map gives to NODE (taken from the pool)."""
    import numpy as np
    with Pool.attach(path, readonly=True, prefault=False, local=False) as p:
        sec = p.info.section("owners")
        owners = np.frombuffer(p.observe(sec.offset, sec.length), np.uint8)[:p.slot_count]
    return int((owners == node + 1).sum())


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
def test_a_dead_hosts_locks_writes_and_pins_come_back_online(region, monkeypatch, simulate):
    manager = on_host(monkeypatch, "host-a", region, 0, manager=True, simulate=simulate,
                      host_dead_after=DEAD_AFTER)
    b_agent = None
    try:
        with Worker(region, 2, simulate=simulate) as writer:
            writer.call("index_put_chains", chains=[CHAIN, OTHER])     # OTHER now heads the lists
            foreign = writer.call("alloc", n=5)                        # host A's slots
        b_agent = on_host(monkeypatch, "host-b", region, 1, manager=False, simulate=simulate,
                          takeover_after=None)
        # host B's processes, started first (a process start is the slow part)
        reader = Worker(region, 1, simulate=simulate)
        writer_b = Worker(region, 1, simulate=simulate)
        in_alloc = Worker(region, 1, simulate=simulate,
                          env={"TRACT_DIE_AT": str(lib.TRACT_DIE_RELEASE_OWNERS)})
        in_stripe = Worker(region, 1, simulate=simulate,
                           env={"TRACT_DIE_AT": str(lib.TRACT_DIE_LRU_MOVED)})
        # its agent stops from here (the manager's clock starts): it must not
        # clean up after its workers before the host dies whole
        b_agent.proc.send_signal(signal.SIGSTOP)
        assert reader.call("index_pin_chain", chain=OTHER) == 12     # heads already: moves nothing
        # a handoff record reserved, its publish never made (a P/D prefill's):
        # it holds no pins, so it never holds up the dead host's pin clearing
        reserved = reader.call("handoff_reserve", request="dead-host")
        assert writer_b.call("index_reserve_chain", chain=UNFINISHED)["claimed"] == 6
        # killed inside the allocator, giving host A's slots back: the header
        # uncounted them and their owner bytes are cleared, their bits are not
        in_alloc.send("free", slots=foreign)
        assert in_alloc.proc.wait(timeout=60) == -9, "the free released nothing"
        # killed inside a stripe, between two LRU moves of a lookup
        in_stripe.send("index_lookup_verify", chains=[CHAIN])
        assert in_stripe.proc.wait(timeout=60) == -9, "the lookup moved nothing"
        kill_host_b(region, b_agent, [reader, writer_b, in_stripe, in_alloc])

        rec = wait_for("node 1 declared dead", lambda: (r := node_record(region, 1)).dead and r)
        assert rec.dead_epoch == rec.epoch
        assert node_row(region, 1)["state"] == "dead"          # what `tract inspect` shows
        # what it left half done, for the next holders of its locks to repair:
        # the allocator header (and, in plain mode, where its last LRU move
        # reached the region, the stripe's list)
        left = {v.check for v in slot_violations(region)}
        assert "allocator" in left and (simulate or "lru" in left), left
        # host A enters every stripe without moving a block (a chain it never
        # put): the stripe host B held is repaired by that entry alone
        with Worker(region, 3, simulate=simulate) as passer:
            assert passer.call("index_lookup_verify", chains=[[0, 0, 99, 12]]) == [0]
        assert "lru" not in {v.check for v in slot_violations(region)}
        # host A works on: through the stripes host B held (repaired by whoever
        # enters first), the allocator it held, and its reserved keys
        with Worker(region, 2, simulate=simulate) as a:
            assert a.call("index_lookup_verify", chains=[CHAIN, OTHER]) == [12, 12]
            whole = VERDICT_CLAIMS | VERDICT_PINS | VERDICT_SLOTS
            wait_for("node 1's recovery", lambda: node_record(region, 1).recovered == whole)
            assert record_state(region, reserved) == 0, "the dead host's reservation stays"
            assert a.call("index_reserve_chain", chain=UNFINISHED)["claimed"] == 6
            a.call("index_evict_all")                 # node 1's pins are gone: all evictable
        with Worker(region, 3, simulate=simulate) as fresh:
            fresh.call("alloc", n=8)                  # claims: lock 0 taken back, repaired
        assert not {v.check for v in slot_violations(region)} & {"allocator"}
        assert check_index(region, allow_pending=True)["ready"] == 0
        # and its slots: its free list's at the first sweep, the ones host A
        # evicted since (their frees left them to the sweep) at the next
        wait_for("node 1's slots back in the pool", lambda: taken_slots(region, 1) == 0)
        assert slot_violations(region) == []
    finally:
        gone(b_agent and b_agent.proc)
        manager.stop()


def record_state(path: str, record: int) -> int:
    """The state of transfer record RECORD (0: FREE)."""
    import numpy as np
    from tract_cli.core.media import RECORD_DTYPE
    with Pool.attach(path, readonly=True, prefault=False, local=False) as p:
        tr = p.info.section("transfer")
        return int(np.frombuffer(p.observe(tr.offset, tr.length), RECORD_DTYPE)["state"][record])


def pins_and_records(path: str, node: int) -> tuple[int, int]:
    """(NODE's pin counts summed over the index, transfer records in use)."""
    import numpy as np
    from tract_cli.core.media import RECORD_DTYPE, pins_view
    with Pool.attach(path, readonly=True, prefault=False, local=False) as p:
        pins = p.info.section("pins")
        total = int(pins_view(np.frombuffer(p.observe(pins.offset, pins.length), np.uint8),
                              p.info)[node].sum())
        tr = p.info.section("transfer")
        rec = np.frombuffer(p.observe(tr.offset, tr.length), RECORD_DTYPE)
    return total, int((rec["state"] != 0).sum())


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
@pytest.mark.parametrize("point", ["RELEASE_INTENT", "RELEASE_PINS"])
def test_a_dead_hosts_half_done_release_of_another_hosts_handoff_is_finished_exactly(
        region, monkeypatch, simulate, point):
    """Host B acknowledges a handoff host A's node 2 published, and dies
    inside the release, holding a stripe lock: with the group's intent on the
    device and no pin given back (RELEASE_INTENT), or with the pins given
    back in its caches (RELEASE_PINS: in plain mode they reached the region,
    under the simulator they die with host B's cache). The group's progress
    is marked in the record only once its pins are on the device, so the
    manager's resumption of the release re-enters that stripe, whose repair
    (the next holder after the verdict) finishes the group from its intent
    with absolute counts, whichever of the dead host's stores landed.
    A second handoff of the same chain keeps every block pinned once more,
    so a pin given back twice shows, as does one left behind: node 2 must
    hold exactly the second handoff's 12 pins. Before, the release marked
    each group before giving its pins back, so a host dying inside one left
    whatever of its stores were lost pinned for good (the chaos run's seed
    102)."""
    manager = on_host(monkeypatch, "host-a", region, 0, manager=True, simulate=simulate,
                      host_dead_after=DEAD_AFTER)
    b_agent = None
    try:
        with Worker(region, 2, simulate=simulate) as prefill:
            first = prefill.call("handoff_publish", chain=CHAIN, request="first", ttl=3600)
            second = prefill.call("handoff_publish", chain=CHAIN, request="second", ttl=3600)
            assert pins_and_records(region, 2) == (24, 2)
            b_agent = on_host(monkeypatch, "host-b", region, 1, manager=False, simulate=simulate,
                              takeover_after=None)
            acker = Worker(region, 1, simulate=simulate,
                           env={"TRACT_DIE_AT": str(getattr(lib, f"TRACT_DIE_{point}"))})
            b_agent.proc.send_signal(signal.SIGSTOP)     # it must not finish the release
            acker.send("handoff_receive", ticket=first, chain=CHAIN, request="first")
            assert acker.proc.wait(timeout=60) == -9, "the release gave nothing back"
            kill_host_b(region, b_agent, [acker])
            wait_for("node 1 declared dead", lambda: node_record(region, 1).dead)
            wait_for("its release finished by the manager",
                     lambda: pins_and_records(region, 2)[1] == 1)
            assert pins_and_records(region, 2) == (12, 1)
            with Worker(region, 3, simulate=simulate) as decode:
                assert decode.call("handoff_receive", ticket=second, chain=CHAIN,
                                   request="second") == 12
            assert pins_and_records(region, 2) == (0, 0)
        assert check_index(region)["ready"] == 12
        assert slot_violations(region) == []
    finally:
        gone(b_agent and b_agent.proc)
        manager.stop()


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
def test_a_dead_hosts_half_done_free_of_another_nodes_slots_is_finished(region, monkeypatch,
                                                                       simulate):
    """Host B frees slots of host A's node 2 (as an eviction of node 2's
    blocks, or the release of node 2's handoff, does) and dies inside lock 0
    before any owner byte or bit changed on the device (RELEASE_HEADER: the
    header written, as when the owner-byte stores that followed died in its
    caches). Its DRAM intent died with it and the region alone showed a
    whole state: the slots stayed node 2's for good, named by nothing. The
    allocator header names them now (on the device before any owner byte
    changes), so the next holder of lock 0 after the verdict finishes the
    free: the slots are back in the pool (40 of them: the list spans lines)."""
    manager = on_host(monkeypatch, "host-a", region, 0, manager=True, simulate=simulate,
                      host_dead_after=DEAD_AFTER)
    b_agent = None
    try:
        with Worker(region, 2, simulate=simulate) as a:
            foreign = a.call("alloc", n=40)     # three lines of the intent's list
        before = taken_slots(region, 2)
        b_agent = on_host(monkeypatch, "host-b", region, 1, manager=False, simulate=simulate,
                          takeover_after=None)
        in_alloc = Worker(region, 1, simulate=simulate,
                          env={"TRACT_DIE_AT": str(lib.TRACT_DIE_RELEASE_HEADER)})
        b_agent.proc.send_signal(signal.SIGSTOP)
        in_alloc.send("free", slots=foreign)
        assert in_alloc.proc.wait(timeout=60) == -9, "the free released nothing"
        kill_host_b(region, b_agent, [in_alloc])
        wait_for("node 1 declared dead", lambda: node_record(region, 1).dead)
        with Worker(region, 3, simulate=simulate) as fresh:
            fresh.call("alloc", n=1)                # takes lock 0: repaired first
        assert taken_slots(region, 2) == before - 40
        assert not {v.check for v in slot_violations(region)} & {"allocator"}
    finally:
        gone(b_agent and b_agent.proc)
        manager.stop()


def _forge_node(pool: Pool, node: int, epoch: int, manager_epoch: int = 0,
                dead_epoch: int | None = None) -> None:
    """Writes NODE's line 0 (alive, EPOCH) and, with DEAD_EPOCH, its verdict,
    as an agent and a manager's agent would."""
    from tract_cli.core.media import VERDICT_LINE
    from tract_cli.core.nodes import NODE_ALIVE, encode_node_line
    sec = pool.info.section("nodes")
    at = sec.offset + node * sec.entry_size
    now = time.time_ns()
    pool.publish(at, encode_node_line(NODE_ALIVE, os.getpid(), epoch, now, 0, manager_epoch, now))
    if dead_epoch is not None:
        pool.publish(at + 64, VERDICT_LINE.pack(dead_epoch, now, 0, now, 0))


def test_other_nodes_frees_leave_a_dead_hosts_slots_to_its_sweep(region):
    """While node 1 is dead, node 2 evicting node 1's blocks does not give
    their slots back itself: the dead host's sweep does (a free racing a sweep
    could give a slot twice).  Once node 1 rejoined (its stale free list
    dropped), evictions of its new blocks free them as ever.  The lock
    manager runs in this process, so no agent sweeps behind the test's back."""
    from tract_cli.core.native import ffi
    from tract_cli.core.nodes import encode_node_line, NODE_ALIVE
    from tract_cli.core.recovery import recover_host, rejoin
    with Pool.attach(region, node=0, prefault=False) as p0:
        _forge_node(p0, 0, 1, manager_epoch=1)          # node 0 holds the manager claim
        mgr = ffi.new("tract_manager **")
        assert lib.tract_manager_start(p0._r(), 1000000, mgr) == 0
        try:
            with Worker(region, 1) as b:
                assert b.call("index_put_chains", chains=[CHAIN])["stored"] == 12
            _forge_node(p0, 1, 1, dead_epoch=1)          # node 1 declared dead
            taken = taken_slots(region, 1)
            with Worker(region, 2) as a:
                a.call("index_evict_all")
            assert check_index(region)["ready"] == 0
            assert taken_slots(region, 1) == taken, "a dead host's slot was freed by an eviction"
            got = recover_host(p0, 1, slots=True, timeout=30)
            assert got.slots == taken and got.owned == 0 and taken_slots(region, 1) == 0
            assert slot_violations(region) == []
            # node 1 comes back, with the verdict as a rejoin racing the sweep
            # may find it: the slots swept, the sweep not recorded yet
            _forge_node(p0, 1, 1, dead_epoch=1)
            with Pool.attach(region, node=1, prefault=False) as p1:
                line = encode_node_line(NODE_ALIVE, os.getpid(), 2, time.time_ns(), 0, 0, 0)
                named, pins, dropped = rejoin(p1, 1, line)
                assert named and dropped > 0 and p1.allocator.local_free().size == 0
            with Worker(region, 1) as b:
                assert b.call("index_put_chains", chains=[OTHER])["stored"] == 12
            taken = taken_slots(region, 1)
            with Worker(region, 2) as a:
                a.call("index_evict_all")
            assert taken_slots(region, 1) == taken - 12      # alive again: freed as ever
            assert slot_violations(region) == []
        finally:
            lib.tract_manager_stop(mgr[0])


def test_a_dead_evictors_slots_swept_and_taken_again_are_not_freed_by_its_journal(region):
    """A process of node 1 dies between evicting node 1's blocks and freeing
    their slots, so its journal names them (with node 1's epoch then). Node
    1 is declared dead before its agent frees them: the sweep returns them,
    and node 1 comes back and takes them again. The new agent's recovery of
    that journal must leave them alone: they are held now, and freeing them
    would hand them out twice. The free checks node 1's own verdict against
    the epoch the eviction saw, as it does for other nodes' slots."""
    from tract_cli.core.native import ffi
    from tract_cli.core.nodes import NODE_ALIVE, encode_node_line
    from tract_cli.core.recovery import recover_dead_processes, recover_host, rejoin
    with Pool.attach(region, node=0, prefault=False) as p0:
        _forge_node(p0, 0, 1, manager_epoch=1)          # node 0 holds the manager claim
        _forge_node(p0, 1, 1)                           # node 1 alive, epoch 1
        mgr = ffi.new("tract_manager **")
        assert lib.tract_manager_start(p0._r(), 1000000, mgr) == 0
        try:
            with Worker(region, 1) as b:
                assert b.call("index_put_chains", chains=[CHAIN])["stored"] == 12
            evictor = Worker(region, 1, env={"TRACT_DIE_AT": str(lib.TRACT_DIE_EVICTED)})
            evictor.send("index_evict_all")
            assert evictor.proc.wait(timeout=60) == -9, "the eviction did not get to its free"
            evictor.close()
            _forge_node(p0, 1, 1, dead_epoch=1)          # node 1 declared dead
            got = recover_host(p0, 1, slots=True, timeout=30)
            assert got.slots > 0 and taken_slots(region, 1) == 0, got
            with Pool.attach(region, node=1, prefault=False) as p1:
                line = encode_node_line(NODE_ALIVE, os.getpid(), 2, time.time_ns(), 0, 0, 0)
                named, _, _ = rejoin(p1, 1, line)
                assert named
            with Worker(region, 1) as again:
                held = set(again.call("alloc", n=64))      # node 1's slots again, all held
                with Pool.attach(region, node=1, prefault=False) as p1:
                    rec = recover_dead_processes(p1, timeout=30)
                assert rec.processes == 1 and rec.slots == 0, vars(rec)
                assert not held & set(node_free_list(region, 1)), "a held slot was freed"
                assert taken_slots(region, 1) == 64
                again.call("free", slots=sorted(held))
            assert slot_violations(region) == []
        finally:
            lib.tract_manager_stop(mgr[0])


def test_a_paused_host_declared_dead_is_fenced_and_comes_back_empty_handed(region, monkeypatch,
                                                                          tmp_path):
    """Host B pauses (its agent and a reader holding pins stopped) past
    --host-dead-after: declared dead, its pins given back.  When it resumes,
    its agent stops (its node was declared dead), its reader can take no lock,
    and a new agent refuses to start while that reader runs; once it is gone,
    the new agent rejoins and forgets the pins the reader journaled (given
    back once already: a second time would take a live reader's)."""
    from test_cli import TRACT, assert_one_line_error
    manager = on_host(monkeypatch, "host-a", region, 0, manager=True, host_dead_after=DEAD_AFTER)
    log_b = tmp_path / "b.log"
    b_agent = zombie = None
    try:
        with Worker(region, 2) as writer:
            writer.call("index_put_chains", chains=[OTHER])
        b_agent = on_host(monkeypatch, "host-b", region, 1, manager=False, takeover_after=None,
                          log_path=str(log_b))
        zombie = Worker(region, 1)
        assert zombie.call("index_pin_chain", chain=OTHER) == 12
        for proc in (b_agent.proc, zombie.proc):
            proc.send_signal(signal.SIGSTOP)          # the whole host stands still
        wait_for("node 1 declared dead and its pins given back",
                 lambda: node_record(region, 1).recovered & VERDICT_PINS)
        for proc in (b_agent.proc, zombie.proc):
            proc.send_signal(signal.SIGCONT)
        assert b_agent.proc.wait(timeout=30) == 0
        assert "was declared dead by the lock manager" in log_b.read_text()
        with pytest.raises(AssertionError, match="LockTimeout"):
            zombie.call("lock_acquire", lock_id=LOCK_OBJDIR, wait=1.0)   # fenced
        monkeypatch.setenv("TRACT_HOSTNAME", "host-b")
        refused = subprocess.run(TRACT + ["agent", "--pool", region, "--node", "1"],
                                 capture_output=True, text=True, timeout=60)
        assert_one_line_error(refused, 1, "declared dead", "still run")
        zombie.proc.kill()
        zombie.proc.wait(timeout=30)
        zombie.close()
        log_b2 = tmp_path / "b2.log"
        with RunningAgent(region, 1, manager=False, takeover_after=None, log_path=str(log_b2)):
            monkeypatch.delenv("TRACT_HOSTNAME")
            # its recovery line is written at start, but may reach the file after the
            # agent answers as ready: waited for (bounded), not assumed
            wait_for("the restarted agent's log naming the pins it forgot",
                     lambda: "12 journaled pin(s) forgotten, " in log_b2.read_text())
            assert not node_record(region, 1).dead
            with Worker(region, 1) as reader:
                assert reader.call("index_pin_chain", chain=OTHER) == 12
                reader.call("lock_acquire", lock_id=LOCK_OBJDIR, wait=30.0)   # not fenced
                reader.call("lock_release", lock_id=LOCK_OBJDIR)
                assert pinned_by_node(region).get(1) == 12
    finally:
        gone(b_agent and b_agent.proc, zombie and zombie.proc)
        manager.stop()


def test_a_node_coming_back_without_the_allocator_lock_keeps_nothing_it_cannot_check(region):
    """A verdict named node 1's previous epoch, and no lock manager runs to
    grant lock 0: the rejoining agent cannot tell which of its free-list
    slots the dead host's sweep returned, so it keeps none (a leak at worst,
    never a slot twice)."""
    from tract_cli.core.native import ffi
    from tract_cli.core.nodes import NODE_ALIVE, encode_node_line
    from tract_cli.core.recovery import rejoin
    with Pool.attach(region, node=0, prefault=False) as p0:
        _forge_node(p0, 0, 1, manager_epoch=1)
        mgr = ffi.new("tract_manager **")
        assert lib.tract_manager_start(p0._r(), 1000000, mgr) == 0
        try:
            with Worker(region, 1) as b:
                b.call("free", slots=b.call("alloc", n=3))     # a batch on node 1's list
        finally:
            lib.tract_manager_stop(mgr[0])
        listed = len(node_free_list(region, 1))
        assert listed > 0
        _forge_node(p0, 1, 1, dead_epoch=1)
        with Pool.attach(region, node=1, prefault=False) as p1:
            line = encode_node_line(NODE_ALIVE, os.getpid(), 2, time.time_ns(), 0, 0, 0)
            named, _, dropped = rejoin(p1, 1, line, timeout=0.3)
            assert named and dropped == listed and p1.allocator.local_free().size == 0


def node_free_list(path: str, node: int) -> list:
    with Pool.attach(path, node=node, prefault=False) as p:
        return p.allocator.local_free().tolist()


def _all_threads_stopped(pid: int) -> bool:
    """Whether every thread of PID is in state T (stopped by a signal)."""
    task = f"/proc/{pid}/task"
    states = []
    for tid in os.listdir(task):
        with open(f"{task}/{tid}/stat") as f:
            states.append(f.read().rsplit(")", 1)[1].split()[0])
    return all(st == "T" for st in states)


def test_a_node_of_this_host_is_never_declared_dead(region):
    """Node 1's agent, on the manager's own host, stands still past
    --host-dead-after: it is judged by its processes' pids (its own agent's
    recovery when it comes back), never declared dead by a heartbeat."""
    manager = RunningAgent(region, 0, manager=True, host_dead_after=DEAD_AFTER)
    other = None
    try:
        other = RunningAgent(region, 1, manager=False, takeover_after=None)
        other.proc.send_signal(signal.SIGSTOP)
        # kill() returns before the target has stopped: a heartbeat may still
        # land, so the heartbeat is read once every thread is stopped
        wait_for("the agent to stop", lambda: _all_threads_stopped(other.proc.pid), timeout=30)
        still = node_record(region, 1).heartbeat_ns
        deadline = time.monotonic() + 2 * DEAD_AFTER
        while time.monotonic() < deadline:
            assert not node_record(region, 1).dead
            time.sleep(0.1)        # watching for a verdict that must not come
        assert node_record(region, 1).heartbeat_ns == still
        other.proc.send_signal(signal.SIGCONT)
        other.stop()
    finally:
        gone(other and other.proc)
        manager.stop()
