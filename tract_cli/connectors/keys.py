"""The pool keys of a vLLM prompt: what the connector looks up, saves and hands
off under (docs/VLLM.md, "Block size and hashes").

Full blocks are the region's chained block hashes over `g`-token blocks with
the tenant's salt; the served model's identity enters every key (the tract
scheme's root; the vLLM scheme, whose chain must stay vLLM's own, by a tag
mixed into each key).  A prompt's partial last block is stored for handoffs
under a key of its own, chained from the last full block and tagged, so no
full block's key can equal it.
"""
from __future__ import annotations

import hashlib
from typing import NamedTuple

import numpy as np

from tract_cli.core.hashing import (MAX_EXTRA_BYTES, block_hashes, pool_root, request_keys,
                                    tag_keys)
from tract_cli.core.index import as_keys

PARTIAL_TAG = b"tract-partial-v1|"
# the longest cache salt a request may carry into the pool: it enters a partial
# block's extra bytes after PARTIAL_TAG (the hash chain's bound); a longer one
# (vLLM sets no limit) leaves the request to vLLM alone, uncached here
MAX_SALT_BYTES = MAX_EXTRA_BYTES - len(PARTIAL_TAG)


class PromptKeys(NamedTuple):
    keys: np.ndarray                  # (n_full, 16) uint8: the full blocks' keys
    tail_key: np.ndarray | None       # (1, 16) uint8: the partial last block's, if any
    tail_tokens: int                  # tokens in the partial last block (0: none)
    # (n_full, 32 | 16) uint8: the full blocks' hashes as the scheme made them,
    # untagged (the vLLM scheme's are vLLM's own): what KV events publish
    hashes: np.ndarray


def prompt_keys(info, model_tag: bytes, block_tokens: int, tokens,
                salt: str | None = None) -> PromptKeys:
    """The keys of TOKENS' blocks on the region INFO describes, for the model whose
    identity tag is MODEL_TAG (16 bytes) and a tenant's SALT (at most MAX_SALT_BYTES)."""
    arr = np.asarray(tokens, dtype=np.int32)
    vllm = info.hash_scheme == "vllm"
    root = pool_root(info, salt, model_tag)      # (the vLLM scheme's root takes no tag)
    hashes = request_keys(info, arr, block_tokens, salt, root=root)
    keys = as_keys(hashes) if len(hashes) else np.zeros((0, 16), np.uint8)
    untagged = hashes if len(hashes) else np.zeros((0, 32 if vllm else 16), np.uint8)
    tail = arr.size % block_tokens
    tail_key = None
    if tail:
        # chained from the last full block (or the root: tenant and, on the tract
        # scheme, model), the salt in its extra bytes either way
        parent = bytes(keys[-1]) if len(keys) else root[:16]
        extra = PARTIAL_TAG + (salt.encode() if salt else b"")
        tail_key = as_keys(block_hashes(arr[-tail:], "tract", tail, root=parent, extra=extra))
    if vllm:
        keys = tag_keys(keys, model_tag)
        tail_key = None if tail_key is None else tag_keys(tail_key, model_tag)
    return PromptKeys(keys, tail_key, tail, untagged)


def key_tag(model_digest: bytes, layout_digest: bytes | None) -> bytes:
    """The 16 bytes mixed into every key of an instance: its model's identity
    and, unless its engine keeps KV pages in the region's canonical order, the
    order it stores blocks in (core/kvpages.py): an instance of another page
    layout never finds, so never misreads, a block stored in this one."""
    if layout_digest is None:
        return model_digest[:16]
    return hashlib.sha256(b"tract-kv-tag-v1|" + model_digest + layout_digest).digest()[:16]
