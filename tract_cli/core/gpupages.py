"""An engine's paged KV cache on a GPU to and from region slots by DMA, layer
by layer, on a side stream (the GPU twin of core/kvpages.py's `PagedKV`).

The region's mapping is registered once (`CudaPool`), so a slot is page-locked
host memory the GPU's copy engines reach directly.  A layer of a batch of
blocks moves one of two ways, queued on the side stream:

- **direct** (inside vLLM, `batch_copy` given): one batched copy a layer
  between the engine's pages and the slots themselves, each run of the page
  layout one copy (vLLM 0.32's default layout, LBNHC, `[tokens][heads][K|V
  dim]` a page: one copy a block; FlashAttention's own `[2, pages, B, heads,
  dim]`: two, K and V).  The copy is vLLM's own `swap_blocks_batch`, what its
  KV offloading moves pages with: one `cuMemcpyBatchAsync` (CUDA 12.8 and
  newer; a loop of `cudaMemcpyAsync` before).  Nothing goes through a buffer
  of ours, and this mode allocates no GPU memory: a partial block's elements
  past its tokens are not copied (vLLM's page may hold another request's
  stale KV there, which must not reach the pool); the checksum thread that
  owns its slot writes zeros there, in host memory, once the layer's DMA
  landed and before it checksums and writes the layer back.  Every address
  is made on the CPU from the view's first element, the layout's runs and
  the slot; nothing is uploaded.
- **through a staging buffer** (no batched copy: outside vLLM, or a layout
  whose runs are too short to copy one by one): on the GPU, between the
  engine's pages and a staging buffer of that layer's blocks in region
  order, one `index_select` (save) or `index_copy_` (load) over *rows*, the
  longest stretch of elements every run of the page layout is made of; then
  by DMA, between the staging buffer and the slots, one pitched copy
  (`cudaMemcpy2DAsync`) per run of consecutive slots, the batch taken in
  slot order.  The row table is uploaded once; a step uploads its pages
  only.  The staging buffer is allocated once, `capacity` blocks of one
  layer; a batch larger than that moves in chunks of it.

A save queues each layer as the engine hands it over (after that layer's
attention wrote its pages: the side stream waits for the engine's stream
first), so the DMA overlaps the rest of the forward; `finish` waits for it,
and `checksums` for the checksum threads (which, in the direct mode, also
zero partial blocks' tails): a save's slots are whole once both returned.
A load queues every layer at once and records an event per layer, which the
engine's stream waits for before that layer's attention (`wait_layer`).

The checksums are the CPU's CRC-32C of the slots, the same a CPU reader
checks, computed off the engine's thread by a few checksum threads (each
owns a share of the batch's slots, so a slot's layers go in order): a save's
layer as soon as its DMA landed (an event per layer), each slot's register
carried from layer to layer (`Pool.advance_checksums`), and written back to
the device right after, as a commit of DMA'd slots must (DDIO may leave the
DMA's lines dirty in the last-level cache), so the commit says `streamed`;
a load's whole blocks at once, while the DMA reads the same slots.
"""
from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tract_cli.core.cudart import CudaRuntime
from tract_cli.core.errors import TractError, UsageError
from tract_cli.core.gpu import CudaPool, _runs
from tract_cli.core.kvpages import PageLayout, view_extent
from tract_cli.core.native import ffi


def vllm_batch_copy():
    """vLLM's batched copy between raw addresses (`_custom_ops.swap_blocks_batch`:
    one `cuMemcpyBatchAsync` on CUDA 12.8 and newer, a loop of `cudaMemcpyAsync`
    before, on the current stream), which its own KV offloading moves pages
    with, and None; or None and why not (vLLM's CPU build has no such op).
    vLLM is imported here only, when asked: core needs no engine otherwise."""
    try:
        import torch
        from vllm import _custom_ops as ops
    except Exception as exc:   # no vLLM here, or a broken one: its own words
        return None, f"vLLM's extension cannot be imported ({type(exc).__name__}: {exc})"
    try:
        torch.ops._C_cache_ops.swap_blocks_batch     # raises where the op is not built
    except Exception:
        return None, "this vLLM build has no batched copy (swap_blocks_batch)"
    return ops.swap_blocks_batch, None


