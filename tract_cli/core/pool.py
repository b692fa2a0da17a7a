"""`Pool`: a TraCT region mapped into this process, with the access discipline,
payload copies and zero-copy views of block slots.

Views (numpy arrays, torch tensors) share memory with the mapping; they are
never copies.  A Pool refuses to close while views of it are alive, so a view
can never outlive its mapping.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from typing import Callable

import numpy as np

from tract_cli.core import medium
from tract_cli.core.errors import GeometryMismatchError, TractError, UsageError
from tract_cli.core.geometry import DTYPES, Geometry, ModelProfile, load_model
from tract_cli.core.header import RegionInfo, decode_header
from tract_cli.core.native import FLUSH_MODE_NAMES, FLUSH_MODES, ffi, lib, raise_for
from tract_cli.core.allocator import Allocator
from tract_cli.core.cpu import require_flush_mode
from tract_cli.core.handoff import Handoffs
from tract_cli.core.index import PrefixIndex
from tract_cli.core.local import LocalSegment
from tract_cli.core.ownership import check_may_attach, sharing_of
from tract_cli.core.locks import Locks
from tract_cli.core.objects import ObjectStore
from tract_cli.core.region import (DEFAULT_INDEX_STRIPES, DEFAULT_TRANSFER_ENTRIES, FormatOptions,
                                   format_region)

# set bits of each byte value: a bitmap's population count in one numpy gather
_POPCOUNT = np.array([bin(i).count("1") for i in range(256)], np.uint8)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "") not in ("", "0")


# the ledger's mark for a slot no line of which this node caches (payload.c)
LEDGER_EVICTED = lib.TRACT_LEDGER_EVICTED


class Pool:
    """A mapped, verified TraCT region, attached as one node.

    Create with `Pool.create(...)` (formats) or `Pool.attach(path, node=N)`.
    Offsets are bytes from the region base; sizes are bytes.
    """

    def __init__(self, path: str, target: medium.Target, mm: mmap.mmap, base, region,
                 info: RegionInfo, node: int, readonly: bool, local: LocalSegment | None = None):
        self.path = path
        self._local = local
        self._local_kept = None    # a segment kept mapped by _detach
        self.locks = Locks(self)
        self.allocator = Allocator(self)
        self.objects = ObjectStore(self)
        self.index = PrefixIndex(self)
        self.handoffs = Handoffs(self)
        self.target = target
        self.info = info
        self.node = node
        self.readonly = readonly
        self._mm = mm
        self._base = base
        self._region = region
        data = info.section("data")
        self._data_offset = data.offset
        self._stride = info.slot_stride
        # the zero-copy views over the whole data area, made once (slots_array,
        # slots_tensor) and dropped at close so the mapping can go
        self._area_np = None
        self._area_torch = None

    # ---- construction ----

    @classmethod
    def create(cls, path: str, size: int | None, model: str | ModelProfile = "tiny", *,
               nodes: int = 4, flush_mode: str | None = None, force: bool = False,
               hash_scheme: str = "tract", index_stripes: int = DEFAULT_INDEX_STRIPES,
               transfer_entries: int = DEFAULT_TRANSFER_ENTRIES, group: str | None = None,
               progress: Callable[[int, int], None] | None = None, **attach_options) -> "Pool":
        """Formats a region at PATH (a file is created: 0600, or 0660 shared with
        GROUP) and attaches to it as node 0."""
        profile = load_model(model) if isinstance(model, str) else model
        opts = FormatOptions(model=profile, max_nodes=nodes, flush_mode=flush_mode,
                             hash_scheme=hash_scheme, index_stripes=index_stripes,
                             transfer_entries=transfer_entries)
        format_region(path, size, opts, force=force, progress=progress, group=group)
        return cls.attach(path, **attach_options)

    @classmethod
    def attach(cls, path: str, node: int = 0, *, flush_mode: str | None = None,
               simulate: bool | None = None, sim_evict_prob: float = 0.0, sim_seed: int = 0,
               prefault: bool = True, readonly: bool = False,
               expect: ModelProfile | Geometry | None = None, local: bool = True) -> "Pool":
        """Maps and verifies the region at PATH and attaches as NODE.

        flush_mode overrides the header's (env TRACT_FLUSH_MODE does too);
        simulate runs every metadata access through the non-coherence
        simulator (env TRACT_SIMULATE=1); prefault maps every page before
        returning so no request pays a first-touch fault; expect refuses a
        region formatted for another model or geometry; local maps the
        node-local segment (locks, allocator), skipped when readonly.
        """
        flush_mode = flush_mode or os.environ.get("TRACT_FLUSH_MODE") or None
        if flush_mode is not None:
            require_flush_mode(flush_mode)
        if simulate is None:
            simulate = _env_flag("TRACT_SIMULATE")
        if not 0.0 <= sim_evict_prob <= 1.0:
            raise UsageError(f"sim_evict_prob {sim_evict_prob} is not a probability",
                             "give a value from 0 to 1")

        target = medium.inspect_target(path, for_write=not readonly)
        if target.kind == "missing":
            raise UsageError(f"{path} does not exist",
                             f"create a region with `tract init {path} --size 1G`")
        if target.size < lib.TRACT_HEADER_SIZE:
            raise_for(lib.TRACT_E_NOT_FORMATTED, path)
        size = target.size
        check_may_attach(path)
        try:
            fd = os.open(path, os.O_RDONLY if readonly else os.O_RDWR)
        except PermissionError:
            raise TractError(f"{path}: permission denied",
                             "run as its owner, or have it shared with one of your groups "
                             "(tract init --group)") from None
        try:
            prot = mmap.PROT_READ | (0 if readonly else mmap.PROT_WRITE)
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        except OSError as exc:
            raise TractError(f"{path}: cannot map {size} bytes: {exc.strerror}",
                             "check the device alignment and memory limits") from None
        finally:
            os.close(fd)
        base = ffi.from_buffer(mm)
        region = ffi.NULL
        segment = None
        try:
            handle = ffi.new("tract_region **")
            flags = (lib.TRACT_ATTACH_SIMULATE if simulate else 0) | \
                    (lib.TRACT_ATTACH_READONLY if readonly else 0)
            hdr = ffi.new("struct tract_header *")
            raise_for(lib.tract_verify_header(base, size, hdr), path)
            info = decode_header(hdr)
            if target.kind == "file" and info.region_size != size:
                raise_for(lib.TRACT_E_SIZE, path)
            if not 0 <= node < info.max_nodes:
                raise UsageError(f"node {node} is outside this region's nodes 0..{info.max_nodes - 1}",
                                 "pick a node in range or reformat with a larger --nodes")
            if expect is not None:
                _check_expected(path, info, expect)
            mode = -1 if flush_mode is None else FLUSH_MODES[flush_mode]
            raise_for(lib.tract_attach(base, size, mode, flags, node, handle), path)
            region = handle[0]
            if simulate:
                prob = min(int(sim_evict_prob * 2**32), 2**32 - 1)
                raise_for(lib.tract_sim_configure(region, prob, sim_seed), path)
            if prefault:
                raise_for(lib.tract_prefault(base, info.region_size, 0 if readonly else 1), path)
            if local and not readonly:
                segment = LocalSegment.open_or_create(region, info.uuid, node, sharing_of(path),
                                                      region_path=path,
                                                      device=target.kind == "devdax")
        except BaseException:
            if region != ffi.NULL:
                lib.tract_detach(region)
            ffi.release(base)
            mm.close()
            raise
        return cls(path, target, mm, base, region, info, node, readonly, segment)

    # ---- lifetime ----

    def close(self) -> None:
        """Detaches and unmaps; refuses while numpy/torch views of the pool are alive."""
        if self._region is None:
            return
        self._detach()
        self._area_np = self._area_torch = None
        if self._local is not None and self._local_kept is None:
            self._local.close()
        ffi.release(self._base)
        try:
            self._mm.close()
        except BufferError:
            # views still reference the mapping: keep it mapped for them
            self._base = None
            raise TractError(f"{self.path}: views of the pool are still alive",
                             "delete the arrays/tensors taken from it before close()") from None

    def _detach(self) -> None:
        """Releases the C handle. A lock it still holds (closed inside a
        critical section: an exception between acquire and release) is let go
        as a dead holder's: the node's next process to take it, or its agent,
        takes it over and repairs what the section left half done. A lock
        another thread holds cannot be let go from here (pthreads lets only
        the owner unlock its mutex): that mutex stays on its thread's robust
        list, which pthreads walks at the thread's next robust lock, so its
        segment stays mapped until the process exits -- an extra reference
        that is never dropped keeps it past the interpreter's teardown."""
        left = lib.tract_lock_abandon(self._region)
        lib.tract_detach(self._region)
        self._region = None
        if left and self._local is not None:
            self._local_kept = self._local
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(self._local))

    def __enter__(self) -> "Pool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        if getattr(self, "_region", None) is not None:
            self._detach()

    @property
    def closed(self) -> bool:
        return self._region is None

    def _r(self):
        """The C region handle, for core's own wrappers (locks, allocator, index,
        handoffs, agent) to pass to `lib`; raises once the pool is closed.

        Private to core: the layers above call the Pool's public methods, which
        batch a C call per operation (tests/test_layering.py holds them to it)."""
        if self._region is None:
            raise TractError(f"{self.path}: the pool is closed", "attach again")
        return self._region

    # ---- facts ----

    @property
    def geometry(self) -> Geometry:
        return self.info.geometry

    @property
    def slot_count(self) -> int:
        return self.info.slot_count

    @property
    def flush_mode(self) -> str:
        """The flush mode this process runs with (header's unless overridden)."""
        return FLUSH_MODE_NAMES[lib.tract_region_flush_mode(self._r())]

    @property
    def accessors(self) -> str:
        """Name of the accessor table in use: a flush mode, or "sim"."""
        return ffi.string(lib.tract_region_ops_name(self._r())).decode()

    @property
    def medium(self) -> str:
        return self.target.medium

    def sim_stats(self) -> dict:
        """Simulator counters (hits, misses, writebacks, evictions)."""
        out = ffi.new("uint64_t[4]")
        raise_for(lib.tract_sim_stats(self._r(), out), self.path)
        return dict(zip(("hits", "misses", "writebacks", "evictions"), list(out)))

    def slots_in_use(self) -> int:
        """Slots taken from the pool by every node: the allocator header's count
        (one observed line, no lock), which `tract check` holds equal to the
        bitmap.  What a metrics scrape reads: O(1), whatever the pool size."""
        return self.observe_u64(self.info.section("alloc").offset)

    def slot_usage(self) -> dict:
        """Slots taken from the pool (bitmap) and claimed per node (owner map):
        one observe of each section, counted with numpy (no lock)."""
        bitmap = self.info.section("bitmap")
        owners = self.info.section("owners")
        bits = np.empty(bitmap.length, np.uint8)
        self.observe_into(bitmap.offset, bits)
        if bitmap.count % 8:            # bits past the last slot do not count
            bits[bitmap.count // 8] &= (1 << (bitmap.count % 8)) - 1
        used = int(_POPCOUNT[bits[: -(-bitmap.count // 8)]].sum(dtype=np.int64))
        own = np.empty(owners.length, np.uint8)
        self.observe_into(owners.offset, own)
        counts = np.bincount(own[: owners.count], minlength=self.info.max_nodes + 1)
        per_node = {n: int(counts[n + 1]) for n in range(self.info.max_nodes) if counts[n + 1]}
        return {"total": self.slot_count, "used": used, "free": self.slot_count - used,
                "claimed_by_node": per_node}

    # ---- the access discipline (metadata) ----

    def store_u64(self, off: int, value: int) -> None:
        """Plain store; stays in this host's cache until flushed (docs/PROTOCOLS.md §1)."""
        raise_for(lib.tract_store_u64(self._r(), off, value), f"{self.path} @{off:#x}")

    def load_u64(self, off: int) -> int:
        """Plain load; may return a stale cached line."""
        out = ffi.new("uint64_t *")
        raise_for(lib.tract_load_u64(self._r(), off, out), f"{self.path} @{off:#x}")
        return out[0]

    def publish_u64(self, off: int, value: int) -> None:
        """Store, flush the line, fence: other hosts can observe it afterwards."""
        raise_for(lib.tract_publish_u64(self._r(), off, value), f"{self.path} @{off:#x}")

    def observe_u64(self, off: int) -> int:
        """Invalidate the line, fence, load: sees what other hosts published."""
        out = ffi.new("uint64_t *")
        raise_for(lib.tract_observe_u64(self._r(), off, out), f"{self.path} @{off:#x}")
        return out[0]

    def publish(self, off: int, data: bytes) -> None:
        """Publishes a byte range: stores, flushes every touched line, one fence."""
        raise_for(lib.tract_publish(self._r(), off, ffi.from_buffer(data), len(data)),
                  f"{self.path} @{off:#x}")

    def observe(self, off: int, length: int) -> bytes:
        """Observes a byte range: invalidates every touched line, one fence, loads."""
        buf = bytearray(length)
        raise_for(lib.tract_observe(self._r(), off, ffi.from_buffer(buf), length),
                  f"{self.path} @{off:#x}")
        return bytes(buf)

    def observe_into(self, off: int, out) -> None:
        """Observes len(out) bytes into a caller's writable buffer (no allocation)."""
        buf = ffi.from_buffer(out, require_writable=True)
        raise_for(lib.tract_observe(self._r(), off, buf, len(buf)), f"{self.path} @{off:#x}")

    def flush(self, off: int, length: int) -> None:
        raise_for(lib.tract_flush_range(self._r(), off, length), f"{self.path} @{off:#x}")

    def invalidate(self, off: int, length: int) -> None:
        raise_for(lib.tract_invalidate_range(self._r(), off, length), f"{self.path} @{off:#x}")

    def fence(self) -> None:
        lib.tract_fence(self._r())

    # ---- block slots: payload copies and zero-copy views ----

    def slot_offset(self, slot: int) -> int:
        """Region offset of SLOT's payload."""
        if not 0 <= slot < self.info.slot_count:
            raise UsageError(f"slot {slot} is outside 0..{self.info.slot_count - 1}",
                             "use a slot id the allocator returned")
        return self._data_offset + slot * self._stride

    def copy_in(self, slot: int, src) -> None:
        """Copies a block from private memory into SLOT (non-temporal stores).

        SRC is any C-contiguous buffer (numpy array, bytes, CPU torch tensor
        via .numpy()) of at most one block.
        """
        buf = ffi.from_buffer(src)
        if len(buf) > self.info.block_bytes:
            raise UsageError(f"{len(buf)} bytes do not fit a {self.info.block_bytes}-byte slot",
                             "copy one block at a time")
        raise_for(lib.tract_copy_in(self._r(), self.slot_offset(slot), buf, len(buf)), self.path)

    def copy_out(self, slot: int, dst, invalidate: bool = True) -> None:
        """Copies SLOT into a private writable buffer (invalidating stale lines
        first; the node's payload ledger then forgets the slot).  invalidate=False
        only after `acquire_payload` of the slot."""
        buf = ffi.from_buffer(dst, require_writable=True)
        if len(buf) > self.info.block_bytes:
            raise UsageError(f"a {len(buf)}-byte buffer is larger than a slot",
                             "pass a buffer of one block")
        raise_for(lib.tract_copy_out(self._r(), buf, self.slot_offset(slot), len(buf),
                                     1 if invalidate else 0), self.path)

    def slot_bytes(self, slot: int) -> np.ndarray:
        """Zero-copy uint8 view of SLOT's payload (block_bytes long)."""
        self._r()
        return np.frombuffer(self._mm, dtype=np.uint8, count=self.info.block_bytes,
                             offset=self.slot_offset(slot))

    def slot_array(self, slot: int) -> np.ndarray:
        """Zero-copy view of SLOT shaped (layer, K|V, token, kv_head, head_dim).

        bf16 has no numpy dtype: its view is uint16 holding the raw bits.
        """
        g = self.geometry
        dtype = DTYPES[g.dtype].numpy
        return self.slot_bytes(slot).view(dtype).reshape(g.block_shape)

    def acquire_payload(self, slots, tags=None) -> int:
        """Makes SLOTS safe to load from (one C call): evicts this host's cached
        lines of every slot the node's payload ledger does not vouch for, given
        the payload TAGS a lookup returned (None: every slot).  Zero-copy readers
        and DMA call it before loading blocks another host may have rewritten;
        returns how many slots were evicted."""
        arr = np.ascontiguousarray(slots, dtype=np.uint32)
        tag_arr = None if tags is None else np.ascontiguousarray(tags, dtype=np.uint64)
        if tag_arr is not None and tag_arr.shape != arr.shape:
            raise UsageError(f"{arr.size} slots but {tag_arr.size} payload tags",
                             "pass the tags of the same lookup")
        out = ffi.new("uint32_t *")
        rc = lib.tract_payload_acquire(
            self._r(), ffi.cast("uint32_t *", ffi.from_buffer(arr)) if arr.size else ffi.NULL,
            ffi.NULL if tag_arr is None or not arr.size else
            ffi.cast("uint64_t *", ffi.from_buffer(tag_arr)), arr.size, out)
        if rc == lib.TRACT_E_RANGE:
            raise UsageError("a slot id is outside the pool", "use slot ids the index returned")
        raise_for(rc, self.path)
        return int(out[0])

    def sweep_payload(self, cursor: int, max_slots: int, max_bytes: int) -> tuple[int, int]:
        """Evicts, off the request path, slots whose payload this node may cache
        and that has died since (or that are free), so that the first read of
        their next payload here evicts nothing (one C call; the node agent's
        heartbeat).  Visits up to MAX_SLOTS slots from CURSOR and evicts at
        most MAX_BYTES; returns (the next cursor, slots evicted)."""
        cur, out = ffi.new("uint32_t *", cursor), ffi.new("uint32_t *")
        raise_for(lib.tract_payload_sweep(self._r(), cur, max_slots, max_bytes, out), self.path)
        return int(cur[0]), int(out[0])

    def forget_payload(self, slots) -> None:
        """This node's ledger stops vouching for SLOTS (one C call): for a
        reader that may have loaded them after its pin or handoff was gone,
        so their next payloads are evicted before they are read here."""
        arr = np.ascontiguousarray(slots, dtype=np.uint32)
        raise_for(lib.tract_payload_forget(
            self._r(), ffi.cast("uint32_t *", ffi.from_buffer(arr)) if arr.size else ffi.NULL,
            arr.size), self.path)

    def payload_ledger(self, slot: int) -> int:
        """The payload tag this node's ledger holds for SLOT: 0 (unknown),
        LEDGER_EVICTED (no line of it cached here), 0xFFFFFFFF (a sweep at
        work: vouches for nothing), or a lookup's tag."""
        if not 0 <= slot < self.slot_count:
            raise UsageError(f"slot {slot} is outside the pool (0..{self.slot_count - 1})",
                             "use slot ids the index returned")
        return int(lib.tract_payload_ledger(self._r(), slot))

    def invalidate_slots(self, slots) -> None:
        """Evicts this host's cached lines of SLOTS (one C call): zero-copy readers
        with no payload tags call it before loading blocks another host may have
        rewritten (`acquire_payload` with no tags)."""
        self.acquire_payload(slots)

    def checksum_slots(self, slots) -> np.ndarray:
        """CRC-32C of each slot's whole payload, in place (one C call): what a
        zero-copy writer records at commit and a zero-copy reader compares."""
        arr = np.ascontiguousarray(slots, dtype=np.uint32)
        out = np.zeros(max(arr.size, 1), np.uint32)
        u32 = lambda a: ffi.cast("uint32_t *", ffi.from_buffer(a))
        rc = lib.tract_checksum_slots(self._r(), u32(arr) if arr.size else ffi.NULL, arr.size,
                                      u32(out))
        if rc == lib.TRACT_E_RANGE:
            raise UsageError("a slot id is outside the pool", "use slot ids the index returned")
        raise_for(rc, self.path)
        return out[:arr.size]

    def _block_strides(self, elem: int) -> list[int]:
        """Strides, in elements, of one block (layer, K|V, token, kv_head, head_dim)
        inside a slot, and of the slot dimension first (internal)."""
        if self._stride % elem:
            raise TractError("the slot stride is not a multiple of the KV element size",
                             "reformat the region")
        inner, acc = [], 1
        for dim in reversed(self.geometry.block_shape):
            inner.insert(0, acc)
            acc *= dim
        return [self._stride // elem] + inner

    def slots_array(self) -> np.ndarray:
        """Zero-copy numpy view over every slot, made once per Pool: shape
        (slot_count, layer, K|V, token, kv_head, head_dim).  `a[slot]` is one
        block's view (no copy); `a[ids]` with an array copies (numpy fancy
        indexing), so batches are handed out as a `BlockTable` instead."""
        self._r()
        if self._area_np is None:
            g = self.geometry
            dtype = np.dtype(DTYPES[g.dtype].numpy)
            strides = self._block_strides(dtype.itemsize)
            self._area_np = np.ndarray((self.info.slot_count,) + tuple(g.block_shape), dtype,
                                       buffer=self._mm, offset=self._data_offset,
                                       strides=tuple(st * dtype.itemsize for st in strides))
        return self._area_np

    def block_table(self, slots, torch: bool = False) -> "BlockTable":
        """Zero-copy access to the blocks in SLOTS: the cached whole-area view
        (numpy, or torch with torch=True) and the slot ids, in O(1) -- no
        per-block view is made until a consumer indexes one."""
        area = self.slots_tensor() if torch else self.slots_array()
        return BlockTable(area, np.asarray(slots, dtype=np.uint32))

    def advance_checksums(self, slots, regs: np.ndarray, offset: int, length: int,
                          write_back: bool = False) -> None:
        """Advances each slot's CRC-32C register (REGS, uint32, in place; start
        from 0xFFFFFFFF, invert after the last part) over bytes [OFFSET,
        OFFSET+LENGTH) of its payload (one C call, the GIL released): a GPU
        path checksums each layer as its DMA lands.  WRITE_BACK: then writes
        those bytes back to the device, fenced, as a commit of DMA'd slots
        would (the commit may then say streamed)."""
        arr = np.ascontiguousarray(slots, dtype=np.uint32)
        if regs.dtype != np.uint32 or regs.shape != arr.shape or not regs.flags.c_contiguous:
            raise UsageError("one contiguous uint32 register per slot", f"pass {arr.size} registers")
        u32 = lambda a: ffi.cast("uint32_t *", ffi.from_buffer(a))
        rc = lib.tract_checksum_slots_part(self._r(), u32(arr) if arr.size else ffi.NULL, arr.size,
                                           offset, length, u32(regs) if arr.size else ffi.NULL,
                                           int(write_back))
        if rc == lib.TRACT_E_RANGE:
            raise UsageError("a slot id or byte range is outside the pool's slots",
                             "use slot ids the index returned and ranges within a block")
        raise_for(rc, self.path)

    def slots_tensor(self):
        """Zero-copy torch tensor over every slot, made once per Pool: shape
        (slot_count, layer, K|V, token, kv_head, head_dim); `t[ids]` gathers
        blocks as paged attention does."""
        self._r()
        if self._area_torch is None:
            self._area_torch = self._make_slots_tensor()
        return self._area_torch

    def _make_slots_tensor(self):
        torch = _torch()
        g = self.geometry
        elem = g.dtype_bytes
        strides = self._block_strides(elem)
        n = self.info.slot_count
        flat = torch.frombuffer(self._mm, dtype=getattr(torch, DTYPES[g.dtype].torch),
                                count=((n - 1) * self._stride + self.info.block_bytes) // elem,
                                offset=self._data_offset)
        return flat.as_strided([n] + list(g.block_shape), strides)

    def slot_tensor(self, slot: int):
        """Zero-copy torch tensor of SLOT shaped (layer, K|V, token, kv_head, head_dim)."""
        torch = _torch()
        g = self.geometry
        self._r()
        t = torch.frombuffer(self._mm, dtype=getattr(torch, DTYPES[g.dtype].torch),
                             count=self.info.block_bytes // g.dtype_bytes,
                             offset=self.slot_offset(slot))
        return t.view(g.block_shape)


class BlockTable:
    """A batch of blocks in the pool, zero copy: the pool's whole-area view
    (`area`, numpy or torch, shaped (slot_count, layer, K|V, token, kv_head,
    head_dim)) and the batch's slot ids (`slots`, uint32).

    Made in O(1) whatever the batch size.  `table[i]` is block i's view (no
    copy); a consumer that attends over the batch indexes `area` with
    `slots` itself (what paged attention does with a block table).  The views
    stay valid while the blocks are pinned (until unpin / ack).
    """

    __slots__ = ("area", "slots")

    def __init__(self, area, slots: np.ndarray):
        self.area = area
        self.slots = slots

    def __len__(self) -> int:
        return len(self.slots)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return BlockTable(self.area, self.slots[i])
        return self.area[int(self.slots[i])]        # basic indexing: a view

    def __iter__(self):
        # per-block views on demand, for consumers that do want one each
        area = self.area
        return (area[s] for s in self.slots.tolist())

    def __repr__(self) -> str:
        return f"BlockTable({len(self.slots)} blocks)"


def _torch():
    try:
        import torch
    except ImportError:
        raise TractError("torch is not installed", "pip install torch (or use slot_array)") from None
    return torch


def _check_expected(path: str, info: RegionInfo, expect: ModelProfile | Geometry) -> None:
    """Refuses a region whose geometry (and model, if given) differs from EXPECT."""
    geometry = expect.geometry if isinstance(expect, ModelProfile) else expect
    if info.geometry != geometry:
        raise GeometryMismatchError(
            f"{path} holds KV blocks of {info.model_name} ({info.geometry.describe()}), "
            f"not {geometry.describe()}",
            "attach with the model it was formatted for, or reformat with `tract init --force`")
    if isinstance(expect, ModelProfile) and info.model_fingerprint != expect.fingerprint().hex():
        raise GeometryMismatchError(
            f"{path} was formatted for model {info.model_name}, not {expect.name}",
            "attach with the model it was formatted for, or reformat with `tract init --force`")
