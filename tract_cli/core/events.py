"""A region's KV events: what its blocks are, kept current from the stripes'
event logs, and the changes a KV-aware router is told (docs/PROTOCOLS.md §13).

Writers describe the blocks they put (`describe`: hash, parent, token ids,
model tag), and the core writes each description into the block's slot record
before the block turns READY; every READY and every eviction is appended to
its stripe's event log in the same locked section.  A reader (`RegionView`)
tails every stripe's log from its own cursors, without a lock and without any
server: a reader that fell a whole ring behind (or found a log moved on by a
rebuild) takes a snapshot of the stripe under its lock and carries on from
it, so it is never stale for ever.  `Feed` turns the view's changes into what
a router is told: blocks stored (parents before children, chains in runs) and
blocks removed, each once.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from tract_cli.core.errors import UsageError
from tract_cli.core.media import BLOCK_RECORD_DTYPE, EVENT_DTYPE
from tract_cli.core.native import ffi, lib, raise_for

if TYPE_CHECKING:
    from tract_cli.core.pool import Pool

STORED, REMOVED = lib.TRACT_EVENT_STORED, lib.TRACT_EVENT_REMOVED
F_PARENT, F_PARTIAL, F_GIVEN = (lib.TRACT_RECORD_PARENT, lib.TRACT_RECORD_PARTIAL,
                                lib.TRACT_RECORD_GIVEN)
# events read per call into the core (a poll loops while the logs hold more)
READ_BATCH = 4096
# a stripe whose head stays past an event this host cannot see for this long
# (its writer died between the two lines) is taken from a snapshot instead
BEHIND_LIMIT_S = 2.0
# a stripe is taken from a snapshot at most this often (the snapshot holds its
# lock while it reads the stripe's buckets)
RESYNC_EVERY_S = 1.0
# a snapshot's wait for one stripe lock
SNAPSHOT_LOCK_TIMEOUT_S = 2.0
# a stored block whose parent the router was not told of waits this long for
# it (the parent's READY is in another stripe's log, read a poll later), then
# is told anyway
PARENT_WAIT_S = 0.5
# a tail whose read failed (a lock wait of its snapshot timed out, ...) tries
# again from a fresh snapshot after this long
RETRY_S = 1.0


class Described(NamedTuple):
    """What a put's blocks are, for their records: one BLOCK_RECORD_DTYPE row
    and one row of block_tokens token ids (uint32, zero-padded) per key."""

    records: np.ndarray
    token_ids: np.ndarray


# the longest cache salt a record holds (struct tract_block_record's salt line);
# a prompt with a longer one is not described
MAX_RECORD_SALT = 60


def describe(hashes, tokens, block_tokens: int, tag: bytes, parent: bytes | None = None,
             partial_last: bool = False, salt: str | None = None) -> Described:
    """Describes consecutive blocks of one prompt: HASHES ((n, 16) or (n, 32)
    uint8: each block's hash as its scheme made it, untagged), TOKENS (the
    blocks' token ids in order, block_tokens each; the last block fewer when
    PARTIAL_LAST), TAG (16 bytes: the writer's model tag), PARENT (the hash
    of the block before the first; None: the first is the prompt's first),
    SALT (the request's cache salt: kept with the prompt's first block, where
    vLLM's events carry it, in its extra keys).  Vectorised: no Python loop per
    block."""
    h = np.ascontiguousarray(hashes, dtype=np.uint8)
    n = len(h)
    if h.ndim != 2 or h.shape[1] not in (16, 32):
        raise UsageError(f"block hashes must be (n, 16) or (n, 32) uint8, got {h.shape}",
                         "pass the hash chain of the blocks")
    if len(tag) != 16:
        raise UsageError(f"a model tag is 16 bytes, got {len(tag)}", "pass the key tag")
    tok = np.asarray(tokens, dtype=np.int64).ravel()
    full = n - 1 if partial_last else n
    if n and (tok.size < full * block_tokens or tok.size > n * block_tokens or
              (not partial_last and tok.size != n * block_tokens) or
              (partial_last and tok.size == full * block_tokens)):
        raise UsageError(f"{tok.size} token ids for {n} blocks of {block_tokens}",
                         "pass exactly the blocks' tokens")
    if tok.size and (tok.min() < 0 or tok.max() > 0xFFFFFFFF):
        raise UsageError("a token id is outside 0..2^32-1", "pass the prompt's token ids")
    salt_bytes = salt.encode() if salt else b""
    if len(salt_bytes) > MAX_RECORD_SALT:
        raise UsageError(f"a cache salt of {len(salt_bytes)} bytes does not fit a block record",
                         f"leave prompts with salts over {MAX_RECORD_SALT} bytes undescribed")
    rec = np.zeros(n, BLOCK_RECORD_DTYPE)
    raw = rec.view(np.uint8).reshape(n, BLOCK_RECORD_DTYPE.itemsize)
    width = h.shape[1]
    raw[:, 32:32 + width] = h
    raw[:, 16:32] = np.frombuffer(bytes(tag), np.uint8)
    if n > 1:
        raw[1:, 64:64 + width] = h[:-1]
    flags = np.full(n, F_PARENT | F_GIVEN, np.uint16)
    if parent is not None and n:
        pb = np.frombuffer(bytes(parent), np.uint8)
        raw[0, 64:64 + pb.size] = pb
    elif n:
        flags[0] = F_GIVEN
    if partial_last and n:
        flags[-1] |= F_PARTIAL
    rec["flags"] = flags
    ids = np.zeros((n, block_tokens), np.uint32)
    ids.ravel()[:tok.size] = tok
    counts = np.full(n, block_tokens, np.uint32)
    if partial_last and n:
        counts[-1] = tok.size - full * block_tokens
    rec["n_tokens"] = counts
    if salt_bytes and n and parent is None:
        rec["salt_len"][0] = len(salt_bytes)
        raw[0, 132:132 + len(salt_bytes)] = np.frombuffer(salt_bytes, np.uint8)
    return Described(rec, ids)


def describe_span(hashes, tokens, lo: int, hi: int, block_tokens: int, tag: bytes,
                  salt: str | None = None) -> Described:
    """`describe` of full blocks LO..HI of one prompt, given the hashes of all its
    full blocks (HASHES) and its tokens (TOKENS): the parent is block LO - 1's."""
    hi = max(lo, hi)
    return describe(hashes[lo:hi], tokens[lo * block_tokens:hi * block_tokens], block_tokens,
                    tag, bytes(hashes[lo - 1]) if lo else None, salt=salt)


@dataclass(frozen=True)
class Block:
    """A READY block of the region as its record describes it."""

    key: bytes            # its key in the index
    hash: bytes           # its hash as its scheme made it, untagged (vLLM's: 32 bytes)
    parent: bytes | None  # its parent's hash (None: a prompt's first block)
    tokens: bytes         # its token ids, u32 little-endian (compact: a view holds many)
    node: int             # the node that wrote it
    tag: bytes            # its writer's model tag
    salt: str | None = None   # the request's cache salt (a salted prompt's first block)

    @property
    def token_ids(self) -> list[int]:
        return np.frombuffer(self.tokens, "<u4").tolist()


def _hash_bytes(raw: bytes, scheme_bytes: int) -> bytes:
    return bytes(raw[:scheme_bytes])


class RegionView:
    """The described READY blocks of a region (of one model tag, or all), kept
    current from the event logs: `poll()` reads what changed since and returns
    the keys whose presence changed.  Memory is bounded by the region: one
    entry per READY block."""

    def __init__(self, pool: "Pool", tag: bytes | None = None):
        self.pool, self.tag = pool, tag
        info = pool.info
        self.stripes = info.index_stripes
        self.block_tokens = pool.geometry.block_tokens
        self.hash_bytes = 32 if info.hash_scheme == "vllm" else 16
        self.capacity = info.section("events").entry_size // 64 - 1
        self.blocks: dict[bytes, Block] = {}
        self._by_stripe: list[set] = [set() for _ in range(self.stripes)]
        self.cursors = np.zeros(self.stripes, np.uint64)
        self.heads = np.zeros(self.stripes, np.uint64)
        self._behind_since: dict[int, float] = {}
        self._resynced_at: dict[int, float] = {}
        self.events_read = 0         # events taken from the logs
        self.resyncs = 0             # stripes taken from a snapshot after a lost log
        self._buckets = info.section("buckets").count
        self._events = np.zeros(READ_BATCH, EVENT_DTYPE)
        self._stripe_of = np.zeros(READ_BATCH, np.uint32)
        self._state = np.zeros(self.stripes, np.uint8)
        self.snapshot(np.ones(self.stripes, bool))

    # -- the C calls ---------------------------------------------------------

    def _records(self, keys: np.ndarray, slots: np.ndarray):
        n = len(keys)
        rec = np.zeros(max(n, 1), BLOCK_RECORD_DTYPE)
        ids = np.zeros((max(n, 1), self.block_tokens), np.uint32)
        ok = np.zeros(max(n, 1), np.uint8)
        if n:
            rc = lib.tract_records_read(
                self.pool._r(), ffi.from_buffer(np.ascontiguousarray(keys)),
                ffi.cast("uint32_t *", ffi.from_buffer(np.ascontiguousarray(slots, np.uint32))),
                n, ffi.cast("struct tract_block_record *", ffi.from_buffer(rec)),
                ffi.cast("uint32_t *", ffi.from_buffer(ids)), ffi.from_buffer(ok))
            raise_for(rc, f"{self.pool.path} block records")
        return rec[:n], ids[:n], ok[:n]

    def _block(self, key: bytes, rec, ids: np.ndarray) -> Block | None:
        """The block a record describes, or None when it is not one to tell
        of: partial, not described, or of another model."""
        flags = int(rec["flags"])
        if not flags & F_GIVEN or flags & F_PARTIAL:
            return None
        tag = bytes(rec["tag"])
        if self.tag is not None and tag != self.tag:
            return None
        parent = _hash_bytes(bytes(rec["parent"]), self.hash_bytes) if flags & F_PARENT else None
        salt = None
        if rec["salt_len"]:
            try:
                salt = bytes(rec["salt"])[:int(rec["salt_len"])].decode()
            except UnicodeDecodeError:    # a record another host wrote: never trusted blindly
                return None
        return Block(key, _hash_bytes(bytes(rec["hash"]), self.hash_bytes), parent,
                     ids[:int(rec["n_tokens"])].astype("<u4").tobytes(), int(rec["node"]), tag,
                     salt)

    # -- reading ---------------------------------------------------------------

    def snapshot(self, want: np.ndarray, resync: bool = False) -> set:
        """Takes the stripes WANT names from a snapshot (each under its lock)
        and continues their logs from there; returns the keys that changed.
        RESYNC: after a lost log (rate-limited: RESYNC_EVERY_S)."""
        want8 = np.ascontiguousarray(want, dtype=np.uint8)
        heads = np.zeros(self.stripes, np.uint64)
        cap = self._buckets // self.stripes * int(want8.astype(bool).sum())
        keys = np.zeros((cap, 16), np.uint8)
        slots = np.zeros(cap, np.uint32)
        stripe_of = np.zeros(cap, np.uint32)
        n = ffi.new("uint32_t *")
        rc = lib.tract_events_snapshot(
            self.pool._r(), ffi.from_buffer(want8),
            ffi.cast("uint64_t *", ffi.from_buffer(heads)), ffi.from_buffer(keys),
            ffi.cast("uint32_t *", ffi.from_buffer(slots)),
            ffi.cast("uint32_t *", ffi.from_buffer(stripe_of)), cap, n,
            int(SNAPSHOT_LOCK_TIMEOUT_S * 1e9))
        raise_for(rc, f"{self.pool.path} event snapshot")
        k = n[0]
        rec, ids, ok = self._records(keys[:k], slots[:k])
        fresh: dict[bytes, tuple[Block, int]] = {}
        for i in np.flatnonzero(ok):
            key = keys[i].tobytes()
            blk = self._block(key, rec[i], ids[i])
            if blk is not None:
                fresh[key] = (blk, int(stripe_of[i]))
        changed = set()
        now = time.monotonic()
        for s in np.flatnonzero(want8):
            for key in self._by_stripe[s]:
                if key not in fresh:
                    self.blocks.pop(key, None)
                    changed.add(key)
            self._by_stripe[s] = set()
            self.cursors[s] = heads[s]
            self._behind_since.pop(int(s), None)
            if resync:
                self._resynced_at[int(s)] = now
        for key, (blk, s) in fresh.items():
            self._by_stripe[s].add(key)
            if self.blocks.get(key) != blk:
                changed.add(key)
            self.blocks[key] = blk
        return changed

    def poll(self) -> set:
        """Reads every stripe's log from its cursor; returns the keys whose
        presence changed (a snapshot replaces a stripe whose log overran this
        reader, or stayed behind a dead writer for BEHIND_LIMIT_S)."""
        changed: set = set()
        for _ in range(64):            # bounded: a burst larger than this waits a poll
            n = ffi.new("uint32_t *")
            rc = lib.tract_events_read(
                self.pool._r(), ffi.cast("uint64_t *", ffi.from_buffer(self.cursors)),
                ffi.cast("struct tract_event *", ffi.from_buffer(self._events)),
                ffi.cast("uint32_t *", ffi.from_buffer(self._stripe_of)), READ_BATCH, n,
                ffi.from_buffer(self._state), ffi.cast("uint64_t *", ffi.from_buffer(self.heads)))
            raise_for(rc, f"{self.pool.path} event logs")
            k = n[0]
            self.events_read += k
            if k:
                self._apply(self._events[:k], self._stripe_of[:k], changed)
            now = time.monotonic()
            lost = np.zeros(self.stripes, bool)
            for s in range(self.stripes):
                state = self._state[s]
                if state == lib.TRACT_EVENTS_BEHIND:
                    since = self._behind_since.setdefault(s, now)
                    lost[s] = now - since >= BEHIND_LIMIT_S
                else:
                    if self.cursors[s] == self.heads[s]:
                        self._behind_since.pop(s, None)
                    lost[s] = state == lib.TRACT_EVENTS_LOST
                # a stripe resynchronised less than RESYNC_EVERY_S ago waits: a
                # reader that keeps losing its place does not hold stripe locks
                # (and the writers behind them) in a loop
                if lost[s] and now - self._resynced_at.get(s, -RESYNC_EVERY_S) < RESYNC_EVERY_S:
                    lost[s] = False
            if lost.any():
                self.resyncs += int(lost.sum())
                changed |= self.snapshot(lost, resync=True)
            if k < READ_BATCH:
                break
        return changed

    def _apply(self, ev: np.ndarray, stripe_of: np.ndarray, changed: set) -> None:
        """Applies events in log order (per stripe: one key's events are in one
        stripe, in the order its lock gave them)."""
        stored = np.flatnonzero(ev["kind"] == STORED)
        keys = np.ascontiguousarray(ev["key"]).view(np.uint8).reshape(-1, 16)
        rec, ids, ok = self._records(keys[stored], ev["slot"][stored] - 1)
        described = {int(i): j for j, i in enumerate(stored)}
        for i in range(len(ev)):
            key = keys[i].tobytes()
            s = int(stripe_of[i])
            if ev["kind"][i] == REMOVED:
                if self.blocks.pop(key, None) is not None:
                    changed.add(key)
                self._by_stripe[s].discard(key)
                continue
            j = described[i]
            # a record no longer the key's: the block was evicted since, and its
            # REMOVED event follows in this stripe's log
            blk = self._block(key, rec[j], ids[j]) if ok[j] else None
            if blk is None:
                continue
            if self.blocks.get(key) != blk:
                changed.add(key)
            self.blocks[key] = blk
            self._by_stripe[s].add(key)


@dataclass
class Change:
    """What a router is told: STORED blocks (one chain run, parent first: each
    block's parent is the one before it, the first's is `parent`) or REMOVED
    blocks, all of one locality."""

    kind: str                  # "stored" | "removed"
    blocks: list
    parent: bytes | None
    local: bool


class Feed:
    """The changes of a RegionView told once each: what was told is kept
    (`told`), and each take tells the difference between it and the view
    (bounded: a block stored and evicted between two takes is never told)."""

    def __init__(self, view: RegionView, node: int | None):
        self.view, self.node = view, node
        self.told: dict[bytes, Block] = {}
        self._told_hashes: dict[bytes, int] = {}
        self._waiting: dict[bytes, float] = {}
        self._pending: set = set(view.blocks)
        self._retell = False

    def note(self, changed: set) -> None:
        """Keys a poll found changed, to consider at the next take."""
        self._pending |= changed

    def reattach(self, view: RegionView) -> None:
        """Follows VIEW (a fresh snapshot, after a failed read) instead: the next
        take tells the difference between it and what was told."""
        self.view = view
        self.note(set(view.blocks) | set(self.told))

    def retell(self) -> None:
        """At the next take, tells every block of the view again (a subscriber
        that joined, a router told to forget the instance's blocks), after the
        removals due since the last take."""
        self._retell = True

    def take(self, now: float | None = None, wait_parents: bool = True) -> list[Change]:
        """The changes since the last take: removals first, then stores.  NOW:
        the clock of the parent wait; WAIT_PARENTS false: every stored block is
        told now, whether its parent was told or not."""
        now = time.monotonic() if now is None else now
        keys, self._pending = self._pending | set(self._waiting), set()
        retell, self._retell = self._retell, False
        if retell:
            keys |= set(self.told) | set(self.view.blocks)
        removed, stored = [], {}
        for key in keys:
            cur = self.view.blocks.get(key)
            if cur is None:
                self._waiting.pop(key, None)
            was = self.told.get(key)
            if was is not None and cur != was:
                removed.append(was)
                self._forget(key)
            elif was is not None and retell:
                self._forget(key)              # told again below
            if cur is not None and key not in self.told:
                stored[key] = cur
        out: list[Change] = []
        for local, group in self._by_locality(removed):
            out.append(Change("removed", group, None, local))
        out.extend(self._stored_runs(stored, now, wait_parents))
        return out

    def _forget(self, key: bytes) -> None:
        blk = self.told.pop(key)
        left = self._told_hashes.get(blk.hash, 0) - 1
        if left > 0:
            self._told_hashes[blk.hash] = left
        else:
            self._told_hashes.pop(blk.hash, None)

    def _local(self, blk: Block) -> bool:
        return self.node is not None and blk.node == self.node

    def _by_locality(self, blocks: list):
        for local in (True, False):
            group = [b for b in blocks if self._local(b) == local]
            if group:
                yield local, group

    def _stored_runs(self, stored: dict, now: float, wait_parents: bool) -> list[Change]:
        """STORED (key -> block) parent first, in chain runs; a block whose
        parent was never told waits (PARENT_WAIT_S) for it, then is told anyway."""
        in_batch = {b.hash for b in stored.values()}
        children: dict[bytes, list] = {}
        ready = []
        for blk in stored.values():
            if blk.parent is None or blk.parent in self._told_hashes:
                ready.append(blk)
            elif blk.parent in in_batch:
                children.setdefault(blk.parent, []).append(blk)
            elif not wait_parents or now - self._waiting.setdefault(blk.key, now) >= PARENT_WAIT_S:
                ready.append(blk)
        out: list[Change] = self._runs(ready, children, now)
        if not wait_parents:
            # blocks in a cycle of parents, or under a parent that is not told:
            # told now all the same
            while children:
                out += self._runs(children.pop(next(iter(children))), children, now)
        return out

    def _runs(self, ready: list, children: dict, now: float) -> list[Change]:
        """Tells READY blocks and, after each, the children waiting on it, in runs."""
        out: list[Change] = []
        while ready:
            blk = ready.pop()
            run = [blk]
            while True:
                kids = children.pop(run[-1].hash, [])
                same = [k for k in kids if self._local(k) == self._local(blk)]
                ready.extend(k for k in kids if not same or k is not same[0])
                if not same:
                    break
                run.append(same[0])
            for b in run:
                self.told[b.key] = b
                self._told_hashes[b.hash] = self._told_hashes.get(b.hash, 0) + 1
                self._waiting.pop(b.key, None)
            out.append(Change("stored", run, blk.parent, self._local(blk)))
        # blocks whose parents were not told (nor stored now): wait for them
        for kids in children.values():
            for k in kids:
                self._waiting.setdefault(k.key, now)
        return out


class Tail:
    """A RegionView polled on a thread of its own (every INTERVAL_S), its
    changes gathered for a Feed taken from another thread (an engine's
    scheduler): nothing of the polling runs on the taker's loop."""

    def __init__(self, pool: "Pool", tag: bytes | None, node: int | None,
                 interval_s: float = 0.05):
        self._lock = threading.Lock()
        self.pool, self.tag, self.node = pool, tag, node
        self.view: RegionView | None = None     # made by the thread (its snapshot takes locks)
        self.feed: Feed | None = None
        self.interval_s = interval_s
        self.error: BaseException | None = None
        self._retell = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tract-events", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            wait = self.interval_s
            try:
                with self._lock:
                    if self.view is None:
                        # (again after a failure: a fresh snapshot, and the feed
                        # tells the difference from what it told before)
                        view = RegionView(self.pool, self.tag)
                        if self.feed is None:
                            self.feed = Feed(view, self.node)
                        else:
                            self.feed.reattach(view)
                        self.view = view
                    else:
                        self.feed.note(self.view.poll())
                self.error = None
            except Exception as exc:    # reported through `error`; retried from a snapshot
                self.error = exc
                self.view = None
                wait = max(self.interval_s, RETRY_S)
            if self._stop.wait(wait):
                return

    def take(self) -> list[Change]:
        """The changes since the last take; none while a poll runs (a snapshot
        may wait for stripe locks): they are told at a later take, and the
        taker never waits."""
        if not self._lock.acquire(blocking=False):
            return []
        try:
            if self.feed is None:
                return []
            if self._retell:
                self._retell = False
                self.feed.retell()
            return self.feed.take()
        finally:
            self._lock.release()

    def close(self, timeout: float = 60.0) -> None:
        """Stops the thread and waits for it (bounded: a snapshot waits at most
        SNAPSHOT_LOCK_TIMEOUT_S a stripe), so nothing reads the pool after."""
        self._stop.set()
        self._thread.join(timeout)

    def retell(self) -> None:
        """Every block told again at the next take (never waits: a flag)."""
        self._retell = True


def wire_hash(h: bytes, as_int: bool = True):
    """A block hash as vLLM's KV events carry it: by default the int of its last
    8 bytes, big-endian (vLLM's `maybe_convert_block_hash` with
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1), else the bytes."""
    return int.from_bytes(h, "big") & ((1 << 64) - 1) if as_int else bytes(h)


def event_fields(change: Change, *, block_size: int, medium: str | None, ownership: str | None,
                 locality: bool, int_hashes: bool = True) -> tuple[str, dict]:
    """A Change as vLLM's KV event (its class name and its fields, by name:
    vllm.distributed.kv_events.BlockStored / BlockRemoved)."""
    loc = ("LOCAL" if change.local else "REMOTE") if locality else None
    hashes = [wire_hash(b.hash, int_hashes) for b in change.blocks]
    # group 0: the connector serves engines of one KV cache group (vllm_setup.py)
    if change.kind == "removed":
        return "BlockRemoved", dict(block_hashes=hashes, medium=medium, group_idx=0,
                                    locality=loc, ownership=ownership)
    # vLLM's extra keys, one entry a block: the cache salt on a salted prompt's
    # first block, None elsewhere (vLLM's to_event_extra_keys)
    extra = [(b.salt,) if b.salt else None for b in change.blocks]
    return "BlockStored", dict(
        block_hashes=hashes,
        parent_block_hash=None if change.parent is None else wire_hash(change.parent, int_hashes),
        token_ids=[t for b in change.blocks for t in b.token_ids], block_size=block_size,
        lora_id=None, medium=medium, lora_name=None, extra_keys=extra, group_idx=0,
        locality=loc, ownership=ownership)