# cuMemcpyBatchAsync's CUDA (the runtime's encoding): before it, vLLM's batched
# copy is a loop of cudaMemcpyAsync, one call a copy on the engine's thread
# (12,000 a step for a 6000-token Llama-3-8B prompt), slower than the staging path
BATCHED_CUDA = 12080


def _version_code(text: str | None) -> int:
    """12080 for "12.8" (torch.version.cuda's form); 0 if unknown."""
    try:
        major, minor = (int(x) for x in (text or "").split(".")[:2])
    except ValueError:
        return 0
    return major * 1000 + minor * 10


def gpu_batch_copy(mode: str, driver_version: int | None = None):
    """The batched copy the GPU path takes for MODE (the connector's gpu_copy),
    and what to say of the choice: (op, None), (None, why not), or (op, a
    warning).  auto: vLLM's op where it is built and CUDA (torch's build,
    which vLLM's wheels share, and the driver: DRIVER_VERSION, else asked of
    the runtime) is 12.8 or newer; direct: vLLM's op whatever the CUDA (with
    a warning before 12.8; UsageError where it is missing); staging: none."""
    import torch
    if mode == "staging":
        return None, "gpu_copy is staging"
    op, why = vllm_batch_copy()
    if op is None:
        if mode == "direct":
            raise UsageError(f"gpu_copy direct: {why}",
                             'use "gpu_copy": "auto" or "staging", or vLLM 0.32\'s CUDA build')
        return None, why
    if driver_version is None:
        driver_version = CudaRuntime().driver_version()
    built = _version_code(torch.version.cuda)
    if min(built, driver_version) >= BATCHED_CUDA:
        return op, None
    old = (f"CUDA {torch.version.cuda} with driver {driver_version // 1000}."
           f"{driver_version % 1000 // 10}: before 12.8 vLLM's batched copy is a call a copy")
    if mode == "direct":
        return op, f"{old}, on the engine's thread (gpu_copy direct)"
    return None, f'{old} ("gpu_copy": "direct" takes it anyway)'


def row_elements(layout: PageLayout) -> int:
    """The longest stretch R of elements such that every run of every
    sub-block, and the page stride, are whole rows of R (offsets and lengths
    multiples of R): a block's layer is then `elements / R` rows."""
    parts = [np.asarray([layout.page_stride], np.int64)]
    for offsets, lengths in layout.runs:
        parts += [np.asarray(offsets, np.int64), np.asarray(lengths, np.int64)]
    r = int(np.gcd.reduce(np.concatenate(parts)))
    return max(r, 1)


def row_table(layout: PageLayout, rows: int) -> np.ndarray:
    """int64 [sub-blocks, rows a block's layer]: the row (of ROWS elements), in
    page 0 of one layer's tensor, of each row of a region block, region order."""
    per = layout.index.reshape(layout.index.shape[0], -1, rows)
    table = per[:, :, 0] // rows
    expect = table[:, :, None] * rows + np.arange(rows)
    if not np.array_equal(per, expect):
        raise TractError("the page layout's runs are not whole rows",
                         "report the attention backend: the GPU path cannot move it")
    return np.ascontiguousarray(table, dtype=np.int64)


# False only where tests stand the CPU in for CUDA (tests/fake_cuda.py)
ON_CUDA_ONLY = True

# checksum threads of a CudaPagedKV: a GPU host's cores are mostly idle while
# it serves, and one core's CRC-32C (~10 GB/s) is slower than the DMA (~45 GB/s)
CHECKSUM_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))
# what a checksum thread is handed at a time, at least (a group of layers)
CHECKSUM_TASK_BYTES = 4 << 20
# how the GPU path copies (the connector's `gpu_copy`): direct where it can, or
# always, or through the staging buffer
GPU_COPIES = ("auto", "direct", "staging")
# the shortest run of a page layout the direct mode copies on its own: a
# copy engine spends about as long on a descriptor as on a few hundred bytes,
# so a layout of shorter runs gathers through the staging buffer instead
# (vLLM's layouts' shortest run is a page's tokens of one head, K and V: 4 KiB
# and more in 16 bits)
DIRECT_MIN_RUN_BYTES = 512


