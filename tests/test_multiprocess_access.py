"""Real processes on emulated nodes publish and observe through the accessors,
in plain mode and under the non-coherence simulator, and the simulator
catches the two planted mistakes (a missing flush, a missing invalidate)."""
from __future__ import annotations

import pytest

from procs import Worker
from tract_cli.core.pool import Pool


@pytest.fixture
def region(region_path):
    Pool.create(region_path, 16 << 20, "tiny", nodes=4, flush_mode="clflush").close()
    return region_path


def scratch_offsets(path: str) -> tuple[int, int]:
    """Two words on distinct lines of the (unused) object directory."""
    with Pool.attach(path, readonly=True, prefault=False) as p:
        base = p.info.section("objdir").offset
    return base, base + 64


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
def test_published_value_is_observed_by_another_process(region, simulate):
    a_off, _ = scratch_offsets(region)
    with Worker(region, 0, simulate) as writer, Worker(region, 1, simulate) as reader:
        assert reader.call("observe_u64", off=a_off) == 0
        writer.call("publish_u64", off=a_off, value=0xC0FFEE)
        assert reader.call("observe_u64", off=a_off) == 0xC0FFEE


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
def test_ping_pong_delivers_every_value_in_order(region, simulate):
    a_off, b_off = scratch_offsets(region)
    rounds = 2000 if not simulate else 500
    with Worker(region, 0, simulate) as a, Worker(region, 1, simulate) as b:
        # both loops run concurrently: start b without waiting, then a
        b.send("ping_pong", my_off=b_off, peer_off=a_off, rounds=rounds, first=False,
               deadline_s=60)
        ra = a.call("ping_pong", my_off=a_off, peer_off=b_off, rounds=rounds, first=True,
                    deadline_s=60)
        rb = b.recv("ping_pong")
        assert ra == {"completed": rounds}
        assert rb == {"completed": rounds}


def test_simulator_hides_a_store_that_was_not_flushed(region):
    """Planted mistake 1: the writer stores but skips the flush."""
    a_off, _ = scratch_offsets(region)
    with Worker(region, 0, True) as writer, Worker(region, 1, True) as reader:
        writer.call("store_u64", off=a_off, value=41)          # no flush
        assert writer.call("load_u64", off=a_off) == 41         # visible to itself
        assert reader.call("observe_u64", off=a_off) == 0       # never reached the device
        writer.call("publish_u64", off=a_off, value=42)         # the correct protocol
        assert reader.call("observe_u64", off=a_off) == 42


def test_plain_mode_cannot_see_the_missing_flush(region):
    """Why the simulator exists: on a coherent machine the same bug goes unnoticed."""
    a_off, _ = scratch_offsets(region)
    with Worker(region, 0, False) as writer, Worker(region, 1, False) as reader:
        writer.call("store_u64", off=a_off, value=41)
        assert reader.call("observe_u64", off=a_off) == 41


def test_simulator_keeps_a_stale_line_that_was_not_invalidated(region):
    """Planted mistake 2: the reader loads without invalidating first."""
    a_off, _ = scratch_offsets(region)
    with Worker(region, 0, True) as writer, Worker(region, 1, True) as reader:
        assert reader.call("load_u64", off=a_off) == 0          # line now cached
        writer.call("publish_u64", off=a_off, value=7)
        assert reader.call("load_u64", off=a_off) == 0          # stale: no invalidate
        assert reader.call("load_u64", off=a_off) == 0          # and it stays stale
        assert reader.call("observe_u64", off=a_off) == 7       # the correct protocol


def test_simulator_write_back_clobbers_the_whole_line(region):
    """A line written from a stale copy overwrites other hosts' bytes, as real caches do."""
    a_off, _ = scratch_offsets(region)
    neighbour = a_off + 8                                       # same 64-byte line
    with Worker(region, 0, True) as a, Worker(region, 1, True) as b:
        assert a.call("load_u64", off=a_off) == 0               # a caches the line
        b.call("publish_u64", off=neighbour, value=5)           # b writes its word
        a.call("publish_u64", off=a_off, value=9)               # a writes back its stale line
        with Worker(region, 2, True) as c:
            assert c.call("observe_u64", off=a_off) == 9
            assert c.call("observe_u64", off=neighbour) == 0    # b's word is lost


def test_random_eviction_eventually_leaks_an_unflushed_store(region):
    """With random eviction on, an unflushed store reaches memory at an unpredictable time."""
    a_off, _ = scratch_offsets(region)
    with Worker(region, 0, True, sim_evict_prob=1.0, sim_seed=3) as writer, \
            Worker(region, 1, True) as reader:
        writer.call("store_u64", off=a_off, value=77)
        assert reader.call("observe_u64", off=a_off) == 0
        # every access evicts one random way of the 8192; the seed fixes which,
        # so after 200k accesses the dirty line has been written back
        writer.call("load_u64_times", off=a_off, times=200000)
        assert reader.call("observe_u64", off=a_off) == 77
        assert writer.call("sim_stats")["writebacks"] >= 1
