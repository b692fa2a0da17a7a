"""An engine's paged KV cache to and from region slots: the data path of an
engine connector, one C call per batch of blocks (native/kvpages.c).

A `PageLayout` says where an engine keeps each KV element of a page: the
element offset of every `(K|V, token, kv_head, dim)` of page 0 in one layer's
tensor (`offsets`, int64 [2, B, heads, dim]) and the stride from one page to
the next.  A region block of `g` tokens is sub-block `j` of a page (`B = r*g`);
it holds, for each layer, that sub-block's elements *in the order the page
holds them* (ascending offset).  So with one region block per page, a CPU
page layout copies as one run per (layer, page), FlashAttention's as two
(K, V), whatever the kernel's packing inside the page.

The order is part of the block's identity: `layout_digest` names it (None
when it is the region's canonical `[K|V][token][head][dim]` order, which the
reference engine's pages and FlashAttention's own `[2, pages, B, heads,
dim]` tensor are; vLLM 0.32's GPU views, K and V side by side in a page's
last axis, are another order), and an engine
connector mixes it into its keys, so a reader of another layout finds no
block written in this one (a miss, computed; never a misread).
"""
from __future__ import annotations

import hashlib
import mmap
import os
from dataclasses import dataclass, field

import numpy as np

from tract_cli.core.errors import TractError, UsageError
from tract_cli.core.native import ffi, lib, raise_for

# where an engine connector copies a pool hit into its pages: in the step that
# computes the rest of the prompt (before its forward), or on a thread of its
# own while the engine runs other requests (connectors/settings.py load_mode;
# here because the connector and `tract bench --engine vllm` both name them)
LOAD_MODES = ("sync", "async")


def flash_offsets(pages: int, page_tokens: int, kv_heads: int, head_dim: int) -> tuple:
    """FlashAttention's own cache argument `[2, pages, B, heads, dim]` as one
    tensor (K's plane, then V's; what vLLM before 0.32 registered): (offsets,
    page stride)."""
    kv, t, h, d = np.meshgrid(np.arange(2), np.arange(page_tokens), np.arange(kv_heads),
                              np.arange(head_dim), indexing="ij")
    page = page_tokens * kv_heads * head_dim
    return (kv * pages * page + (t * kv_heads + h) * head_dim + d).astype(np.int64), page


