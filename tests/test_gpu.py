"""The GPU path: registration, DMA in and out of slots, a put from GPU memory
read back on the CPU.  Skipped without CUDA (run on a GPU host; docs/SERVING.md)."""
from __future__ import annotations

import numpy as np
import pytest

from tract_cli.core.hashing import block_hashes, pool_root
from tract_cli.core.pool import Pool
from tract_cli.core.gpu import _runs, cuda_available
from tract_cli.core.index import PUT_CLAIMED


def test_runs_of_consecutive_slots():
    assert _runs(np.array([4, 5, 6, 9, 10, 2], np.uint32)) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert _runs(np.array([], np.uint32)) == []


@pytest.fixture
def gpu_pool(region_path):
    """A 64 MiB region of the tiny Llama, node 0's agent running the lock manager."""
    from agents import RunningAgent
    pool = Pool.create(region_path, 64 << 20, "tiny-llama")
    agent = RunningAgent(region_path, 0, manager=True)
    yield pool
    agent.stop()
    pool.close()


@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU (the GPU path of docs/ARCHITECTURE.md §12)")
def test_gpu_put_and_load_through_registered_mapping(gpu_pool):
    import torch

    from tract_cli.core.gpu import CudaPool
    pool = gpu_pool
    g = pool.geometry
    cp = CudaPool(pool)
    try:
        kv = torch.randn((40, *g.block_shape), device="cuda")
        keys = block_hashes(np.arange(40 * 16, dtype=np.int32), root=pool_root(pool.info))
        status = cp.put(keys, kv)
        assert (status == 0).all()
        hit = pool.index.lookup(keys)
        assert hit.hits == 40
        cpu = np.empty((40, pool.info.block_bytes), np.uint8)
        pool.index.read(hit, cpu)                        # CPU read of what the GPU wrote
        assert np.array_equal(cpu.view(np.float32).reshape(kv.shape), kv.cpu().numpy())
        back = torch.empty_like(kv)
        cp.load(hit.slots, back)
        cp.stream.synchronize()
        assert torch.equal(back, kv)
        pool.index.unpin(hit)
    finally:
        cp.close()


# ---- the GPU paged path (core/gpupages.py): rows, runs, and the DMA itself ----

def _flash_layout(block_tokens, heads, dim, pages, elem_bytes, page_tokens=None):
    from tract_cli.core.kvpages import PageLayout, flash_offsets
    offsets, stride = flash_offsets(pages, page_tokens or block_tokens, heads, dim)
    return PageLayout(offsets, stride, block_tokens, elem_bytes)


def test_rows_of_flash_and_flashinfer_layouts():
    from tract_cli.core.gpupages import row_elements, row_table
    from tract_cli.core.kvpages import PageLayout
    flash = _flash_layout(16, 4, 64, pages=10, elem_bytes=2)
    rows = row_elements(flash)
    assert rows == 16 * 4 * 64                    # K and V of a page: two rows
    assert row_table(flash, rows).tolist() == [[0, 10]]
    # two region blocks a page: each takes half of K and half of V
    half = _flash_layout(8, 4, 64, pages=10, elem_bytes=2, page_tokens=16)
    rows = row_elements(half)
    assert rows == 8 * 4 * 64
    assert row_table(half, rows).tolist() == [[0, 20], [1, 21]]
    # FlashInfer's [pages, 2, B, heads, dim]: a page is one row
    kv, t, h, d = np.meshgrid(np.arange(2), np.arange(16), np.arange(4), np.arange(64),
                              indexing="ij")
    infer = PageLayout((kv * 16 * 4 * 64 + (t * 4 + h) * 64 + d).astype(np.int64),
                       2 * 16 * 4 * 64, 16, 2)
    assert row_element_table(infer) == (2 * 16 * 4 * 64, [[0]])


def row_element_table(layout):
    from tract_cli.core.gpupages import row_elements, row_table
    rows = row_elements(layout)
    return rows, row_table(layout, rows).tolist()


def test_rows_of_a_transposed_layout_split_in_sub_blocks():
    """K and V transposed (`[heads][dim][B]`, as AVX-512's K) with two region
    blocks a page: each sub-block's elements are runs of its 8 tokens, so rows
    of 8 elements, and the table names every element of the sub-block once."""
    from tract_cli.core.gpupages import row_elements, row_table
    from tract_cli.core.kvpages import PageLayout
    B, H, D = 16, 2, 8
    t, h, d = np.meshgrid(np.arange(B), np.arange(H), np.arange(D), indexing="ij")
    k = (h * D + d) * B + t
    layout = PageLayout(np.stack([k, k + H * D * B]).astype(np.int64), 2 * H * D * B, 8, 2)
    rows = row_elements(layout)
    assert rows == 8
    table = row_table(layout, rows)
    for sub in range(2):
        named = (table[sub][:, None] * rows + np.arange(rows)).ravel()
        assert np.array_equal(named, layout.index[sub])


