"""The GPU data path of the vLLM connector, measured on a GPU host:
`python -m tract_cli.bench.micro.gpu_pages [--tokens N] [--flush-mode M] [--copy C]`.

A prompt's KV in GPU pages as vLLM 0.32 lays them out for FlashAttention
(its default KV cache layout; a model profile's shape, random values) is
saved into claimed slots and loaded back into other pages through
`CudaPagedKV` (core/gpupages.py), each timed against a DMA of the same
bytes between the same GPU memory and the same registered slots (one pitched
copy: the copy engines' own speed here).  The parts are timed apart: the
copy, the CPU's checksum of the slots, the commit (whose write-back the flush
mode decides).  Then each is run beside a stand-in forward (a bf16 matrix
product per layer on the engine's stream, of a Llama-3-8B layer's arithmetic
for the prompt): a save queued layer by layer as each layer finishes, a load
waited for layer by layer; the figure is the forward's time with the copy
against without.  Loaded bytes are checked equal to the saved ones.  The
copy is the connector's inside vLLM (`--copy direct`: vLLM's batched copy
straight between pages and slots; run it with a Python that has vLLM's CUDA
build) or its staging path (`--copy staging`); `auto`, the default, takes the
direct one where vLLM's op is there and CUDA (torch's build, the driver) is
12.8 or newer, as the connector's `gpu_copy` does.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np


def _median_ms(fn, repeats: int) -> float:
    fn()                                   # warm: allocations, registration, caches
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def vllm_views(layers: int, pages: int, block_tokens: int, heads: int, dim: int, dtype,
               device: str = "cuda", fill=None) -> list:
    """KV layer views as vLLM 0.32 registers them in its default layout (LBNHC):
    one allocation, a layer's pages `[tokens][heads][K dim, V dim]` one after
    another, each layer viewed `[pages, heads, tokens, 2*dim]`; FILL (e.g.
    torch.randn) makes the allocation's values, else zeros."""
    import torch
    n = layers * pages * block_tokens * heads * 2 * dim
    raw = (fill or torch.zeros)(n, dtype=dtype, device=device)
    per = n // layers
    return [raw[i * per:(i + 1) * per].view(pages, block_tokens, heads, 2 * dim).transpose(1, 2)
            for i in range(layers)]


def _setup(path: str, model: str, tokens: int, flush_mode: str):
    """A region for TOKENS tokens of MODEL, the prompt's KV in GPU pages
    (random) as vLLM 0.32 lays them out (its default layout), their page
    layout, and the prompt's block keys."""
    import torch

    from tract_cli.core.hashing import block_hashes, pool_root
    from tract_cli.core.kvpages import PageLayout, strided_offsets
    from tract_cli.core.pool import Pool
    from tract_cli.core.geometry import load_model
    g = load_model(model).geometry
    n = tokens // g.block_tokens
    size = (n * 2 + 64) * g.block_bytes + (64 << 20)
    pool = Pool.create(path, size, model, flush_mode=flush_mode, force=True)
    pages = n + 8
    dtype = {2: torch.bfloat16, 4: torch.float32}[g.dtype_bytes]
    src = vllm_views(g.num_layers, pages, g.block_tokens, g.num_kv_heads, g.head_dim, dtype,
                     fill=torch.randn)
    offsets, stride = strided_offsets(tuple(src[0].shape), tuple(src[0].stride()),
                                      g.block_tokens, g.num_kv_heads, g.head_dim)
    layout = PageLayout(offsets, stride, g.block_tokens, g.dtype_bytes)
    keys = block_hashes(np.arange(n * g.block_tokens, dtype=np.int32) % 30000,
                        block_tokens=g.block_tokens, root=pool_root(pool.info))
    return pool, layout, src, keys


