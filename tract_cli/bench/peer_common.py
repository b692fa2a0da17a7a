"""What the peer adapters (peer_nixl.py, peer_mooncake.py) share: the protocol
channel, the stand-in KV, the sender's fill-and-compute step, the receiver's
check and record, and the command line.  Standalone like them: numpy only,
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


def payload(keys: np.ndarray, block_bytes: int) -> np.ndarray:
    """(n, block_bytes): each block is its 16-byte key, repeated (as runner.payloads)."""
    return np.tile(keys, (1, block_bytes // 16)) if len(keys) else np.zeros((0, block_bytes), np.uint8)


def tail_bytes(rid: str, n: int) -> np.ndarray:
    raw = rid.encode() or b"x"
    return np.frombuffer((raw * (n // len(raw) + 1))[:n], dtype=np.uint8)


def out(obj) -> None:
    PROTO.write(json.dumps(obj) + "\n")
    PROTO.flush()


def keys_of(msg: dict) -> np.ndarray:
    return np.frombuffer(bytes.fromhex(msg["keys"]), np.uint8).reshape(-1, 16)


def fill_and_compute(buf: np.ndarray, req: dict) -> tuple[dict, int]:
    """Writes the request's stand-in KV and tail into BUF, waits out the rest of
    its modelled compute (producing the KV is part of it); returns (timings, bytes)."""
    t = {"queue": time.monotonic() - req["arrival"]}
    c = time.perf_counter()
    n, bb, tb = req["blocks"], req["block_bytes"], req["tail_bytes"]
    if n:
        buf[:n * bb].reshape(n, bb)[:] = payload(keys_of(req), bb)
    buf[n * bb:n * bb + tb] = tail_bytes(req["rid"], tb)
    made = time.perf_counter() - c
    time.sleep(max(req["compute_s"] - made, 0.0))
    t["compute"] = max(req["compute_s"], made)
    return t, n * bb + tb


def record(buf: np.ndarray, capacity: int, exp: dict, t: dict, every: int = 0) -> dict:
    """Checks the first and last block and the tail that landed in the request's
    receive slot (and, with EVERY, each EVERY-th block: the first of each chunk
    of a chunked transfer); the record the runner's decode side would give
    (decode modelled as continuous batching). The first token's time is taken
    before the check."""
    t["first_token"] = exp["decode_s"]
    ttft = time.monotonic() + t["first_token"] - exp["arrival"]
    n, bb, tb = exp["blocks"], exp["block_bytes"], exp["tail_bytes"]
    base = exp["slot"] * capacity
    keys = keys_of(exp)
    blocks = buf[base:base + n * bb].reshape(n, bb) if n else np.zeros((0, bb), np.uint8)
    which = sorted({0, n - 1} | set(range(0, n, every) if every else ())) if n else []
    ok = bool(np.array_equal(blocks[which], payload(keys[which], bb)) and
              np.array_equal(buf[base + n * bb:base + n * bb + tb], tail_bytes(exp["rid"], tb)))
    return {"rid": exp["rid"], "t": t, "ok": ok, "hits": 0, "blocks": n, "tokens": exp["tokens"],
            "output_len": exp["output_len"], "ttft": ttft,
            "e2e": ttft + max(exp["output_len"] - 1, 0) * exp["decode_s"], "prefill": 0,
            "slot": exp["slot"]}


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
