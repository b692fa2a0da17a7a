"""The prefix index: put / lookup / read / pin / evict, against a model in
one process (hypothesis) and with real processes on emulated nodes, in
plain mode and under the non-coherence simulator."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from agents import RunningAgent
from index_check import check_index, lru_lists, payload_for
from procs import Worker
from tract_cli.core.errors import ChecksumMismatch, LockTimeout, PoolFull
from tract_cli.core.hashing import block_hashes, pool_root
from tract_cli.core.index import PUT_CLAIMED
from tract_cli.core.pool import Pool


@pytest.fixture(scope="module")
def small_region(tmp_path_factory):
    """A 4 MiB tiny-model region (about 250 slots) with a lock manager."""
    import uuid
    path = f"/dev/shm/tract-test-index-{uuid.uuid4().hex[:8]}.pool"
    Pool.create(path, 4 << 20, "tiny", nodes=4, index_stripes=4).close()
    agent = RunningAgent(path, 0, manager=True)
    yield path
    agent.stop()
    from conftest import remove_region
    remove_region(path)


def chain(pool: Pool, seed: int, blocks: int, prefix_seed: int | None = None,
          prefix_blocks: int = 0) -> np.ndarray:
    bt = pool.info.geometry.block_tokens
    pre = np.random.default_rng(prefix_seed).integers(0, 50000, prefix_blocks * bt)
    suf = np.random.default_rng(seed).integers(0, 50000, (blocks - prefix_blocks) * bt)
    return block_hashes(np.concatenate([pre, suf]).astype(np.int32), root=pool_root(pool.info))


def blocks_for(pool: Pool, keys) -> np.ndarray:
    return np.stack([payload_for(k.tobytes(), pool.info.block_bytes) for k in keys]) \
        if len(keys) else np.empty((0, pool.info.block_bytes), np.uint8)


def test_put_lookup_read_unpin_round_trip(small_region):
    with Pool.attach(small_region, node=1) as p:
        keys = chain(p, 1, 10)
        assert p.index.put(keys, blocks_for(p, keys), checksum=True).count("stored") == 10
        again = p.index.put(keys, blocks_for(p, keys))
        assert again.count("already_ready") == 10 and again.count("stored") == 0
        res = p.index.lookup(keys)
        assert res.hits == 10 and len(set(res.slots.tolist())) == 10
        out = np.empty((10, p.info.block_bytes), np.uint8)
        p.index.read(res, out)
        assert np.array_equal(out, blocks_for(p, keys))
        views = p.index.views(res)                      # zero copy, same bytes
        assert views.area is p.slots_array() and np.array_equal(views.slots, res.slots)
        assert views[3].tobytes() == blocks_for(p, keys)[3].tobytes()
        del views
        p.index.unpin(res)
        check_index(small_region)
        # a different suffix: only the shared prefix hits
        other = chain(p, 2, 10, prefix_seed=1, prefix_blocks=0)
        assert p.index.lookup(other).hits == 0
        p.index.evict(1000)
        check_index(small_region)


def test_shared_prefix_hits_only_the_prefix(small_region):
    with Pool.attach(small_region, node=1) as p:
        a = chain(p, 11, 8, prefix_seed=7, prefix_blocks=5)
        b = chain(p, 12, 8, prefix_seed=7, prefix_blocks=5)
        assert np.array_equal(a[:5], b[:5]) and not np.array_equal(a[5:], b[5:])
        p.index.put(a, blocks_for(p, a))
        res = p.index.lookup(b)
        assert res.hits == 5
        p.index.unpin(res)
        p.index.evict(1000)


def test_a_corrupted_block_is_an_error_naming_it(small_region):
    with Pool.attach(small_region, node=1) as p:
        keys = chain(p, 21, 3)
        p.index.put(keys, blocks_for(p, keys), checksum=True)
        res = p.index.lookup(keys)
        view = p.slot_bytes(int(res.slots[1]))
        view[100] ^= 0xFF                                # a stray write into the block
        del view
        with pytest.raises(ChecksumMismatch, match=f"block 1 .*{keys[1].tobytes().hex()}"):
            p.index.read(res, np.empty((3, p.info.block_bytes), np.uint8))
        p.index.unpin(res)
        p.index.evict(1000)


def test_eviction_never_takes_a_pinned_block_and_full_is_a_result(small_region):
    with Pool.attach(small_region, node=1) as p:
        held_keys = chain(p, 31, 20)
        p.index.put(held_keys, blocks_for(p, held_keys))
        held = p.index.lookup(held_keys)
        assert held.hits == 20
        # fill the pool several times over: eviction must skip the pinned chain
        for s in range(12):
            keys = chain(p, 100 + s, 40)
            p.index.put(keys, blocks_for(p, keys))
        out = np.empty((20, p.info.block_bytes), np.uint8)
        p.index.read(held, out)
        assert np.array_equal(out, blocks_for(p, held_keys))
        check_index(small_region)
        # evict everything unpinned: only the held chain is left, pinned
        p.index.evict(10000)
        assert check_index(small_region)["ready"] == 20
        # a put larger than every free slot finds nothing evictable: PoolFull, no damage
        free = p.slot_usage()["free"] + len(p.allocator.local_free())
        big = chain(p, 999, free + 5)
        with pytest.raises(PoolFull):
            p.index.put(big, blocks_for(p, big))
        state = check_index(small_region)
        assert state["ready"] == 20
        p.index.read(held, out)
        assert np.array_equal(out, blocks_for(p, held_keys))
        p.index.unpin(held)
        p.index.evict(10000)
        assert check_index(small_region)["ready"] == 0


def test_a_put_larger_than_the_whole_pool_says_so_and_evicts_nothing(small_region):
    """More blocks than the pool has slots can never fit: PoolFull naming both
    sizes (not "invalid argument", not "pinned"), and the cache is left as it
    was (nothing evicted in a hopeless attempt)."""
    with Pool.attach(small_region, node=1) as p:
        kept = chain(p, 41, 10)
        p.index.put(kept, blocks_for(p, kept))
        big = chain(p, 998, p.slot_count + 1)
        with pytest.raises(PoolFull, match=f"{p.slot_count + 1} blocks cannot fit a pool of "
                                           f"{p.slot_count} slots"):
            p.index.put(big, blocks_for(p, big))
        with pytest.raises(PoolFull, match="cannot fit"):
            p.index.reserve(big)
        with pytest.raises(PoolFull):
            p.allocator.alloc(p.slot_count + 1)
        hit = p.index.lookup(kept)
        assert hit.hits == 10, "the hopeless put evicted cached blocks"
        p.index.unpin(hit)


ops = st.lists(st.tuples(st.sampled_from(["put", "lookup", "hold", "release", "evict"]),
                         st.integers(0, 7), st.integers(1, 30)), min_size=1, max_size=25)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops)
def test_random_operations_keep_every_invariant(small_region, sequence):
    """Against a model: hits return exactly the bytes put under each key; held pins survive."""
    with Pool.attach(small_region, node=2) as p:
        held = []
        try:
            for op, seed, n in sequence:
                keys = chain(p, seed // 2, n, prefix_seed=99, prefix_blocks=min(n, seed % 3))
                if op == "put":
                    try:
                        p.index.put(keys, blocks_for(p, keys), checksum=True)
                    except PoolFull:
                        pass
                elif op in ("lookup", "hold"):
                    res = p.index.lookup(keys)
                    out = np.empty((res.hits, p.info.block_bytes), np.uint8)
                    p.index.read(res, out)
                    assert np.array_equal(out, blocks_for(p, keys[:res.hits]))
                    (held.append(res) if op == "hold" else p.index.unpin(res))
                elif op == "release" and held:
                    p.index.unpin(held.pop(0))
                elif op == "evict":
                    p.index.evict(n)
                for res in held:        # pinned blocks stay readable and intact
                    out = np.empty((res.hits, p.info.block_bytes), np.uint8)
                    p.index.read(res, out)
                check_index(small_region)
        finally:
            for res in held:
                p.index.unpin(res)
            p.index.evict(100000)


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
def test_prefill_and_decode_processes_share_prefixes(region_path, simulate):
    Pool.create(region_path, 8 << 20, "tiny", nodes=4, index_stripes=8).close()
    # chains: (prefix_seed, prefix_blocks, suffix_seed, n_blocks), overlapping prefixes
    chains_a = [(1, 6, 100 + i, 12) for i in range(6)]
    chains_b = [(1, 6, 200 + i, 12) for i in range(6)] + [(1, 6, 100, 12)]
    with RunningAgent(region_path, 0, manager=True, simulate=simulate):
        workers = [Worker(region_path, n, simulate) for n in range(4)]
        try:
            prefill_a, prefill_b, decode_c, decode_d = workers
            prefill_a.send("index_put_chains", chains=chains_a)
            prefill_b.send("index_put_chains", chains=chains_b)
            decode_c.send("index_lookup_verify", chains=chains_a + chains_b)
            decode_d.send("index_lookup_verify", chains=chains_b)
            ra = prefill_a.recv("index_put_chains", timeout=300)
            rb = prefill_b.recv("index_put_chains", timeout=300)
            decode_c.recv("index_lookup_verify", timeout=300)
            decode_d.recv("index_lookup_verify", timeout=300)
            # afterwards every chain is fully cached and reads back exactly
            hits = decode_c.call("index_lookup_verify", chains=chains_a + chains_b, timeout=300)
            assert hits == [12] * len(chains_a + chains_b)
        finally:
            for w in workers:
                w.close()
    state = check_index(region_path)
    distinct = 6 + 6 * 6 + 6 * 6          # shared prefix once, every suffix once
    assert state["ready"] == distinct
    # the shared prefix and the duplicated chain were stored once between the two writers
    assert ra["stored"] + rb["stored"] + ra["already_pending"] + rb["already_pending"] >= distinct
    assert ra["stored"] + rb["stored"] == distinct


def test_reads_into_torch_and_torch_views(small_region):
    torch = pytest.importorskip("torch")
    with Pool.attach(small_region, node=1) as p:
        keys = chain(p, 41, 4)
        p.index.put(keys, blocks_for(p, keys), checksum=True)
        res = p.index.lookup(keys)
        out = torch.empty((4,) + p.geometry.block_shape, dtype=torch.float32)
        p.index.read(res, out)
        assert out.numpy().view(np.uint8).reshape(4, -1).tobytes() == blocks_for(p, keys).tobytes()
        views = p.index.views(res, torch=True)
        # the same bytes (random payload read as float32 has NaNs, which equal nothing)
        assert torch.equal(views[2].view(torch.uint8), out[2].view(torch.uint8))
        del views
        p.index.unpin(res)
        p.index.evict(100)


def test_zero_copy_put_writes_straight_into_slots(small_region):
    with Pool.attach(small_region, node=1) as p:
        keys = chain(p, 51, 5)
        status, slots = p.index.reserve(keys)
        assert (status == PUT_CLAIMED).all()
        for i, s in enumerate(slots):
            p.slot_bytes(int(s))[:] = payload_for(keys[i].tobytes(), p.info.block_bytes)
        assert p.index.commit(keys, status, slots).count("stored") == 5
        res = p.index.lookup(keys)
        out = np.empty((5, p.info.block_bytes), np.uint8)
        p.index.read(res, out)
        assert np.array_equal(out, blocks_for(p, keys))
        p.index.unpin(res)
        # an abandoned reservation leaves nothing behind
        other = chain(p, 52, 3)
        st, sl = p.index.reserve(other)
        p.index.commit(other, st, sl, publish=False)
        assert p.index.lookup(other).hits == 0
        check_index(small_region)
        p.index.evict(1000)


def test_a_block_pinned_by_any_node_is_never_evicted(managed_region):
    """A block is pinned while any node's count is non-zero (format 4 keeps
    no total): node 1's eviction skips what only node 2 holds."""
    with Pool.attach(managed_region, node=1) as one, Pool.attach(managed_region, node=2) as two:
        keys = chain(one, 41, 12)
        one.index.put(keys, blocks_for(one, keys))
        held = two.index.lookup(keys)
        assert held.hits == 12
        one.index.evict(10000)
        assert check_index(managed_region)["ready"] == 12
        two.index.unpin(held)
        one.index.evict(10000)
        assert check_index(managed_region)["ready"] == 0