def run(model: str, tokens: int, flush_mode: str, repeats: int,
        copy: str = "auto") -> list[tuple[str, str]]:
    import torch

    from tract_cli.core.errors import UsageError
    from tract_cli.core.gpupages import gpu_batch_copy
    # as the connector's gpu_copy chooses (direct needs vLLM's CUDA build here)
    try:
        batch_copy, why = gpu_batch_copy(copy)
    except UsageError as exc:
        raise SystemExit(f"gpu_pages: {exc.problem}; {exc.fix}") from None

    from tract_cli.core.agent_launch import ensure_agent
    from tract_cli.core.gpu import CudaPool
    from tract_cli.core.gpupages import CHECKSUM_THREADS, CudaPagedKV, staging_capacity
    from tract_cli.core.region import remove_region

    path = f"/dev/shm/tract-gpu-bench-{os.getpid()}.pool"
    pool, layout, src, keys = _setup(path, model, tokens, flush_mode)
    rows = []
    cuda = agent = None
    try:
        agent = ensure_agent(path, 0, manager=True, flush_mode=flush_mode)
        g = pool.geometry
        n, bb = len(keys), pool.info.block_bytes
        nbytes = n * bb
        cap = staging_capacity(8192, g.block_tokens, bb // g.num_layers)
        cuda = CudaPool(pool)          # one registration, shared by both directions
        out = CudaPagedKV(pool, layout, src, cap, cuda_pool=cuda, batch_copy=batch_copy)
        dst = [torch.zeros_like(t) for t in src]
        into = CudaPagedKV(pool, layout, dst, cap, cuda_pool=cuda, batch_copy=batch_copy)
        way = (f"direct (vLLM's swap_blocks_batch{'; ' + why if why else ''})" if out.direct else
               f"through {out.gpu_bytes / 2**20:.1f} MiB of staging "
               f"({why or 'the layout is of short runs'})")
        status, slots = pool.index.reserve(keys)
        pages = np.arange(n, dtype=np.int64)
        subs = np.zeros(n, np.int64)
        flat = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
        stride, base = pool.info.slot_stride, out.slot_address(0, 0)
        gbps = lambda ms: nbytes / ms / 1e6

        def reference(to_slots: bool) -> None:
            # the same bytes between GPU memory and the same slots: one pitched
            # copy per run of consecutive slots, every layer of a block at once
            for i, first, m in out.batch(slots, pages, subs).runs:
                at_slot, at_gpu = base + first * stride, flat.data_ptr() + i * bb
                if to_slots:
                    out.runtime.memcpy2d_async(at_slot, stride, at_gpu, bb, bb, m,
                                               out.stream.cuda_stream)
                else:
                    out.runtime.memcpy2d_async(at_gpu, bb, at_slot, stride, bb, m,
                                               out.stream.cuda_stream)
            out.stream.synchronize()

        def save(checksum: bool) -> None:
            batch = out.batch(slots, pages, subs, checksum=checksum)
            for layer in range(g.num_layers):
                out.save_layer(batch, layer)
            out.finish()
            out.checksums(batch)

        ref_save = _median_ms(lambda: reference(True), repeats)
        dma_ms = _median_ms(lambda: save(False), repeats)
        save_ms = _median_ms(lambda: save(True), repeats)
        t0 = time.perf_counter()
        sums = pool.checksum_slots(slots)
        one_thread_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        pool.index.commit(keys, status, slots, checksums=sums, streamed=True)
        commit_ms = (time.perf_counter() - t0) * 1e3
        rows += [("kv save: the DMA alone (layer by layer)",
                  f"{dma_ms:.2f} ms, {gbps(dma_ms):.1f} GB/s, {dma_ms / ref_save:.2f}x "
                  f"the reference DMA ({ref_save:.2f} ms)"),
                 (f"kv save: DMA + checksum + write-back ({CHECKSUM_THREADS} threads)",
                  f"{save_ms:.2f} ms, {save_ms / ref_save:.2f}x the reference DMA; "
                  f"the checksum adds {save_ms - dma_ms:.2f} ms"),
                 ("  (a checksum on one thread after the copy)", f"{one_thread_ms:.2f} ms"),
                 (f"  commit (flush mode {flush_mode}, written back already)",
                  f"{commit_ms:.2f} ms")]
        hit = pool.index.lookup(keys)
        if hit.hits != n:
            raise SystemExit(f"{hit.hits} of {n} saved blocks found in the pool")

        def load(checksum: bool) -> None:
            batch = into.batch(hit.slots, pages, subs, checksum=checksum)
            into.load(batch)
            into.finish()
            into.checksums(batch)

        ref_load = _median_ms(lambda: reference(False), repeats)
        dma_load_ms = _median_ms(lambda: load(False), repeats)
        load_ms = _median_ms(lambda: load(True), repeats)
        for layer in range(g.num_layers):           # pages are the views' first axis
            if not torch.equal(dst[layer][:n], src[layer][:n]):
                raise SystemExit(f"layer {layer}: the loaded pages differ from the saved ones")
        dst[0][0, 0, 0, 0] += 1             # the check can fail: one element wrong
        if torch.equal(dst[0][:n], src[0][:n]):
            raise SystemExit("the loaded-bytes check does not see a wrong element")
        rows += [("kv load: the DMA alone (layer by layer)",
                  f"{dma_load_ms:.2f} ms, {gbps(dma_load_ms):.1f} GB/s, "
                  f"{dma_load_ms / ref_load:.2f}x the reference DMA ({ref_load:.2f} ms)"),
                 ("kv load: DMA + checksum", f"{load_ms:.2f} ms, {load_ms / ref_load:.2f}x the "
                  f"reference DMA; the checksum adds {load_ms - dma_load_ms:.2f} ms")]
        rows += _beside_a_forward(out, into, hit.slots, pages, subs, tokens, g.num_layers,
                                  repeats)
        pool.index.unpin(hit)
        out.close()
        into.close()
    finally:
        if cuda is not None:
            cuda.close()
        if agent is not None:
            agent.terminate()
            agent.wait(timeout=30)
        pool.close()
        remove_region(path)
    return [("prompt", f"{tokens} tokens of {model}: {n} blocks, {nbytes / 2**20:.1f} MiB"),
            ("copy", way)] + rows


def _beside_a_forward(out, into, slots, pages, subs, tokens: int, layers: int,
                      repeats: int) -> list:
    """The copies beside a stand-in forward: a bf16 product per layer of a
    Llama-3-8B layer's arithmetic for TOKENS tokens (~2.6 TFLOP at 6000)."""
    import torch
    x = torch.randn((tokens, 4096), dtype=torch.bfloat16, device="cuda")
    w = torch.randn((4096, 53248), dtype=torch.bfloat16, device="cuda")

    def forward(before=None, after=None) -> None:
        for layer in range(layers):
            if before is not None:
                before(layer)
            torch.matmul(x, w)
            if after is not None:
                after(layer)
        torch.cuda.current_stream().synchronize()

    plain = _median_ms(forward, repeats)

    def with_load() -> None:
        batch = into.batch(slots, pages, subs, checksum=True)
        into.load(batch)
        forward(before=into.wait_layer)
        into.finish()
        into.checksums(batch)

    def with_save() -> None:
        batch = out.batch(slots, pages, subs, checksum=True)
        forward(after=lambda layer: out.save_layer(batch, layer))
        out.finish()
        out.checksums(batch)

    loaded = _median_ms(with_load, repeats)
    saved = _median_ms(with_save, repeats)
    return [("stand-in forward (bf16 products, per layer)", f"{plain:.2f} ms"),
            ("  with the load (and its checksum), waited for layer by layer",
             f"{loaded:.2f} ms ({loaded / plain:.3f}x)"),
            ("  with the save (checksummed, written back), queued layer by layer", f"{saved:.2f} ms ({saved / plain:.3f}x)")]


def main(argv=None) -> None:
    from tract_cli.core.gpupages import GPU_COPIES
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="llama-3-8b")
    parser.add_argument("--tokens", type=int, default=6000)
    parser.add_argument("--flush-mode", default="none")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--copy", choices=GPU_COPIES, default="auto")
    args = parser.parse_args(argv)
    from tract_cli.core.errors import TractError
    from tract_cli.core.gpu import cuda_available
    if args.tokens < 16 or args.repeats < 1:
        raise SystemExit("gpu_pages: --tokens must be at least one block (16) and --repeats "
                         "at least 1")
    if not cuda_available():
        raise SystemExit("gpu_pages: no CUDA GPU here: this benchmark measures the GPU path; "
                         "run it on a GPU host")
    try:
        rows = run(args.model, args.tokens, args.flush_mode, args.repeats, args.copy)
    except TractError as exc:
        raise SystemExit(f"gpu_pages: {exc.problem}; {exc.fix}") from None
    for name, value in rows:
        print(f"{name:46} {value}")


if __name__ == "__main__":
    main()
