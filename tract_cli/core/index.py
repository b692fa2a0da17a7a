"""The prefix index as a Python object: batched, one C call per request.

Keys are 16-byte block hashes ((n, 16) uint8 from `hashing.block_hashes`;
for the vLLM scheme's 32-byte hashes, the first 16 bytes).  A lookup pins
the blocks it returns; the caller reads them (a copy into its buffer, or
zero-copy views) and unpins.  "Pool full, nothing evictable" is a
`PoolFull` result the caller can act on.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tract_cli.core.errors import ChecksumMismatch, CorruptRegion, PoolFull, RequestTooLarge, UsageError
from tract_cli.core.locks import DEFAULT_TIMEOUT_S
from tract_cli.core.media import BLOCK_RECORD_DTYPE
from tract_cli.core.native import ffi, id_array, lib, raise_for

if TYPE_CHECKING:
    from tract_cli.core.events import Described
    from tract_cli.core.pool import BlockTable

# the per-key status that put and reserve return (enum tract_put_status,
# native/tract.h); PUT_STATUS names them, by value (PUT_STATUS[status])
PUT_STORED, PUT_WAS_READY, PUT_WAS_PENDING, PUT_NO_ROOM, PUT_CLAIMED, PUT_BURIED = (
    lib.TRACT_PUT_STORED, lib.TRACT_PUT_WAS_READY, lib.TRACT_PUT_WAS_PENDING,
    lib.TRACT_PUT_NO_ROOM, lib.TRACT_PUT_CLAIMED, lib.TRACT_PUT_BURIED)
_PUT_NAMES = {"TRACT_PUT_STORED": "stored", "TRACT_PUT_WAS_READY": "already_ready",
              "TRACT_PUT_WAS_PENDING": "already_pending", "TRACT_PUT_NO_ROOM": "no_room",
              "TRACT_PUT_CLAIMED": "claimed", "TRACT_PUT_BURIED": "buried"}
_PUT_ENUM = ffi.typeof("enum tract_put_status").elements          # value -> C name
if sorted(_PUT_ENUM) != list(range(len(_PUT_ENUM))) or set(_PUT_ENUM.values()) != set(_PUT_NAMES):
    raise ImportError(f"enum tract_put_status (native/tract.h) is {_PUT_ENUM}: "
                      "tract_cli/core/index.py names 0.. of these: " + ", ".join(_PUT_NAMES))
PUT_STATUS = tuple(_PUT_NAMES[_PUT_ENUM[v]] for v in range(len(_PUT_ENUM)))

# a bucket's state in the buckets section (native/format.h, FORMAT.md): what
# `tract check` and `tract inspect` read there
BUCKET_EMPTY = lib.TRACT_BUCKET_EMPTY
BUCKET_PENDING = lib.TRACT_BUCKET_PENDING
BUCKET_READY = lib.TRACT_BUCKET_READY
BUCKET_TOMBSTONE = lib.TRACT_BUCKET_TOMBSTONE
BUCKET_STATES = {BUCKET_EMPTY: "EMPTY", BUCKET_PENDING: "PENDING", BUCKET_READY: "READY",
                 BUCKET_TOMBSTONE: "TOMBSTONE"}
# a bucket's flags: its `checksum` field holds the payload's CRC-32C
BUCKET_F_CHECKSUM = lib.TRACT_BUCKET_F_CHECKSUM

# `Audit.reach` per bucket (native/tract.h): what the key rule says of it
AUDIT_OK = lib.TRACT_AUDIT_OK                      # live, reachable from its key's home
AUDIT_NOT_LIVE = lib.TRACT_AUDIT_NOT_LIVE          # EMPTY or TOMBSTONE: nothing to reach
AUDIT_OTHER_STRIPE = lib.TRACT_AUDIT_OTHER_STRIPE  # live, but its key is another stripe's
AUDIT_CHAIN_BROKEN = lib.TRACT_AUDIT_CHAIN_BROKEN  # live, an EMPTY bucket between home and it


@dataclass
class Lookup:
    """The pinned leading run of a lookup: keys[:hits] are READY and pinned."""

    keys: np.ndarray
    hits: int
    slots: np.ndarray
    tokens: np.ndarray
    checksums: np.ndarray
    # per hit, the payload's tag (bucket and epoch): the node's payload ledger
    # skips evicting a slot whose cached lines are of this very payload
    tags: np.ndarray | None = None


@dataclass
class PutResult:
    status: np.ndarray           # per key: index into PUT_STATUS

    def count(self, name: str) -> int:
        return int((self.status == PUT_STATUS.index(name)).sum())

    def pinned(self, hashes) -> np.ndarray:
        """The keys of HASHES a pinning put pinned: those it stored and those
        already READY (unpin them once the handoff holds its own pins)."""
        ok = (self.status == PUT_STORED) | (self.status == PUT_WAS_READY)
        return as_keys(hashes)[ok]


@dataclass
class Audit:
    """Per bucket (`Index.audit`): `reach` an AUDIT_* code, `home` its
    key's home bucket (live buckets of the right stripe), `broken` the EMPTY
    bucket that breaks its probe chain."""

    reach: np.ndarray
    home: np.ndarray
    broken: np.ndarray


def as_keys(hashes) -> np.ndarray:
    """(n, 16) contiguous uint8 keys from block hashes ((n, 16) or (n, 32))."""
    arr = np.ascontiguousarray(hashes, dtype=np.uint8)
    if arr.ndim != 2 or arr.shape[1] not in (16, 32):
        raise UsageError(f"keys must be an (n, 16) or (n, 32) uint8 array, got {arr.shape}",
                         "pass block_hashes(...) output")
    return np.ascontiguousarray(arr[:, :16])


def _described(described, n: int, block_tokens: int):
    """The (desc, token_ids) C arguments of a put's Described (NULLs for None)."""
    if described is None:
        return ffi.NULL, ffi.NULL
    rec, ids = described.records, described.token_ids
    # the C core reads n records and n rows of the region's block tokens: exactly
    # those, or a one-line error (never a read past them)
    if (rec.dtype != BLOCK_RECORD_DTYPE or rec.shape != (n,) or ids.dtype != np.uint32
            or ids.shape != (n, block_tokens) or not rec.flags.c_contiguous
            or not ids.flags.c_contiguous):
        raise UsageError(f"block descriptions must be {n} records and ({n}, {block_tokens}) "
                         f"uint32 token ids, got {rec.dtype}{rec.shape} and {ids.dtype}"
                         f"{ids.shape}", "describe the put's blocks with core.events.describe")
    return (ffi.cast("struct tract_block_record *", ffi.from_buffer(described.records)),
            ffi.cast("uint32_t *", ffi.from_buffer(described.token_ids)))


