"""What the peer adapters (adapter_nixl.py, adapter_mooncake.py, adapter_lmcache.py)
share: the protocol channel, the stand-in KV's buffers, the sender's
stamp-and-compute step, the receiver's check and record, and the command line.
Standalone like them: numpy only, nothing of TraCT (they run in the peer's own
virtual environment); the stand-in itself is standin.py's, which the runner
imports too.

Importing this module takes the process's stdout for the protocol and sends
whatever the peer libraries print to stderr, so import it before them.
"""
import argparse
import json
import os
import sys
import time

# the protocol owns the original stdout; whatever the libraries print goes to stderr
PROTO = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

import numpy as np  # noqa: E402


# the KV geometry the driver runs with (--block-bytes, --block-tokens)
GEOMETRY = {"block_bytes": 0, "block_tokens": 0}


# the stand-in KV, the runner's own (bench/standin.py, one folder up: numpy
# only, imported by path as this module is): the sender stamps it, the
# receiver checks it; appended after the stdlib and site-packages, like ours
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from standin import Expected, same, sleep_until, stamp, stand_in  # noqa: E402,F401


def sender_buffer(capacity: int) -> np.ndarray:
    """The sender's buffer, the stand-in KV of the longest request in it: made
    at start, before the driver's clock (a GPU has its KV when compute ends)."""
    return stand_in(capacity)


# what each request's KV must be (the receiver's own stand-in, made at start)
_EXPECTED: list = []


def receiver_buffer(capacity: int, slots: int) -> np.ndarray:
    """The SLOTS receive slots of CAPACITY bytes, faulted in now (np.zeros
    would leave the first transfer into each page to fault it in, inside the
    timed transfer); and the stand-in `record` checks them against, made now
    too, before the driver's clock."""
    buf = np.empty(capacity * slots, np.uint8)
    buf.fill(0)
    _EXPECTED[:] = [Expected(capacity)]
    return buf


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
    stamp(buf, keys_of(req), bb, req["rid"], tb)
    sleep_until(start + req["compute_s"])
    t["compute"] = time.monotonic() - start
    return t, n * bb + tb


def record(buf: np.ndarray, capacity: int, exp: dict, t: dict) -> dict:
    """The record the runner's decode side would give (decode modelled as
    continuous batching), the first token's time taken before the check:
    every block and the tail in the request's receive slot hold exactly what
    the sender made (its stand-in and stamps), compared byte for byte in one
    vectorized comparison, timed on its own (`verify_s`)."""
    t["first_token"] = exp["decode_s"]
    ttft = time.monotonic() + t["first_token"] - exp["arrival"]
    n, bb, tb = exp["blocks"], exp["block_bytes"], exp["tail_bytes"]
    base = exp["slot"] * capacity
    if not _EXPECTED or _EXPECTED[0].kv.size < n * bb + tb:     # no receiver_buffer made
        _EXPECTED[:] = [Expected(max(capacity, n * bb + tb))]
    c = time.perf_counter()
    ok = same(buf[base:base + n * bb + tb], _EXPECTED[0].of(keys_of(exp), bb, exp["rid"], tb))
    verify_s = time.perf_counter() - c
    return {"rid": exp["rid"], "t": t, "ok": bool(ok), "verify_s": verify_s, "hits": 0, "blocks": n,
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