def strided_offsets(shape: tuple, strides: tuple, page_tokens: int, kv_heads: int,
                    head_dim: int) -> tuple:
    """A layer's KV as vLLM 0.32 registers it on a GPU: a view `[kernel
    blocks, heads, N, 2*dim]` whose strides (in elements) give its physical
    order (vLLM's `KVCacheLayout`: LBNHC by default, any of its orders), K
    then V in the last axis, as FlashAttention splits it (`kv_cache.transpose(1,
    2).split(head_dim, -1)`).  An engine page of PAGE_TOKENS is PAGE_TOKENS // N
    consecutive kernel blocks (vLLM splits a page into kernel blocks a constant
    stride apart).  Returns (offsets [2, page_tokens, heads, dim] of page 0,
    page stride), both in elements from the view's first element."""
    if len(shape) != 4 or len(strides) != 4:
        raise TractError(f"vLLM's KV view has shape {list(shape)}, not [blocks, heads, tokens, "
                         "2 x head dim]", "serve with vLLM 0.32 (its FLASH_ATTN backend)")
    blocks, heads, n, content = shape
    if heads != kv_heads or content != 2 * head_dim or n < 1 or page_tokens % n:
        raise TractError(f"vLLM's KV view has blocks of {list(shape[1:])}, expected "
                         f"[{kv_heads}, a divisor of {page_tokens}, {2 * head_dim}]",
                         "serve the region's model, with the block size it was formatted for")
    per_page = page_tokens // n
    if blocks % per_page:
        raise TractError(f"vLLM's KV view has {blocks} kernel blocks, not whole pages of "
                         f"{per_page}", "report the attention backend: its layout is unknown")
    sb, sh, sn, sc = (int(x) for x in strides)
    if sc != 1:
        raise TractError("vLLM's KV view does not keep a head's K and V contiguous",
                         "serve with vLLM's default KV cache layout (VLLM_KV_CACHE_LAYOUT unset)")
    kv, t, h, d = np.meshgrid(np.arange(2), np.arange(page_tokens), np.arange(kv_heads),
                              np.arange(head_dim), indexing="ij")
    offsets = ((t // n) * sb + h * sh + (t % n) * sn + (kv * head_dim + d) * sc).astype(np.int64)
    if len(np.unique(offsets)) != offsets.size:
        raise TractError("vLLM's KV view puts two elements of a page at one address",
                         "report the attention backend: its layout is unknown")
    return offsets, per_page * sb


def view_extent(tensor) -> int:
    """Elements from a (strided) tensor's first element to just past its last."""
    if tensor.numel() == 0:
        return 0
    return 1 + sum((size - 1) * stride for size, stride in zip(tensor.shape, tensor.stride()))


@dataclass
class PageLayout:
    """An engine's page layout and the region order it implies (see the module
    docstring): runs, each element's token, and the gather index per sub-block."""

    offsets: np.ndarray          # int64 [2, B, heads, dim]: element offset within page 0
    page_stride: int             # elements from one page to the next
    block_tokens: int            # g
    elem_bytes: int
    runs: list = field(init=False)          # per sub-block: (offsets, lengths) in elements
    index: np.ndarray = field(init=False)   # [r, block elements]: page offsets, region order
    elem_token: np.ndarray = field(init=False)   # uint16 [r, block elements]
    digest: bytes | None = field(init=False)     # None: the canonical order

    def __post_init__(self):
        two, page_tokens, heads, dim = self.offsets.shape
        if two != 2 or page_tokens % self.block_tokens:
            raise TractError(f"the engine's block size {page_tokens} is not a multiple of the "
                             f"region's {self.block_tokens} tokens per block",
                             f"serve with a block size that is a multiple of {self.block_tokens},"
                             " or format the region with `tract init --block-tokens` dividing it")
        g, r = self.block_tokens, page_tokens // self.block_tokens
        if g > np.iinfo(np.uint16).max:      # elem_token names tokens in 16 bits
            raise TractError(f"{g} tokens per block is more than a page layout can name",
                             "format the region with at most 65535 tokens per block")
        # per sub-block: its elements in canonical order (K|V, token, head, dim)
        per = self.offsets.reshape(2, r, g, heads, dim).transpose(1, 0, 2, 3, 4).reshape(r, -1)
        tokens = np.broadcast_to(np.arange(g).reshape(1, g, 1, 1), (2, g, heads, dim)).ravel()
        order = np.argsort(per, axis=1, kind="stable")
        self.index = np.ascontiguousarray(np.take_along_axis(per, order, axis=1))
        self.elem_token = np.ascontiguousarray(tokens[order].astype(np.uint16))
        self.runs = []
        for j in range(r):
            e = self.index[j]
            breaks = np.flatnonzero(np.diff(e) != 1) + 1
            starts = np.concatenate([[0], breaks])
            ends = np.concatenate([breaks, [e.size]])
            self.runs.append((e[starts], ends - starts))
        identity = np.arange(per.shape[1])
        if all(np.array_equal(o, identity) for o in order):
            self.digest = None
        else:
            h = hashlib.sha256(b"tract-page-order-v1")
            h.update(np.array([g, r, heads, dim, self.elem_bytes], np.int64).tobytes())
            h.update(np.ascontiguousarray(order, dtype=np.int64).tobytes())
            self.digest = h.digest()

    @property
    def blocks_per_page(self) -> int:
        return self.offsets.shape[1] // self.block_tokens

    @property
    def run_count(self) -> int:
        return sum(len(o) for o, _ in self.runs)

    def gather_index(self, pages: np.ndarray, subs: np.ndarray) -> np.ndarray:
        """[n, block elements] offsets, in one layer's tensor, of region blocks
        (page, sub), in the region's order (a torch gather's index)."""
        return pages.astype(np.int64)[:, None] * self.page_stride + self.index[subs]


def touch_page_sizes(target) -> tuple[int, int]:
    """The page sizes in which a save or load reads one byte a few MiB ahead of
    its copy (native/kvpages.c touch_ahead: the copy finds the translations in
    the TLB): the region's mapping's (a device's alignment, a file's system
    pages) and the engine's tensors' (system pages).  TRACT_NO_PAGE_TOUCH=1:
    neither (the benchmark's A/B)."""
    if os.environ.get("TRACT_NO_PAGE_TOUCH", "") not in ("", "0"):
        return 0, 0
    region = target.alignment if target.kind == "devdax" else mmap.PAGESIZE
    return max(region, mmap.PAGESIZE), mmap.PAGESIZE


# the smaps fields that count a mapping's bytes in huge pages: transparent ones
# (anonymous, shared memory, file) and hugetlbfs's
_HUGE_FIELDS = ("AnonHugePages:", "ShmemPmdMapped:", "FilePmdMapped:", "Shared_Hugetlb:",
                "Private_Hugetlb:")


def huge_page_share(tensors: list, smaps: str = "/proc/self/smaps") -> float | None:
    """The share of TENSORS' bytes (CPU tensors of this process) that the kernel
    maps in huge pages, from the huge-page fields of each mapping holding them
    (a mapping's share taken as even over it); None where SMAPS cannot be
    read.  Why it matters: a copy meets every 4 KiB page of an engine's KV
    cache it touches with a page walk, which on a VM costs as much as the
    copy itself (docs/VLLM.md "The data path")."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    total = sum(e - s for s, e in spans)
    if not total:
        return None
    try:
        with open(smaps) as f:
            text = f.read()
    except OSError:
        return None
    huge = 0.0
    lo = hi = 0
    for line in text.splitlines():
        head = line.split(" ", 1)[0]
        if "-" in head and ":" not in head:
            a, _, b = head.partition("-")
            try:
                lo, hi = int(a, 16), int(b, 16)
            except ValueError:
                lo = hi = 0
        elif line.startswith(_HUGE_FIELDS) and hi > lo:
            overlap = sum(max(0, min(e, hi) - max(s, lo)) for s, e in spans)
            fields = line.split()
            if overlap and len(fields) > 1 and fields[1].isdigit():
                huge += int(fields[1]) * 1024 * overlap / (hi - lo)
    return min(1.0, huge / total)


class PagedKV:
    """Moves blocks between one engine's layer tensors and a pool's slots (one
    C call per batch; the GIL released while it copies).  TENSORS are the
    engine's per-layer KV tensors, in the region's layer order, contiguous, on
    the CPU, alike; they must outlive this object."""

    def __init__(self, pool, layout: PageLayout, tensors: list):
        g = pool.geometry
        if len(tensors) != g.num_layers:
            raise UsageError(f"{len(tensors)} layer tensors for a region of {g.num_layers} layers",
                             "pass every attention layer's KV cache")
        first = tensors[0]
        nbytes = first.numel() * first.element_size()
        if first.element_size() != layout.elem_bytes:
            raise UsageError(f"KV elements of {first.element_size()} bytes, the layout says "
                             f"{layout.elem_bytes}", "describe the engine's own KV dtype")
        for t in tensors:
            if (t.device.type != "cpu" or not t.is_contiguous() or t.dtype != first.dtype
                    or t.numel() != first.numel()):
                raise UsageError("the engine's KV layer tensors are not alike contiguous CPU "
                                 "tensors", "pass each layer's whole KV cache tensor")
        layer_bytes = pool.info.block_bytes // g.num_layers
        if layout.index.shape[1] * layout.elem_bytes != layer_bytes:
            raise UsageError(f"a page's sub-block holds {layout.index.shape[1]} elements, a region "
                             f"block's layer {layer_bytes // layout.elem_bytes}",
                             "format the region for this model")
        self.pool, self.layout, self._tensors = pool, layout, list(tensors)
        eb = layout.elem_bytes
        counts = np.array([len(o) for o, _ in layout.runs], np.uint32)
        # kept alive as long as the struct that points into them
        self._arrays = {
            "bases": np.array([t.data_ptr() for t in tensors], np.uint64),
            "run_first": np.concatenate([[0], np.cumsum(counts)]).astype(np.uint32),
            "run_off": np.concatenate([o for o, _ in layout.runs]).astype(np.uint64) * eb,
            "run_len": np.concatenate([n for _, n in layout.runs]).astype(np.uint64) * eb,
            "run_pos": np.concatenate([np.cumsum(n) - n for _, n in layout.runs]).astype(
                np.uint64) * eb,
            "elem_token": layout.elem_token,
        }
        a = self._arrays
        kv = ffi.new("struct tract_kv_pages *")
        kv.layers, kv.subs = g.num_layers, layout.blocks_per_page
        kv.layer_bytes, kv.page_stride = layer_bytes, layout.page_stride * eb
        kv.tensor_bytes = nbytes
        kv.bases = self._p("uint64_t *", a["bases"])
        kv.run_first = self._p("uint32_t *", a["run_first"])
        kv.run_off = self._p("uint64_t *", a["run_off"])
        kv.run_len = self._p("uint64_t *", a["run_len"])
        kv.run_pos = self._p("uint64_t *", a["run_pos"])
        kv.elem_token = self._p("uint16_t *", a["elem_token"])
        kv.elem_bytes, kv.block_tokens = eb, g.block_tokens
        kv.region_page, kv.engine_page = touch_page_sizes(pool.target)
        self._kv = kv

    @staticmethod
    def _p(kind: str, arr: np.ndarray):
        return ffi.cast(kind, ffi.from_buffer(arr))

    @staticmethod
    def _args(slots, pages, subs) -> tuple:
        """The blocks as C arrays (copied only where not already contiguous of the
        C type; the C core visits them by ascending slot itself).  As few numpy
        and cffi calls as can be: inside a busy engine, whose forward has pushed
        the interpreter out of the caches, each costs tens of µs.  Arrays already of
        the C type are passed as they are: the caller leaves them unchanged
        until the call returns (the C core checks them, then reads them
        again as it copies, with the GIL released)."""
        if np.ndim(slots) != 1:
            raise UsageError("slots, pages and sub-blocks are not lists of blocks",
                             "pass one page and sub-block per slot")
        try:
            s = np.ascontiguousarray(slots, dtype=np.uint32)
            p = np.ascontiguousarray(pages, dtype=np.uint64)
            j = np.ascontiguousarray(subs, dtype=np.uint32)
        except (OverflowError, ValueError, TypeError):
            raise UsageError("a slot, page or sub-block is not a non-negative integer",
                             "pass slots the index gave and pages of the engine's own "
                             "cache") from None
        if not (s.shape == p.shape == j.shape):
            raise UsageError("slots, pages and sub-blocks differ in length",
                             "pass one page and sub-block per slot")
        if not s.size:
            return 0, ffi.NULL, ffi.NULL, ffi.NULL
        return (s.size, ffi.from_buffer("uint32_t[]", s), ffi.from_buffer("uint64_t[]", p),
                ffi.from_buffer("uint32_t[]", j))

    def save(self, slots, pages, subs, tokens=None, checksum: bool = True) -> np.ndarray | None:
        """Copies blocks (page, sub) of every layer into SLOTS (claimed), with
        streaming stores; TOKENS (per block; None: all full) below the block's
        tokens zero the rest.  Returns each block's CRC-32C, computed as it
        copies.  CHECKSUM=False: a memcpy of the same runs only (no checksum,
        no write-back: not a save), the reference a benchmark times it against."""
        args = self._args(slots, pages, subs)
        n = args[0]
        crcs = np.empty(n, np.uint32) if checksum else None
        tok = ffi.NULL
        if tokens is not None:
            t = np.ascontiguousarray(tokens, dtype=np.uint32)
            if t.shape != (n,):
                raise UsageError("one token count per block", f"pass {n} counts")
            tok = ffi.from_buffer("uint32_t[]", t) if n else ffi.NULL
        rc = lib.tract_kv_save(self.pool._r(), self._kv, *args, tok, self._out(crcs))
        self._raise(rc, "save")
        return crcs

    def load(self, slots, pages, subs, checksum: bool = True) -> np.ndarray | None:
        """Copies SLOTS (acquired: `Pool.acquire_payload`) into blocks (page, sub)
        of every layer.  Returns the CRC-32C of each block as read.  CHECKSUM=False:
        a memcpy of the same runs only, the benchmark's reference."""
        args = self._args(slots, pages, subs)
        crcs = np.empty(args[0], np.uint32) if checksum else None
        rc = lib.tract_kv_load(self.pool._r(), self._kv, *args, self._out(crcs))
        self._raise(rc, "load")
        return crcs

    @staticmethod
    def _out(crcs: np.ndarray | None):
        """Where the C core writes the checksums (NULL: a memcpy, the reference)."""
        if crcs is None:
            return ffi.NULL
        return ffi.from_buffer("uint32_t[]", crcs) if crcs.size else ffi.new("uint32_t[1]")

    def evict(self, slots, pages, subs) -> None:
        """Evicts every line of these blocks (their slots and their pages) from this
        host's caches: the cold state a benchmark times a copy and its memcpy
        from.  Not part of the data path (a load's own eviction is
        `Pool.acquire_payload`'s)."""
        rc = lib.tract_kv_evict(self.pool._r(), self._kv, *self._args(slots, pages, subs))
        self._raise(rc, "eviction")

    def _raise(self, rc: int, what: str) -> None:
        if rc == lib.TRACT_E_RANGE:
            raise UsageError(f"a KV {what} names a slot, page or sub-block outside the pool or "
                             "the engine's KV cache", "pass slots the index gave and pages of "
                             "the engine's own cache")
        raise_for(rc, f"{self.pool.path} KV {what}")
