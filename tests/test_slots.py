"""Block slots: payload copies (NT and plain paths), zero-copy views, lifetime."""
from __future__ import annotations

import numpy as np
import pytest

from tract_cli.core.errors import TractError, UsageError
from tract_cli.core.native import lib
from tract_cli.core.pool import Pool


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
