"""Prefill -> decode handoffs through the pool (docs/PROTOCOLS.md §10).

The prefill side publishes a record naming the request's blocks (pinned until
the decode side acknowledges, or the record expires and a node agent
reclaims it) and its partial tail block.  What crosses the control plane is
a `Ticket`: the record index and the request id, a few bytes of JSON.  KV
bytes never travel on the control plane.

Two ways to use a handoff on the decode side: `copy_blocks` (the copying
path, what a GPU does by DMA) or `views` (zero copy on CPUs: attend over the
pinned slots in place, so the handoff moved only metadata).
"""
from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import numpy as np

from tract_cli.core.errors import (BlocksPending, ChecksumMismatch, HandoffError,
                                   HandoffGone, HandoffLost, HandoffPending, PoolFull,
                                   ReservationGone, TransferTableFull, UsageError)
from tract_cli.core.index import as_keys
from tract_cli.core.locks import DEFAULT_TIMEOUT_S
from tract_cli.core.native import ffi, lib, raise_for

if TYPE_CHECKING:
    from tract_cli.core.pool import BlockTable


def request_key(request_id: str | bytes) -> bytes:
    """16 bytes identifying a request: raw 16-byte ids as they are, others hashed."""
    if isinstance(request_id, bytes) and len(request_id) == 16:
        return request_id
    raw = request_id.encode() if isinstance(request_id, str) else bytes(request_id)
    return hashlib.blake2b(raw, digest_size=16).digest()


# the longest pair name (a proxy's transfer id) a paired request may carry
MAX_PAIR_CHARS = 256


def pair_key(pair: str) -> bytes:
    """16 bytes naming the handoff of a paired prefill and decode: PAIR, the
    name a proxy gave both requests (the connector's kv_transfer_params
    `tract_pair`), so the decode side finds the record by it without the
    prefill's reply.  Keyed apart from `request_key` (its own
    personalisation), so no request id names a pair's record."""
    return hashlib.blake2b(pair.encode(), digest_size=16, person=b"tract-pair").digest()


def named_by_pair(name: bytes, request_id: str) -> bool:
    """Whether NAME, the name of request REQUEST_ID's handoff record, is a
    pair's (`pair_key`: its paired decode finds the record by it, without a
    ticket) rather than the request's own (`request_key`)."""
    return name != request_key(request_id)


def check_pair(value) -> str:
    """A pair name from outside (a request's kv_transfer_params): a string of
    1 to MAX_PAIR_CHARS printable characters, else a UsageError."""
    if not isinstance(value, str) or not 0 < len(value) <= MAX_PAIR_CHARS or not value.isprintable():
        raise UsageError(f"a pair name must be a string of 1 to {MAX_PAIR_CHARS} printable "
                         f"characters, got {str(value)[:40]!r}",
                         "give both requests of the pair the same id, e.g. a uuid")
    return value


# how long a publisher waits for a block another writer of the same key still
# holds PENDING (it is finishing its write) before the handoff fails: the
# serving path's and the benchmark's one value
PENDING_WAIT_S = 10.0