def test_runs_cut_to_a_chunk():
    from tract_cli.core.gpupages import _runs_within, staging_capacity

    class B:
        runs = _runs(np.array([3, 4, 5, 9, 10, 11, 12], np.uint32))
    assert list(_runs_within(B, 0, 7)) == [(0, 3, 3), (3, 9, 4)]
    assert list(_runs_within(B, 2, 5)) == [(2, 5, 1), (3, 9, 2)]
    assert list(_runs_within(B, 5, 7)) == [(5, 11, 2)]
    assert staging_capacity(2048, 16, 1 << 16) == 129
    assert staging_capacity(1 << 20, 16, 1 << 20) == 256      # bounded by 256 MiB


def _mismatched(pool, slots, expect: np.ndarray) -> list[int]:
    """Indices of the blocks whose slot bytes differ from EXPECT [n, block bytes]."""
    got = np.stack([np.frombuffer(pool.slot_array(int(s)).tobytes(), np.uint8) for s in slots])
    return [i for i in range(len(slots)) if not np.array_equal(got[i], expect[i])]


def _gpu_layers(kind: str, layers: int, pages: int, B: int, H: int, D: int):
    """KV layer tensors on the GPU, random, and their page layout: `flash`,
    FlashAttention's own `[2, pages, B, H, D]` a layer; `vllm`, the views vLLM
    0.32 registers in its default layout (LBNHC: one allocation, a layer's
    pages `[B][H][K|V dim]`, viewed `[pages, H, B, 2*D]`).  Returns (tensors,
    layout, page(t, p) -> [2, B, H, D] as FlashAttention reads page p,
    flat(t) -> the layer's elements from its first, in memory order)."""
    import torch

    from tract_cli.core.kvpages import PageLayout, strided_offsets, view_extent
    if kind == "flash":
        tensors = [torch.randn((2, pages, B, H, D), device="cuda") for _ in range(layers)]
        return (tensors, _flash_layout(B, H, D, pages, elem_bytes=4),
                lambda t, p: t[:, p], lambda t: t.reshape(-1))
    from tract_cli.bench.micro.gpu_pages import vllm_views
    tensors = vllm_views(layers, pages, B, H, D, torch.float32, fill=torch.randn)
    offsets, stride = strided_offsets(tuple(tensors[0].shape), tuple(tensors[0].stride()),
                                      B, H, D)

    def page(t, p):
        return torch.stack(t[p].transpose(0, 1).split(D, dim=-1))

    def flat(t):
        return torch.as_strided(t, (view_extent(t),), (1,), t.storage_offset())
    return tensors, PageLayout(offsets, stride, B, 4), page, flat


def _copies_one_by_one():
    """A batched copy as vLLM's swap_blocks_batch is called (CPU int64 tensors
    of addresses and sizes, queued on the current stream), made of one
    runtime copy each: the direct mode's addressing on a GPU with no vLLM."""
    import torch

    from tract_cli.core.cudart import CudaRuntime
    runtime = CudaRuntime()

    def copy(src_ptrs, dst_ptrs, sizes):
        stream = torch.cuda.current_stream().cuda_stream
        for src, dst, n in zip(src_ptrs.tolist(), dst_ptrs.tolist(), sizes.tolist()):
            runtime.memcpy2d_async(dst, n, src, n, n, 1, stream)
    return copy


