"""Block slots: payload copies (NT and plain paths), zero-copy views, lifetime."""
from __future__ import annotations

import numpy as np
import pytest

from tract_cli.core.errors import TractError, UsageError
from tract_cli.core.geometry import Geometry, ModelProfile
from tract_cli.core.native import lib
from tract_cli.core.pool import BlockTable, Pool


@pytest.fixture
def nt_threshold():
    """Restores the default non-temporal threshold after a test changes it."""
    yield lib.tract_set_movnt_threshold
    lib.tract_set_movnt_threshold(0)


def block(pool: Pool, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, pool.info.block_bytes, dtype=np.uint8)


@pytest.mark.parametrize("threshold", [1, 1 << 40], ids=["nt-stores", "plain-stores"])
def test_copy_in_then_out_round_trips(tiny_pool, nt_threshold, threshold):
    nt_threshold(threshold)
    for slot in (0, 1, tiny_pool.slot_count - 1):
        src = block(tiny_pool, slot)
        tiny_pool.copy_in(slot, src)
        out = np.zeros_like(src)
        tiny_pool.copy_out(slot, out)
        assert np.array_equal(out, src)


@pytest.mark.parametrize("length", [1, 63, 64, 65, 255, 257, 4095, 4097, 8191])
@pytest.mark.parametrize("misalign", [0, 1, 17])
def test_partial_and_unaligned_copies_touch_only_their_bytes(tiny_pool, nt_threshold, length,
                                                             misalign):
    nt_threshold(1)     # force the NT path with its unaligned edges
    tiny_pool.copy_in(3, np.full(tiny_pool.info.block_bytes, 0xAA, dtype=np.uint8))
    raw = np.random.default_rng(length).integers(0, 256, length + misalign, dtype=np.uint8)
    src = raw[misalign:]
    tiny_pool.copy_in(3, src)
    view = tiny_pool.slot_bytes(3)
    assert np.array_equal(view[:length], src)
    assert (view[length:] == 0xAA).all()


def test_views_share_memory_with_the_region(tiny_pool):
    arr = tiny_pool.slot_array(5)
    assert arr.shape == tiny_pool.geometry.block_shape == (2, 2, 16, 2, 16)
    assert arr.dtype == np.float32
    assert not arr.flags.owndata
    arr[1, 0, 3, 1, :] = 7.5                       # write through the view
    out = np.zeros(tiny_pool.geometry.block_shape, dtype=np.float32)
    tiny_pool.copy_out(5, out)
    assert (out[1, 0, 3, 1] == 7.5).all()
    src = np.arange(out.size, dtype=np.float32).reshape(out.shape)
    tiny_pool.copy_in(5, src)                       # write through the core
    assert np.array_equal(arr, src)                 # the old view sees it
    del arr


def test_one_layer_of_a_slot_is_one_contiguous_range(tiny_pool):
    g = tiny_pool.geometry
    arr = tiny_pool.slot_array(0)
    layer1 = arr[1]
    assert layer1.flags.c_contiguous
    offset = layer1.__array_interface__["data"][0] - arr.__array_interface__["data"][0]
    assert offset == g.layer_bytes
    del arr, layer1


def test_bf16_views_are_raw_uint16(region_path):
    with Pool.create(region_path, 64 << 20, "llama-3-8b") as pool:
        arr = pool.slot_array(0)
        assert arr.dtype == np.uint16 and arr.shape == (32, 2, 16, 8, 128)
        assert arr.nbytes == 2 << 20
        del arr


def test_torch_view_is_zero_copy(tiny_pool):
    torch = pytest.importorskip("torch")
    t = tiny_pool.slot_tensor(2)
    assert t.dtype == torch.float32 and tuple(t.shape) == tiny_pool.geometry.block_shape
    t.fill_(3.0)
    assert (tiny_pool.slot_array(2) == 3.0).all()
    del t


def test_close_refuses_while_a_view_is_alive(region_path):
    pool = Pool.create(region_path, 16 << 20, "tiny")
    view = pool.slot_array(0)
    with pytest.raises(TractError, match="views of the pool are still alive"):
        pool.close()
    view[0, 0, 0, 0, 0] = 1.0                       # the mapping is still valid
    del view


def test_slot_ids_are_bounds_checked(tiny_pool):
    with pytest.raises(UsageError, match="outside"):
        tiny_pool.slot_offset(tiny_pool.slot_count)
    with pytest.raises(UsageError):
        tiny_pool.copy_in(0, np.zeros(tiny_pool.info.block_bytes + 1, dtype=np.uint8))


def test_offsets_are_bounds_checked_in_the_core(tiny_pool):
    size = tiny_pool.info.region_size
    with pytest.raises(TractError, match="outside the region"):
        tiny_pool.observe_u64(size)
    with pytest.raises(TractError, match="outside the region"):
        tiny_pool.publish(size - 8, b"x" * 16)
    with pytest.raises(TractError, match="outside the region"):
        tiny_pool.observe(2**64 - 8, 16)               # wrap-around is caught
    with pytest.raises(UsageError, match="alignment"):
        tiny_pool.publish_u64(4097, 1)


def test_readonly_attach_refuses_stores(region_path):
    Pool.create(region_path, 16 << 20, "tiny").close()
    with Pool.attach(region_path, readonly=True) as pool:
        assert pool.observe_u64(4096) == 0
        with pytest.raises(UsageError):
            pool.publish_u64(4096, 1)


