"""The engine data path against memcpy (`tract microbench kvpages`): one
request's KV saved from an engine's page tensors into region slots and loaded
back (core/kvpages.py, native/kvpages.c: one C call, checksummed as it
copies), each timed against a plain memcpy of the same runs between the same
buffers in the same order (the kernel's own reference, `checksum=False`),
interleaved round by round, medians reported.

Two cache states, because they answer different questions:
- warm: each copy right after the same copy, so the bytes sit in the caches
  for both; what the checksum costs on top of moving the bytes, at its worst
  (a memcpy from the cache runs at cache speed, the checksum does not);
- cold: every line of both buffers evicted before each copy
  (`PagedKV.evict`: clflushopt, else clflush), as a load meets the region on a
  device (its acquire evicts this host's lines) and a save meets pages the
  engine wrote many layers ago; the connector's own reference inside vLLM
  (`tract bench --engine vllm`) times from the same two states.

The engine's pages are vLLM's CPU layout: one region block per page of
`page_tokens`, each (layer, page) one contiguous run (the connector formats
its region so, docs/VLLM.md "The data path").
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from tract_cli.bench.regions import need_space, temp_region_path
from tract_cli.core.cpu import checksum_path
from tract_cli.core.errors import TractError, UsageError
from tract_cli.core.geometry import load_model, with_block_tokens
from tract_cli.core.kvpages import PageLayout, PagedKV
from tract_cli.core.pool import Pool


@dataclass
class PagedFigures:
    model: str
    input_len: int
    blocks: int
    bytes: int                 # the request's KV, every layer
    run_bytes: int             # one (layer, page) run
    flush_mode: str
    crc_path: str              # the checksum's CPU path (core.cpu.checksum_path)
    rounds: int
    us: dict                   # "{save|load}_{warm|cold}_{memcpy|tract}" -> median µs

    def ratio(self, op: str, state: str) -> float:
        return self.us[f"{op}_{state}_tract"] / self.us[f"{op}_{state}_memcpy"]

    def gbps(self, op: str, state: str, kind: str) -> float:
        return self.bytes / self.us[f"{op}_{state}_{kind}"] / 1e3


def cpu_page_layout(block_tokens: int, heads: int, dim: int, elem_bytes: int) -> PageLayout:
    """vLLM's CPU page of BLOCK_TOKENS tokens as one region block: per head, K
    in dimension pairs and V in token pairs (its packed layout); whatever the
    packing, one run per (layer, page)."""
    kv, t, h, d = np.meshgrid(np.arange(2), np.arange(block_tokens), np.arange(heads),
                              np.arange(dim), indexing="ij")
    g = block_tokens
    k = h * (g * dim) + (d // 2) * (g * 2) + t * 2 + d % 2
    v = heads * g * dim + h * (g * dim) + (t // 2) * (dim * 2) + d * 2 + t % 2
    return PageLayout(np.where(kv == 0, k, v).astype(np.int64), 2 * g * heads * dim, g, elem_bytes)


def bench_paged(model: str = "llama-3-8b", input_len: int = 1500, page_tokens: int = 128,
                flush_mode: str = "none", rounds: int = 15) -> PagedFigures:
    try:
        import torch          # an engine's page tensors: torch's, as the connector's
    except ImportError:
        raise UsageError("tract microbench kvpages needs torch (an engine's KV tensors)",
                         'pip install "tract-cxl[serve]"') from None

    profile = with_block_tokens(load_model(model), page_tokens)
    g = profile.geometry
    blocks = input_len // page_tokens
    if blocks < 1:
        raise UsageError(f"--input-len {input_len} holds no whole page of {page_tokens} tokens",
                         f"use at least {page_tokens} tokens")
    dtypes = {2: torch.bfloat16, 4: torch.float32, 1: torch.uint8}
    if g.dtype_bytes not in dtypes:
        raise UsageError(f"{model}'s KV elements are {g.dtype_bytes} bytes", "use a 1-, 2- or "
                         "4-byte KV dtype")
    layout = cpu_page_layout(page_tokens, g.num_kv_heads, g.head_dim, g.dtype_bytes)
    total = blocks * g.block_bytes
    size = ((2 * total + (64 << 20)) // (2 << 20) + 1) * (2 << 20)
    with temp_region_path() as path:
        need_space(path, size, "a shorter --input-len")
        with Pool.create(path, size, profile, nodes=1, flush_mode=flush_mode,
                         progress=None) as pool:
            pages = blocks + 2                # the engine's cache: the request's pages and two more
            tensors = [torch.randint(0, 255, (pages * layout.page_stride * g.dtype_bytes,),
                                     dtype=torch.uint8).view(dtypes[g.dtype_bytes])
                       for _ in range(g.num_layers)]
            paged = PagedKV(pool, layout, tensors)
            # the request's pages in the engine's order, its slots forward in the region
            slots = np.arange(blocks, dtype=np.uint32)
            at = np.random.default_rng(3).permutation(pages)[:blocks]
            subs = np.zeros(blocks, np.uint32)
            # one process, nothing another host wrote: the loads need no
            # acquire (its eviction is what the cold state stands for)
            crcs = paged.save(slots, at, subs)
            ops = {"save": lambda checksum: paged.save(slots, at, subs, checksum=checksum),
                   "load": lambda checksum: paged.load(slots, at, subs, checksum=checksum)}
            samples = {f"{op}_{state}_{kind}": [] for op in ops for state in ("warm", "cold")
                       for kind in ("memcpy", "tract")}
            for r in range(rounds + 1):           # round 0 warms up, unrecorded
                for op, run in ops.items():
                    for state in ("warm", "cold"):
                        for kind in ("memcpy", "tract"):
                            checksum = kind == "tract"
                            if state == "warm":
                                run(checksum)
                            else:
                                paged.evict(slots, at, subs)
                            t0 = time.perf_counter()
                            out = run(checksum)
                            dt = time.perf_counter() - t0
                            if checksum and not np.array_equal(out, crcs):
                                raise TractError(f"the {op}'s checksums differ from the first "
                                                 "save's", "report it: the data path is wrong")
                            if r:
                                samples[f"{op}_{state}_{kind}"].append(dt)
            del paged, tensors
            mode = pool.flush_mode
    return PagedFigures(model, input_len, blocks, total, g.block_bytes // g.num_layers, mode,
                        checksum_path(), rounds,
                        {k: statistics.median(v) * 1e6 for k, v in samples.items()})
