"""The Mooncake Transfer Engine peer adapter (`mooncake-transfer-engine-non-cuda`,
protocol `tcp`, metadata by `P2PHANDSHAKE`): run by the peer's own Python,
as `receiver` (decode side) or `sender` (prefill side), driven by
`tract bench` over JSON lines on stdin/stdout (as adapter_nixl.py).

The receiver registers SLOTS receive buffers and prints its session id and
buffer address.  The sender, per request: stamps the stand-in KV (made at
start, before the clock: the same bytes as the tract transports), waits out
its modelled compute and
`transfer_sync_write`s it into the receiver's slot, then prints the request's
timings; the driver relays them to the receiver, which verifies every
block and the tail and prints the record (adapter_common.py).

Standalone on purpose: it must import nothing from TraCT.
"""
import json
import os
import sys
import time

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # after the stdlib: see peers/__init__.py
from adapter_common import (fill_and_compute, main, out, receiver_buffer, record, relayed,  # noqa: E402
                         sender_buffer)  # (importing it takes stdout: before the libraries)
from mooncake.engine import TransferEngine  # noqa: E402


def engine() -> TransferEngine:
    te = TransferEngine()
    rc = te.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "")
    if rc != 0:
        raise SystemExit(f"mooncake: initialize failed ({rc})")
    return te


def receiver(capacity: int, slots: int) -> None:
    te = engine()
    buf = receiver_buffer(capacity, slots)
    addr = buf.ctypes.data
    if te.register_memory(addr, buf.size) != 0:
        raise SystemExit("mooncake: registering the receive buffers failed")
    out({"session": f"127.0.0.1:{te.get_rpc_port()}", "addr": addr})
    for exp, t in relayed(sys.stdin):
        out(record(buf, capacity, exp, t))


def sender(capacity: int) -> None:
    te = engine()
    buf = sender_buffer(capacity)          # the stand-in KV, before the clock
    addr = buf.ctypes.data
    if te.register_memory(addr, buf.size) != 0:
        raise SystemExit("mooncake: registering the send buffer failed")
    hello = json.loads(sys.stdin.readline())
    out({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        t, size = fill_and_compute(buf, req)
        c = time.perf_counter()
        rc = te.transfer_sync_write(hello["session"], addr, hello["addr"] + req["slot"] * capacity,
                                    size)
        if rc != 0:
            raise SystemExit(f"mooncake: the transfer of {req['rid']} failed ({rc})")
        t["kv_read"] = time.perf_counter() - c
        out({"done": req["rid"], "t": t})


if __name__ == "__main__":
    main(receiver, sender)