class _Batch:
    """A batch of blocks in slot order, its rows on the GPU, and (checksummed)
    each block's CRC register and the checksum threads' work on it."""

    def __init__(self, slots, order, rows_t, tails, checksum: bool, pages=None, subs=None):
        self.slots, self.order, self.rows_t, self.tails = slots, order, rows_t, tails
        # the direct mode's: each block's page and sub-block (slot order), and per
        # direction (save?) its copies' addresses relative to a layer's
        # (`CudaPagedKV._copies`), made once for every layer
        self.pages, self.subs = pages, subs
        self.copies: dict = {}
        self.runs = _runs(slots)
        # per chunk start: its partial blocks' rows and stale elements, on the GPU
        self.tail_masks: dict = {}
        # the direct mode's save: each partial block's index (slot order) and the
        # byte ranges of a layer past its tokens, which its checksum thread zeroes
        self.blanks: list = []
        self.regs = np.full(len(slots), 0xFFFFFFFF, np.uint32) if checksum else None
        self.pending: list = []
        # a save's layers landed and not yet handed to the checksum threads:
        # (first, last, the event after the last) -- handed over in groups
        self.unsummed: tuple | None = None


class CudaPagedKV:
    """Moves blocks between an engine's per-layer CUDA KV tensors (region layer
    order, alike) and a pool's slots.  The layout's offsets are elements from
    each tensor's first element, through its own strides (what
    `kvpages.strided_offsets` gives for a view; for a contiguous tensor its
    flat index): nothing here can check them against the strides, so a
    layout made for another shape of tensor moves other elements.  CAPACITY: blocks a staging
    buffer of one layer holds (what one step saves, typically).  The tensors
    must outlive this object.  CUDA_POOL: the pool's registration to share
    (None: one of its own, which close() unregisters).  BATCH_COPY: a
    batched copy `(src_ptrs, dst_ptrs, sizes)` (CPU int64 tensors of
    addresses and byte counts) queued on the current stream, vLLM's
    `swap_blocks_batch`: given, and the layout's runs MIN_RUN_BYTES long at
    least, the direct mode (the module docstring), and CAPACITY unused."""

    def __init__(self, pool, layout: PageLayout, tensors: list, capacity: int,
                 cuda_pool: CudaPool | None = None, batch_copy=None,
                 min_run_bytes: int = DIRECT_MIN_RUN_BYTES):
        import torch
        g = pool.geometry
        if len(tensors) != g.num_layers:
            raise UsageError(f"{len(tensors)} layer tensors for a region of {g.num_layers} layers",
                             "pass every attention layer's KV cache")
        first = tensors[0]
        if first.device.type != "cuda" and ON_CUDA_ONLY:
            raise UsageError("the engine's KV tensors are not on a CUDA device",
                             "use PagedKV (core/kvpages.py) for CPU tensors")
        for t in tensors:
            # vLLM 0.32's layer views are strided (its KV cache layout): alike,
            # each read through a flat view of its own span (below)
            if (t.device != first.device or t.dtype != first.dtype or t.shape != first.shape
                    or t.stride() != first.stride()):
                raise UsageError("the engine's KV layer tensors are not alike tensors on one GPU",
                                 "pass each layer's whole KV cache tensor")
        if first.element_size() != layout.elem_bytes:
            raise UsageError(f"KV elements of {first.element_size()} bytes, the layout says "
                             f"{layout.elem_bytes}", "describe the engine's own KV dtype")
        self.layer_bytes = pool.info.block_bytes // g.num_layers
        elements = self.layer_bytes // layout.elem_bytes
        if layout.index.shape[1] != elements:
            raise UsageError(f"a page's sub-block holds {layout.index.shape[1]} elements, a region "
                             f"block's layer {elements}", "format the region for this model")
        extent = view_extent(first)
        shortest = min(int(lengths.min()) for _, lengths in layout.runs) * layout.elem_bytes
        self.direct = batch_copy is not None and shortest >= min_run_bytes
        self.rows = None if self.direct else row_elements(layout)
        if not self.direct and extent % self.rows:
            raise UsageError("the engine's KV tensor is not a whole number of the layout's rows",
                             "report the attention backend: the GPU path cannot move it")
        self.pool, self.layout, self.device = pool, layout, first.device
        # the engine's pages: those whose every element lies in the tensor
        self.pages = (extent - int(layout.index.max()) - 1) // layout.page_stride + 1
        self._owns = cuda_pool is None
        self.cuda = cuda_pool if cuda_pool is not None else CudaPool(pool, device=str(first.device))
        try:
            self.runtime = CudaRuntime()
            if self.direct:
                self._batch_copy = batch_copy
                # each layer's first element: every offset of the layout is from it
                self._bases = np.array([t.data_ptr() for t in tensors], np.int64)
                self._segments: dict = {}
                self._blank_runs: dict = {}
                self.capacity = 0
            else:
                self._init_staging(tensors, layout, extent, elements, capacity)
        except BaseException:
            if self._owns:
                self.cuda.close()
            raise
        self.stream = self.cuda.stream
        self._mapping = int(ffi.cast("uintptr_t", pool._base))
        self._stride = pool.info.slot_stride
        self._data = pool.slot_offset(0)
        self._events: dict[int, object] = {}
        # each on the engine's device: an event waited for on a thread with no
        # device set would open a context on GPU 0
        self._crc = [ThreadPoolExecutor(1, thread_name_prefix=f"tract-crc{k}",
                                        initializer=torch.cuda.set_device,
                                        initargs=(self.device,))
                     for k in range(CHECKSUM_THREADS)]

    def _init_staging(self, tensors: list, layout: PageLayout, extent: int, elements: int,
                      capacity: int) -> None:
        import torch
        first = tensors[0]
        # each layer as rows from its first element to its last (in a
        # block-outermost layout the span holds other layers' pages too,
        # which the row table never names)
        self._views = [torch.as_strided(t, (extent // self.rows, self.rows), (self.rows, 1),
                                        t.storage_offset()) for t in tensors]
        self._table = torch.from_numpy(row_table(layout, self.rows)).to(self.device)
        self._page_rows = layout.page_stride // self.rows
        # elements' tokens, to zero a partial block past its tokens (vLLM's page
        # may hold another request's stale KV there, which must not reach the pool)
        self._elem_token = torch.from_numpy(layout.elem_token.astype(np.int32)).to(self.device)
        self.capacity = max(1, int(capacity))
        self._staging = torch.empty((self.capacity, elements), dtype=first.dtype,
                                    device=self.device)

    @property
    def gpu_bytes(self) -> int:
        """What this object allocated on the GPU, for good (a batch's own
        index tensors aside, the staging mode's: a step's pages); the direct
        mode allocates none."""
        if self.direct:
            return 0
        return (self.capacity * self.layer_bytes + self._table.numel() * 8
                + self._elem_token.numel() * 4)

    # ---- batches ----

    def batch(self, slots, pages, subs, tokens=None, checksum: bool = False) -> _Batch:
        """The blocks (page, sub) to move to or from SLOTS, in slot order (so
        consecutive slots are one pitched copy), their rows on the GPU, and the
        partial blocks (TOKENS below the block's) to zero past their tokens;
        CHECKSUM: their CRC-32C computed (and a save's written back) as they
        move (`checksums`)."""
        import torch
        s = np.asarray(slots, dtype=np.uint32)
        p, j = np.asarray(pages, dtype=np.int64), np.asarray(subs, dtype=np.int64)
        if not (s.shape == p.shape == j.shape) or s.ndim != 1:
            raise UsageError("slots, pages and sub-blocks differ in length",
                             "pass one page and sub-block per slot")
        if s.size and int(s.max()) >= self.pool.info.slot_count:
            raise UsageError("a slot id is outside the pool", "use slot ids the index returned")
        if s.size and (p.min() < 0 or p.max() >= self.pages or j.min() < 0
                       or j.max() >= self.layout.blocks_per_page):
            raise UsageError("a page or sub-block is outside the engine's KV cache",
                             "pass pages of the engine's own cache")
        order = np.argsort(s, kind="stable")
        s, p, j = s[order], p[order], j[order]
        tails = None
        if tokens is not None:
            t = np.asarray(tokens, dtype=np.int64)[order]
            part = np.flatnonzero(t < self.pool.geometry.block_tokens)
            if part.size:
                tails = (part, t[part], j[part])
        if self.direct:
            batch = _Batch(s, order, None, tails, checksum, pages=p, subs=j)
            if tails is not None:
                batch.blanks = [(int(i), self._blanks_of(int(sub), int(used)))
                                for i, used, sub in zip(*tails)]
            return batch
        with torch.cuda.stream(self.stream):
            # allocated on the side stream, which uses them: never freed under it;
            # non-blocking: a blocking upload waits for the side stream, so for
            # every copy queued before (the engine's thread stalled on them)
            pages_t = torch.from_numpy(p).to(self.device, non_blocking=True)
            subs_t = torch.from_numpy(j).to(self.device, non_blocking=True)
            rows_t = pages_t[:, None] * self._page_rows + self._table[subs_t]
        return _Batch(s, order, rows_t, tails, checksum)

    def slot_address(self, slot: int, layer: int) -> int:
        return self._mapping + self._data + slot * self._stride + layer * self.layer_bytes

    def _chunks(self, n: int):
        for start in range(0, n, self.capacity):
            yield start, min(n, start + self.capacity)

    # ---- save ----

    def save_layer(self, batch: _Batch, layer: int) -> None:
        """Queues LAYER of the batch's blocks from the engine's pages into their
        slots, after what the engine's stream queued so far (its attention wrote
        them)."""
        import torch
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            if self.direct:
                self._copy_direct(batch, layer, to_slots=True)
            else:
                view, staging = self._views[layer], self._staging
                for start, end in self._chunks(len(batch.slots)):
                    n = end - start
                    rows = batch.rows_t[start:end].reshape(-1)
                    torch.index_select(view, 0, rows, out=staging[:n].view(-1, self.rows))
                    self._zero_tails(batch, start, end)
                    self._copy_runs(batch, start, end, layer, to_slots=True)
            if batch.regs is not None or batch.blanks:
                # blocking: a checksum thread waits for it asleep, not spinning
                # on a core the engine uses
                landed = torch.cuda.Event(blocking=True)
                landed.record(self.stream)
                self._layer_landed(batch, layer, landed)

    def _zero_tails(self, batch: _Batch, start: int, end: int) -> None:
        """Zeroes, in the staging buffer, the elements of the chunk's partial
        blocks past their tokens (on the side stream: its caller's)."""
        if batch.tails is None:
            return
        mask = batch.tail_masks.get(start)
        if mask is None:             # the chunk's first layer: made once, on the GPU
            part, used, subs = batch.tails
            inside = (part >= start) & (part < end)
            if not inside.any():
                mask = batch.tail_masks[start] = ()
            else:
                import torch
                at = torch.from_numpy(part[inside] - start).to(self.device, non_blocking=True)
                used_t = torch.from_numpy(used[inside]).to(self.device, non_blocking=True)
                sub_t = torch.from_numpy(subs[inside]).to(self.device, non_blocking=True)
                mask = batch.tail_masks[start] = (at, self._elem_token[sub_t] >= used_t[:, None])
        if mask:
            at, stale = mask
            # zeros, as the CPU path writes (a product with 0 would keep -0.0's sign)
            self._staging[at] = self._staging[at].masked_fill(stale, 0)

    def finish(self) -> None:
        """Waits for every copy queued (a save's, before its commit, and then
        `checksums`, whether the batch is checksummed or not: a direct save's
        partial tails are zeroed by the checksum threads)."""
        self.stream.synchronize()
        self._events.clear()

    def _layer_landed(self, batch: _Batch, layer: int, landed) -> None:
        """Hands a save's landed layers to the checksum threads in groups of
        consecutive layers of about CHECKSUM_TASK_BYTES a thread (a task per
        layer costs more in Python than its checksum, for short prompts)."""
        group = batch.unsummed
        if group is not None and layer == group[1] + 1:
            group = (group[0], layer, landed)
        else:
            self._sum_landed(batch)
            group = (layer, layer, landed)
        batch.unsummed = group
        share = math.ceil(len(batch.slots) / len(self._crc)) * self.layer_bytes
        if (group[1] - group[0] + 1) * share >= CHECKSUM_TASK_BYTES:
            self._sum_landed(batch)

    def _sum_landed(self, batch: _Batch) -> None:
        group, batch.unsummed = batch.unsummed, None
        if group is not None:
            first, last, landed = group
            self._checksum(batch, landed, first * self.layer_bytes,
                           (last - first + 1) * self.layer_bytes, True)

    def _checksum(self, batch: _Batch, landed, offset: int, length: int,
                  write_back: bool) -> None:
        """Each checksum thread advances its share of the batch's registers over
        [OFFSET, OFFSET+LENGTH) of the slots once LANDED (an event; None: now)."""
        n = len(batch.slots)
        shares = np.linspace(0, n, len(self._crc) + 1).astype(np.int64)
        for worker, lo, hi in zip(self._crc, shares[:-1], shares[1:]):
            if hi > lo:
                batch.pending.append(worker.submit(self._advance, batch, int(lo), int(hi),
                                                   landed, offset, length, write_back))

    def _advance(self, batch: _Batch, lo: int, hi: int, landed, offset: int, length: int,
                 write_back: bool) -> None:
        if landed is not None:
            landed.synchronize()          # the GIL released while it waits
        if write_back and batch.blanks:   # a direct save: zeros past partial blocks' tokens
            self._blank(batch, lo, hi, offset, length)
        if batch.regs is None:            # not checksummed: the commit writes the slots back
            return
        self.pool.advance_checksums(batch.slots[lo:hi], batch.regs[lo:hi], offset, length,
                                    write_back)

    def _blank(self, batch: _Batch, lo: int, hi: int, offset: int, length: int) -> None:
        """Zeroes, in the slots of the batch's partial blocks within [LO, HI),
        the bytes past their tokens of the layers in [OFFSET, OFFSET+LENGTH),
        which the direct mode's DMA skipped; the write-back right after takes
        them to the device with the layers (not checksummed: the commit's own
        write-back does).  A loop over partial blocks (one a request at most)
        and a layer's stretches past the tokens (K's and V's in the region's
        canonical order; up to two a head where the page's order puts heads
        before tokens), each one numpy fill over every layer at once."""
        first, last = offset // self.layer_bytes, (offset + length) // self.layer_bytes
        for i, runs in batch.blanks:
            if lo <= i < hi:
                layers = self.pool.slot_bytes(int(batch.slots[i])).reshape(-1, self.layer_bytes)
                for start, end in runs:
                    layers[first:last, start:end] = 0

    def _blanks_of(self, sub: int, used: int) -> list:
        """The byte ranges [start, end) of a region block's layer of sub-block
        SUB past its first USED tokens (made once per (sub, used))."""
        runs = self._blank_runs.get((sub, used))
        if runs is None:
            past = np.concatenate([[False], self.layout.elem_token[sub] >= used, [False]])
            edges = np.flatnonzero(past[1:] != past[:-1]) * self.layout.elem_bytes
            runs = self._blank_runs[(sub, used)] = [(int(a), int(b)) for a, b
                                                    in zip(edges[::2], edges[1::2])]
        return runs

    def checksums(self, batch: _Batch) -> np.ndarray | None:
        """Waits for the batch's checksum threads (after finish: a save's
        layers all queued); each block's CRC-32C in the caller's order, None
        if not checksummed.  Raises what a checksum thread raised."""
        self._sum_landed(batch)
        pending, batch.pending = batch.pending, []
        errors = []
        for done in pending:
            try:
                done.result()
            except Exception as exc:      # every thread waited for before raising
                errors.append(exc)
        if errors:
            raise errors[0]
        if batch.regs is None:
            return None
        out = np.empty(len(batch.slots), np.uint32)
        out[batch.order] = ~batch.regs
        return out

    def quiesce(self, batch: _Batch) -> None:
        """Nothing of the batch in flight after this (its DMA, its checksum
        threads' reads and write-backs): before its slots are given back."""
        try:
            self.finish()
        except Exception:                 # a CUDA error: nothing more will run on it
            pass
        try:
            self.checksums(batch)
        except Exception:                 # the slots are given back regardless
            pass

    # ---- load ----

    def load(self, batch: _Batch) -> None:
        """Queues every layer of the batch's slots into the engine's pages; the
        engine's stream waits for a layer with wait_layer before using it."""
        import torch
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for layer in range(self.pool.geometry.num_layers):
                if self.direct:
                    self._copy_direct(batch, layer, to_slots=False)
                else:
                    view, staging = self._views[layer], self._staging
                    for start, end in self._chunks(len(batch.slots)):
                        n = end - start
                        self._copy_runs(batch, start, end, layer, to_slots=False)
                        rows = batch.rows_t[start:end].reshape(-1)
                        view.index_copy_(0, rows, staging[:n].view(-1, self.rows))
                event = torch.cuda.Event()
                event.record(self.stream)
                self._events[layer] = event
        if batch.regs is not None:     # the slots are pinned: read beside the DMA
            self._checksum(batch, None, 0, self.pool.info.block_bytes, False)

    def wait_all(self) -> None:
        """The engine's stream waits for every layer of the loads queued."""
        import torch
        if self._events:
            torch.cuda.current_stream(self.device).wait_event(self._events[max(self._events)])

    def wait_layer(self, layer: int) -> None:
        """The engine's stream waits for LAYER of the loads queued (no-op if none)."""
        import torch
        event = self._events.get(layer)
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    # ---- the DMA ----

    def _segments_of(self, sub: int, used: int) -> tuple:
        """A region block's layer of sub-block SUB, its first USED tokens, as
        copies in region order: (page offset, region offset, length, in
        elements): the layout's runs, cut where its tokens past USED begin and
        end, those past USED left out (made once per (sub, used))."""
        seg = self._segments.get((sub, used))
        if seg is None:
            e = self.layout.index[sub]
            past = self.layout.elem_token[sub] >= used
            cut = np.flatnonzero((np.diff(e) != 1) | (past[1:] != past[:-1])) + 1
            starts = np.concatenate([[0], cut])
            lengths = np.diff(np.concatenate([starts, [e.size]]))
            keep = ~past[starts]
            seg = self._segments[(sub, used)] = (e[starts][keep], starts[keep], lengths[keep])
        return seg

    def _copies(self, batch: _Batch, to_slots: bool) -> tuple:
        """The batch's copies, made once for every layer: (each copy's page
        address from a layer's first element, its slot address from the
        mapping's layer 0, its bytes as a CPU tensor); a save leaves out its
        partial blocks' elements past their tokens (`_blank` zeroes them), a
        load writes whole blocks (the slot holds zeros there)."""
        copies = batch.copies.get(to_slots)
        if copies is not None:
            return copies
        g = self.pool.geometry.block_tokens
        eb, stride = self.layout.elem_bytes, self.layout.page_stride
        used = np.full(len(batch.slots), g, np.int64)
        if to_slots and batch.tails is not None:
            part, tokens, _ = batch.tails
            used[part] = tokens
        pages, slots = batch.pages, batch.slots.astype(np.int64)
        parts = []
        # one group per (sub-block, tokens): a page's few sub-blocks, and the
        # batch's partial blocks
        for sub, u in np.unique(np.stack([batch.subs, used]), axis=1).T:
            who = np.flatnonzero((batch.subs == sub) & (used == u))
            page_e, region_e, length = self._segments_of(int(sub), int(u))
            parts.append(((pages[who, None] * stride + page_e) * eb,
                          self._data + slots[who, None] * self._stride + region_e * eb,
                          np.broadcast_to(length * eb, (who.size, page_e.size))))
        import torch
        page, slot, size = (np.concatenate([p[k].reshape(-1) for p in parts]) for k in range(3))
        copies = batch.copies[to_slots] = (page, slot, torch.from_numpy(size))
        return copies

    def _copy_direct(self, batch: _Batch, layer: int, to_slots: bool) -> None:
        """LAYER of the batch's blocks between the engine's pages and the
        slots, in one batched copy on the current stream (the side stream)."""
        import torch
        if not len(batch.slots):
            return
        page, slot, sizes = self._copies(batch, to_slots)
        engine = page + self._bases[layer]
        region = slot + (self._mapping + layer * self.layer_bytes)
        src, dst = (engine, region) if to_slots else (region, engine)
        pending = self.runtime.take_last()
        if pending:        # not this copy's: said as what it is, not as the DMA's
            raise TractError(f"a CUDA error was pending before the batched DMA of layer "
                             f"{layer}: {self.runtime.describe_last(pending)}",
                             "check the GPU (vLLM's log)")
        try:
            self._batch_copy(torch.from_numpy(src), torch.from_numpy(dst), sizes)
        except Exception as exc:       # its batched call's error, raised by vLLM
            raise TractError(f"the batched DMA of layer {layer} failed: {exc}",
                             "check the GPU and that the region is registered (CudaPool)") \
                from None
        # vLLM's fallback (a loop of cudaMemcpyAsync: CUDA before 12.8) checks no
        # copy's result: a failed one is only the thread's last runtime error,
        # which torch's next kernel launch in vLLM's forward would raise; taken
        # (and so cleared) here, and raised in the connector
        rc = self.runtime.take_last()
        if rc:
            raise TractError(f"the batched DMA of layer {layer} failed: "
                             f"{self.runtime.describe_last(rc)}",
                             "check the GPU and that the region is registered (CudaPool)")

    def _copy_runs(self, batch: _Batch, start: int, end: int, layer: int,
                   to_slots: bool) -> None:
        """One pitched copy per run of consecutive slots within [START, END)
        between the slots' LAYER and the staging buffer's rows."""
        stage = self._staging.data_ptr()
        stream = self.stream.cuda_stream
        lb = self.layer_bytes
        for i, first, n in _runs_within(batch, start, end):
            slot_at = self.slot_address(first, layer)
            stage_at = stage + (i - start) * lb
            if to_slots:
                self.runtime.memcpy2d_async(slot_at, self._stride, stage_at, lb, lb, n, stream)
            else:
                self.runtime.memcpy2d_async(stage_at, lb, slot_at, self._stride, lb, n, stream)

    def close(self) -> None:
        """Waits for the copies in flight, then unregisters the mapping (if its own)."""
        if self.cuda is not None:
            self.stream.synchronize()
            for worker in self._crc:
                worker.shutdown(wait=True)
            if self._owns:
                self.cuda.close()
            self.cuda = None


def _runs_within(batch: _Batch, start: int, end: int):
    """The batch's runs of consecutive slots cut to [START, END)."""
    for i, first, n in batch.runs:
        lo, hi = max(i, start), min(i + n, end)
        if lo < hi:
            yield lo, first + (lo - i), hi - lo


def staging_capacity(max_tokens: int, block_tokens: int, layer_bytes: int,
                     limit_bytes: int = 256 << 20) -> int:
    """Blocks of staging for a step of MAX_TOKENS new tokens (their full blocks
    and a partial one), at most LIMIT_BYTES of one layer's blocks."""
    blocks = math.ceil(max_tokens / block_tokens) + 1
    return max(1, min(blocks, limit_bytes // max(layer_bytes, 1)))
