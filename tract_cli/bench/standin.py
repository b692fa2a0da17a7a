"""The stand-in KV, one definition for both sides of every handoff: the
runner's prefill and decode workers (`tract_cli.bench.runner`) and the peer
adapters (peer_common.py, in the peers' own virtual environments) import this
module, so the stamps one side writes and the checks the other makes cannot
drift apart.

Standalone on purpose: numpy and the standard library only, nothing of TraCT.
The peers import it by path, as `standin` (their directory is appended to
sys.path, as for peer_common), the rest of bench as `tract_cli.bench.standin`.

A request's KV is its blocks then its tail: a fixed function of the byte's
position (`pattern_at`), each block's key stamped into its first 16 bytes,
the request's stamp (`tail_stamp`) into the tail's.
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


def block_ok(block: np.ndarray, i: int, key: np.ndarray, block_bytes: int,
             computed: bool = True) -> bool:
    """Block I of a request as the decode side got it: its key in the first 16
    bytes and, when this request computed it, the stand-in bytes in full."""
    b = block.reshape(-1)
    if not np.array_equal(b[:16], key):
        return False
    return not computed or np.array_equal(b[16:], pattern_at(i * block_bytes + 16, block_bytes - 16))


def tail_ok(tail: np.ndarray, n: int, block_bytes: int, rid: str) -> bool:
    """The tail of a request of N blocks as the decode side got it: its stamp,
    then the stand-in bytes."""
    k = min(16, tail.size)
    return np.array_equal(tail[:k], tail_stamp(rid)[:k]) and \
        np.array_equal(tail[k:], pattern_at(n * block_bytes + k, tail.size - k))


def sleep_until(deadline: float) -> None:
    """Sleeps until DEADLINE on the monotonic clock (modelled compute)."""
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(left)
