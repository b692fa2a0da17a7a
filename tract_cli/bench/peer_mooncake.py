"""The Mooncake Transfer Engine peer adapter (`mooncake-transfer-engine-non-cuda`,
protocol `tcp`, metadata by `P2PHANDSHAKE`): run by the peer's own Python,
as `receiver` (decode side) or `sender` (prefill side), driven by
`tract bench` over JSON lines on stdin/stdout (as peer_nixl.py).

The receiver registers SLOTS receive buffers and prints its session id and
buffer address.  The sender, per request: waits out its modelled compute,
writes the stand-in KV (the same bytes as the tract transports) and
`transfer_sync_write`s it into the receiver's slot, then prints the request's
timings; the driver relays them to the receiver, which verifies the first
and last block and the tail and prints the record.

Standalone on purpose: it must import nothing from TraCT.
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
from mooncake.engine import TransferEngine  # noqa: E402


def payload(keys: np.ndarray, block_bytes: int) -> np.ndarray:
    return np.tile(keys, (1, block_bytes // 16)) if len(keys) else np.zeros((0, block_bytes), np.uint8)


def tail_bytes(rid: str, n: int) -> np.ndarray:
    raw = rid.encode() or b"x"
    return np.frombuffer((raw * (n // len(raw) + 1))[:n], dtype=np.uint8)


def out(obj) -> None:
    PROTO.write(json.dumps(obj) + "\n")
    PROTO.flush()


def engine() -> TransferEngine:
    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise SystemExit(f"mooncake: initialize failed ({rc})")
    return te


def receiver(capacity: int, slots: int) -> None:
    te = engine()
    buf = np.zeros(capacity * slots, np.uint8)
    addr = buf.ctypes.data
    if te.register_memory(addr, buf.size) != 0:
        raise SystemExit("mooncake: registering the receive buffers failed")
    out({"session": f"127.0.0.1:{te.get_rpc_port()}", "addr": addr})
    expected, done = {}, {}
    for line in sys.stdin:
        msg = json.loads(line)
        if "done" in msg:
            done[msg["done"]] = msg["t"]
        else:
            expected[msg["rid"]] = msg
        for rid in [r for r in done if r in expected]:
            exp, t = expected.pop(rid), done.pop(rid)
            n, bb, tb = exp["blocks"], exp["block_bytes"], exp["tail_bytes"]
            base = exp["slot"] * capacity
            keys = np.frombuffer(bytes.fromhex(exp["keys"]), np.uint8).reshape(-1, 16)
            blocks = buf[base:base + n * bb].reshape(n, bb) if n else np.zeros((0, bb), np.uint8)
            want = payload(keys[[0, n - 1]] if n else keys[:0], bb)
            ok = bool((not n or (np.array_equal(blocks[0], want[0]) and
                                 np.array_equal(blocks[-1], want[-1])))
                      and np.array_equal(buf[base + n * bb:base + n * bb + tb], tail_bytes(rid, tb)))
            t["first_token"] = exp["decode_s"]
            ttft = time.monotonic() + t["first_token"] - exp["arrival"]
            out({"rid": rid, "t": t, "ok": ok, "hits": 0, "blocks": n, "tokens": exp["tokens"],
                 "output_len": exp["output_len"], "ttft": ttft,
                 "e2e": ttft + max(exp["output_len"] - 1, 0) * exp["decode_s"], "prefill": 0,
                 "slot": exp["slot"]})


def sender(capacity: int) -> None:
    te = engine()
    buf = np.zeros(capacity, np.uint8)
    addr = buf.ctypes.data
    if te.register_memory(addr, buf.size) != 0:
        raise SystemExit("mooncake: registering the send buffer failed")
    hello = json.loads(sys.stdin.readline())
    out({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        t = {"queue": time.monotonic() - req["arrival"]}
        c = time.perf_counter()
        n, bb, tb = req["blocks"], req["block_bytes"], req["tail_bytes"]
        keys = np.frombuffer(bytes.fromhex(req["keys"]), np.uint8).reshape(-1, 16)
        if n:
            buf[:n * bb].reshape(n, bb)[:] = payload(keys, bb)
        buf[n * bb:n * bb + tb] = tail_bytes(req["rid"], tb)
        made = time.perf_counter() - c
        time.sleep(max(req["compute_s"] - made, 0.0))
        t["compute"] = max(req["compute_s"], made)
        c = time.perf_counter()
        rc = te.transfer_sync_write(hello["session"], addr, hello["addr"] + req["slot"] * capacity,
                                    n * bb + tb)
        if rc != 0:
            raise SystemExit(f"mooncake: the transfer of {req['rid']} failed ({rc})")
        t["kv_read"] = time.perf_counter() - c
        out({"done": req["rid"], "t": t})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("role", choices=("receiver", "sender"))
    p.add_argument("--capacity", type=int, required=True)
    p.add_argument("--slots", type=int, default=4)
    args = p.parse_args()
    if args.role == "receiver":
        receiver(args.capacity, args.slots)
    else:
        sender(args.capacity)


if __name__ == "__main__":
    main()
