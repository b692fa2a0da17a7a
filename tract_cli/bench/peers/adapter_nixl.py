"""The NIXL peer adapter: run by the peer's own Python (its virtual environment
has nixl and numpy, not TraCT), as `receiver` (decode side) or `sender`
(prefill side), driven by `tract bench` over JSON lines on stdin/stdout.

The receiver registers SLOTS receive buffers of CAPACITY bytes and prints its
agent metadata and buffer address.  The sender registers one send buffer,
loads the receiver's metadata, and per request: stamps the stand-in KV (made
at start, before the clock: the same bytes as the tract transports), waits
out its modelled compute,
WRITEs it into the receiver's slot and, once the WRITE is DONE (the bytes are
in the receiver's memory), notifies the request id with its timings.  The
receiver polls its notifications (the progress thread is off: it would spin
a core), verifies every block and the tail, and prints the record
(adapter_common.py).

Standalone on purpose: it must import nothing from TraCT.
"""
import json
import os
import sys
import threading
import time

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # after the stdlib: see peers/__init__.py
from adapter_common import (fill_and_compute, main, out, receiver_buffer, record,  # noqa: E402
                         sender_buffer)  # (importing it takes stdout: before the libraries)
from nixl._api import nixl_agent, nixl_agent_config  # noqa: E402


def agent(name: str):
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def receiver(capacity: int, slots: int) -> None:
    a = agent("tract-bench-decode")
    buf = receiver_buffer(capacity, slots)
    addr = buf.ctypes.data
    reg = a.get_reg_descs([(addr, buf.size, 0, "")], "DRAM")
    if a.register_memory(reg) is None:
        raise SystemExit("nixl: registering the receive buffers failed")
    out({"meta": a.get_agent_metadata().hex(), "addr": addr})
    expected, lock = {}, threading.Lock()

    def read_expectations():
        for line in sys.stdin:
            msg = json.loads(line)
            with lock:
                expected[msg["rid"]] = msg
        with lock:
            expected["__eof__"] = True
    threading.Thread(target=read_expectations, daemon=True).start()
    pending = []
    while True:
        for msgs in a.get_new_notifs().values():
            pending.extend(json.loads(m) for m in msgs)
        if not pending:
            with lock:
                if expected.get("__eof__") and len(expected) == 1:
                    return
            time.sleep(0.0002)          # passive side: poll, yielding the core
            continue
        note = pending.pop(0)
        with lock:
            exp = expected.pop(note["rid"], None)
        if exp is None:                 # the notification raced its expectation: retry later
            pending.append(note)
            time.sleep(0.0002)
            continue
        out(record(buf, capacity, exp, note["t"]))


def sender(capacity: int) -> None:
    a = agent("tract-bench-prefill")
    buf = sender_buffer(capacity)          # the stand-in KV, before the clock
    addr = buf.ctypes.data
    reg = a.get_reg_descs([(addr, buf.size, 0, "")], "DRAM")
    if a.register_memory(reg) is None:
        raise SystemExit("nixl: registering the send buffer failed")
    hello = json.loads(sys.stdin.readline())
    remote = a.add_remote_agent(bytes.fromhex(hello["meta"]))
    raddr = hello["addr"]
    out({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        t, size = fill_and_compute(buf, req)
        c = time.perf_counter()
        local = a.get_xfer_descs([(addr, size, 0)], "DRAM")
        dst = a.get_xfer_descs([(raddr + req["slot"] * capacity, size, 0)], "DRAM")
        h = a.initialize_xfer("WRITE", local, dst, remote)
        state = a.transfer(h)
        while state not in ("DONE", "ERR"):
            state = a.check_xfer_state(h)
        if state == "ERR":
            raise SystemExit(f"nixl: the transfer of {req['rid']} failed")
        t["kv_read"] = time.perf_counter() - c
        a.release_xfer_handle(h)
        # DONE of a WRITE means the bytes are in the receiver's memory: tell it now
        a.send_notif(remote, json.dumps({"rid": req["rid"], "t": t}).encode())


if __name__ == "__main__":
    main(receiver, sender)
