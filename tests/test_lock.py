"""The two-tier lock with real processes on emulated nodes: shared counters
incremented with a plain read-modify-write stay exact under the lock (plain
mode and under the non-coherence simulator) and lose updates without it."""
from __future__ import annotations

import pytest

from agents import RunningAgent
from counters import counter_offset, finish_counters, start_counters
from procs import Worker
from tract_cli.core.errors import LockTimeout
from tract_cli.core.pool import Pool

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
            counts = [w.call("lock_stats", lock_id=1)[0] for w in workers]
        finally:
            for w in workers:
                w.close()
    assert counts == [200] * NODES


def test_a_lock_held_elsewhere_times_out_naming_the_holder(region):
    with RunningAgent(region, 0, manager=True):
        with Worker(region, 2) as holder:
            holder.call("lock_acquire", lock_id=0)
            with Pool.attach(region, node=1) as p:
                with pytest.raises(LockTimeout, match=r"allocator .* held by node 2 pid \d+"):
                    p.locks.acquire(0, timeout=0.3)
            holder.call("lock_release", lock_id=0)
            with Pool.attach(region, node=1) as p:
                with p.locks.hold(0, timeout=30):
                    pass


def test_without_a_manager_acquire_times_out_with_a_hint(region):
    with Pool.attach(region, node=1) as p:
        with pytest.raises(LockTimeout, match="no grant was issued .*manager"):
            p.locks.acquire(3, timeout=0.2)
        # the withdrawn request left the slot IDLE: a manager started now grants at once
        with RunningAgent(region, 0, manager=True):
            with p.locks.hold(3, timeout=30):
                pass


def test_release_without_acquire_is_an_error(region):
    from tract_cli.core.errors import TractError
    with Pool.attach(region, node=1) as p:
        with pytest.raises(TractError, match="not held"):
            p.locks.release(0)


def test_a_dead_holders_lock_is_recovered_by_the_next_process_of_its_node(region):
    with RunningAgent(region, 0, manager=True):
        dead = Worker(region, 2)
        dead.call("lock_acquire", lock_id=1)
        dead.kill()
        dead.close()
        with Worker(region, 2) as successor:                 # same node: EOWNERDEAD
            assert successor.call("lock_acquire", lock_id=1, timeout=30) is True
            successor.call("lock_release", lock_id=1)


def test_the_nodes_agent_releases_a_dead_holders_lock(region):
    with RunningAgent(region, 0, manager=True), RunningAgent(region, 2, manager=False):
        dead = Worker(region, 2)
        dead.call("lock_acquire", lock_id=1)
        dead.kill()
        dead.close()
        # no process of node 2 ever asks again: the agent of node 2 releases it
        with Pool.attach(region, node=1) as p:
            with p.locks.hold(1, timeout=30):
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
    with RunningAgent(region_path, 0, manager=True), Pool.attach(region_path, node=1) as p:
        path = local_path(p.info.uuid, 1)
        with open(path, "r+b") as f, mmap.mmap(f.fileno(), 0) as mm:
            locks_off = struct.unpack_from("<Q", mm, 56)[0]   # struct tract_local_hdr
            mutex = locks_off + 5 * 64                          # lock 5's record
            struct.pack_into("<i", mm, mutex + 16, 0x7F)        # pthread_mutex_t.__kind
        ffi.errno = 0
        with pytest.raises(TractError) as exc:
            p.locks.acquire(5, timeout=1.0)
        assert os.strerror(errno.EINVAL) in str(exc.value)
