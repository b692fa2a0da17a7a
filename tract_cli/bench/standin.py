"""The stand-in KV, one definition for both sides of every handoff: the
runner's prefill and decode workers (`tract_cli.bench.workload.runner`) and the peer
adapters (peers/adapter_common.py, in the peers' own virtual environments) import this
module, so the stamps one side writes and the checks the other makes cannot
drift apart.

Standalone on purpose: numpy and the standard library only, nothing of TraCT.
The peers import it by path, as `standin` (adapter_common.py appends this
folder to sys.path), the rest of bench as `tract_cli.bench.standin`.

A request's KV is its blocks then its tail: a fixed function of the byte's
position (`pattern_at`), each block's key stamped into its first 16 bytes,
the request's stamp (`tail_stamp`) into the tail's.  So what every block and
the tail must hold follows from the request (its keys, its id) and the
block's index alone, and the checking side knows it without a copy of what
was sent: `Expected` (the stand-in, made once at start, stamped per request
as the sender stamps its own), compared byte for byte with `same` (one
vectorized comparison per request), or `BlockCrcs` (each block's CRC-32C,
computed from its key and index: for blocks checked in place, in the pool's
slots, by the core's one-call checksum).
"""
import hashlib
import time

import numpy as np

PATTERN_BYTES = 4093           # a prime: the stand-in differs block to block
_PATTERN = ((np.arange(PATTERN_BYTES, dtype=np.uint64) * np.uint64(2654435761)) >> np.uint64(7)
            & np.uint64(0xFF)).astype(np.uint8)


