"""The transports of `tract bench`'s worker processes (runner.py), one class
per transport and side, so that the worker loops have no branch per transport.

- `tract-copy`: the prefill side puts its private KV into the pool (one copy
  in, `pool.index.put`), the decode side copies it out into private memory
  (`pool.handoffs.copy_blocks`): what a GPU does by DMA;
- `tract-zero-copy`: the prefill side reserves the slots its compute writes
  into (`pool.index.reserve`) and commits them (`commit`), the decode side
  reads them in place (`pool.handoffs.views`): the handoff moves metadata only;
- `tcp`: the KV over loopback sockets, one per prefill/decode pair (the
  network path stand-in); no prefix cache.

A request through a prefill side, in the worker loop's order:

    hits = side.lookup(keys, t)          # the prefix cache (pinned): "lookup"
    side.reserve(miss, t)                # zero-copy: the slots to compute into
    side.compute_into(kv, hits)          # inside the modelled compute
    stored = side.write(miss, kv[hits:], t)       # "kv_write"
    side.publish(out, keys, tokens, tail, tail_tokens, t)   # "handoff_publish"
    side.deliver(out, inbox, dec, payload)

and through a decode side:

    blocks, tail = side.read(msg, out, t)   # "handoff_open", "kv_read"
    ...                                     # first token
    ok = side.verify(blocks, tail, keys, want)    # every block and the tail: untimed
    side.ack(t)                             # "ack"

Each method times its own stage into T, around exactly the core call the
serving path makes (`pool.index.lookup/put/reserve/commit`,
`pool.handoffs.publish/open/copy_blocks/views/copy_tail/ack`): one C call per
batch of blocks, KV never copied in Python (numpy views over the mapping).
A side serves one request at a time (a worker process is single-threaded):
what a request holds between two calls (its lookup's pins, its reservation,
its ticket) is the side's until the next request.
"""
from __future__ import annotations

import socket
import struct
import time
from abc import ABC, abstractmethod

import numpy as np

from tract_cli.bench.standin import BlockCrcs, same
from tract_cli.core.errors import TractError
from tract_cli.core.handoff import PENDING_WAIT_S, Ticket
from tract_cli.core.index import PUT_CLAIMED, PUT_STORED


# ---- TCP framing: a 4-byte hello naming the sender, then each request's bytes ----

def send_hello(sock: socket.socket, index: int) -> None:
    """Says which prefill worker this connection is (the first 4 bytes on it)."""
    sock.sendall(struct.pack("<I", index))


def read_hello(conn: socket.socket) -> int:
    """The prefill worker index a new connection names."""
    raw = b""
    while len(raw) < 4:
        chunk = conn.recv(4 - len(raw))
        if not chunk:
            raise TractError("a prefill worker closed its connection", "check the workers")
        raw += chunk
    return struct.unpack("<I", raw)[0]


def recv_exact(conn: socket.socket, buf: memoryview) -> None:
    """Fills BUF from CONN (a request's blocks, then its tail)."""
    got = 0
    while got < buf.nbytes:
        k = conn.recv_into(buf[got:], buf.nbytes - got)
        if not k:
            raise TractError("a prefill worker closed its connection mid-transfer",
                             "its error is printed above")
        got += k


# ---- prefill sides ----

class PrefillSide(ABC):
    """What every prefill side does unless it says otherwise: no prefix cache,
    nothing to reserve, compute's output already in private memory, the KV
    sent once (so do the peers: `kv_accounting`)."""

    prefix_cache = False            # whether a request's leading blocks may be hits

    def __init__(self, pool):
        self.pool = pool

    @staticmethod
    def kv_bytes_moved(rec: dict, block_bytes: int) -> int:
        """The KV bytes a request's record (stats.py) moved: its blocks, sent once."""
        return rec["blocks"] * block_bytes

    def connect(self, index: int, decode_ports: list[int]) -> None:
        """Setup, before the driver's clock starts."""

    def lookup(self, keys: np.ndarray, t: dict) -> int:
        """The request's leading blocks found in the prefix cache (pinned)."""
        return 0

    def reserve(self, miss: np.ndarray, t: dict) -> None:
        """Before compute: where the compute's KV goes."""

    def compute_into(self, kv: np.ndarray, hits: int) -> None:
        """Inside the modelled compute: its stores outside private memory."""

    def write(self, miss: np.ndarray, kv_miss: np.ndarray, t: dict) -> np.ndarray:
        """After compute: the missed blocks written; which of them this request wrote."""
        return np.ones(len(miss), bool)

    @abstractmethod
    def publish(self, out: dict, keys: np.ndarray, tokens: int, tail: np.ndarray,
                tail_tokens: int, t: dict) -> None:
        """Sets OUT's ticket: what the decode side needs to take the KV (each
        transport's own)."""

    def deliver(self, out: dict, inbox, dec: int, payload: np.ndarray) -> None:
        """Hands OUT to decode worker DEC (INBOX is its queue)."""
        inbox.put(out)

    def close(self) -> None:
        """Teardown, after the last request."""


