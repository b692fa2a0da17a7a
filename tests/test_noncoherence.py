"""What another host sees, under the non-coherence simulator: the state a
lock holder publishes, and a handoff record reused for a new request. These
cover flushes and invalidates the other protocol tests do not depend on
(tests/mutation.py removes each one and checks that some test fails)."""
from __future__ import annotations

import pytest

from agents import RunningAgent
from procs import Worker
from tract_cli.core.pool import Pool

LOCK = 1
LOCKED, WAITING, IDLE = 2, 1, 0


@pytest.fixture
def region(region_path):
    # a one-record transfer table: the second handoff reuses the first's record
    # whatever record a publisher tries first (publish is next fit)
    Pool.create(region_path, 16 << 20, "tiny", nodes=3, flush_mode="clflush",
                transfer_entries=1).close()
    with RunningAgent(region_path, 0, manager=True, simulate=True):
        yield region_path


def slot_offset(path: str, lock_id: int, node: int) -> int:
    with Pool.attach(path, readonly=True, prefault=False, local=False) as p:
        locks = p.info.section("locks")
        return locks.offset + lock_id * locks.entry_size + (1 + node) * 64


def test_another_host_sees_the_holder_of_a_lock_as_locked(region):
    off = slot_offset(region, LOCK, 1)
    with Worker(region, 1, True) as holder, Worker(region, 2, True) as observer:
        assert observer.call("observe_u64", off=off) & 0xFFFFFFFF == IDLE   # now cached there
        holder.call("lock_acquire", lock_id=LOCK)
        assert observer.call("observe_u64", off=off) & 0xFFFFFFFF == LOCKED
        holder.call("lock_release", lock_id=LOCK)
        assert observer.call("observe_u64", off=off) & 0xFFFFFFFF == IDLE


def test_a_lock_passes_between_hosts_within_a_bound(region):
    """Requests, grants and releases cross hosts within a few seconds under
    the simulator: each acquire waits at most 5 s (not the minute a production
    acquire allows), so a request, grant or release that is not published, or
    a line that is not observed again while polling, fails here with a lock
    timeout instead of leaving the protocol waiting (the mutation test's lock
    sites)."""
    with Worker(region, 1, True) as a, Worker(region, 2, True) as b:
        for _ in range(3):
            for w in (a, b):
                w.call("lock_acquire", lock_id=LOCK, wait=5.0)
                w.call("lock_release", lock_id=LOCK)


def test_a_reused_handoff_record_is_read_afresh(region):
    """Decode host A read record R for one request (it stays in A's cache);
    host B acknowledges it, R is reused for the next request: A opening the
    new ticket must not see its old copy."""
    chain1, chain2 = [0, 0, 1, 4], [0, 0, 2, 5]
    with Worker(region, 1, True) as prefill, Worker(region, 2, True) as a, \
            Worker(region, 0, True) as b:
        t1 = prefill.call("handoff_publish", chain=chain1, request="first")
        assert a.call("handoff_receive", ticket=t1, chain=chain1, request="first",
                      ack=False) == 4
        assert b.call("handoff_receive", ticket=t1, chain=chain1, request="first") == 4
        t2 = prefill.call("handoff_publish", chain=chain2, request="second")
        assert t2["record"] == t1["record"]            # the only record, again
        assert a.call("handoff_receive", ticket=t2, chain=chain2, request="second") == 5


def test_a_stripe_line_another_host_rewrote_is_read_afresh(region):
    """Host A reads a bucket line under its stripe's lock (its put finds the block
    READY: nothing written, the line stays in A's cache); host B evicts the block
    (the line rewritten and flushed); A's next put of it must read the line
    afresh, find it gone and store it, not trust its old copy.  (The lookups of
    other tests look without a lock first, which observes the line and so would
    hide a missing invalidate under the lock.)"""
    block = [7, 0, 7, 1]                       # one block
    with Worker(region, 1, True) as a, Worker(region, 2, True) as b:
        assert b.call("index_put_chains", chains=[block])["stored"] == 1
        assert a.call("index_put_chains", chains=[block])["already_ready"] == 1
        assert b.call("index_evict", count=1) == 1
        assert a.call("index_put_chains", chains=[block])["stored"] == 1