def test_lookups_keep_exact_lru_order_and_a_repeated_hit_writes_no_bucket(managed_region):
    """Every put and every hit moves its blocks to their stripe's LRU head,
    a request's last block first (exact LRU, checked against a model). A
    lookup whose hits already head their stripes' lists in that order
    writes nothing to the buckets -- in clflush mode each written line is a
    serialized flush -- and a lookup that changes the order does write."""
    with Pool.attach(managed_region, node=1) as p:
        per = p.info.section("buckets").count // p.info.index_stripes
        model: list[list[bytes]] = [[] for _ in range(p.info.index_stripes)]

        def touch(keys):
            stripes = p.index.key_homes(keys) // per
            for i in reversed(range(len(keys))):            # the last block first
                k, s = keys[i].tobytes(), int(stripes[i])
                if k in model[s]:
                    model[s].remove(k)
                model[s].insert(0, k)

        def hit(keys):
            res = p.index.lookup(keys)
            assert res.hits == len(keys)
            p.index.unpin(res)
            touch(keys)

        bs = p.info.section("buckets")
        buckets = lambda: p.observe(bs.offset, bs.count * 64)   # noqa: E731
        a, b = chain(p, 51, 16), chain(p, 52, 10)
        for keys in (a, b):
            p.index.put(keys, blocks_for(p, keys))
            touch(keys)
        assert lru_lists(p) == model
        hit(a)
        assert lru_lists(p) == model
        before = buckets()
        hit(a)                      # already heading every stripe in this order
        hit(a[:4])                  # a prefix of it: the same
        assert buckets() == before and lru_lists(p) == model
        hit(b)
        hit(a)
        assert buckets() != before and lru_lists(p) == model
        # a stripe's hits that head its list but not as a run: the first and
        # the last of a's keys in a stripe holding three or more of them
        stripes = p.index.key_homes(a) // per
        s = next(s for s in range(p.info.index_stripes) if (stripes == s).sum() >= 3)
        idx = np.flatnonzero(stripes == s)
        hit(a[[idx[0], idx[-1]]])
        assert lru_lists(p) == model
        # reversed, duplicated and interleaved keys
        for keys in (a[::-1], np.concatenate([a[:3], a[:3]]), a[[0, 0, 0]], a[[5, 1, 5, 1]], a):
            hit(keys)
            assert lru_lists(p) == model
        check_index(managed_region)