class _PoolPrefill(PrefillSide):
    """The tract transports: a prefix cache, and the KV handed off in the pool."""

    prefix_cache = True

    def lookup(self, keys, t):
        c = time.perf_counter()
        self._hit = self.pool.index.lookup(keys)
        t["lookup"] = time.perf_counter() - c
        return self._hit.hits

    def _stored(self, put) -> None:
        if put.count("no_room"):
            raise TractError(f"{put.count('no_room')} blocks found no free index bucket",
                             "the index is too full: use a larger region (more buckets)")
        self._put = put

    def publish(self, out, keys, tokens, tail, tail_tokens, t):
        c = time.perf_counter()
        out["ticket"] = self.pool.handoffs.publish(out["rid"], keys, tokens, tail=tail,
                                                   tail_tokens=tail_tokens,
                                                   wait_s=PENDING_WAIT_S).to_dict()
        t["handoff_publish"] = time.perf_counter() - c
        self.pool.index.unpin(self._hit)
        self.pool.index.unpin(self._put.pinned(self._miss))
        self._hit = self._put = self._miss = None


class CopyPrefill(_PoolPrefill):
    """tract-copy: private KV -> pool (one copy in)."""

    @staticmethod
    def kv_bytes_moved(rec: dict, block_bytes: int) -> int:
        """Written: the blocks the request computed; read: every block."""
        return (rec["blocks"] - rec["hits"] + rec["blocks"]) * block_bytes

    def write(self, miss, kv_miss, t):
        c = time.perf_counter()
        put = self.pool.index.put(miss, kv_miss, pin=True)   # pinned until the handoff pins them
        t["kv_write"] = time.perf_counter() - c
        self._stored(put)
        self._miss = miss
        return put.status == PUT_STORED


class ZeroCopyPrefill(_PoolPrefill):
    """tract-zero-copy: computed straight into reserved slots, then committed."""

    @staticmethod
    def kv_bytes_moved(rec: dict, block_bytes: int) -> int:
        return 0                    # computed in place, attended in place

    def reserve(self, miss, t):
        c = time.perf_counter()
        self._status, self._slots = self.pool.index.reserve(miss, pin=True)
        t["kv_write"] = time.perf_counter() - c

    def connect(self, index, decode_ports):
        self._rows = slot_rows(self.pool)

    def compute_into(self, kv, hits):
        # the compute's own output, stored into the slots it computes into
        # (what a GPU's kernels write there): every block it claimed, in full
        # (one scatter), so that the decode side can check every block
        mine = np.flatnonzero(self._status == PUT_CLAIMED)
        if mine.size == len(self._status):               # the usual case: a view, no gather
            self._rows[self._slots] = kv[hits:]
        elif mine.size:
            self._rows[self._slots[mine]] = kv[hits + mine]

    def write(self, miss, kv_miss, t):
        c = time.perf_counter()
        put = self.pool.index.commit(miss, self._status, self._slots, pin=True)
        t["kv_write"] += time.perf_counter() - c
        self._stored(put)
        self._miss = miss
        claimed = self._status == PUT_CLAIMED
        self._status = self._slots = None
        return claimed


class TcpPrefill(PrefillSide):
    """tcp: the KV sent over a loopback socket to its decode worker."""

    def connect(self, index, decode_ports):
        self.socks = [socket.create_connection(("127.0.0.1", p)) for p in decode_ports]
        for sock in self.socks:                          # say who we are to each decode worker
            send_hello(sock, index)

    def publish(self, out, keys, tokens, tail, tail_tokens, t):
        out["ticket"] = {"blocks": out["blocks"], "tail_bytes": tail.size}

    def deliver(self, out, inbox, dec, payload):
        # tell the decode side first, so it is receiving while we send (the
        # transfer is timed there, from its first byte to its last)
        inbox.put(out)
        if payload.size:
            self.socks[dec].sendall(memoryview(payload))

    def close(self):
        for sock in self.socks:
            sock.close()


# ---- decode sides ----

class DecodeSide(ABC):
    """Takes each request's KV into OUT (the worker's private buffer: blocks,
    then the tail) or views of it, and gives the handoff back."""

    def __init__(self, pool):
        self.pool = pool
        self.block_bytes = pool.info.block_bytes
        self.bytes_per_token = pool.info.bytes_per_token

    def listen(self, prefill_count: int) -> int:
        """Setup: the port the prefill workers connect to (0: none)."""
        return 0

    def accept(self, prefill_count: int) -> None:
        """Setup, once the driver knows the port: the prefill workers' connections."""

    def _blocks(self, out: np.ndarray, n: int) -> np.ndarray:
        bb = self.block_bytes
        return out[:n * bb].reshape(n, bb) if n else out[:0].reshape(0, bb)

    @abstractmethod
    def read(self, msg: dict, out: np.ndarray, t: dict):
        """The request's (blocks, tail) as the decode side now has them (each
        transport's own)."""

    def verify(self, blocks, tail: np.ndarray, keys: np.ndarray, want: np.ndarray) -> bool:
        """Whether every block and the tail hold what the prefill side made
        (WANT: the request's stand-in KV, its blocks then its tail; KEYS its
        blocks' keys): here, the blocks in private memory, compared byte for
        byte in one vectorized comparison (no copy), the tail likewise.  Run
        after the first token's time is taken, before the ack: not timed."""
        n = len(keys) * self.block_bytes
        return same(blocks.reshape(-1), want[:n]) and same(tail, want[n:])

    def ack(self, t: dict) -> None:
        """After the first token: the handoff given back (its blocks unpinned)."""

    def close(self) -> None:
        """Teardown, after the last request."""


