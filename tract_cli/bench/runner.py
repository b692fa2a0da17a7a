"""`tract bench`: requests through prefill and decode worker processes on two
emulated nodes, the KV moved by a transport under test, timed per stage.

Transports: `tract-copy` (private -> pool -> private, as a GPU does by DMA),
`tract-zero-copy` (prefill computes into pool slots, decode reads them in
place: the handoff moves metadata only), `tcp` (the KV over a loopback
socket: the network path stand-in).  Compute is modelled from a device
profile (prefill tokens/s, decode s/token) and added to the measured stages;
reports say so.  Every request's KV is verified on the decode side.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import socket
import statistics
import time
from dataclasses import dataclass, field

import numpy as np

from tract_cli.bench.workloads import Request

TRANSPORTS = ("tract-copy", "tract-zero-copy", "tcp")
WORKER_TIMEOUT_S = 600


def payload(key: bytes, nbytes: int) -> np.ndarray:
    """Deterministic stand-in KV for a block: the key, repeated."""
    return np.frombuffer((key * (nbytes // 16 + 1))[:nbytes], dtype=np.uint8)


def _tail(rid: str, nbytes: int) -> np.ndarray:
    raw = rid.encode() or b"x"
    return np.frombuffer((raw * (nbytes // len(raw) + 1))[:nbytes], dtype=np.uint8)


def _prefill(path, node, transport, ctl, to_decode, tcp_port, prefill_rate):
    from tract_cli.core.hashing import block_hashes, pool_root
    from tract_cli.core.pool import Pool
    pool = Pool.attach(path, node=node)
    info, g = pool.info, pool.info.geometry
    root = pool_root(info)
    sock = socket.create_connection(("127.0.0.1", tcp_port)) if transport == "tcp" else None
    while (msg := ctl.recv()) is not None:
        rid, tokens = msg["rid"], np.frombuffer(msg["tokens"], dtype=np.int32)
        t = {}
        c = time.perf_counter()
        keys = block_hashes(tokens, root=root)
        t["hash"] = time.perf_counter() - c
        n, bt = len(keys), g.block_tokens
        tail_tokens = len(tokens) - n * bt
        tail = _tail(rid, tail_tokens * info.bytes_per_token)
        hits = 0
        if transport != "tcp":
            c = time.perf_counter()
            hit = pool.index.lookup(keys)
            t["lookup"] = time.perf_counter() - c
            hits = hit.hits
        t["compute"] = (len(tokens) - hits * bt) / prefill_rate          # modelled
        miss = keys[hits:]
        if transport == "tract-copy":
            kv = np.stack([payload(k.tobytes(), info.block_bytes) for k in miss]) if len(miss) \
                else np.zeros((0, info.block_bytes), np.uint8)
            c = time.perf_counter()
            pool.index.put(miss, kv)
            t["kv_write"] = time.perf_counter() - c
        elif transport == "tract-zero-copy":
            c = time.perf_counter()
            status, slots = pool.index.reserve(miss)
            t["kv_write"] = time.perf_counter() - c
            for i in np.flatnonzero(status == 4):                       # "compute" into slots
                pool.slot_bytes(int(slots[i]))[:] = payload(miss[i].tobytes(), info.block_bytes)
            c = time.perf_counter()
            pool.index.commit(miss, status, slots)
            t["kv_write"] += time.perf_counter() - c
        if transport == "tcp":
            kv = np.stack([payload(k.tobytes(), info.block_bytes) for k in keys])
            # tell the decode side first, so it is receiving while we send
            # (the transfer is timed there, from its first byte to its last)
            to_decode.send({"rid": rid, "ticket": {"blocks": n, "tail_bytes": tail.size},
                            "keys": keys.tobytes(), "t": t, "hits": 0, "blocks": n})
            sock.sendall(memoryview(kv).cast("B"))
            sock.sendall(memoryview(tail))
            continue
        else:
            c = time.perf_counter()
            ticket = pool.handoffs.publish(rid, keys, len(tokens), tail=tail,
                                           tail_tokens=tail_tokens).to_dict()
            t["handoff_publish"] = time.perf_counter() - c
            pool.index.unpin(hit)
        to_decode.send({"rid": rid, "ticket": ticket, "keys": keys.tobytes(), "t": t,
                        "hits": hits, "blocks": n})
    pool.close()


def _decode(path, node, transport, from_prefill, ctl, listener_port_q, decode_s):
    from tract_cli.core.handoff import Ticket
    from tract_cli.core.pool import Pool
    pool = Pool.attach(path, node=node)
    info = pool.info
    conn = None
    if transport == "tcp":
        srv = socket.socket()
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        listener_port_q.put(srv.getsockname()[1])
        conn, _ = srv.accept()
    else:
        listener_port_q.put(0)
    out = None
    while (msg := from_prefill.recv()) is not None:
        t = msg["t"]
        keys = np.frombuffer(msg["keys"], np.uint8).reshape(-1, 16)
        n = msg["blocks"]
        if out is None or out.shape[0] < n:
            out = np.empty((n, info.block_bytes), np.uint8)
            out.fill(0)          # fault the private buffer in now, not inside a timed copy
        if transport == "tcp":
            tail = np.empty(msg["ticket"]["tail_bytes"], np.uint8)
            c = time.perf_counter()
            view = memoryview(out[:n]).cast("B")
            got = 0
            while got < view.nbytes:
                got += conn.recv_into(view[got:], view.nbytes - got)
            got = 0
            tv = memoryview(tail)
            while got < tail.size:
                got += conn.recv_into(tv[got:], tail.size - got)
            t["kv_read"] = time.perf_counter() - c
            blocks = [out[0], out[n - 1]] if n else []
        else:
            ticket = Ticket.from_dict(msg["ticket"])
            c = time.perf_counter()
            rec = pool.handoffs.open(ticket)
            t["handoff_open"] = time.perf_counter() - c
            c = time.perf_counter()
            if transport == "tract-copy":
                pool.handoffs.copy_blocks(rec, out[:n], verify=False)
                blocks = [out[0], out[n - 1]] if n else []
            else:
                views = pool.handoffs.views(rec)
                blocks = [views[0].view(np.uint8).reshape(-1), views[-1].view(np.uint8).reshape(-1)] \
                    if n else []
                del views
            t["kv_read"] = time.perf_counter() - c
            tail = np.empty(rec.tail_tokens * info.bytes_per_token, np.uint8)
            pool.handoffs.copy_tail(rec, tail)
        ok = all(np.array_equal(b, payload(keys[i].tobytes(), info.block_bytes))
                 for b, i in zip(blocks, (0, n - 1))) and np.array_equal(tail, _tail(msg["rid"], tail.size))
        t["first_token"] = decode_s                                       # modelled
        if transport != "tcp":
            del blocks
            c = time.perf_counter()
            pool.handoffs.ack(ticket)
            t["ack"] = time.perf_counter() - c
        ctl.send({"rid": msg["rid"], "t": t, "ok": bool(ok), "hits": msg["hits"], "blocks": n})
    pool.close()


@dataclass
class TransportResult:
    transport: str
    records: list = field(default_factory=list)

    def stage(self, name: str) -> list[float]:
        return [r["t"].get(name, 0.0) for r in self.records]


def handoff_s(rec: dict) -> float:
    """Moving the KV from prefill to decode: writing it to the pool (or sending),
    the handoff record, reading it out (or receiving)."""
    t = rec["t"]
    return sum(t.get(k, 0.0) for k in ("kv_write", "handoff_publish", "handoff_open", "kv_read"))


def ttft_s(rec: dict) -> float:
    t = rec["t"]
    return sum(t.get(k, 0.0) for k in ("hash", "lookup", "compute", "kv_write", "handoff_publish",
                                        "handoff_open", "kv_read", "first_token"))


def run_transport(path: str, transport: str, requests: list[Request], prefill_rate: float,
                  decode_s: float, progress=None) -> TransportResult:
    """Runs every request through one transport with a prefill and a decode process."""
    ctx = mp.get_context("spawn")
    p_ctl, p_ctl_child = ctx.Pipe()
    d_ctl, d_ctl_child = ctx.Pipe()
    to_dec_w, to_dec_r = ctx.Pipe()
    port_q = ctx.Queue()
    decode = ctx.Process(target=_decode, args=(path, 2, transport, to_dec_r, d_ctl_child, port_q,
                                               decode_s), daemon=True)
    decode.start()
    port = port_q.get(timeout=WORKER_TIMEOUT_S)
    prefill = ctx.Process(target=_prefill, args=(path, 1, transport, p_ctl_child, to_dec_w, port,
                                                 prefill_rate), daemon=True)
    prefill.start()
    res = TransportResult(transport)
    try:
        for req in requests:
            p_ctl.send({"rid": req.rid, "tokens": req.tokens.tobytes()})
            if not d_ctl.poll(WORKER_TIMEOUT_S):
                raise RuntimeError(f"{transport}: no result for {req.rid} within {WORKER_TIMEOUT_S} s")
            res.records.append(d_ctl.recv())
            if progress:
                progress()
    finally:
        p_ctl.send(None)
        prefill.join(timeout=60)
        to_dec_w.send(None)
        decode.join(timeout=60)
        for proc in (prefill, decode):
            if proc.is_alive():
                proc.kill()
    return res


def memcpy_reference(nbytes: int, rounds: int = 3) -> float:
    """Seconds for two copies of NBYTES (private -> buffer -> private), best of rounds."""
    a = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8)
    b, c = np.empty_like(a), np.empty_like(a)
    np.copyto(b, a)
    np.copyto(c, b)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(b, a)
        np.copyto(c, b)
        best = min(best, time.perf_counter() - t0)
    return best


def summarize(r: TransportResult) -> dict:
    ttft = [ttft_s(x) for x in r.records]
    hand = [handoff_s(x) for x in r.records]
    pct = lambda v, q: float(np.percentile(v, q)) if v else 0.0
    blocks = sum(x["blocks"] for x in r.records)
    hits = sum(x["hits"] for x in r.records)
    return {"transport": r.transport, "requests": len(r.records),
            "verified": all(x["ok"] for x in r.records),
            "ttft_mean_s": statistics.fmean(ttft), "ttft_p50_s": pct(ttft, 50),
            "ttft_p90_s": pct(ttft, 90), "ttft_p99_s": pct(ttft, 99),
            "handoff_mean_s": statistics.fmean(hand), "handoff_p50_s": pct(hand, 50),
            "hit_rate_blocks": hits / blocks if blocks else 0.0,
            "stages_mean_s": {k: statistics.fmean(r.stage(k)) for k in
                              ("hash", "lookup", "compute", "kv_write", "handoff_publish",
                               "handoff_open", "kv_read", "first_token", "ack")}}
