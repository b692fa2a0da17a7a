"""Drives the GPU path's page map and copies over the KV views vLLM 0.32
itself makes (`vllm.v1.kv_cache_interface.create_kv_cache_views`: one
`[kernel blocks, heads, N, 2*dim]` view a layer, strided as each of its KV
cache layouts orders it, a page split into kernel blocks where vLLM splits
it), with the CPU standing in for CUDA (tests/fake_cuda.py), against a real
region: no model, no server, no GPU.

For each layout, through each of the GPU path's two ways (`direct`: vLLM's
batched copy straight between the pages and the slots, stood in for by
`fake_cuda.batch_copy`; `staging`: through a staging buffer):
- `empty_batch`: a batch of no blocks saves and loads nothing, raising nothing;
- `offsets`: every (K|V, token, head, dim) of every page that
  `kvpages.strided_offsets` names holds what FlashAttention reads there
  (`kv_cache.transpose(1, 2).split(head_dim, -1)`, the backend's own split);
- `slots_in_region_order`: each saved slot holds its block as the CPU path
  writes it (each layer in its place, the region's order, zeros past a
  partial block's tokens);
- `round_trip`: blocks saved from some pages (a partial last one among them)
  and loaded into other pages of other views of the same layout read back
  as FlashAttention sees them, the partial block zeroed past its tokens;
- `one_wrong_block`: the same comparison, after one byte of one slot is
  changed, names that block alone (the check can fail);
- (`errors`, once) a batched copy that raises, one that leaves the runtime's
  last error (vLLM's unchecked fallback loop), and an error pending before
  the copy: each raised by the save as what it is, the error taken;
- `written_elsewhere`: each load wrote nothing outside its blocks' tokens
  (non-zero elements of the whole backing allocation, every layer's, beyond
  those, after it was zeroed: 0 each time).

Each layer is handed to the checksum threads as it is queued, except in
`LBNHC/grouped/direct`, where every layer goes in one group when the
checksums are asked for (a short prompt's save): the checksum thread zeroes
a partial block's tail over all those layers at once.

Run in vLLM's environment: `python tests/gpu_layout_driver.py POOL`; prints one
JSON object of observations (tests/test_gpu.py checks them).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fake_cuda  # noqa: E402

fake_cuda.install()

import torch  # noqa: E402

import tract_cli.core.gpupages as gpupages  # noqa: E402
from tract_cli.core.gpupages import CudaPagedKV  # noqa: E402
from tract_cli.core.hashing import block_hashes, pool_root  # noqa: E402
from tract_cli.core.index import PUT_CLAIMED  # noqa: E402
from tract_cli.core.kvpages import PageLayout, strided_offsets  # noqa: E402
from tract_cli.core.pool import Pool  # noqa: E402

PAGES = 12
# every landed layer handed to the checksum threads at once (as a long prompt's
# are), so that a checksum not waiting for its layer's copy reads it early
gpupages.CHECKSUM_TASK_BYTES = 1
DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


def views(layout, g, page_tokens: int, kernel_tokens: int | None) -> list:
    """One vLLM 0.32 KV view a layer, as its GPU model runner makes them."""
    from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheTensor,
                                            compute_layout_strides, create_kv_cache_views)
    spec = FullAttentionSpec(block_size=page_tokens, num_kv_heads=g.num_kv_heads,
                             head_size=g.head_dim, dtype=DTYPES[g.dtype])
    layer_stride, block_stride, *_ = compute_layout_strides(spec, PAGES, g.num_layers, layout)
    size = g.num_layers * PAGES * spec.page_size_bytes
    tensor = KVCacheTensor(size=size, layers=[f"layer{i}" for i in range(g.num_layers)],
                           layer_stride=layer_stride, block_stride=block_stride)
    raw = torch.zeros(size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, PAGES, layout, tensor,
                                 kernel_block_size=kernel_tokens)


def flash(view, head_dim: int, page: int, page_tokens: int) -> torch.Tensor:
    """Page PAGE of a layer as FlashAttention reads it: [2, tokens, heads, dim]."""
    key, value = view.transpose(1, 2).split(head_dim, dim=-1)     # [blocks, N, heads, dim]
    n = view.shape[2]
    per = page_tokens // n
    return torch.stack([c[page * per:(page + 1) * per].reshape(page_tokens, *c.shape[2:])
                        for c in (key, value)])


def slots_hold(pool, pl, src, slots, pages, subs, tokens) -> bool:
    """Each slot holds its block as the CPU path would write it: layer l in
    the slot's l-th part, its elements in the region's order (the layout's
    index), zeros past a partial block's tokens."""
    g = pool.geometry
    for slot, page, sub, used in zip(slots, pages, subs, tokens):
        got = pool.slot_bytes(int(slot)).reshape(g.num_layers, -1)
        for layer, v in enumerate(src):
            whole = v.untyped_storage().nbytes() // v.element_size()
            flat = torch.as_strided(v, (whole - v.storage_offset(),), (1,), v.storage_offset())
            want = flat[torch.from_numpy(page * pl.page_stride + pl.index[sub])].clone()
            want[torch.from_numpy(pl.elem_token[sub].astype(np.int64) >= used)] = 0
            if not np.array_equal(got[layer], want.view(torch.uint8).numpy()):
                return False
    return True