class _PoolDecode(DecodeSide):

    def _open(self, msg, out, t):
        self._ticket = Ticket.from_dict(msg["ticket"])
        c = time.perf_counter()
        rec = self.pool.handoffs.open(self._ticket)
        t["handoff_open"] = time.perf_counter() - c
        n = msg["blocks"]
        bb = self.block_bytes
        return rec, out[n * bb:n * bb + rec.tail_tokens * self.bytes_per_token]

    def ack(self, t):
        c = time.perf_counter()
        self.pool.handoffs.ack(self._ticket)
        t["ack"] = time.perf_counter() - c
        self._ticket = None


class CopyDecode(_PoolDecode):
    """tract-copy: pool -> private KV (one copy out)."""

    def read(self, msg, out, t):
        blocks = self._blocks(out, msg["blocks"])
        rec, tail = self._open(msg, out, t)
        c = time.perf_counter()
        self.pool.handoffs.copy_blocks(rec, blocks, verify=False)
        self.pool.handoffs.copy_tail(rec, tail)
        t["kv_read"] = time.perf_counter() - c
        return blocks, tail


class ZeroCopyDecode(_PoolDecode):
    """tract-zero-copy: views of the pinned slots (attended in place); the
    tail is copied (it is a partial block)."""

    def __init__(self, pool):
        super().__init__(pool)
        self.crcs = BlockCrcs(self.block_bytes)          # at start: milliseconds

    def read(self, msg, out, t):
        rec, tail = self._open(msg, out, t)
        c = time.perf_counter()
        views = self.pool.handoffs.views(rec)            # a block table: O(1)
        self.pool.handoffs.copy_tail(rec, tail)
        t["kv_read"] = time.perf_counter() - c
        return views, tail

    def verify(self, blocks, tail, keys, want):
        """The blocks where they are, in the pinned slots: each slot's CRC-32C
        (one C call over the request's slots, in place, no copy) against the
        CRC its block must have (from its key and index, `BlockCrcs`); the
        tail byte for byte."""
        got, crcs = self.pool.checksum_slots(blocks.slots), self.crcs.of(keys)
        return got.shape == crcs.shape and bool((got == crcs).all()) and \
            same(tail, want[len(keys) * self.block_bytes:])


class TcpDecode(DecodeSide):
    """tcp: the KV received from the prefill worker's socket."""

    def listen(self, prefill_count):
        self.srv = socket.socket()
        self.srv.bind(("127.0.0.1", 0))
        self.srv.listen(prefill_count)
        self.who = {}
        return self.srv.getsockname()[1]

    def accept(self, prefill_count):
        conns = [self.srv.accept()[0] for _ in range(prefill_count)]
        # connections arrive in any order: each names its sender
        self.who = {read_hello(c): c for c in conns}

    def read(self, msg, out, t):
        n = msg["blocks"]
        bb = self.block_bytes
        blocks = self._blocks(out, n)
        tail = out[n * bb:n * bb + msg["ticket"]["tail_bytes"]]
        conn = self.who[msg["prefill"]]
        buf = memoryview(out[:n * bb + tail.size])
        c = time.perf_counter()
        recv_exact(conn, buf)
        t["kv_read"] = time.perf_counter() - c
        return blocks, tail

    def close(self):
        for c in self.who.values():
            c.close()
        self.srv.close()


def slot_rows(pool) -> np.ndarray:
    """A writable uint8 view of every slot's block, shaped (slot_count,
    block_bytes): `rows[slots] = blocks` stores a batch into its slots in one
    scatter (no Python loop per block)."""
    area = pool.slots_array()
    return np.lib.stride_tricks.as_strided(area.view(np.uint8),
                                           (pool.slot_count, pool.info.block_bytes),
                                           (area.strides[0], 1))


# transport -> (prefill side, decode side)
SIDES = {"tract-copy": (CopyPrefill, CopyDecode),
         "tract-zero-copy": (ZeroCopyPrefill, ZeroCopyDecode),
         "tcp": (TcpPrefill, TcpDecode)}
TRANSPORTS = tuple(SIDES)


def kv_accounting(transport: str) -> type[PrefillSide]:
    """Whose `prefix_cache` and `kv_bytes_moved` describe TRANSPORT's run
    (stats.summarize): its prefill side's (real compute's tract-copy and
    tract-zero-copy move the KV as the runner's do); a peer's sends it once, as
    the base side."""
    return SIDES[transport][0] if transport in SIDES else PrefillSide


def prefill_side(transport: str, pool) -> PrefillSide:
    return SIDES[transport][0](pool)


def decode_side(transport: str, pool) -> DecodeSide:
    return SIDES[transport][1](pool)