@pytest.mark.parametrize("mode", ["none", "clflush", "clflushopt", "clwb"])
def test_every_supported_flush_mode_publishes(region_path, mode):
    from tract_cli.core.native import flush_mode_supported
    if not flush_mode_supported(mode):
        pytest.skip(f"this CPU lacks {mode}")
    Pool.create(region_path, 16 << 20, "tiny").close()
    with Pool.attach(region_path, flush_mode=mode) as pool:
        assert pool.flush_mode == mode and pool.accessors == mode
        off = pool.info.section("objdir").offset
        pool.publish_u64(off, 123)
        assert pool.observe_u64(off) == 123


def test_simulator_is_selected_at_attach_without_rebuild(region_path):
    Pool.create(region_path, 16 << 20, "tiny").close()
    with Pool.attach(region_path, simulate=True) as pool:
        assert pool.accessors == "sim"
        assert pool.flush_mode == "clflush"        # 'none' is promoted under the simulator
        off = pool.info.section("objdir").offset
        pool.publish_u64(off, 5)
        assert pool.observe_u64(off) == 5
        assert pool.sim_stats()["writebacks"] >= 1


def test_environment_selects_flush_mode_and_simulator(region_path, monkeypatch):
    Pool.create(region_path, 16 << 20, "tiny").close()
    monkeypatch.setenv("TRACT_SIMULATE", "1")
    monkeypatch.setenv("TRACT_FLUSH_MODE", "clflush")
    with Pool.attach(region_path) as pool:
        assert pool.accessors == "sim"
    monkeypatch.setenv("TRACT_FLUSH_MODE", "bogus")
    with pytest.raises(UsageError, match="unknown flush mode"):
        Pool.attach(region_path)


def test_the_whole_area_view_is_made_once_and_each_slot_is_its_own_bytes(region_path):
    """slots_array / slots_tensor: one zero-copy view over every slot, cached per
    Pool, slot i at the slot's offset even where the slot stride (a multiple of
    64) is larger than the block; close() drops the cache so the pool can go."""
    torch = pytest.importorskip("torch")
    odd = ModelProfile("odd-blocks", Geometry(1, 1, 3, "f16", 3))      # 36-byte blocks
    with Pool.create(region_path, 4 << 20, odd) as pool:
        assert pool.info.slot_stride == 64 and pool.info.block_bytes == 36
        area = pool.slots_array()
        assert pool.slots_array() is area and pool.slots_tensor() is pool.slots_tensor()
        assert area.shape == (pool.slot_count,) + pool.geometry.block_shape
        for s in (0, 1, 777, pool.slot_count - 1):
            pool.copy_in(s, block(pool, s))
            assert area[s].tobytes() == pool.slot_bytes(s).tobytes() == block(pool, s).tobytes()
            assert pool.slots_tensor()[s].numpy().tobytes() == block(pool, s).tobytes()
        area[5] = 1.5                                   # writes land in the slot itself
        assert (pool.slot_array(5) == 1.5).all() and not (pool.slot_array(6) == 1.5).all()
        del area
    # the cached views did not keep the mapping alive: close() above did not raise


def test_a_block_table_indexes_the_area_without_copying(tiny_pool):
    torch = pytest.importorskip("torch")
    slots = np.array([7, 2, 40], np.uint32)
    for s in slots:
        tiny_pool.copy_in(int(s), block(tiny_pool, int(s)))
    bt = tiny_pool.block_table(slots)
    assert isinstance(bt, BlockTable) and bt.area is tiny_pool.slots_array() and len(bt) == 3
    assert np.array_equal(bt.slots, slots)
    for i, s in enumerate(slots):
        assert np.shares_memory(bt[i], tiny_pool.slot_array(int(s)))
        assert bt[i].view(np.uint8).tobytes() == block(tiny_pool, int(s)).tobytes()
    assert [v.shape for v in bt] == [tiny_pool.geometry.block_shape] * 3
    assert np.array_equal(bt[1:].slots, slots[1:])
    tt = tiny_pool.block_table(slots, torch=True)
    assert tt.area is tiny_pool.slots_tensor()
    assert tt[2].data_ptr() == tiny_pool.slot_tensor(40).data_ptr()
    del bt, tt


def test_slots_in_use_is_the_bitmap_count(region_path):
    """What a metrics scrape reads (the allocator header's count, one line) is
    what the bitmap says, with a slot count that is not a multiple of 8."""
    from agents import RunningAgent
    odd = ModelProfile("odd-blocks", Geometry(1, 1, 9, "f16", 9))      # 5461 slots in 6 MiB
    Pool.create(region_path, 6 << 20, odd, nodes=2).close()
    with RunningAgent(region_path, 0, manager=True), Pool.attach(region_path, node=1) as p:
        assert p.slot_count % 8 and p.slots_in_use() == p.slot_usage()["used"] == 0
        got = p.allocator.alloc(37)
        used = p.slot_usage()["used"]
        assert used >= 37 and p.slots_in_use() == used     # the node claims in batches
        p.allocator.free(got)
        p.allocator.drain()
        assert p.slots_in_use() == p.slot_usage()["used"] == 0
