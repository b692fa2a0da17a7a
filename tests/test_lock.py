"""The two-tier lock with real processes on emulated nodes: shared counters
incremented with a plain read-modify-write stay exact under the lock (plain
mode and under the non-coherence simulator) and lose updates without it."""
from __future__ import annotations

import numpy as np
import pytest

import background
from agents import RunningAgent
from counters import counter_offset, finish_counters, start_counters
from procs import Worker, wait_for
from tract_cli.core.errors import LockTimeout
from tract_cli.core.index import PUT_CLAIMED
from tract_cli.core.locks import (LOCK_ALLOCATOR, LOCK_OBJDIR, LOCK_TRANSFER, SLOT_IDLE,
                                  SLOT_WAITING, lock_count, lock_name, stripe_lock)
from tract_cli.core.pool import Pool
from tract_cli.inspect.snapshot import take

NODES, PER_NODE = 4, 2


@pytest.fixture
def region(region_path):
    Pool.create(region_path, 16 << 20, "tiny", nodes=NODES, flush_mode="clflush").close()
    return region_path


def run_counters(path: str, simulate: bool, iterations: int, use_lock: bool) -> int:
    nodes = [node for node in range(NODES) for _ in range(PER_NODE)]
    workers = start_counters(path, simulate, iterations, nodes, use_lock)
    return finish_counters(path, workers, iterations)


@pytest.mark.parametrize("simulate,iterations", [(False, 1500), (True, 300)], ids=["plain", "sim"])
def test_counters_are_exact_under_the_lock(region, simulate, iterations):
    with RunningAgent(region, 0, manager=True, simulate=simulate):
        total = run_counters(region, simulate, iterations, use_lock=True)
    assert total == NODES * PER_NODE * iterations


def test_counters_lose_updates_without_the_lock(region):
    """The same test with the lock disabled must fail: it can detect a broken lock."""
    iterations = 10000
    total = run_counters(region, False, iterations, use_lock=False)
    assert total < NODES * PER_NODE * iterations


def test_every_node_gets_the_lock(region):
    """Round-robin grants: with all nodes contending, every node acquires."""
    with RunningAgent(region, 0, manager=True):
        off = counter_offset(region)
        workers = [Worker(region, node) for node in range(NODES)]
        try:
            for w in workers:
                w.send("counter_loop", off=off, iterations=200, use_lock=True)
            for w in workers:
                w.recv("counter_loop", timeout=300)
            counts = [w.call("lock_stats", lock_id=LOCK_OBJDIR)[0] for w in workers]
        finally:
            for w in workers:
                w.close()
    assert counts == [200] * NODES


def test_a_lock_held_elsewhere_times_out_naming_the_holder(region):
    with RunningAgent(region, 0, manager=True):
        with Worker(region, 2) as holder:
            holder.call("lock_acquire", lock_id=LOCK_ALLOCATOR)
            with Pool.attach(region, node=1) as p:
                with pytest.raises(LockTimeout, match=r"allocator .* held by node 2 pid \d+"):
                    p.locks.acquire(LOCK_ALLOCATOR, timeout=0.3)
            holder.call("lock_release", lock_id=LOCK_ALLOCATOR)
            with Pool.attach(region, node=1) as p:
                with p.locks.hold(LOCK_ALLOCATOR, timeout=30):
                    pass
                mine = p.locks.stats(LOCK_ALLOCATOR)
                assert mine.acquired >= 1 and mine.wait_s >= 0
                assert p.locks.totals().acquired >= mine.acquired


def test_without_a_manager_acquire_times_out_with_a_hint(region):
    with Pool.attach(region, node=1) as p:
        with pytest.raises(LockTimeout, match="no grant was issued .*manager"):
            p.locks.acquire(stripe_lock(0), timeout=0.2)
        # the withdrawn request left the slot IDLE: a manager started now grants at once
        with RunningAgent(region, 0, manager=True):
            with p.locks.hold(stripe_lock(0), timeout=30):
                pass


def test_lock_ids_are_the_documented_ones(region):
    """docs/FORMAT.md §4: 0 allocator, 1 object directory, 2 transfer table,
    then 3 + s for index stripe s; the region has one lock per stripe more."""
    assert (LOCK_ALLOCATOR, LOCK_OBJDIR, LOCK_TRANSFER, stripe_lock(0)) == (0, 1, 2, 3)
    assert [lock_name(i) for i in range(4)] == ["allocator", "object directory",
                                                "transfer table", "index stripe 0"]
    with Pool.attach(region, readonly=True, prefault=False) as p:
        assert p.locks.count == lock_count(p.info.index_stripes)
        assert lock_name(p.locks.count - 1) == f"index stripe {p.info.index_stripes - 1}"