def pattern_at(offset: int, length: int) -> np.ndarray:
    """The stand-in bytes at OFFSET..OFFSET+LENGTH of a request's KV (blocks,
    then the tail), before stamps: a fixed function of the position."""
    rolled = np.roll(_PATTERN, -(offset % PATTERN_BYTES))
    return np.tile(rolled, -(-length // PATTERN_BYTES))[:length] if length else rolled[:0]


def stand_in(nbytes: int) -> np.ndarray:
    """A flat buffer of NBYTES of stand-in KV, made once (before the clock): a
    request's KV is its first blocks (and tail) once stamped."""
    return np.ascontiguousarray(pattern_at(0, nbytes))


def tail_stamp(rid: str) -> np.ndarray:
    """The 16 bytes that mark a request's tail."""
    return np.frombuffer(hashlib.blake2b(rid.encode(), digest_size=16).digest(), np.uint8)


def stamp(buf: np.ndarray, keys: np.ndarray, block_bytes: int, rid: str, tail_bytes: int) -> None:
    """Marks a request's KV in BUF (flat stand-in): each block's first 16 bytes
    are its key (KEYS: one 16-byte row per block), the tail's its request's
    stamp.  Microseconds."""
    n = len(keys)
    if n:
        buf[:n * block_bytes].reshape(n, block_bytes)[:, :16] = keys
    k = min(16, tail_bytes)
    buf[n * block_bytes:n * block_bytes + k] = tail_stamp(rid)[:k]


def same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two flat uint8 arrays hold the same bytes: one vectorized
    comparison (in 8-byte words), no copy of either."""
    if a.shape != b.shape:
        return False
    k = a.size - a.size % 8
    return np.array_equal(a[:k].view(np.uint64), b[:k].view(np.uint64)) and \
        np.array_equal(a[k:], b[k:])


class Expected:
    """What a request's KV must be, on the side that checks it: one buffer of
    stand-in KV made at start (before the clock, as the sender's), stamped per
    request exactly as the sender stamps its own (microseconds)."""

    def __init__(self, nbytes: int):
        self.kv = stand_in(nbytes)

    def of(self, keys: np.ndarray, block_bytes: int, rid: str, tail_bytes: int) -> np.ndarray:
        """The request's KV as the sender made it: its blocks (KEYS: one 16-byte
        row per block), then its TAIL_BYTES of tail; valid until the next call."""
        stamp(self.kv, keys, block_bytes, rid, tail_bytes)
        return self.kv[:len(keys) * block_bytes + tail_bytes]


# ---- CRC-32C of stand-in blocks, from their keys and indices alone ----
#
# CRC-32C (the core's block checksum, `Pool.checksum_slots`) without its
# initial value and final xor is linear over GF(2): feeding a byte x into the
# register c gives shift1(c) ^ T[x].  So the CRC of block i (its key, then
# the stand-in from byte i*B+16 on) is the key's part, shifted past the
# block's other B-16 bytes (a 32x32 bit matrix), xor the stand-in's part,
# which depends only on where the block starts in the pattern's period
# (PATTERN_BYTES phases: all of them computed once, by a rolling CRC).

_CRC32C_POLY = 0x82F63B78


def _crc_table() -> np.ndarray:
    table = []
    for c in range(256):
        for _ in range(8):
            c = (c >> 1) ^ (_CRC32C_POLY if c & 1 else 0)
        table.append(c)
    return np.array(table, np.uint32)


_CRC_TABLE = _crc_table()
_BITS = np.arange(32, dtype=np.uint32)
_IDENTITY = np.uint32(1) << _BITS


def _apply(m: np.ndarray, v) -> np.ndarray:
    """The 32x32 bit matrix M (its 32 columns) applied to each value of V."""
    v = np.asarray(v, np.uint32)
    bits = ((v[..., None] >> _BITS) & 1).astype(bool)
    return np.bitwise_xor.reduce(np.where(bits, m, np.uint32(0)), axis=-1).astype(np.uint32)


def _zeros_shift(nbytes: int) -> np.ndarray:
    """The matrix of feeding NBYTES zero bytes into the CRC register."""
    out = _IDENTITY
    base = _CRC_TABLE[_IDENTITY & 0xFF] ^ (_IDENTITY >> 8)      # one zero byte, then squared
    while nbytes:
        if nbytes & 1:
            out = _apply(base, out)
        base = _apply(base, base)
        nbytes >>= 1
    return out


def _raw_crc(data, c: int = 0) -> int:
    """The CRC register after DATA from C (no initial value or final xor)."""
    table = _CRC_TABLE.tolist()
    for x in data.tolist():
        c = table[(c ^ x) & 0xFF] ^ (c >> 8)
    return c


class BlockCrcs:
    """The CRC-32C each stand-in block of BLOCK_BYTES must have, from its key
    and index alone: the expected side of `Pool.checksum_slots` (one call over
    a request's slots, in place).  Made at start (milliseconds); per request,
    a few vector operations on its keys."""

    def __init__(self, block_bytes: int):
        if block_bytes < 16:
            raise ValueError(f"a {block_bytes}-byte block has no room for its 16-byte key")
        p, w = PATTERN_BYTES, block_bytes - 16
        self.block_bytes = block_bytes
        self.key_shift = _zeros_shift(w)                 # the key, past the block's stand-in
        # the register's initial value and the final xor, past a whole block
        self.const = np.uint32(0xFFFFFFFF) ^ _apply(_zeros_shift(block_bytes), 0xFFFFFFFF)
        # raw CRC of the W pattern bytes from phase 0: K whole periods (binary
        # doubling: ACC for k periods, SHIFT_K past them), then the rest
        period, shift_p = _raw_crc(_PATTERN), _zeros_shift(p)
        acc, shift_k = 0, _IDENTITY
        for bit in bin(w // p)[2:]:
            acc, shift_k = int(_apply(shift_k, acc)) ^ acc, _apply(shift_k, shift_k)     # 2k
            if bit == "1":
                acc, shift_k = int(_apply(shift_p, acc)) ^ period, _apply(shift_p, shift_k)  # k+1
        r = w % p
        first = int(_apply(_zeros_shift(r), acc)) ^ _raw_crc(_PATTERN[:r])
        # every phase, rolling the W-byte window one byte along the period
        out_w = _apply(self.key_shift, _CRC_TABLE).tolist()   # a byte leaving, W bytes back
        table, pat = _CRC_TABLE.tolist(), _PATTERN.tolist()
        phases, c = [0] * p, first
        for ph in range(p):
            phases[ph] = c
            c = table[c & 0xFF] ^ (c >> 8) ^ out_w[pat[ph]] ^ table[pat[(ph + w) % p]]
        self.phases = np.array(phases, np.uint32)

    def of(self, keys: np.ndarray) -> np.ndarray:
        """The CRC-32C of blocks 0..n-1 of a request (KEYS: one 16-byte row per block)."""
        n = len(keys)
        c = np.zeros(n, np.uint32)
        for j in range(16):                              # the keys' raw CRCs, all at once
            c = _CRC_TABLE[(c ^ keys[:, j]) & 0xFF] ^ (c >> 8)
        start = (np.arange(n, dtype=np.int64) * self.block_bytes + 16) % PATTERN_BYTES
        return self.const ^ _apply(self.key_shift, c) ^ self.phases[start]


def sleep_until(deadline: float) -> None:
    """Sleeps until DEADLINE on the monotonic clock (modelled compute)."""
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(left)