@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU (the GPU path of docs/VLLM.md)")
@pytest.mark.parametrize("way", ["staging", "direct"])
@pytest.mark.parametrize("kind", ["flash", "vllm"])
def test_gpu_pages_save_and_load_by_dma(gpu_pool, kind, way):
    """KV pages on the GPU (FlashAttention's own tensors; vLLM 0.32's strided
    views) into scattered slots (through a small staging buffer whose chunks
    cut the runs, or straight by batched copies; a partial tail zeroed past
    its tokens) and back into other pages, layer by layer; bytes equal, and
    the comparison fails when one block is wrong."""
    import torch

    from tract_cli.core.gpupages import CudaPagedKV
    pool = gpu_pool
    g = pool.geometry
    B, H, D, L = g.block_tokens, g.num_kv_heads, g.head_dim, g.num_layers
    pages = 48
    torch.manual_seed(0)
    src, layout, page_of, flat = _gpu_layers(kind, L, pages, B, H, D)
    copy = _copies_one_by_one() if way == "direct" else None
    kv = CudaPagedKV(pool, layout, src, capacity=5, batch_copy=copy)
    assert kv.direct == (way == "direct")
    try:
        keys = block_hashes(np.arange(40 * B, dtype=np.int32), root=pool_root(pool.info))
        status, slots = pool.index.reserve(keys)
        assert (status == PUT_CLAIMED).all()
        pick = np.array([0, 1, 2, 5, 6, 7, 8, 9, 13, 20, 21, 22, 30, 31, 39])
        page_ids = np.random.default_rng(1).permutation(pages)[:len(pick)]
        tokens = np.full(len(pick), B, np.int64)
        tokens[-1] = 5                           # a partial last block
        for slot in slots[pick]:                 # another block's bytes, overwritten
            pool.slot_bytes(int(slot))[:] = 0xA5
        # the engine's stream is busy, then changes the pages: a save that did not
        # wait for the engine's stream would copy them as they were
        torch.cuda._sleep(100_000_000)
        for t in src:
            t.neg_()
        batch = kv.batch(slots[pick], page_ids, np.zeros(len(pick), np.int64), tokens,
                         checksum=True)
        for layer in range(L):
            kv.save_layer(batch, layer)
        kv.finish()
        # the checksum threads' CRC, layer by layer as each landed, is the slots' own
        assert np.array_equal(kv.checksums(batch), pool.checksum_slots(slots[pick]))
        # what each slot must hold: every layer's page in region order, tail zeroed
        cpu = [flat(t).cpu().numpy() for t in src]
        index = layout.gather_index(page_ids, np.zeros(len(pick), np.int64))
        expect = np.stack([np.concatenate([c[index[i]] for c in cpu]) for i in range(len(pick))])
        per_layer = expect.reshape(len(pick), L, -1)
        per_layer[-1][:, layout.elem_token[0] >= 5] = 0
        if kind == "vllm":        # the map's order is the page's own, LBNHC's: token,
            for i, p in enumerate(page_ids[:-1]):     # head, K|V, dim (full blocks)
                for layer in range(L):
                    own = page_of(src[layer], int(p)).permute(1, 2, 0, 3).reshape(-1)
                    assert np.array_equal(per_layer[i, layer], own.cpu().numpy())
        expect = expect.view(np.uint8).reshape(len(pick), -1)
        assert _mismatched(pool, slots[pick], expect) == []
        # the comparison can fail: one byte of one block wrong
        pool.slot_array(int(slots[pick[3]])).reshape(-1).view(np.uint8)[100] ^= 0xFF
        assert _mismatched(pool, slots[pick], expect) == [3]
        pool.slot_array(int(slots[pick[3]])).reshape(-1).view(np.uint8)[100] ^= 0xFF
        # back into other pages of other tensors, layer by layer
        dst, _, _, _ = _gpu_layers(kind, L, pages, B, H, D)
        for t in dst:
            t.zero_()
        kv.close()                # one registration of the mapping at a time
        back = CudaPagedKV(pool, layout, dst, capacity=4, batch_copy=copy)
        into = (page_ids + 7) % pages
        sums = pool.checksum_slots(slots[pick])
        pool.slot_array(int(slots[pick[6]])).reshape(-1).view(np.uint8)[7] ^= 0x01
        loading = back.batch(slots[pick], into, np.zeros(len(pick), np.int64), checksum=True)
        with torch.cuda.stream(back.stream):      # the copies run late: a layer read
            torch.cuda._sleep(100_000_000)        # without waiting would find zeros
        back.load(loading)
        gathered = []
        for layer in range(L):
            back.wait_layer(layer)
            gathered.append(torch.stack([page_of(dst[layer], int(q)) for q in into], dim=1))
        torch.cuda.current_stream().synchronize()
        for layer in range(L):
            got = gathered[layer]                 # [2, blocks, B, H, D]
            want = torch.stack([page_of(src[layer], int(p)) for p in page_ids], dim=1).clone()
            want[:, -1, 5:] = 0
            if layer == 0:            # the byte changed in the slot: the block read as it is
                assert not torch.equal(got, want)
                got[:, 6], want[:, 6] = 0, 0
            assert torch.equal(got, want), f"layer {layer} loaded other bytes"
        back.finish()
        # the load's checksums see the one block changed since, and only it
        assert np.flatnonzero(back.checksums(loading) != sums).tolist() == [6]
        back.close()
        pool.index.commit(keys, status, slots, publish=False)
    finally:
        kv.close()


@pytest.mark.parametrize("simulate,flush", [(False, None), (True, None), (False, "clflush")],
                         ids=["plain", "simulator", "clflush"])
