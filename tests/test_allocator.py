"""The allocator across emulated nodes: concurrent allocate/free with
cross-node frees, then bitmap, owner map, header and free lists agree and no
slot is owned twice or lost."""
from __future__ import annotations

import numpy as np
import pytest

from agents import RunningAgent
from procs import Worker
from tract_cli.core.errors import PoolFull
from tract_cli.core.errors import TractError
from tract_cli.core.pool import Pool

NODES = 4


@pytest.fixture
def region(region_path):
    Pool.create(region_path, 16 << 20, "tiny", nodes=NODES).close()
    return region_path


def region_state(path: str) -> dict:
    """Bitmap, owner map and allocator header as the region holds them."""
    with Pool.attach(path, readonly=True) as p:
        bm, own, hdr = (p.info.section(n) for n in ("bitmap", "owners", "alloc"))
        n = p.slot_count
        bits = np.unpackbits(np.frombuffer(p.observe(bm.offset, bm.length), np.uint8),
                             bitorder="little")[:n].astype(bool)
        owners = np.frombuffer(p.observe(own.offset, own.length), np.uint8)[:n]
        used = int.from_bytes(p.observe(hdr.offset, 8), "little")
    return {"bits": bits, "owners": owners, "used": used}


def assert_consistent(path: str, held: dict[int, list[int]], free: dict[int, list[int]]):
    st = region_state(path)
    taken = set(np.flatnonzero(st["bits"]).tolist())
    assert st["used"] == len(taken), "header used_slots disagrees with the bitmap"
    assert taken == set(np.flatnonzero(st["owners"]).tolist()), "bitmap and owner map disagree"
    seen: list[int] = []
    for node in held:
        mine = held[node] + free[node]
        seen += mine
        # a node's cached free slots were claimed by that node
        assert all(st["owners"][s] == node + 1 for s in free[node])
    assert len(seen) == len(set(seen)), "a slot is owned twice"
    assert set(seen) == taken, "a taken slot is neither held nor on a free list (lost)"


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
def test_concurrent_churn_with_cross_node_frees(region, simulate):
    with RunningAgent(region, 0, manager=True, simulate=simulate):
        workers = {n: Worker(region, n, simulate) for n in range(NODES)}
        try:
            # node 0 hands slots to node 3, which frees them (foreign frees)
            handed = workers[0].call("alloc", n=100)
            for n, w in workers.items():
                w.send("churn", rounds=150, seed=n)
            held = {n: w.recv("churn", timeout=300) for n, w in workers.items()}
            workers[3].call("free", slots=handed)
            free = {n: w.call("local_free") for n, w in workers.items()}
            assert_consistent(region, held, free)
            st = region_state(region)
            assert not st["bits"][handed].any(), "foreign frees did not return to the region"
            # drained nodes hold only what they use
            for n, w in workers.items():
                w.call("drain")
                w.call("free", slots=held[n])
                w.call("drain")
            assert region_state(region)["used"] == 0
        finally:
            for w in workers.values():
                w.close()


def test_alloc_is_all_or_nothing_and_pool_full_is_a_result(region):
    with RunningAgent(region, 0, manager=True):
        with Pool.attach(region, node=1) as p:
            everything = p.allocator.alloc(p.slot_count)
            assert len(set(everything.tolist())) == p.slot_count
            with pytest.raises(PoolFull):
                p.allocator.alloc(1)
            p.allocator.free(everything[:10])
            again = p.allocator.alloc(10)
            assert sorted(again.tolist()) == sorted(everything[:10].tolist())


def test_double_free_is_refused(region):
    with RunningAgent(region, 0, manager=True):
        with Pool.attach(region, node=1) as p:
            slots = p.allocator.alloc(3)
            p.allocator.free(slots)
            with pytest.raises(TractError, match="double free"):
                p.allocator.free(slots[:1])
            p.allocator.drain()
            with pytest.raises(TractError, match="double free"):
                p.allocator.free(slots[:1])


def test_slot_ids_are_validated(region):
    with Pool.attach(region, node=1) as p:
        with pytest.raises(TractError, match="outside the pool"):
            p.allocator.free([p.slot_count])


def test_allocating_a_6000_token_request_is_one_call(region_path):
    Pool.create(region_path, 1 << 30, "llama-3-8b", nodes=2).close()
    with RunningAgent(region_path, 0, manager=True):
        with Pool.attach(region_path, node=1) as p:
            slots = p.allocator.alloc(375)
            assert len(set(slots.tolist())) == 375
            assert p.slot_usage()["claimed_by_node"] == {1: 375}
