"""How vLLM's attention backends lay out a page of KV: measured or stated, as
the element offsets the core's data path (core/kvpages.py) is built from.

An engine keeps each layer's KV in pages of `B` tokens, in a layout of its
kernel's choosing: vLLM's CPU backend, for one, packs K and V differently for
each instruction set (AMX: K in dimension pairs `[D/2][B][2]`, V in token
pairs `[B/2][D][2]`; AVX-512: K transposed `[D][B]`), none of them token
major.  So the layout is not assumed: the element offset, in one layer's
tensor, of every `(K|V, token, head, dim)` of a page is *measured* by letting
the engine's own cache writer store known values into a scratch page
(`probe_offsets`), or read from the strides of a view whose axes are known
(vLLM 0.32's GPU view: `core.kvpages.strided_offsets`).
`core.kvpages.PageLayout` turns the offsets into the order a region block
holds them in (the page's own) and the runs one C call copies.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from tract_cli.core.errors import TractError


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