def retry_while_pending(publish, wait_s: float):
    """Calls PUBLISH until it stops failing for "not every block" (a block
    another writer still holds PENDING) or WAIT_S has passed (then it raises)."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            return publish()
        except BlocksPending:
            if time.monotonic() >= deadline:
                raise
        time.sleep(0.002)      # another process finishing its write: poll, bounded


# the states of a transfer record (native/format.h), for readers of the table
RECORD_FREE = lib.TRACT_TRANSFER_FREE
RECORD_PUBLISHED = lib.TRACT_TRANSFER_PUBLISHED      # its blocks pinned for the decode side
RECORD_ACKED = lib.TRACT_TRANSFER_ACKED              # acknowledged: being given back
RECORD_RECLAIMING = lib.TRACT_TRANSFER_RECLAIMING    # expired: being given back
RECORD_RESERVED = lib.TRACT_TRANSFER_RESERVED        # taken, its publish to follow (no key list)
# where a P/D prefill's handoff is published (the vLLM connector's handoff_publish):
# its record reserved in the step that completes the prompt and published after
# that step's commit, or published in that step, which waits for it
HANDOFF_PUBLISH = ("after_step", "in_step")
# the names of the states a record in use can hold
RECORD_STATES = {RECORD_PUBLISHED: "PUBLISHED", RECORD_ACKED: "ACKED",
                 RECORD_RECLAIMING: "RECLAIMING", RECORD_RESERVED: "RESERVED"}

# the most blocks any key list can hold: one slot (at most 2^TRACT_MAX_BLOCK_SHIFT
# bytes) of TRACT_KEY_ENTRY_SIZE-byte entries (native/tract.h); a ticket naming
# more is malformed.  A pool's own bound is its slot's (`Handoffs.open`).
MAX_TICKET_BLOCKS = (1 << lib.TRACT_MAX_BLOCK_SHIFT) // lib.TRACT_KEY_ENTRY_SIZE


def has_repeats(keys: np.ndarray) -> bool:
    """Whether (n, 16) uint8 KEYS name a key twice (why a publish was
    refused): sorted as pairs of u64 (np.unique over 16-byte voids is ten
    times slower)."""
    if len(keys) < 2:
        return False
    v = keys.view(np.uint64).reshape(-1, 2)
    s = v[np.lexsort((v[:, 1], v[:, 0]))]
    return bool((s[1:] == s[:-1]).all(axis=1).any())


@dataclass(frozen=True)
class Ticket:
    """The control message from prefill to decode: metadata only."""

    record: int
    request_id: str          # 32 hex digits
    blocks: int
    tokens: int

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "Ticket":
        """Validates a ticket from outside (another process, the network): integers in
        range, a 32-hex-digit request id; anything else is a UsageError."""
        try:
            fields = [d["record"], d["blocks"], d["tokens"]]
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in fields):
                raise TypeError
            t = cls(fields[0], str(d["request_id"]), fields[1], fields[2])
            if len(bytes.fromhex(t.request_id)) != 16 or not (
                    0 <= t.record < 2**32 and 0 <= t.blocks <= MAX_TICKET_BLOCKS and
                    0 <= t.tokens < 2**63):
                raise ValueError
        except (KeyError, TypeError, ValueError, AttributeError):
            raise UsageError("malformed handoff ticket",
                             "pass the dict Handoffs.publish returned") from None
        return t


@dataclass
class Received:
    ticket: Ticket
    keys: np.ndarray              # (blocks, 16) uint8: the key of each block
    slots: np.ndarray
    checksums: np.ndarray
    block_tokens: np.ndarray
    token_count: int
    tail_slot: int | None
    tail_tokens: int
    # per block, its payload tag (index bucket + epoch; 0 unknown): readers
    # evict only the slots their node may hold stale lines of
    tags: np.ndarray | None = None


class Handoffs:
    """publish / open / copy_blocks / views / ack / reclaim."""

    def __init__(self, pool):
        self._pool = pool

    def publish(self, request_id: str | bytes, hashes, token_count: int, tail=None,
                tail_tokens: int = 0, ttl: float = 30.0, timeout: float = DEFAULT_TIMEOUT_S,
                wait_s: float = 0.0, record: int | None = None) -> Ticket:
        """Pins the request's cached blocks for a decode side and writes the record
        (in RECORD, `peek_free`'s choice, if given: TransferTableFull if it is
        taken by now; else the first free one).

        Every block must be READY; a block another writer still holds PENDING
        is waited for up to WAIT_S (polling), then HandoffError.
        """
        return retry_while_pending(lambda: self._publish(request_id, hashes, token_count, tail,
                                                         tail_tokens, ttl, timeout, record),
                                   wait_s)

    def publish_lost(self, request_id: str | bytes, ttl: float,
                     timeout: float = DEFAULT_TIMEOUT_S) -> Ticket:
        """A record of no blocks under REQUEST_ID's name: what a handoff that will
        not be published leaves for a decode side that finds records by name
        (a paired decode, which has no ticket to find its record gone): it opens
        it, finds none of its prompt's blocks and computes the prompt at once,
        instead of waiting for a record that will never come.  It takes a
        record and one slot (its empty key list) until acknowledged or its TTL
        runs out; TransferTableFull or PoolFull where there is no room."""
        return self._publish(request_id, np.zeros((0, 16), np.uint8), 0, None, 0, ttl, timeout)

    def _publish(self, request_id, hashes, token_count, tail, tail_tokens, ttl, timeout,
                 record=None) -> Ticket:
        keys = as_keys(hashes)
        rid = request_key(request_id)
        tail_buf = None if tail is None else np.ascontiguousarray(tail).view(np.uint8).reshape(-1)
        rec = ffi.new("uint32_t *")
        rc = lib.tract_handoff_publish_in(
            self._pool._r(), 0xFFFFFFFF if record is None else int(record), rid,
            ffi.from_buffer(keys), len(keys), token_count,
            ffi.from_buffer(tail_buf) if tail_buf is not None else ffi.NULL,
            0 if tail_buf is None else tail_buf.size, tail_tokens, int(ttl * 1e9), rec,
            int(timeout * 1e9))
        self._raise_publish(rc, keys, record, BlocksPending(
            "not every block of the request is in the pool",
            "put the blocks before publishing the handoff"))
        raise_for(rc, f"{self._pool.path} handoff publish")
        return Ticket(rec[0], rid.hex(), len(keys), token_count)

    def _raise_publish(self, rc: int, keys: np.ndarray, record: int | None,
                       not_found: Exception) -> None:
        """The error of a publish (plain or pinned) that returned RC, if any:
        NOT_FOUND (its blocks not READY) for TRACT_E_NOT_FOUND."""
        if rc == lib.TRACT_E_NOT_FOUND:
            raise not_found
        if rc == lib.TRACT_E_TABLE_FULL and record is not None:
            raise TransferTableFull(f"handoff record {record} is taken",
                                    "choose another with peek_free")
        if rc == lib.TRACT_E_TABLE_FULL:
            raise TransferTableFull("the transfer table is full",
                                    "acknowledge handoffs, or let expired ones be reclaimed")
        if rc == lib.TRACT_E_FULL:
            raise PoolFull("no slot for the handoff's key list: the pool is full and every "
                           "block in it is pinned", "acknowledge handoffs or use a larger region")
        if rc == lib.TRACT_E_RANGE:
            raise UsageError("the request has more blocks than one key-list slot holds, or "
                             "the record is past the table",
                             "use a model with larger blocks or shorter requests, and a record "
                             "peek_free gave")
        if rc == lib.TRACT_E_INVAL and has_repeats(keys):
            # the core refuses it before it pins anything: a release counts
            # one pin per key-list entry (looked for only once refused)
            raise UsageError("the request names a block twice (its block hashes must be "
                             "distinct, as chained hashes are)",
                             "check how the block hashes are computed")

    def peek_free(self, start: int = 0, skip=()) -> int | None:
        """A record that looks FREE, read without a lock from START on (wrapping),
        none of SKIP: a choice for `publish_pinned`, which checks it under the
        transfer lock (another publisher may take it first); None if none looks
        FREE."""
        skip_arr = np.ascontiguousarray(list(skip), dtype=np.uint32)
        rec = ffi.new("uint32_t *")
        rc = lib.tract_handoff_peek_free(
            self._pool._r(), max(0, int(start)) & 0xFFFFFFFF,
            ffi.cast("uint32_t *", ffi.from_buffer(skip_arr)) if skip_arr.size else ffi.NULL,
            skip_arr.size, rec)
        if rc == lib.TRACT_E_TABLE_FULL:
            return None
        raise_for(rc, f"{self._pool.path} handoff table")
        return int(rec[0])

    def find(self, request_keys: np.ndarray) -> np.ndarray:
        """The record of each of (n, 16) uint8 REQUEST_KEYS (`request_key`s),
        found in one pass over the table without a lock: the first record
        PUBLISHED or RESERVED for it, or -1.  A hint for a `Ticket`: `open`
        checks the record it names."""
        ids = np.ascontiguousarray(request_keys, dtype=np.uint8).reshape(-1, 16)
        recs = np.empty(len(ids), np.uint32)
        if not len(ids):
            return recs.astype(np.int64)
        rc = lib.tract_handoff_find(self._pool._r(), ffi.from_buffer(ids), len(ids),
                                    ffi.cast("uint32_t *", ffi.from_buffer(recs)))
        raise_for(rc, f"{self._pool.path} handoff table")
        out = recs.astype(np.int64)
        out[recs == np.uint32(0xFFFFFFFF)] = -1
        return out

    def publish_pinned(self, record: int, request_id: str | bytes, hashes, token_count: int,
                       ttl: float = 30.0, timeout: float = DEFAULT_TIMEOUT_S,
                       reserved: bool = False) -> Ticket:
        """Publishes a handoff of blocks this process holds one pin on each (a
        pinning put's: `reserve(pin=True)` and `commit(pin=True)`) in RECORD
        (`peek_free`'s choice; RESERVED: this process's `reserve_record` of it for
        the request, which must still hold): the pins become the record's.  On
        any failure (TransferTableFull: RECORD was taken meanwhile; BlocksPending:
        a block is not READY; ReservationGone: the reservation is gone) the pins
        stay the caller's, to give back."""
        keys = as_keys(hashes)
        rid = request_key(request_id)
        rc = lib.tract_handoff_publish_pinned(self._pool._r(), int(record), rid,
                                              ffi.from_buffer(keys), len(keys), token_count,
                                              int(ttl * 1e9), int(reserved), int(timeout * 1e9))
        if rc == lib.TRACT_E_TABLE_FULL and reserved:
            raise ReservationGone(f"handoff record {record} is no longer reserved for the "
                                  "request (given back by a decode side that stopped waiting, "
                                  "or expired)",
                                  "its decode computes the prompt; publish sooner next time")
        self._raise_publish(rc, keys, record, BlocksPending(
            "not every block of the request is READY in the pool",
            "publish the blocks' commit first"))
        raise_for(rc, f"{self._pool.path} handoff publish")
        return Ticket(int(record), rid.hex(), len(keys), token_count)

    def reserve_record(self, record: int, request_id: str | bytes, blocks: int,
                       token_count: int, ttl: float = 30.0,
                       timeout: float = DEFAULT_TIMEOUT_S) -> Ticket:
        """Reserves RECORD (`peek_free`'s choice) for the request's handoff of
        BLOCKS blocks and TOKEN_COUNT tokens until TTL from now; returns its
        ticket, which may go out before the publish (`publish_pinned` with
        reserved): a decode side that opens it meanwhile gets HandoffPending.
        TransferTableFull if RECORD is taken by now."""
        rid = request_key(request_id)
        rc = lib.tract_handoff_reserve(self._pool._r(), int(record), rid, int(blocks),
                                       int(token_count), int(ttl * 1e9), int(timeout * 1e9))
        if rc == lib.TRACT_E_TABLE_FULL:
            raise TransferTableFull(f"handoff record {record} is taken",
                                    "choose another with peek_free")
        raise_for(rc, f"{self._pool.path} handoff reserve")
        return Ticket(int(record), rid.hex(), int(blocks), int(token_count))

    def unreserve(self, record: int, request_id: str | bytes,
                  timeout: float = DEFAULT_TIMEOUT_S) -> bool:
        """Gives back RECORD's reservation for the request (its owner's, that
        publishes nothing; a decode side's that stopped waiting): True if it
        was reserved for it, False if not (published, given back or freed)."""
        rc = lib.tract_handoff_unreserve(self._pool._r(), int(record), request_key(request_id),
                                         int(timeout * 1e9))
        if rc == lib.TRACT_E_NOT_FOUND:
            return False
        raise_for(rc, f"{self._pool.path} handoff unreserve")
        return True

    def open(self, ticket: Ticket) -> Received:
        """Reads the record and its key list (metadata only).  HandoffPending
        while the record is reserved for the request (its prefill side still
        commits the blocks): ask again."""
        # no record of this pool has more blocks than its key-list slot holds:
        # a ticket that names more is not one of this pool's
        cap = self._pool.info.block_bytes // lib.TRACT_KEY_ENTRY_SIZE
        if ticket.blocks > cap:
            raise HandoffError(f"the ticket names {ticket.blocks} blocks; a handoff of this pool "
                               f"holds at most {cap}", "pass the ticket the prefill worker returned")
        n = ticket.blocks
        slots, sums, toks = (np.zeros(max(n, 1), np.uint32) for _ in range(3))
        keys = np.zeros((max(n, 1), 16), np.uint8)
        bc, tc, ts, tt = (ffi.new(t) for t in ("uint32_t *", "uint64_t *", "uint32_t *",
                                                "uint32_t *"))
        u32 = lambda a: ffi.cast("uint32_t *", ffi.from_buffer(a))
        rc = lib.tract_handoff_open(self._pool._r(), ticket.record, bytes.fromhex(ticket.request_id),
                                    ffi.from_buffer(keys), u32(slots), u32(sums), u32(toks), n,
                                    bc, tc, ts, tt)
        if rc == lib.TRACT_E_PENDING and (bc[0], tc[0]) != (ticket.blocks, ticket.tokens):
            raise HandoffError(f"handoff record {ticket.record} is reserved for {bc[0]} blocks "
                               f"and {tc[0]} tokens, the ticket names {ticket.blocks} and "
                               f"{ticket.tokens}", "pass the ticket the prefill worker returned")
        if rc == lib.TRACT_E_PENDING:
            raise HandoffPending(f"handoff record {ticket.record} for request "
                                 f"{ticket.request_id} is reserved, not yet published",
                                 "ask again shortly")
        if rc == lib.TRACT_E_NOT_FOUND:
            raise HandoffGone(f"handoff record {ticket.record} for request {ticket.request_id} "
                               "is not published (acknowledged, expired or never written)",
                               "ask the prefill worker again")
        if rc == lib.TRACT_E_CORRUPT:
            raise HandoffError(f"handoff record {ticket.record} points outside the pool",
                               "run `tract check` on the region")
        if rc == lib.TRACT_E_RANGE:
            raise HandoffError(f"handoff record {ticket.record} does not match the ticket (no "
                               "such record, or more blocks than the ticket names)",
                               "pass the ticket the prefill worker returned")
        raise_for(rc, f"{self._pool.path} handoff open")
        k = bc[0]
        if k == 0 and ticket.blocks:
            raise HandoffLost(f"handoff record {ticket.record} holds no block: its prefill "
                              "side lost the handoff", "compute the prompt")
        if k != ticket.blocks:
            raise HandoffError(f"handoff record {ticket.record} holds {k} blocks, the ticket names "
                               f"{ticket.blocks}", "pass the ticket the prefill worker returned")
        # the blocks are pinned by the record: their buckets cannot change, so
        # their payload tags are read without a lock (one C call)
        tags = self._pool.index.tags(keys[:k], slots[:k])
        return Received(ticket, keys[:k], slots[:k], sums[:k], toks[:k], tc[0],
                        ts[0] - 1 if ts[0] else None, tt[0], tags)

    def copy_blocks(self, rec: Received, out: np.ndarray, verify: bool = True) -> None:
        """Copies the blocks into OUT (shape (blocks, ...)): the copying path."""
        self._pool.index.read_slots(rec.slots, rec.checksums if verify else None, out,
                                    rec.keys, rec.tags)

    def copy_tail(self, rec: Received, out: np.ndarray) -> None:
        """Copies the partial tail block's bytes into OUT."""
        if rec.tail_slot is None:
            return
        self._pool.copy_out(rec.tail_slot, out.reshape(-1).view(np.uint8))

    @staticmethod
    def read_slots(rec: Received) -> np.ndarray:
        """Every slot a reader of REC loads from: its blocks' and its tail's (for `ack`)."""
        return np.concatenate([rec.slots.astype(np.uint32),
                               np.array([] if rec.tail_slot is None else [rec.tail_slot],
                                        np.uint32)])

    def views(self, rec: Received, torch: bool = False) -> BlockTable:
        """Zero-copy views of the blocks (valid until ack), as a `BlockTable`
        (`views[i]` is block i; numpy, or torch with torch=True): the CPU
        zero-copy path.  One C call evicts the slots this host may hold stale
        lines of (the payload ledger, by the record's tags); no per-block work."""
        self._pool.acquire_payload(rec.slots, rec.tags)
        return self._pool.block_table(rec.slots, torch=torch)

    def tail_view(self, rec: Received) -> np.ndarray | None:
        """Zero-copy view of the partial tail block's slot (valid until ack)."""
        if rec.tail_slot is None:
            return None
        self._pool.invalidate_slots([rec.tail_slot])
        return self._pool.slots_array()[rec.tail_slot]

    def still_published(self, ticket: Ticket) -> bool:
        """Whether the ticket's record is still published, read without a lock
        (one C call).  Asked after copying its blocks, True proves the copy
        read them before any release of their slots (an acknowledgement or a
        reclaim moves the record off PUBLISHED before it releases anything), so
        the copy stands whatever happens to the record afterwards."""
        rc = lib.tract_handoff_check(self._pool._r(), ticket.record,
                                     bytes.fromhex(ticket.request_id))
        if rc == lib.TRACT_E_NOT_FOUND:
            return False
        raise_for(rc, f"{self._pool.path} handoff check")
        return True

    def ack(self, ticket: Ticket, timeout: float = DEFAULT_TIMEOUT_S, read=None,
            resume: bool = False) -> None:
        """Done with the blocks: pins and slots are released, the record freed.
        READ: the slots this node loaded from (a `Received`'s, with its tail
        slot); if the record expired and was reclaimed meanwhile, those loads
        may have outlived it, so the node's payload ledger forgets them.
        RESUME: this is the retry of this process's own acknowledgement of the
        ticket that timed out partway; if the record is ACKED by this process,
        finish that release (no proof that any load outlived the record)."""
        rid = bytes.fromhex(ticket.request_id)
        rc = lib.tract_handoff_ack(self._pool._r(), ticket.record, rid, int(timeout * 1e9))
        if rc == lib.TRACT_E_NOT_FOUND and resume:
            rc = lib.tract_handoff_ack_resume(self._pool._r(), ticket.record, rid,
                                              int(timeout * 1e9))
        if rc == lib.TRACT_E_NOT_FOUND and read is not None:
            self._pool.forget_payload(read)
        if rc == lib.TRACT_E_NOT_FOUND:
            raise HandoffError(f"handoff record {ticket.record} is no longer published "
                               "(expired and reclaimed?)", "acknowledge before the expiry")
        raise_for(rc, f"{self._pool.path} handoff ack")

    def reclaim(self, now_ns: int | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> int:
        """Reclaims expired records (the node agent calls this); returns how many."""
        out = ffi.new("uint32_t *")
        rc = lib.tract_handoff_reclaim(self._pool._r(), now_ns or time.time_ns(), out,
                                       int(timeout * 1e9))
        raise_for(rc, f"{self._pool.path} handoff reclaim")
        return out[0]


    def recover(self, timeout: float = 1.0) -> int:
        """Finishes the acknowledgements and reclaims that dead processes of this
        node left half done (from where they stopped); returns how many."""
        out = ffi.new("uint32_t *")
        rc = lib.tract_handoff_recover(self._pool._r(), out, int(timeout * 1e9))
        if rc == lib.TRACT_E_TIMEOUT:
            return out[0]            # a lock was busy: the next heartbeat goes on
        raise_for(rc, f"{self._pool.path} handoff recovery")
        return out[0]


__all__ = ["ChecksumMismatch", "HandoffError", "Handoffs", "Received", "Ticket", "request_key",
           "retry_while_pending"]