def case(pool, layout, page_tokens: int, kernel_tokens: int | None, seed: int,
         direct: bool) -> dict:
    g = pool.geometry
    B, H, D = g.block_tokens, g.num_kv_heads, g.head_dim
    src = views(layout, g, page_tokens, kernel_tokens)
    torch.manual_seed(seed)
    for v in src:
        v.copy_(torch.randn(v.shape))
    offsets, stride = strided_offsets(tuple(src[0].shape), tuple(src[0].stride()), page_tokens,
                                      H, D)
    out = {"kernel_blocks_a_page": page_tokens // src[0].shape[2]}
    # 1. the offsets name what FlashAttention reads
    ok = True
    for v in src:
        whole = v.untyped_storage().nbytes() // v.element_size()
        flat = torch.as_strided(v, (whole - v.storage_offset(),), (1,), v.storage_offset())
        for page in range(PAGES):
            named = flat[torch.from_numpy(page * stride + offsets.reshape(-1))].reshape(
                offsets.shape)
            ok = ok and torch.equal(named, flash(v, D, page, page_tokens))
    out["offsets"] = bool(ok)

    # 2. save some pages' blocks, load them into other pages of other views
    pl = PageLayout(offsets, stride, B, src[0].element_size())
    per_page = pl.blocks_per_page
    pages = np.array([7, 2, 9, 4, 11], np.int64)
    blocks = [(p, j) for p in pages for j in range(per_page)]
    tokens = np.full(len(blocks), B, np.int64)
    tokens[-1] = 5                                           # a partial last block
    root = pool_root(pool.info)
    keys = block_hashes(np.arange(len(blocks) * B, dtype=np.int32) + 7919 * seed,
                        block_tokens=B, root=root)
    status, slots = pool.index.reserve(keys)
    assert (status == PUT_CLAIMED).all(), status
    # a slot may hold another block's bytes: a save writes each of its bytes,
    # zeros past a partial block's tokens included
    for slot in slots:
        pool.slot_bytes(int(slot))[:] = 0xA5
    copy = fake_cuda.batch_copy if direct else None
    kv = CudaPagedKV(pool, pl, src, capacity=3, batch_copy=copy)
    out["direct"] = kv.direct
    # a batch of no blocks moves nothing, either way
    none = np.zeros(0, np.int64)
    empty = kv.batch(none, none, none, none, checksum=True)
    for layer in range(g.num_layers):
        kv.save_layer(empty, layer)
    kv.load(empty)
    kv.finish()
    out["empty_batch"] = kv.checksums(empty).size == 0
    page_of = np.array([p for p, _ in blocks], np.int64)
    sub_of = np.array([j for _, j in blocks], np.int64)
    batch = kv.batch(slots, page_of, sub_of, tokens, checksum=True)
    for layer in range(g.num_layers):
        kv.save_layer(batch, layer)
    kv.finish()
    sums = kv.checksums(batch)
    out["checksums"] = bool(np.array_equal(sums, pool.checksum_slots(slots)))
    out["slots_in_region_order"] = slots_hold(pool, pl, src, slots, page_of, sub_of, tokens)
    kv.close()
    dst = views(layout, g, page_tokens, kernel_tokens)
    into = (page_of + 5) % PAGES
    back = CudaPagedKV(pool, pl, dst, capacity=2, batch_copy=copy)

    whole = dst[0].untyped_storage().nbytes() // dst[0].element_size()
    backing = torch.as_strided(dst[0], (whole,), (1,), 0)     # every layer's pages
    written = int((tokens * H * 2 * D).sum()) * g.num_layers  # what the loads write
    out["written_elsewhere"] = []

    def loaded_as_saved() -> list:
        """The blocks (indices into BLOCKS) whose loaded tokens differ from the
        saved ones, the partial block's past-tail tokens read as zeros; and
        (written_elsewhere) how many elements of the backing allocation beyond
        the loaded blocks' tokens the load made non-zero."""
        backing.zero_()
        loading = back.batch(slots, into, sub_of, checksum=False)
        back.load(loading)
        # each layer as its attention reads it: after waiting for that layer's
        # load alone, before the rest is done (the direct way's copies run late)
        seen = []
        for layer, d in enumerate(dst):
            back.wait_layer(layer)
            seen.append(d.clone())
        back.finish()
        out["written_elsewhere"].append(int(torch.count_nonzero(backing)) - written)
        wrong = []
        for i, ((p, j), q) in enumerate(zip(blocks, into)):
            lo, hi = j * B, (j + 1) * B
            for s, d in zip(src, seen):
                want = flash(s, D, p, page_tokens)[:, lo:hi].clone()
                want[:, int(tokens[i]):] = 0
                got = flash(d, D, int(q), page_tokens)[:, lo:hi]
                if not torch.equal(got, want):
                    wrong.append(i)
                    break
        return wrong

    out["round_trip"] = loaded_as_saved() == []
    wrong_block = len(blocks) // 2
    pool.slot_array(int(slots[wrong_block])).reshape(-1).view(np.uint8)[12] ^= 0x10
    out["one_wrong_block"] = loaded_as_saved() == [wrong_block]
    back.close()
    pool.index.commit(keys, status, slots, publish=False)
    return out


def error_paths(pool) -> dict:
    """A batched copy that fails: raising (vLLM's batched call), leaving the
    runtime's last error (its unchecked loop of cudaMemcpyAsync), or with an
    error already pending: each a TractError from the save, naming what
    failed, and the runtime's last error taken."""
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from tract_cli.core.errors import TractError
    g = pool.geometry
    src = views(KVCacheLayout.LBNHC, g, g.block_tokens, None)
    offsets, stride = strided_offsets(tuple(src[0].shape), tuple(src[0].stride()),
                                      g.block_tokens, g.num_kv_heads, g.head_dim)
    pl = PageLayout(offsets, stride, g.block_tokens, src[0].element_size())
    keys = block_hashes(np.arange(g.block_tokens, dtype=np.int32) + 99991,
                        block_tokens=g.block_tokens, root=pool_root(pool.info))
    status, slots = pool.index.reserve(keys)

    def raising(src_ptrs, dst_ptrs, sizes):
        raise RuntimeError("cuMemcpyBatchAsync stood in for")

    def leaving(src_ptrs, dst_ptrs, sizes):
        fake_cuda.batch_copy(src_ptrs, dst_ptrs, sizes)
        fake_cuda.leave_error(700)

    def said(copy, before: int = 0) -> str:
        kv = CudaPagedKV(pool, pl, src, capacity=1, batch_copy=copy)
        batch = kv.batch(slots, np.zeros(1, np.int64), np.zeros(1, np.int64))
        fake_cuda.leave_error(before)
        try:
            kv.save_layer(batch, 0)
            return ""
        except TractError as exc:
            return exc.problem
        finally:
            kv.close()
    out = {"raised_by_the_op": said(raising) == "the batched DMA of layer 0 failed: "
           "cuMemcpyBatchAsync stood in for",
           "left_by_its_loop": said(leaving) == "the batched DMA of layer 0 failed: "
           "a stand-in error (700)",
           "pending_before": said(fake_cuda.batch_copy, before=1).startswith(
               "a CUDA error was pending before the batched DMA of layer 0: a stand-in error")}
    out["cleared"] = fake_cuda._Runtime.pending == 0
    pool.index.commit(keys, status, slots, publish=False)
    return out


def main(path: str) -> dict:
    from vllm.v1.kv_cache_layout import KVCacheLayout
    pool = Pool.attach(path, node=1)
    g = pool.geometry
    seen = {}
    seed = 1
    try:
        for layout in KVCacheLayout:
            # two region blocks a page; a page of two kernel blocks where vLLM
            # splits it (its layer-compact layouts only)
            for kernel in (None, g.block_tokens):
                name = f"{layout.name}/{'split' if kernel else 'whole'}"
                try:
                    views(layout, g, 2 * g.block_tokens, kernel)
                except ValueError:              # vLLM refuses to split this layout
                    continue
                for way in ("direct", "staging"):
                    seen[f"{name}/{way}"] = case(pool, layout, 2 * g.block_tokens, kernel,
                                                 seed, way == "direct")
                    seed += 1
        # one region block a page, in vLLM's default layout
        for way in ("direct", "staging"):
            seen[f"LBNHC/one-block/{way}"] = case(pool, KVCacheLayout.LBNHC, g.block_tokens,
                                                  None, seed, way == "direct")
            seed += 1
        gpupages.CHECKSUM_TASK_BYTES = 1 << 40
        try:
            seen["LBNHC/grouped/direct"] = case(pool, KVCacheLayout.LBNHC, 2 * g.block_tokens,
                                                None, seed, True)
        finally:
            gpupages.CHECKSUM_TASK_BYTES = 1
        seen["errors"] = error_paths(pool)
    finally:
        pool.close()
    return seen


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