def test_checksums_advanced_layer_by_layer_equal_the_whole(managed_region, simulate, flush):
    """What the GPU path's checksum threads compute (each slot's register
    carried over its layers, written back as it goes: in clflush mode streamed
    back in place as the checksum reads it) is the block's CRC-32C, and the
    bytes are as they were, in plain mode and through the simulator's loads; a
    range past the block is refused, and a changed byte changes only its
    block's checksum."""
    from tract_cli.core.errors import UsageError
    with Pool.attach(managed_region, node=2, simulate=simulate, flush_mode=flush) as pool:
        keys = block_hashes(np.arange(5 * 16, dtype=np.int32) + 7, root=pool_root(pool.info))
        status, slots = pool.index.reserve(keys)
        rng = np.random.default_rng(3)
        for s in slots:        # written as a DMA would: straight into memory
            pool.slot_array(int(s)).reshape(-1).view(np.uint8)[:] = rng.integers(
                0, 256, pool.info.block_bytes, dtype=np.uint8)
        whole = pool.checksum_slots(slots)
        before = np.stack([pool.slot_array(int(s)).reshape(-1).view(np.uint8).copy()
                           for s in slots])
        layers = pool.geometry.num_layers
        part = pool.info.block_bytes // layers
        regs = np.full(len(slots), 0xFFFFFFFF, np.uint32)
        for layer in range(layers):
            pool.advance_checksums(slots, regs, layer * part, part, write_back=True)
        assert np.array_equal(~regs, whole)
        assert all(np.array_equal(pool.slot_array(int(s)).reshape(-1).view(np.uint8), b)
                   for s, b in zip(slots, before))
        pool.slot_array(int(slots[2])).reshape(-1).view(np.uint8)[part + 3] ^= 0x10
        again = np.full(len(slots), 0xFFFFFFFF, np.uint32)
        pool.advance_checksums(slots, again, 0, pool.info.block_bytes)
        assert np.flatnonzero(~again != whole).tolist() == [2]
        with pytest.raises(UsageError, match="outside"):
            pool.advance_checksums(slots, regs, part, pool.info.block_bytes)
        pool.index.commit(keys, status, slots, publish=False)


def test_the_worker_around_the_gpu_path_with_the_cpu_standing_in(region_path):
    """The connector's worker half on its GPU path (tests/gpu_worker_driver.py, in
    vLLM's environment, tests/fake_cuda.py standing the CPU in for CUDA): layers
    saved as handed over; a step whose forward handed over none (a FULL CUDA
    graph's replay) saved whole in wait_for_save; a layer out of order leaves
    the step unsaved and its claims given back; a block that fails its checksum
    is reported with its pages from there on, before wait_for_save (speculative
    decoding's order), and the blocks before it load intact; both ways the GPU
    path copies (direct, staging)."""
    import os

    from tests.vllm_stack import VLLM_PY
    from tests.worker_stand import run_driver
    if not os.path.exists(VLLM_PY):
        pytest.skip(f"no vLLM environment at {VLLM_PY} (.ci/setup builds it)")
    both = run_driver("gpu_worker_driver.py", region_path)
    assert set(both) == {"direct", "staging"}
    for seen in both.values():
        assert seen["in_order"] == {"hits": 4, "bytes_equal": True, "checksums_equal": True}
        assert seen["no_layer_handed_over"] == {"hits": 3, "bytes_equal": True,
                                                "checksums_equal": True}
        assert seen["out_of_order"] == {"hits": 0, "claimable_again": True}
        assert seen["load"] == {"errors": [22, 23], "reported": ["d"],
                                "good_blocks_equal": True}