def test_the_core_takes_the_locks_python_names(region):
    """The fixed lock ids are private #defines of the C files that take them:
    while another process holds the lock Python names for a structure, the
    core's operation on that structure waits for it."""
    with Pool.attach(region, readonly=True, prefault=False) as p:
        stripes = p.info.index_stripes
    keys = np.zeros((2, 16), np.uint8)
    keys[0, 0] = 1                    # in stripe 0: published in a handoff
    keys[1, 13] = stripes - 1         # bytes 8-15, bits 40 and up, pick the stripe
    with RunningAgent(region, 0, manager=True), Worker(region, 2) as holder, \
            Pool.attach(region, node=1) as p:
        block = np.zeros((1, p.info.block_bytes), np.uint8)
        steps = [  # (the lock, what makes the operation need it, the operation)
            (LOCK_ALLOCATOR, p.allocator.drain,        # no slot in the node's free list
             lambda: p.allocator.alloc(1, timeout=0.3)),
            (LOCK_OBJDIR, None, lambda: p.objects.put("x", 0, 0, timeout=0.3)),
            (LOCK_TRANSFER, lambda: p.index.put(keys[:1], block),
             lambda: p.handoffs.publish("r", keys[:1], 1, timeout=0.3)),
            (stripe_lock(stripes - 1), None, lambda: p.index.put(keys[1:], block, timeout=0.3))]
        for lock, prepare, operation in steps:
            if prepare is not None:
                prepare()
            holder.call("lock_acquire", lock_id=lock)
            with pytest.raises(LockTimeout):
                operation()
            holder.call("lock_release", lock_id=lock)
            operation()                # and goes through once it is free


def test_release_without_acquire_is_an_error(region):
    from tract_cli.core.errors import TractError
    with Pool.attach(region, node=1) as p:
        with pytest.raises(TractError, match="not held"):
            p.locks.release(LOCK_ALLOCATOR)


def test_a_dead_holders_lock_is_recovered_by_the_next_process_of_its_node(region):
    with RunningAgent(region, 0, manager=True):
        dead = Worker(region, 2)
        dead.call("lock_acquire", lock_id=LOCK_OBJDIR)
        dead.kill()
        dead.close()
        with Worker(region, 2) as successor:                 # same node: EOWNERDEAD
            assert successor.call("lock_acquire", lock_id=LOCK_OBJDIR, timeout=30) is True
            successor.call("lock_release", lock_id=LOCK_OBJDIR)


def test_the_nodes_agent_releases_a_dead_holders_lock(region):
    with RunningAgent(region, 0, manager=True), RunningAgent(region, 2, manager=False):
        dead = Worker(region, 2)
        dead.call("lock_acquire", lock_id=LOCK_OBJDIR)
        dead.kill()
        dead.close()
        # no process of node 2 ever asks again: the agent of node 2 releases it
        with Pool.attach(region, node=1) as p:
            with p.locks.hold(LOCK_OBJDIR, timeout=30):
                pass


def test_a_broken_local_mutex_is_reported_with_its_own_error(region_path):
    """pthread calls return their error instead of setting errno: a local
    segment whose mutex is not a mutex any more (its kind overwritten) gives
    the error pthread returned, not whatever errno last held."""
    import errno
    import mmap
    import os
    import struct
    from tract_cli.core.errors import TractError
    from tract_cli.core.local import local_path
    from tract_cli.core.native import ffi
    Pool.create(region_path, 8 << 20, "tiny", nodes=2).close()
    lock = stripe_lock(2)
    with RunningAgent(region_path, 0, manager=True), Pool.attach(region_path, node=1) as p:
        path = local_path(p.info.uuid, 1)
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
            locks_off = struct.unpack_from("<Q", mm, 56)[0]   # struct tract_local_hdr
            mutex = locks_off + lock * 64                       # the lock's record
            struct.pack_into("<i", mm, mutex + 16, 0x7F)        # pthread_mutex_t.__kind
        ffi.errno = 0
        with pytest.raises(TractError) as exc:
            p.locks.acquire(lock, timeout=1.0)
        assert os.strerror(errno.EINVAL) in str(exc.value)


CLOSED_HOLDING = """
import gc, sys
from tract_cli.core.pool import Pool
path = sys.argv[1]
first = Pool.attach(path, node=1)
first.locks.acquire({x}, timeout=10)        # on this thread's robust list first
second = Pool.attach(path, node=2)
second.locks.acquire({y}, timeout=10)
second.close()                              # closed inside its critical section
first.locks.release({x})                    # pthreads walks the list past {y}'s mutex
first.close()
with Pool.attach(path, node=2) as again:    # the same process takes it over
    again.locks.acquire({y}, timeout=10)
    again.locks.release({y})
dropped = Pool.attach(path, node=2)
dropped.locks.acquire({y}, timeout=10)
del dropped                                 # dropped without close(), still inside
gc.collect()
print("survived", flush=True)
sys.stdin.readline()                        # alive until told
"""