def test_eviction_sees_another_hosts_pins_fresh(managed_region):
    """Under the non-coherence simulator: node 1's eviction reads node 2's
    pin lines, first while they are zero, then after node 2 pinned blocks;
    a count read from node 1's stale cached copy would evict a block node 2
    holds (tract check then finds its pin on an EMPTY bucket)."""
    with Pool.attach(managed_region, node=1, simulate=True) as one, \
            Pool.attach(managed_region, node=2, simulate=True) as two:
        keys = np.concatenate([chain(one, 71, 24), chain(one, 72, 24)])
        for k in (keys[:24], keys[24:]):
            one.index.put(k, blocks_for(one, k))
        one.index.evict(8)              # node 2's pin lines read (zero) and cached
        held = [r for r in (two.index.lookup(k[None]) for k in keys) if r.hits]
        assert len(held) == 40
        one.index.evict(10000)
        state = check_index(managed_region)
        for r in held:
            two.index.unpin(r)
    assert state["ready"] == len(held)


def test_an_abandon_that_times_out_in_one_stripe_keeps_those_claims_for_its_retry(
        managed_region):
    """commit(publish=False) buries the claims of the stripes it could enter and frees
    only their slots; a claim in a stripe whose lock timed out stays PUT_CLAIMED with
    its slot, so the same call again (the connector retries it) buries it. (Before, the
    failed abandon freed every claim's slot and marked it done: its key stayed PENDING
    for every writer until the process died.)"""
    from tract_cli.core.locks import stripe_lock
    from tract_cli.core.index import PUT_NO_ROOM
    with Pool.attach(managed_region, node=1) as p, Pool.attach(managed_region, node=2) as other:
        per = p.info.section("buckets").count // p.info.index_stripes
        keys = chain(p, 71, 24)
        stripes = p.index.key_homes(keys) // per
        blocked = int(stripes[0])
        assert len(set(stripes.tolist())) > 1, "the keys must span several stripes"
        status, slots = p.index.reserve(keys)
        assert (status == PUT_CLAIMED).all()
        with other.locks.hold(stripe_lock(blocked), timeout=30):
            with pytest.raises(LockTimeout):
                p.index.commit(keys, status, slots, publish=False, timeout=0.3)
        kept = stripes == blocked
        assert (status[kept] == PUT_CLAIMED).all()             # left for the retry
        assert (status[~kept] == PUT_NO_ROOM).all()            # buried, slots freed
        from tract_cli.inspect.snapshot import take
        assert take(p)["index"]["states"]["PENDING"] == int(kept.sum())
        p.index.commit(keys, status, slots, publish=False, timeout=30)
        assert (status == PUT_NO_ROOM).all()
        assert take(p)["index"]["states"]["PENDING"] == 0
        check_index(managed_region)