class PrefixIndex:
    """lookup / put / read / views / unpin over a pool's index."""

    def __init__(self, pool):
        self._pool = pool

    def _u32(self, a: np.ndarray):
        return ffi.cast("uint32_t *", ffi.from_buffer(a))

    def peek(self, hashes) -> int:
        """How many leading blocks look READY, read without a lock: a hint (what
        `lookup` looks at first).  0 is what a lookup would answer a prompt the
        pool does not hold, with no lock taken and nothing pinned."""
        keys = as_keys(hashes)
        ready = ffi.new("uint32_t *")
        rc = lib.tract_index_peek(self._pool._r(), ffi.from_buffer(keys), len(keys), ready)
        raise_for(rc, f"{self._pool.path} index peek")
        return int(ready[0])

    def lookup(self, hashes, timeout: float = DEFAULT_TIMEOUT_S) -> Lookup:
        """Pins and returns the longest run of leading READY blocks."""
        keys = as_keys(hashes)
        n = len(keys)
        slots, tokens, sums = (np.zeros(n, np.uint32) for _ in range(3))
        tags = np.zeros(n, np.uint64)
        hits = ffi.new("uint32_t *")
        rc = lib.tract_index_lookup(self._pool._r(), ffi.from_buffer(keys), n, self._u32(slots),
                                    self._u32(tokens), self._u32(sums),
                                    ffi.cast("uint64_t *", ffi.from_buffer(tags)), hits,
                                    int(timeout * 1e9))
        raise_for(rc, f"{self._pool.path} index lookup")
        h = hits[0]
        return Lookup(keys, h, slots[:h], tokens[:h], sums[:h], tags[:h])

    def unpin(self, lookup_or_hashes, timeout: float = DEFAULT_TIMEOUT_S,
              done: np.ndarray | None = None) -> None:
        """Unpins the blocks of a Lookup (or keys this node pinned).

        DONE (uint8, one per key, zeros at first) makes it resumable: only keys
        whose entry is 0 are unpinned, and each one given back is marked 1, so
        after a LockTimeout partway the same call again unpins exactly the rest
        (never a key twice: pins are counted per node, and a second unpin would
        take another request's pin)."""
        keys = (lookup_or_hashes.keys[:lookup_or_hashes.hits]
                if isinstance(lookup_or_hashes, Lookup) else as_keys(lookup_or_hashes))
        if done is None:
            rc = lib.tract_index_unpin(self._pool._r(), ffi.from_buffer(keys), len(keys),
                                       int(timeout * 1e9))
        else:
            if done.shape != (len(keys),) or done.dtype != np.uint8:
                raise UsageError("done must be a uint8 array with one entry per key",
                                 "pass np.zeros(len(keys), np.uint8)")
            todo = np.flatnonzero(done == 0)
            rest = np.ascontiguousarray(keys[todo])
            marks = np.zeros(len(todo), np.uint8)
            rc = lib.tract_index_unpin_marked(self._pool._r(), ffi.from_buffer(rest), len(todo),
                                              ffi.from_buffer(marks), int(timeout * 1e9))
            done[todo] = marks
        if rc == lib.TRACT_E_CORRUPT:
            raise CorruptRegion("a key was not pinned by this node", "unpin only what lookup pinned")
        raise_for(rc, f"{self._pool.path} index unpin")

    def put(self, hashes, kv, tokens=None, checksum: bool = False, pin: bool = False,
            described: "Described | None" = None,
            timeout: float = DEFAULT_TIMEOUT_S) -> PutResult:
        """Stores block i of KV (shape (n, ...) with block_bytes per row) under key i.

        Keys already READY or being written (PENDING) are skipped and reported.
        With PIN, the stored blocks are published pinned by this node, and keys
        already READY are pinned too (unpin them with `unpin(result.pinned(keys))`):
        nothing can evict them before the caller's handoff pins them.  Raises PoolFull when the pool has no
        room and nothing is evictable.  DESCRIBED (`core.events.describe`) is what
        the region's KV events say of the blocks (their records); without it, a
        block's record names its key only.
        """
        keys = as_keys(hashes)
        n = len(keys)
        data = np.ascontiguousarray(kv).reshape(n, -1) if n else np.zeros((0, 1), np.uint8)
        row = data.shape[1] * data.itemsize
        if n and row > self._pool.info.block_bytes:
            raise UsageError(f"a block of {row} bytes exceeds the slot size "
                             f"{self._pool.info.block_bytes}", "pass one block per key")
        tok = None if tokens is None else np.ascontiguousarray(tokens, dtype=np.uint32)
        status = np.zeros(n, np.uint8)
        rc = lib.tract_index_put(self._pool._r(), ffi.from_buffer(keys), n,
                                 ffi.from_buffer(data) if n else ffi.NULL, row, row,
                                 self._u32(tok) if tok is not None else ffi.NULL,
                                 (lib.TRACT_PUT_CHECKSUM if checksum else 0) |
                                 (lib.TRACT_PUT_PIN if pin else 0),
                                 *_described(described, n, self._pool.geometry.block_tokens),
                                 ffi.from_buffer(status),
                                 int(timeout * 1e9))
        self._raise_full(rc, n, "unpin blocks (finish or time out handoffs) or use a larger region")
        raise_for(rc, f"{self._pool.path} index put")
        return PutResult(status)

    def _raise_full(self, rc: int, blocks: int, fix: str) -> None:
        """PoolFull for a put of BLOCKS that found no room (RequestTooLarge
        when the blocks it had to store outnumber the whole pool's slots)."""
        if rc == lib.TRACT_E_TOO_LARGE:
            raise RequestTooLarge(f"a request of {blocks} blocks cannot fit a pool of "
                                  f"{self._pool.slot_count} slots",
                                  "use a larger region, or shorter requests")
        if rc == lib.TRACT_E_FULL:
            raise PoolFull("the pool is full and every block in it is pinned", fix)

    def reserve(self, hashes, pin: bool = False, timeout: float = DEFAULT_TIMEOUT_S):
        """Zero-copy put, step 1: claims absent keys and allocates their slots.

        Returns (status, slots); write block i into `pool.slot_array(slots[i])`
        for every i with status[i] == PUT_CLAIMED, then call commit().  With
        PIN, keys already READY are pinned now (commit with pin=True pins the
        claimed ones); unpin `PutResult.pinned(keys)` after the handoff.
        """
        keys = as_keys(hashes)
        n = len(keys)
        status = np.zeros(n, np.uint8)
        slots = np.zeros(max(n, 1), np.uint32)
        rc = lib.tract_index_put_begin(self._pool._r(), ffi.from_buffer(keys), n,
                                       ffi.from_buffer(status), self._u32(slots),
                                       lib.TRACT_PUT_PIN if pin else 0, int(timeout * 1e9))
        self._raise_full(rc, n, "unpin blocks or use a larger region")
        raise_for(rc, f"{self._pool.path} index reserve")
        return status, slots[:n]

    def commit(self, hashes, status: np.ndarray, slots: np.ndarray, publish: bool = True,
               pin: bool = False, tokens=None, checksums=None, streamed: bool = False,
               described: "Described | None" = None,
               timeout: float = DEFAULT_TIMEOUT_S) -> PutResult:
        """Zero-copy put, step 2: publishes (or abandons) what reserve() claimed;
        with PIN, published pinned by this node (as put(pin=True)).  TOKENS (per
        key; default a full block) and CHECKSUMS (per key, `Pool.checksum_slots`
        of the written slots; default none) are recorded with each entry.  The
        payloads are written back to the device line by line first (plain stores,
        a GPU's DMA through the cache), unless STREAMED says they all went in
        through `Pool.copy_in` (streaming stores: on the device already).
        DESCRIBED: as put's."""
        keys = as_keys(hashes)
        n = len(keys)
        extra = []
        for name, arr in (("tokens", tokens), ("checksums", checksums)):
            if arr is not None:
                arr = np.ascontiguousarray(arr, dtype=np.uint32)
                if arr.shape != (n,):
                    raise UsageError(f"{name} must have one entry per key", f"pass {n} values")
            extra.append(arr)
        tok, sums = (self._u32(a) if a is not None else ffi.NULL for a in extra)
        rc = lib.tract_index_put_commit(self._pool._r(), ffi.from_buffer(keys), n,
                                        ffi.from_buffer(status), self._u32(np.ascontiguousarray(
                                            slots, dtype=np.uint32)), tok, sums,
                                        *_described(described, n,
                                                    self._pool.geometry.block_tokens),
                                        ((2 if pin else 1) | (lib.TRACT_COMMIT_STREAMED if streamed
                                                              else 0)) if publish else 0,
                                        int(timeout * 1e9))
        raise_for(rc, f"{self._pool.path} index commit")
        return PutResult(status)

    def read(self, lookup: Lookup, out, verify: bool = True) -> None:
        """Copies the pinned blocks into OUT (shape (hits, ...); a numpy array or a
        CPU torch tensor), verifying checksums."""
        self.read_slots(lookup.slots, lookup.checksums if verify else None, out,
                        lookup.keys[:lookup.hits], lookup.tags)

    def read_slots(self, slots: np.ndarray, checksums: np.ndarray | None, out,
                   keys: np.ndarray | None = None, tags: np.ndarray | None = None) -> None:
        """Copies blocks out of SLOTS into OUT in one call, each checked against its
        CHECKSUMS entry (0 = none recorded; None = no checks); KEYS name a bad block.
        TAGS (a lookup's) spare the eviction of slots this node holds no stale line
        of; without them every slot is evicted first."""
        n = len(slots)
        if n == 0:
            return
        if type(out).__module__.startswith("torch"):
            import torch         # only when given a tensor: torch is a heavy import
            if out.device.type != "cpu":
                raise UsageError("read copies into host memory", "pass a CPU tensor")
            out = out.view(-1).view(dtype=torch.uint8).numpy()
        dst = out.reshape(n, -1)
        if not dst.flags.c_contiguous or not dst.flags.writeable:
            raise UsageError("the output buffer must be writable and C-contiguous", "np.empty(...)")
        row = dst.shape[1] * dst.itemsize
        slots = np.ascontiguousarray(slots, dtype=np.uint32)
        sums = None if checksums is None else np.ascontiguousarray(checksums, dtype=np.uint32)
        bad = ffi.new("uint32_t *")
        tag_arr = None if tags is None else np.ascontiguousarray(tags, dtype=np.uint64)
        rc = lib.tract_index_read(self._pool._r(), self._u32(slots),
                                  ffi.NULL if tag_arr is None else
                                  ffi.cast("uint64_t *", ffi.from_buffer(tag_arr)), n,
                                  ffi.from_buffer(dst, require_writable=True), row, row,
                                  self._u32(sums) if sums is not None else ffi.NULL, bad)
        if rc == lib.TRACT_E_CORRUPT:
            name = f" (key {keys[bad[0]].tobytes().hex()})" if keys is not None else ""
            raise ChecksumMismatch(f"block {bad[0]}{name} does not match its checksum",
                                   "the block was not served; run `tract check` and recompute it")
        raise_for(rc, f"{self._pool.path} index read")

    def views(self, lookup: Lookup, torch: bool = False) -> BlockTable:
        """Zero-copy views of the pinned blocks (valid until unpinned), as a
        `BlockTable`: `views[i]` is block i, a numpy array (a torch tensor with
        torch=True) shaped (layer, K|V, token, kv_head, head_dim).  One C call
        evicts this host's stale lines of the slots (those the payload ledger
        does not vouch for); no per-block work."""
        self._pool.acquire_payload(lookup.slots, lookup.tags)
        return self._pool.block_table(lookup.slots, torch=torch)

    def tags(self, hashes, slots) -> np.ndarray:
        """Payload tags of blocks pinned for this node without its own lookup (a
        handoff's), read in one C call without stripe locks; 0 where a key is
        not READY in its slot (that slot is then evicted as unknown)."""
        keys = as_keys(hashes)
        slot_arr = np.ascontiguousarray(slots, dtype=np.uint32)
        if len(slot_arr) != len(keys):
            raise UsageError(f"{len(keys)} keys but {len(slot_arr)} slots", "pass a record's own")
        out = np.zeros(len(keys), np.uint64)
        if len(keys):
            rc = lib.tract_index_tags(self._pool._r(), ffi.from_buffer(keys), self._u32(slot_arr),
                                      len(keys), ffi.cast("uint64_t *", ffi.from_buffer(out)))
            raise_for(rc, f"{self._pool.path} index tags")
        return out

    def evict(self, count: int, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        """Evicts up to COUNT unpinned blocks, least recently used first."""
        out = ffi.new("uint32_t *")
        raise_for(lib.tract_index_evict(self._pool._r(), count, out, int(timeout * 1e9)), "evict")
        return out[0]

    def audit(self) -> "Audit":
        """What each bucket's own key rule (stripe, home, probing) says of it,
        decided by the core that writes the index, without locks (`tract
        check`)."""
        n = self._pool.info.section("buckets").count
        a = Audit(np.zeros(n, np.uint8), np.zeros(n, np.uint64), np.zeros(n, np.uint64))
        u64 = lambda x: ffi.cast("uint64_t *", ffi.from_buffer(x, require_writable=True))  # noqa: E731
        raise_for(lib.tract_index_audit(self._pool._r(), ffi.from_buffer(a.reach, require_writable=True),
                                        u64(a.home), u64(a.broken), n), "index audit")
        return a

    def key_homes(self, keys: np.ndarray) -> np.ndarray:
        """The home bucket of each key of KEYS ((n, 16) uint8): where its probe
        starts, by the core's key rule (readers of a snapshot: `tract inspect`)."""
        keys = np.ascontiguousarray(keys)
        keys = (keys.view(np.uint8) if keys.dtype.kind == "V" else keys.astype(np.uint8, copy=False))
        keys = keys.reshape(-1, 16)
        homes = np.zeros(len(keys), np.uint64)
        raise_for(lib.tract_index_key_homes(self._pool._r(), ffi.from_buffer(keys),
                                            len(keys), ffi.cast("uint64_t *",
                                                                ffi.from_buffer(homes, require_writable=True))),
                  "index key homes")
        return homes

    def rebuild(self, keep) -> None:
        """Writes the index (buckets, pins, LRU anchors) anew from the READY
        buckets KEEP (bucket indices; each READY, of its key's stripe, no
        bucket or key twice), in one C call that places them by the index's
        own probe and LRU rule (`tract check --repair`).  Offline only: it
        takes no lock, so nobody else may map the region."""
        arr = id_array(keep, np.uint64, "the buckets to keep must be a list of bucket indices",
                       "pass a 1-D array of non-negative integers")
        raise_for(lib.tract_index_rebuild(self._pool._r(), ffi.cast("uint64_t *", ffi.from_buffer(arr)),
                                          arr.size), f"{self._pool.path} index rebuild")

    def checksum_mismatches(self, slots: np.ndarray, checksums: np.ndarray) -> np.ndarray:
        """Indices i whose slot's payload does not match CHECKSUMS[i] (CRC-32C),
        with this host's cached lines of the slots evicted first (`tract
        check`): two C calls for all of them."""
        slots = np.ascontiguousarray(slots, dtype=np.uint32)
        if not slots.size:
            return np.zeros(0, np.int64)
        self._pool.acquire_payload(slots)
        sums = self._pool.checksum_slots(slots)
        return np.flatnonzero(sums != np.asarray(checksums, dtype=np.uint32))

