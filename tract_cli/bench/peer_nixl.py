"""The NIXL peer adapter: run by the peer's own Python (its virtual environment
has nixl and numpy, not TraCT), as `receiver` (decode side) or `sender`
(prefill side), driven by `tract bench` over JSON lines on stdin/stdout.

The receiver registers SLOTS receive buffers of CAPACITY bytes and prints its
agent metadata and buffer address.  The sender registers one send buffer,
loads the receiver's metadata, and per request: waits out its modelled
compute, writes the stand-in KV (the same bytes as the tract transports),
WRITEs it into the receiver's slot and, once the WRITE is DONE (the bytes are
in the receiver's memory), notifies the request id with its timings.  The
receiver polls its notifications (the progress thread is off: it would spin
a core), verifies the first and last block and the tail,
and prints the record (decode modelled as the runner does).

Standalone on purpose: it must import nothing from TraCT.
"""
import argparse
import json
import os
import sys
import threading
import time

# the protocol owns the original stdout; whatever the libraries print goes to stderr
PROTO = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)

import numpy as np  # noqa: E402
from nixl._api import nixl_agent, nixl_agent_config  # noqa: E402


def payload(keys: np.ndarray, block_bytes: int) -> np.ndarray:
    """(n, block_bytes): each block is its 16-byte key, repeated (as runner.payload)."""
    return np.tile(keys, (1, block_bytes // 16)) if len(keys) else np.zeros((0, block_bytes), np.uint8)


def tail_bytes(rid: str, n: int) -> np.ndarray:
    raw = rid.encode() or b"x"
    return np.frombuffer((raw * (n // len(raw) + 1))[:n], dtype=np.uint8)


def out(obj) -> None:
    PROTO.write(json.dumps(obj) + "\n")
    PROTO.flush()


def agent(name: str):
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def receiver(capacity: int, slots: int) -> None:
    a = agent("tract-bench-decode")
    buf = np.zeros(capacity * slots, np.uint8)
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
        n, bb, tb = exp["blocks"], exp["block_bytes"], exp["tail_bytes"]
        base = exp["slot"] * capacity
        keys = np.frombuffer(bytes.fromhex(exp["keys"]), np.uint8).reshape(-1, 16)
        blocks = buf[base:base + n * bb].reshape(n, bb) if n else np.zeros((0, bb), np.uint8)
        want = payload(keys[[0, n - 1]] if n else keys[:0], bb)
        ok = bool((not n or (np.array_equal(blocks[0], want[0]) and np.array_equal(blocks[-1], want[-1])))
                  and np.array_equal(buf[base + n * bb:base + n * bb + tb], tail_bytes(exp["rid"], tb)))
        t = note["t"]
        t["first_token"] = exp["decode_s"]              # modelled as tract's runner does
        ttft = time.monotonic() + t["first_token"] - exp["arrival"]
        out({"rid": exp["rid"], "t": t, "ok": ok, "hits": 0, "blocks": n, "tokens": exp["tokens"],
             "output_len": exp["output_len"], "ttft": ttft,
             "e2e": ttft + max(exp["output_len"] - 1, 0) * exp["decode_s"], "prefill": 0,
             "slot": exp["slot"]})


def sender(capacity: int) -> None:
    a = agent("tract-bench-prefill")
    buf = np.zeros(capacity, np.uint8)
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
        t = {"queue": time.monotonic() - req["arrival"]}
        c = time.perf_counter()            # producing the KV is part of the modelled compute
        n, bb, tb = req["blocks"], req["block_bytes"], req["tail_bytes"]
        keys = np.frombuffer(bytes.fromhex(req["keys"]), np.uint8).reshape(-1, 16)
        if n:
            buf[:n * bb].reshape(n, bb)[:] = payload(keys, bb)
        buf[n * bb:n * bb + tb] = tail_bytes(req["rid"], tb)
        made = time.perf_counter() - c
        time.sleep(max(req["compute_s"] - made, 0.0))
        t["compute"] = max(req["compute_s"], made)
        size = n * bb + tb
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