def test_an_unpin_that_timed_out_partway_gives_back_only_the_rest_when_retried(
        managed_region):
    """Two lookups of one node pin the same keys twice. An unpin of the first that
    times out in a later stripe has given back the earlier stripes' pins already;
    retried with its `done` marks it gives back only the rest, so the second
    lookup's pins are all still there (a whole retry took them: pins are counted
    per node, and the second unpin then failed as 'not pinned')."""
    from tract_cli.core.locks import stripe_lock
    with Pool.attach(managed_region, node=1) as p, Pool.attach(managed_region, node=2) as other:
        per = p.info.section("buckets").count // p.info.index_stripes
        keys = chain(p, 81, 24)
        p.index.put(keys, blocks_for(p, keys))
        stripes = p.index.key_homes(keys) // per
        last = int(stripes.max())
        assert int(stripes.min()) < last, "the keys must span several stripes"
        a, b = p.index.lookup(keys), p.index.lookup(keys)
        assert a.hits == b.hits == 24
        done = np.zeros(24, np.uint8)
        with other.locks.hold(stripe_lock(last), timeout=30):
            with pytest.raises(LockTimeout):
                p.index.unpin(a, timeout=0.3, done=done)
        assert (done[stripes == last] == 0).all() and done[stripes < last].all()
        p.index.unpin(a, done=done)
        assert done.all()
        from tract_cli.inspect.snapshot import take
        assert take(p)["index"]["pins_total"] == 24        # b's pins, every one
        p.index.unpin(b)
        assert take(p)["index"]["pins_total"] == 0


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
def test_a_lookup_locks_only_the_stripes_of_what_a_lockless_look_finds(region_path, simulate):
    """A lookup first looks without locks for the leading READY keys, then pins
    under the locks only those: a prompt the pool does not hold takes no lock (it
    is answered while another node holds every lock), one it holds waits for the
    locks as ever, and one whose head it holds locks only for that head."""
    from tract_cli.core.locks import stripe_lock
    Pool.create(region_path, 8 << 20, "tiny", nodes=4, index_stripes=4).close()
    with RunningAgent(region_path, 0, manager=True), \
            Pool.attach(region_path, node=1, simulate=simulate) as p, \
            Pool.attach(region_path, node=2, simulate=simulate) as other:
        held = chain(p, 91, 6)
        p.index.put(held, blocks_for(p, held))
        absent = chain(p, 92, 6)
        stripes = range(p.info.index_stripes)
        for s in stripes:
            other.locks.acquire(stripe_lock(s), timeout=30)
        try:
            assert p.index.lookup(absent, timeout=0.3).hits == 0     # no lock taken
            with pytest.raises(LockTimeout):
                p.index.lookup(held, timeout=0.3)                    # a hit: locks
        finally:
            for s in stripes:
                other.locks.release(stripe_lock(s))
        hit = p.index.lookup(held)
        assert hit.hits == 6
        p.index.unpin(hit)
        # a prompt that shares the first 3 blocks only: the look stops at the 4th,
        # so the stripes of the other keys are not locked (held here: no timeout)
        per = p.info.section("buckets").count // p.info.index_stripes
        head = {int(h) // per for h in p.index.key_homes(held[:3])}
        # (keys depend on the region's root: find a suffix with a key in a stripe
        # the head does not use; 3 keys in 4 stripes, so one comes within a few seeds)
        for seed in range(93, 193):
            rest = chain(p, seed, 6, prefix_seed=91, prefix_blocks=3)
            tail_only = {int(h) // per for h in p.index.key_homes(rest[3:])} - head
            if tail_only:
                break
        assert (rest[:3] == held[:3]).all()
        assert tail_only, "no suffix with a key in a stripe of its own in 100 seeds"
        for s in tail_only:
            other.locks.acquire(stripe_lock(s), timeout=30)
        try:
            part = p.index.lookup(rest, timeout=5)
            assert part.hits == 3
            p.index.unpin(part)
        finally:
            for s in tail_only:
                other.locks.release(stripe_lock(s))
        # the look observes: blocks another host put after this one looked (their
        # lines cached here, under the simulator) are found -- the first key's
        # probe, and the batch of home lines of the keys after it
        fresh = chain(p, 94, 4)
        assert p.index.lookup(fresh).hits == 0
        other.index.put(fresh[:1], blocks_for(other, fresh[:1]))
        got = p.index.lookup(fresh)                 # caches the later keys' home lines
        assert got.hits == 1
        p.index.unpin(got)
        other.index.put(fresh[1:], blocks_for(other, fresh[1:]))
        got = p.index.lookup(fresh)
        assert got.hits == 4
        p.index.unpin(got)
    check_index(region_path)