def test_a_pool_closed_while_it_holds_a_lock_lets_it_go_as_a_dead_holders(region):
    """A pool closed (or dropped) inside a critical section -- an exception
    between acquire and release -- lets the lock go as a dead holder's: the
    slot stays LOCKED, so no other node enters before a repair, and the
    node's next process to take it, or its agent, takes it over. Unmapping
    the node-local segment with the mutex still held crashed the process at
    its next robust unlock (the mutex stayed on its thread's robust list; the
    mutation test met it), and keeping it held until the process exits would
    hang every node on that lock while the process lives on."""
    import subprocess
    import sys
    code = CLOSED_HOLDING.format(x=LOCK_ALLOCATOR, y=LOCK_OBJDIR)
    with RunningAgent(region, 0, manager=True), RunningAgent(region, 2, manager=False):
        proc = subprocess.Popen([sys.executable, "-c", code, region], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            line = proc.stdout.readline()
            assert line.strip() == "survived", proc.stderr.read()[-2000:] if proc.poll() \
                is not None else line
            # still alive: node 2's agent takes the dropped pool's lock over
            with Worker(region, 3) as other:
                other.call("lock_acquire", lock_id=LOCK_OBJDIR, wait=30.0)
                other.call("lock_release", lock_id=LOCK_OBJDIR)
            assert proc.poll() is None, "the process did not live on"
        finally:
            proc.communicate("\n", timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:] if proc.stderr else proc.returncode


def _lock_row(pool: Pool, lock_id: int) -> dict:
    rows = {r["id"]: r for r in take(pool, views=("locks",))["locks"]["locks"]}
    return rows.get(lock_id, {"holder_node": None, "waiting": []})


def test_a_walk_is_granted_its_stripes_in_order_so_no_wait_cycle_forms(region):
    """A walk requests every stripe it will enter at once, each request naming
    the one below it (docs/PROTOCOLS.md §4).  Here node 1 walks stripes 0 and
    2 while node 3 holds stripe 0: stripe 2 is free, but the manager must not
    grant it before 0.  Node 2, holding stripe 1, then asks for 2, and node 3,
    holding 0, asks for 1: had node 1 been granted 2, the three would wait on
    each other in a cycle (1 on 3 for stripe 0, 3 on 2 for 1, 2 on 1 for 2)
    until their locks timed out.  Granted in order, all three finish."""
    wait = 10.0
    s0, s1, s2 = (stripe_lock(s) for s in range(3))
    with RunningAgent(region, 0, manager=True), \
            Worker(region, 1, env={"TRACT_WALK_AHEAD": "32"}) as walker, \
            Worker(region, 2) as b, Worker(region, 3) as c, Worker(region, 0) as barrier, \
            Pool.attach(region, readonly=True, prefault=False) as look:
        c.call("lock_acquire", lock_id=s0)
        b.call("lock_acquire", lock_id=s1)
        walker.send("index_claim_stripes", stripes=[0, 2], wait=wait)
        wait_for("the walk's request of stripe 2, made ahead",
                 lambda: [w["node"] for w in _lock_row(look, s2)["waiting"]] == [1])
        # a grant of a lock requested only now comes from a manager scan that
        # saw the walk's request of stripe 2, and stripe 2 free; a lock above
        # stripe 2, whose grant that scan writes after stripe 2's decision
        barrier.call("lock_acquire", lock_id=stripe_lock(15), wait=wait)
        barrier.call("lock_release", lock_id=stripe_lock(15))
        assert _lock_row(look, s2)["holder_node"] is None, \
            "stripe 2 was granted to the walk before the stripe below it"
        b.send("lock_acquire", lock_id=s2, wait=wait)
        b.recv("lock_acquire", timeout=wait + 10)
        c.send("lock_acquire", lock_id=s1, wait=wait)
        for lock_id in (s2, s1):
            b.call("lock_release", lock_id=lock_id)
        c.recv("lock_acquire", timeout=wait + 10)
        for lock_id in (s1, s0):
            c.call("lock_release", lock_id=lock_id)
        assert walker.recv("index_claim_stripes", timeout=wait + 10) == [PUT_CLAIMED] * 2


def test_a_walk_request_waits_for_the_one_it_names_by_its_sequence(region):
    """The manager decides whether a walk's request may be granted from the
    request it names (lock and sequence): granted, or gone (IDLE at that
    sequence, or a newer sequence).  The slot of the request below showing an
    older sequence is a request the scan has not seen yet (its copy of the
    table is not taken at one instant): not gone.  The slots are written here
    by hand, as node 1 would."""
    s0, s1 = stripe_lock(0), stripe_lock(1)
    with RunningAgent(region, 0, manager=True), Worker(region, 2) as barrier, \
            Pool.attach(region, node=1) as node1:
        sec = node1.info.section("locks")
        line = lambda lock_id: sec.offset + lock_id * sec.entry_size + (1 + 1) * 64

        def slot(lock_id: int, state: int, seq: int, after: tuple = (0, 0)) -> None:
            off = line(lock_id)
            node1.publish_u64(off + 16, seq)
            node1.publish_u64(off + 40, after[0])       # after_lock (+ reserved0)
            node1.publish_u64(off + 48, after[1])       # after_req
            node1.publish_u64(off, state)               # state, pid 0

        def scanned() -> None:
            # a grant of a lock asked for now: a scan after the writes, and a lock
            # above the two, whose grant that scan writes after their decisions
            barrier.call("lock_acquire", lock_id=stripe_lock(15), wait=10.0)
            barrier.call("lock_release", lock_id=stripe_lock(15))

        slot(s0, SLOT_IDLE, 4)                                   # its request 5 not seen yet
        slot(s1, SLOT_WAITING, 1, after=(s0 + 1, 5))
        scanned()
        assert _lock_row(node1, s1)["holder_node"] is None, "granted before the one below"
        slot(s0, SLOT_WAITING, 5)                                # seen, not granted yet...
        scanned()
        assert _lock_row(node1, s0)["holder_node"] == 1          # ...granted in this scan,
        wait_for("stripe 1 granted once the request below it is",  # stripe 1 in this or the next
                 lambda: _lock_row(node1, s1)["holder_node"] == 1)
        for lock_id in (s1, s0):
            slot(lock_id, SLOT_IDLE, 5 if lock_id == s0 else 1)
        wait_for("both released", lambda: all(_lock_row(node1, x)["holder_node"] is None
                                              for x in (s0, s1)))
        # gone: IDLE at the named sequence, or a newer one
        for below in ((SLOT_IDLE, 5), (SLOT_IDLE, 6), (SLOT_WAITING, 6)):
            slot(s0, *below)
            slot(s1, SLOT_WAITING, 2, after=(s0 + 1, 5))
            wait_for(f"stripe 1 granted with the request below {below}",
                     lambda: _lock_row(node1, s1)["holder_node"] == 1)
            slot(s1, SLOT_IDLE, 2)
            slot(s0, SLOT_IDLE, 7)
            wait_for("released", lambda: all(_lock_row(node1, x)["holder_node"] is None
                                             for x in (s0, s1)))


def test_walk_ahead_is_set_per_process_and_checked():
    from tract_cli.core.errors import UsageError
    from tract_cli.core.locks import walk_ahead
    default = walk_ahead()
    try:
        assert walk_ahead(1) == 1 and walk_ahead() == 1
        assert walk_ahead(32) == 32
        for bad in (0, 33, -1):
            with pytest.raises(UsageError, match="1 to 32"):
                walk_ahead(bad)
    finally:
        walk_ahead(default)


def test_microbench_lock_times_each_walk_ahead_and_one_ahead_idle_and_busy():
    """`tract microbench lock`'s walk figures: a claim and a commit, each with
    its locks requested ahead and one ahead, on an idle and on a busy core;
    the process's affinity and walk setting as they were after."""
    import os
    from tract_cli.bench.micro.locks import bench_locks
    from tract_cli.core.locks import walk_ahead
    import psutil
    affinity, ahead = os.sched_getaffinity(0), walk_ahead()
    # the suite's own children (tests/background.py's model checks) are not the benchmark's
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    r = bench_locks("none", nodes=(), iterations=20, walk_rounds=3)    # (no contended run)
    new = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    # listed after them: what the checks started meanwhile (a vLLM bench's) is in it;
    # one whose parent has gone meanwhile carries their mark
    checks = background.spawned()
    left = []
    for p in new:
        try:
            line = " ".join(p.cmdline())
            theirs = p.pid in checks or background.MARK in p.environ()
        except psutil.Error:
            continue                    # gone since: it did not outlive anything
        if not theirs and "resource_tracker" not in line:    # multiprocessing's own
            left.append(line)
    assert not left, f"processes of the benchmark outlived it: {left}"
    for walks in (r.walks, r.walks_busy):
        assert set(walks) == {"claim", "commit"}
        for w in walks.values():
            assert set(w) == {"ahead", "one_ahead"} and all(v > 0 for v in w.values())
    assert r.stripes == 16
    assert os.sched_getaffinity(0) == affinity and walk_ahead() == ahead
