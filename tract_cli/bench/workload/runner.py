"""`tract bench`: requests through prefill and decode worker processes on
emulated nodes, issued at their arrival times, the KV moved by a transport
under test, timed per stage.

The worker loops here are the same for every transport: what differs
(`tract-copy`, `tract-zero-copy`, `tcp`) is a prefill side and a decode side
in `workload.transports`; the requests' clock, dispatch and collection are
`workload.driver`'s, shared with the peers (NIXL, Mooncake, LMCache: `bench.peers`,
in their own environments) and real compute (`workload.real`).

What is timed is the KV path, never the harness:

- the stand-in KV exists before the clock starts, as a GPU's KV is in its
  memory when its compute ends: each prefill worker makes one buffer of
  stand-in blocks (`bench.standin`, shared with the peers) at start, and per
  request only stamps each block's key into its first 16 bytes (and the
  request's into the tail);
- modelled compute is exactly the model: the worker sleeps until
  start + tokens computed / the profile's prefill rate (`Compute`), doing
  no other work that competes for the CPUs (zero-copy's stores into the
  slots it computes into are the compute's own output: the stand-in of
  every block it computes, in full);
- decode is modelled as continuous batching (a request's first token one
  decode step after its KV is in, one token a step after that, the worker
  free for the next handoff at once);
- verifying runs after the first token's time is taken and before the ack,
  outside every timed stage, and is timed on its own (`verify_s`): on every
  row it means every block of the request and its tail hold exactly the
  bytes the prefill side made (its stand-in and stamps), whoever computed
  them (prefix hits included) -- byte for byte, in one vectorized comparison
  against the decode worker's own stand-in (`standin.Expected`), or for
  zero-copy, where the blocks stay in the pool's slots, each slot's CRC-32C
  taken in place (one C call) against the CRC its block must have
  (`standin.BlockCrcs`).

Reports say "modelled compute".
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import threading
import time
from dataclasses import dataclass

import numpy as np

from tract_cli.bench.workload import transports
from tract_cli.bench.workload.driver import TransportResult, drive
from tract_cli.bench.standin import Expected, sleep_until, stamp, stand_in
from tract_cli.bench.workload.workloads import Request
from tract_cli.core.errors import TractError

WORKER_TIMEOUT_S = int(os.environ.get("TRACT_BENCH_WORKER_TIMEOUT_S", "600"))


@dataclass(frozen=True)
class Compute:
    """Modelled compute: prefill tokens per second, decode seconds per token."""

    prefill_tokens_per_s: float
    decode_s_per_token: float


def _prefill(path, node, index, transport, ctl, to_decode, decode_ports, compute, results,
             max_tokens):
    try:
        _prefill_loop(path, node, index, transport, ctl, to_decode, decode_ports, compute,
                      max_tokens)
    except TractError as exc:              # one line to the driver, not a traceback
        results.put({"error": f"prefill worker {index}: {exc}"})


def _prefill_loop(path, node, index, transport, ctl, to_decode, decode_ports, compute, max_tokens):
    from tract_cli.core.hashing import block_hashes, pool_root
    from tract_cli.core.pool import Pool
    pool = Pool.attach(path, node=node)
    info, g = pool.info, pool.info.geometry
    bb, bt, bpt = info.block_bytes, g.block_tokens, info.bytes_per_token
    root = pool_root(info)
    # the stand-in KV of the longest request, made before the clock starts
    kv_all = stand_in(max_tokens // bt * bb + bt * bpt)
    side = transports.prefill_side(transport, pool)
    side.connect(index, decode_ports)
    ctl.send("ready")                                    # the driver's clock starts after this
    while (msg := ctl.recv()) is not None:
        start = time.monotonic()
        rid, tokens = msg["rid"], np.frombuffer(msg["tokens"], dtype=np.int32)
        dec = msg["decode"]
        t = {"queue": start - msg["arrival"]}
        c = time.perf_counter()
        keys = block_hashes(tokens, root=root)
        t["hash"] = time.perf_counter() - c
        n = len(keys)
        tail_bytes = (len(tokens) - n * bt) * bpt
        hits = side.lookup(keys, t)
        miss = keys[hits:]
        side.reserve(miss, t)
        # compute: exactly the model (the tokens it computes at the profile's
        # rate), slept until its deadline; the KV it produces exists already
        c0 = time.monotonic()
        modelled = (len(tokens) - hits * bt) / compute.prefill_tokens_per_s
        stamp(kv_all, keys, bb, rid, tail_bytes)
        kv = kv_all[:n * bb].reshape(n, bb) if n else kv_all[:0].reshape(0, bb)
        tail = kv_all[n * bb:n * bb + tail_bytes]
        side.compute_into(kv, hits)
        sleep_until(c0 + modelled)
        t["compute"] = time.monotonic() - c0
        side.write(miss, kv[hits:], t)
        out = {"rid": rid, "keys": keys.tobytes(), "t": t, "hits": hits, "blocks": n,
               "tokens": len(tokens), "arrival": msg["arrival"], "output_len": msg["output_len"],
               "prefill": msg["prefill"], "modelled_compute": modelled}
        side.publish(out, keys, len(tokens), tail, len(tokens) - n * bt, t)
        side.deliver(out, to_decode[dec], dec, kv_all[:n * bb + tail_bytes])
    side.close()
    pool.close()


def _decode(path, node, index, transport, inbox, results, ready, prefill_count, compute,
            max_tokens):
    try:
        _decode_loop(path, node, index, transport, inbox, results, ready, prefill_count, compute,
                     max_tokens)
    except TractError as exc:
        results.put({"error": f"decode worker: {exc}"})


def _decode_loop(path, node, index, transport, inbox, results, ready, prefill_count, compute,
                 max_tokens):
    from tract_cli.core.pool import Pool
    pool = Pool.attach(path, node=node)
    info = pool.info
    bb, bt = info.block_bytes, info.geometry.block_tokens
    # the private KV buffer (blocks, then the tail), faulted in now, not inside a timed copy
    out = np.empty(max_tokens // bt * bb + bt * info.bytes_per_token, np.uint8)
    out.fill(0)             # np.zeros would leave the pages to fault in inside the first read
    expected = Expected(out.size)       # what each request's KV must be, made now too
    side = transports.decode_side(transport, pool)
    ready.put((index, side.listen(prefill_count)))
    side.accept(prefill_count)
    while (msg := inbox.get()) is not None:
        t = msg["t"]
        keys = np.frombuffer(msg["keys"], np.uint8).reshape(-1, 16)
        n, hits = msg["blocks"], msg["hits"]
        blocks, tail = side.read(msg, out, t)
        # decode is modelled as continuous batching: the request joins the running
        # batch, its first token one step after its KV is in, one token a step
        # after that; the worker is free for the next handoff at once
        t["first_token"] = compute.decode_s_per_token
        first_token_at = time.monotonic() + t["first_token"]
        # every block and the tail verified after the first token's time is
        # taken, before the ack (zero-copy's slots are pinned until then): in no
        # timed stage, its own time reported apart
        c = time.perf_counter()
        ok = side.verify(blocks, tail, keys, expected.of(keys, bb, msg["rid"], tail.size))
        verify_s = time.perf_counter() - c
        del blocks                          # no view of a slot outlives its handoff
        side.ack(t)
        ttft = first_token_at - msg["arrival"]
        results.put({"rid": msg["rid"], "t": t, "ok": bool(ok), "verify_s": verify_s,
                     "hits": hits, "blocks": n,
                     "tokens": msg["tokens"], "output_len": msg["output_len"], "ttft": ttft,
                     "e2e": ttft + max(msg["output_len"] - 1, 0) * compute.decode_s_per_token,
                     "prefill": msg["prefill"], "modelled_compute": msg["modelled_compute"]})
    side.close()
    pool.close()


def _lock_totals(path: str, nodes) -> tuple[float, int]:
    from tract_cli.core.pool import Pool
    wait, count = 0.0, 0
    for node in nodes:
        with Pool.attach(path, node=node, prefault=False) as p:
            a, w = p.locks.totals()
        wait += w
        count += a
    return wait, count


def run_transport(path: str, transport: str, requests: list[Request], compute: Compute,
                  prefill_workers: int = 1, decode_workers: int = 1, prefill_node: int = 1,
                  decode_node: int = 2, progress=None) -> TransportResult:
    """Runs every request through one transport: requests are issued at their
    arrival times to the prefill worker with the fewest outstanding requests;
    each prefill worker hands off round robin to the decode workers."""
    ctx = mp.get_context("spawn")
    longest = max(len(r.tokens) for r in requests)
    results = ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(decode_workers)]
    ready = ctx.Queue()
    decoders = [ctx.Process(target=_decode, args=(path, decode_node, i, transport, inboxes[i],
                                                  results, ready, prefill_workers, compute,
                                                  longest),
                            daemon=True)
                for i in range(decode_workers)]
    for d in decoders:
        d.start()
    # decode workers report in any order: port i must be decode worker i's
    ports = [p for _, p in sorted(ready.get(timeout=WORKER_TIMEOUT_S) for _ in decoders)]
    ctls, children, prefills = [], [], []
    for i in range(prefill_workers):
        parent, child = ctx.Pipe()
        ctls.append(parent)
        children.append(child)
        prefills.append(ctx.Process(target=_prefill, args=(path, prefill_node, i, transport, child,
                                                          inboxes, ports, compute, results,
                                                          longest),
                                    daemon=True))
    for p in prefills:
        p.start()
    for c in children:          # the driver keeps only its ends: a dead worker breaks its pipe
        c.close()
    for c in ctls:
        if not c.poll(WORKER_TIMEOUT_S) or c.recv() != "ready":
            _stop(prefills + decoders)
            raise TractError(f"{transport}: a prefill worker did not start", "check the workers")
    lock_before = _lock_totals(path, {prefill_node, decode_node})
    outstanding = [0] * prefill_workers
    lock = threading.Lock()

    def dispatch(seq, req, arrival):
        with lock:
            w = min(range(prefill_workers), key=lambda i: (outstanding[i], (seq + i) % prefill_workers))
            outstanding[w] += 1
        try:
            ctls[w].send({"rid": req.rid, "tokens": req.tokens.tobytes(),
                          "arrival": arrival, "output_len": req.output_len,
                          "prefill": w, "decode": seq % decode_workers})
        except OSError:                           # the worker died: receive() says why
            return False

    def receive():
        deadline = time.monotonic() + WORKER_TIMEOUT_S
        while True:
            try:
                rec = results.get(timeout=0.5)
            except queue_mod.Empty:
                dead = [p for p in prefills + decoders if p.exitcode not in (None, 0)]
                if dead:
                    raise TractError(f"{transport}: a worker process died (exit code "
                                     f"{dead[0].exitcode})", "its error is printed above")
                if time.monotonic() > deadline:
                    raise TractError(f"{transport}: no request finished within "
                                     f"{WORKER_TIMEOUT_S} s", "check the workers")
                continue
            if "error" in rec:
                raise TractError(f"{transport}: {rec['error']}")
            with lock:
                outstanding[rec["prefill"]] -= 1
            return rec

    try:
        # bounded: receive() gives up after its deadline
        res = drive(transport, requests, dispatch, receive, progress)
    finally:
        for c in ctls:
            try:
                c.send(None)
            except OSError:                # that worker is gone already
                pass
        for p in prefills:
            p.join(timeout=60)
        for q in inboxes:
            q.put(None)
        for d in decoders:
            d.join(timeout=60)
        _stop(prefills + decoders)
    lock_after = _lock_totals(path, {prefill_node, decode_node})
    res.lock_wait_s = lock_after[0] - lock_before[0]
    res.lock_acquisitions = lock_after[1] - lock_before[1]
    return res


def _stop(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
            proc.join(timeout=30)
