"""Between an engine's paged KV cache and the region's layer-major blocks.

A region block slot is `[layer][K|V][token][kv_head][head_dim]` over
`g = block_tokens` tokens (docs/FORMAT.md §5): the same bytes whichever
engine, attention kernel or CPU instruction set wrote them, so a CPU decode
can read what a GPU prefill wrote, and the reference engine can check both.

An engine keeps each layer's KV in pages of `B` tokens, in a layout of its
kernel's choosing: vLLM's CPU backend, for one, packs K and V differently for
each instruction set (AMX: K in dimension pairs `[D/2][B][2]`, V in token
pairs `[B/2][D][2]`; AVX-512: K transposed `[D][B]`), none of them token
major.  So the layout is not assumed: a `PageMap` is the element offset, in
one layer's tensor, of every `(K|V, token, head, dim)` of a page, *measured*
by letting the engine's own cache writer store known values into a scratch
page (`probe_offsets`), or stated for a layout that is documented.  When `B`
is a multiple of `g`, page `p` holds region blocks `p*r .. p*r + r-1`
(`r = B / g`) and the bytes of a request's blocks of one layer are one
gather over a precomputed index (`page_base + index[sub_block]`), so a step
moves each layer with one batched torch gather (save) or scatter (load),
never a Python loop per block or token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from tract_cli.core.errors import TractError


@dataclass
class PageMap:
    """Where each KV element of a page lives in one layer's (flattened) tensor."""

    offsets: np.ndarray      # int64 [2, B, kv_heads, head_dim]: offset within page 0
    page_stride: int         # elements from one page to the next
    block_tokens: int        # g

    def __post_init__(self):
        two, page_tokens, _, _ = self.offsets.shape
        if two != 2 or page_tokens % self.block_tokens:
            raise TractError(f"the engine's block size {page_tokens} is not a multiple of the "
                             f"region's {self.block_tokens} tokens per block",
                             f"serve with a block size that is a multiple of {self.block_tokens},"
                             " or format the region with `tract init --block-tokens` dividing it")
        r, g = page_tokens // self.block_tokens, self.block_tokens
        # index[j]: region-block order (K|V, token, head, dim) of sub-block j
        per = self.offsets.reshape(2, r, g, *self.offsets.shape[2:]).transpose(1, 0, 2, 3, 4)
        self.index = np.ascontiguousarray(per.reshape(r, -1))

    @property
    def blocks_per_page(self) -> int:
        return self.offsets.shape[1] // self.block_tokens

    def gather_index(self, pages: np.ndarray, subs: np.ndarray) -> np.ndarray:
        """[n, block elements] offsets of region blocks (page, sub) of one layer."""
        return pages.astype(np.int64)[:, None] * self.page_stride + self.index[subs]


def probe_offsets(write: Callable, page_tokens: int, kv_heads: int, head_dim: int,
                  dtype, page_shape: tuple) -> np.ndarray:
    """Measures an engine's page layout with its own cache writer.

    WRITE(key, value, page, slot_mapping) stores key/value `[tokens, heads,
    dim]` into the scratch tensor PAGE (shape PAGE_SHAPE, one page).  Each
    probe writes small integers (exact in any float dtype) naming one
    coordinate, K positive and V negative; five probes name every element.
    Returns int64 offsets [2, B, heads, dim], checked to be a permutation.
    """
    import torch
    n = page_tokens
    coords = [("token_lo", lambda t, h, d: t % 64), ("token_hi", lambda t, h, d: t // 64),
              ("head", lambda t, h, d: h), ("dim_lo", lambda t, h, d: d % 64),
              ("dim_hi", lambda t, h, d: d // 64)]
    t, h, d = np.meshgrid(np.arange(n), np.arange(kv_heads), np.arange(head_dim), indexing="ij")
    seen = {}
    elements = int(np.prod(page_shape))
    for name, fn in coords:
        vals = fn(t, h, d).astype(np.float32) + 1.0
        if vals.max() > 128:
            raise TractError(f"the KV layout probe cannot name {name} values above 128",
                             "use a smaller block size or head size")
        page = torch.zeros(page_shape, dtype=dtype)
        key = torch.from_numpy(vals).to(dtype)
        write(key, -key, page, torch.arange(n, dtype=torch.int64))
        seen[name] = page.reshape(-1).float().numpy()
    sign = np.sign(seen["dim_lo"])
    if (sign == 0).any():
        raise TractError("the engine's cache writer left part of a page unwritten (padding)",
                         "report the attention backend; TraCT cannot map its layout")
    kv = (sign < 0).astype(np.int64)
    tok = (np.abs(seen["token_lo"]) - 1) + 64 * (np.abs(seen["token_hi"]) - 1)
    head = np.abs(seen["head"]) - 1
    dim = (np.abs(seen["dim_lo"]) - 1) + 64 * (np.abs(seen["dim_hi"]) - 1)
    out = np.full((2, n, kv_heads, head_dim), -1, np.int64)
    cells = (kv, tok.astype(np.int64), head.astype(np.int64), dim.astype(np.int64))
    out[cells] = np.arange(elements)
    if (out < 0).any() or len(np.unique(out)) != out.size:
        raise TractError("the engine's KV page layout is not a permutation of its elements",
                         "report the attention backend; TraCT cannot map its layout")
    return out


def flash_offsets(pages: int, page_tokens: int, kv_heads: int, head_dim: int) -> tuple:
    """FlashAttention's documented `[2, pages, B, heads, dim]`: (offsets, page stride)."""
    kv, t, h, d = np.meshgrid(np.arange(2), np.arange(page_tokens), np.arange(kv_heads),
                              np.arange(head_dim), indexing="ij")
    page = page_tokens * kv_heads * head_dim
    return (kv * pages * page + (t * kv_heads + h) * head_dim + d).astype(np.int64), page