def test_the_gpu_path_reads_vllms_own_kv_views_in_every_layout(region_path):
    """vLLM 0.32's GPU KV views (tests/gpu_layout_driver.py, in vLLM's
    environment, made by vLLM's own create_kv_cache_views, the CPU standing in
    for CUDA): in each of its KV cache layouts, whole pages and pages split in
    kernel blocks, the page map names what FlashAttention reads, and blocks
    saved from some pages (a partial one among them) load into other pages
    as FlashAttention sees them, writing nothing else; one changed byte in one
    slot is caught as that block alone.  Both ways the GPU path copies: direct
    (vLLM's batched copy between pages and slots) and through staging."""
    import os

    from tests.vllm_stack import VLLM_PY
    from tests.worker_stand import run_driver
    if not os.path.exists(VLLM_PY):
        pytest.skip(f"no vLLM environment at {VLLM_PY} (.ci/setup builds it)")
    seen = run_driver("gpu_layout_driver.py", region_path)
    # vLLM's six orders whole, and its default one (LBNHC) and LBHNC split too
    # a failed batched copy, in each way it fails, raised in the connector, its
    # error taken off the runtime
    assert seen["errors"] == {"raised_by_the_op": True, "left_by_its_loop": True,
                              "pending_before": True, "cleared": True}
    layouts = {name.rsplit("/", 1)[0] for name in seen if name != "errors"}
    assert {"LBNHC/whole", "LBNHC/split", "LBHNC/split", "BLNHC/whole",
            "BHLNC/whole"} <= layouts, sorted(seen)
    # (and one region block a page in the default layout), each both ways; and
    # the direct way with every layer checksummed in one group (a partial
    # block's tail zeroed over them all at once)
    both = layouts - {"LBNHC/grouped"}
    assert len(both) == 9 and "LBNHC/one-block" in both, sorted(seen)
    assert set(seen) == {f"{name}/{way}" for name in both for way in ("direct", "staging")} \
        | {"LBNHC/grouped/direct", "errors"}
    for name, case in seen.items():
        if name == "errors":
            continue
        assert case == {"kernel_blocks_a_page": 2 if "/split/" in name else 1,
                        "direct": name.endswith("/direct"), "empty_batch": True,
                        "offsets": True, "checksums": True, "slots_in_region_order": True,
                        "round_trip": True, "one_wrong_block": True,
                        "written_elsewhere": [0, 0]}, name


def test_a_kv_view_of_another_shape_is_refused_in_one_line():
    from tract_cli.core.errors import TractError
    from tract_cli.core.kvpages import strided_offsets
    # [kernel blocks, heads, N, 2*dim] of 2 heads of dim 8, pages of 32 tokens
    offsets, stride = strided_offsets((10, 2, 16, 16), (512, 16, 32, 1), 32, 2, 8)
    assert stride == 1024 and offsets.shape == (2, 32, 2, 8)
    assert offsets[1, 17, 1, 3] == 512 + 16 + 32 + 8 + 3     # V, token 1 of kernel block 1
    for shape, strides, why in [((10, 2, 16), (512, 16, 1), "not \\[blocks"),
                                ((10, 4, 16, 16), (1024, 16, 64, 1), "expected"),
                                ((10, 2, 12, 16), (384, 16, 32, 1), "expected"),
                                ((9, 2, 16, 16), (512, 16, 32, 1), "whole pages"),
                                ((10, 2, 16, 16), (512, 256, 16, 2), "contiguous"),
                                ((10, 2, 16, 16), (512, 0, 32, 1), "one address")]:
        with pytest.raises(TractError, match=why):
            strided_offsets(shape, strides, 32, 2, 8)


def test_the_gpu_copy_chosen_by_gpu_copy_and_cuda(monkeypatch):
    """gpu_copy auto takes vLLM's batched copy where it is built and CUDA (its
    build, the driver) is 12.8 or newer, else staging, saying why; direct
    takes it whatever the CUDA (saying so before 12.8), and refuses in one
    line where it is missing."""
    import torch

    from tract_cli.core import gpupages
    from tract_cli.core.errors import UsageError
    from tract_cli.core.gpupages import gpu_batch_copy
    assert gpu_batch_copy("staging") == (None, "gpu_copy is staging")
    op, why = gpu_batch_copy("auto")      # no vLLM's CUDA build here: why not, said
    assert op is None and ("vLLM's extension cannot be imported" in why
                           or "no batched copy" in why), why
    monkeypatch.setattr(gpupages, "vllm_batch_copy",
                        lambda: (None, "this vLLM build has no batched copy (swap_blocks_batch)"))
    op, why = gpu_batch_copy("auto")
    assert op is None and "no batched copy" in why
    with pytest.raises(UsageError, match="gpu_copy direct: this vLLM build has no"):
        gpu_batch_copy("direct")
    op = object()
    monkeypatch.setattr(gpupages, "vllm_batch_copy", lambda: (op, None))
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert gpu_batch_copy("auto", driver_version=12080) == (op, None)
    got, why = gpu_batch_copy("auto", driver_version=12040)      # an older driver
    assert got is None and "driver 12.4" in why
    monkeypatch.setattr(torch.version, "cuda", "12.6")           # an older build
    got, why = gpu_batch_copy("auto", driver_version=13000)
    assert got is None and "CUDA 12.6" in why
    got, why = gpu_batch_copy("direct", driver_version=12040)    # forced: taken, said
    assert got is op and "a call a copy, on the engine's thread" in why
    monkeypatch.setattr(torch.version, "cuda", None)             # a CPU build of torch
    assert gpu_batch_copy("auto", driver_version=13000)[0] is None
