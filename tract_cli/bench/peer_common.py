"""What the peer adapters (peer_nixl.py, peer_mooncake.py, peer_lmcache.py)
share: the protocol channel, the stand-in KV, the sender's stamp-and-compute
step, the receiver's check and record, and the command line.  Standalone like them: numpy only,
nothing of TraCT (they run in the peer's own virtual environment).

Importing this module takes the process's stdout for the protocol and sends
whatever the peer libraries print to stderr, so import it before them.
"""
import argparse
import json
import os
import time

# the protocol owns the original stdout; whatever the libraries print goes to stderr
PROTO = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

import numpy as np  # noqa: E402


# the KV geometry the driver runs with (--block-bytes, --block-tokens)
GEOMETRY = {"block_bytes": 0, "block_tokens": 0}


# the stand-in KV, as runner.py makes it (this module imports nothing of TraCT):
# a fixed function of the byte's position, each block's key stamped into its
# first 16 bytes, the request's stamp into the tail's
PATTERN_BYTES = 4093
_PATTERN = ((np.arange(PATTERN_BYTES, dtype=np.uint64) * np.uint64(2654435761)) >> np.uint64(7)
            & np.uint64(0xFF)).astype(np.uint8)


def pattern_at(offset: int, length: int) -> np.ndarray:
    rolled = np.roll(_PATTERN, -(offset % PATTERN_BYTES))
    return np.tile(rolled, -(-length // PATTERN_BYTES))[:length] if length else rolled[:0]


def sender_buffer(capacity: int) -> np.ndarray:
    """The sender's buffer, the stand-in KV of the longest request in it: made
    at start, before the driver's clock (a GPU has its KV when compute ends)."""
    return np.ascontiguousarray(pattern_at(0, capacity))


def receiver_buffer(nbytes: int) -> np.ndarray:
    """The receive slots, faulted in now (np.zeros would leave the first
    transfer into each page to fault it in, inside the timed transfer)."""
    buf = np.empty(nbytes, np.uint8)
    buf.fill(0)
    return buf


def tail_stamp(rid: str) -> np.ndarray:
    import hashlib
    return np.frombuffer(hashlib.blake2b(rid.encode(), digest_size=16).digest(), np.uint8)


def sleep_until(deadline: float) -> None:
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(left)


def out(obj) -> None:
    PROTO.write(json.dumps(obj) + "\n")
    PROTO.flush()


def keys_of(msg: dict) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(msg["keys"]), np.uint8).reshape(-1, 16)


def fill_and_compute(buf: np.ndarray, req: dict) -> tuple[dict, int]:
    """Marks the request's KV in BUF (its keys into the stand-in blocks, its
    stamp into the tail: microseconds) and waits out its modelled compute,
    exactly (sleep until the deadline); returns (timings, bytes)."""
    start = time.monotonic()
    t = {"queue": start - req["arrival"]}
    n, bb, tb = req["blocks"], req["block_bytes"], req["tail_bytes"]
    if n:
        buf[:n * bb].reshape(n, bb)[:, :16] = keys_of(req)
    k = min(16, tb)
    buf[n * bb:n * bb + k] = tail_stamp(req["rid"])[:k]
    sleep_until(start + req["compute_s"])
    t["compute"] = time.monotonic() - start
    return t, n * bb + tb


def record(buf: np.ndarray, capacity: int, exp: dict, t: dict, every: int = 0) -> dict:
    """The record the runner's decode side would give (decode modelled as
    continuous batching), the first token's time taken before the check: the
    first and last block (and, with EVERY, each EVERY-th block: the first of
    each chunk of a chunked transfer) carry their keys and stand-in bytes, the
    tail its stamp and bytes, in the request's receive slot."""
    t["first_token"] = exp["decode_s"]
    ttft = time.monotonic() + t["first_token"] - exp["arrival"]
    n, bb, tb = exp["blocks"], exp["block_bytes"], exp["tail_bytes"]
    base = exp["slot"] * capacity
    keys = keys_of(exp)
    which = sorted({0, n - 1} | set(range(0, n, every) if every else ())) if n else []
    ok = True
    for i in which:
        b = buf[base + i * bb:base + (i + 1) * bb]
        ok = ok and np.array_equal(b[:16], keys[i]) and \
            np.array_equal(b[16:], pattern_at(i * bb + 16, bb - 16))
    tail = buf[base + n * bb:base + n * bb + tb]
    k = min(16, tb)
    ok = ok and np.array_equal(tail[:k], tail_stamp(exp["rid"])[:k]) and \
        np.array_equal(tail[k:], pattern_at(n * bb + k, tb - k))
    return {"rid": exp["rid"], "t": t, "ok": bool(ok), "hits": 0, "blocks": n,
            "tokens": exp["tokens"], "output_len": exp["output_len"], "ttft": ttft,
            "e2e": ttft + max(exp["output_len"] - 1, 0) * exp["decode_s"], "prefill": 0,
            "slot": exp["slot"], "modelled_compute": exp["compute_s"]}


def relayed(lines):
    """Yields (expectation, sender's timings) per request from the receiver's
    input, once both have arrived: the driver sends the request's expectation
    and relays the sender's completion ({"done": rid, "t": ...}) in either order."""
    expected, done = {}, {}
    for line in lines:
        msg = json.loads(line)
        if "done" in msg:
            done[msg["done"]] = msg["t"]
        else:
            expected[msg["rid"]] = msg
        for rid in [r for r in done if r in expected]:
            yield expected.pop(rid), done.pop(rid)


def main(receiver, sender) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("receiver", "sender"))
    p.add_argument("--capacity", type=int, required=True)
    p.add_argument("--slots", type=int, default=4)
    p.add_argument("--block-bytes", type=int, default=0)
    p.add_argument("--block-tokens", type=int, default=0)
    args = p.parse_args()
    GEOMETRY.update(block_bytes=args.block_bytes, block_tokens=args.block_tokens)
    if args.role == "receiver":
        receiver(args.capacity, args.slots)
    else:
        sender(args.capacity)
