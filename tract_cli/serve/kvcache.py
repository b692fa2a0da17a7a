"""A request's KV cache as a block table, paged-attention style.

Each block of a sequence lives either in the worker's private buffer or in a
pool slot (zero copy: prefix hits, blocks reserved for a zero-copy put, a
handoff's blocks on the decode side).  Both stores share the slot layout
(block, layer, K|V, token, kv_head, head_dim), so a private block and a pool
slot are interchangeable: moving KV between them is one batched C call
(`index.put`, `index.read`), never a layout transform.

Attention gathers a layer's K or V for the first n positions with one
`index_select` per run of blocks from the same store.
"""
from __future__ import annotations

import numpy as np
import torch

PRIVATE, POOL = 0, 1


class BlockTable:
    def __init__(self, private: torch.Tensor, pool: torch.Tensor | None = None):
        self.stores = (private, pool)
        self.block_tokens = private.shape[3]
        self.src: list[int] = []
        self.ids: list[int] = []
        self._runs = None

    def extend(self, src, block_ids) -> None:
        """Appends blocks BLOCK_IDS; SRC is one store (PRIVATE or POOL) for all of
        them or one per block."""
        ids = np.asarray(block_ids, dtype=np.int64).reshape(-1)
        srcs = np.broadcast_to(np.asarray(src, dtype=np.int64), ids.shape)
        if self.stores[POOL] is None and (srcs == POOL).any():
            raise ValueError("no pool store attached to this block table")
        self.src.extend(srcs.tolist())
        self.ids.extend(ids.tolist())
        self._runs = None

    def append(self, src: int, block_id: int) -> None:
        self.extend(src, [block_id])

    def __len__(self) -> int:
        return len(self.src)

    @property
    def capacity_tokens(self) -> int:
        return len(self.src) * self.block_tokens

    def _run_list(self):
        """(store, block ids) of each run of consecutive blocks in the same store."""
        if self._runs is None:
            src = np.asarray(self.src)
            ids = torch.tensor(self.ids, dtype=torch.long)
            cuts = (np.flatnonzero(np.diff(src)) + 1).tolist()
            self._runs = [(self.stores[int(src[a])], ids[a:b])
                          for a, b in zip([0, *cuts], [*cuts, len(src)])]
        return self._runs

    def write(self, layer: int, pos: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Stores K and V of tokens pos..pos+len(k)-1, which lie in one block."""
        blk, off = divmod(pos, self.block_tokens)
        if off + k.shape[0] > self.block_tokens:
            raise ValueError("a write must not cross a block boundary")
        store = self.stores[self.src[blk]]
        dst = store[self.ids[blk], layer]
        dst[0, off:off + k.shape[0]] = k.to(store.dtype)
        dst[1, off:off + k.shape[0]] = v.to(store.dtype)

    def gather(self, layer: int, kind: int, n: int) -> torch.Tensor:
        """K (kind 0) or V (1) of positions 0..n-1 as float32 (n, kv_heads, head_dim)."""
        parts = [store[:, layer, kind].index_select(0, ids) for store, ids in self._run_list()]
        kv = parts[0] if len(parts) == 1 else torch.cat(parts)
        return kv.reshape(-1, *kv.shape[2:])[:n].to(torch.float32)

    def release(self) -> None:
        """Drops the references to the stores (pool views must go before the pool closes)."""
        self.stores = (None, None)
        self._runs = None


def as_bytes(t: torch.Tensor) -> np.ndarray:
    """A zero-copy uint8 numpy view of a contiguous CPU tensor (any dtype)."""
    return t.contiguous().view(torch.uint8).numpy() if t.numel() else np.zeros(0, np.uint8)


def private_blocks(count: int, block_shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A private buffer of COUNT blocks in the slot layout."""
    return torch.zeros((count, *block_shape), dtype=dtype)
