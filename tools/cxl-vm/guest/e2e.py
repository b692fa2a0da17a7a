"""The TraCT parts of the emulated-CXL end-to-end test, run inside the guests.

    e2e.py roundtrip DEV --out F      one host: put / lookup / read on the device
    e2e.py setup DEV --out F          create the shared counter, mailbox and barrier
    e2e.py node DEV --node N --part prefill|decode --params F --out F
    e2e.py counter DEV --node N --offset OFF --iterations K    (one counter process)

Everything goes through the region: the two guests have no network. A's
tickets reach B through a mailbox in the region (publish / observe, the same
accessors as every other shared metadata), the guests meet at barriers in the
region, and the lock test is the lock issue's shared counter: plain
read-modify-writes under the two-tier lock, from processes on both nodes.
Every wait is bounded and fails with a message. Results are JSON files the
host driver (../cxlvm.py) checks.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np

from tract_cli.core.agent import ensure_agent
from tract_cli.core.handoff import Ticket, request_key
from tract_cli.core.hashing import block_hashes, pool_root
from tract_cli.core.pool import Pool
from tract_cli.inspect import snapshot

COUNTER, MAILBOX, BARRIER = "e2e-counter", "e2e-mailbox", "e2e-barrier"
LINE = 64
COUNTER_LOCK = 1                # the lock the lock issue's counter test uses
COUNTER_PROCESSES = 2           # per node
WAIT_S = 300.0                  # TCG guests are slow; a hang still fails


def payload(key: bytes, nbytes: int) -> np.ndarray:
    """The bytes of the block with KEY: a function of the key alone, so the
    decode side knows what every block must hold without being told."""
    seed = int.from_bytes(key[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


def request_tokens(r: int, block_tokens: int) -> np.ndarray:
    """Request R's prompt: 3 + r%4 full blocks and a partial tail; every other
    request shares the first two blocks of request 0 (a cached prefix)."""
    rng = np.random.default_rng(1000 + r)
    n = (3 + r % 4) * block_tokens + 5
    tokens = rng.integers(0, 32000, n).astype(np.int32)
    if r % 2 == 1:
        tokens[:2 * block_tokens] = request_tokens(0, block_tokens)[:2 * block_tokens]
    return tokens


def start_agent(dev: str, node: int, manager: bool, log: str) -> subprocess.Popen | None:
    return ensure_agent(dev, node, manager=manager, timeout=120, log_path=log)


def stop_agent(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise SystemExit("the node agent did not stop within 60 s of SIGTERM")


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    print(json.dumps(data, indent=2))


def wait_until(what: str, cond, timeout: float = WAIT_S):
    """Polls COND (bounded): its first truthy value, or exit with WHAT."""
    deadline = time.monotonic() + timeout
    while True:
        value = cond()
        if value:
            return value
        if time.monotonic() > deadline:
            raise SystemExit(f"e2e: timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.005)      # polling a word in the region, bounded by the deadline


# ---------------------------------------------------------------- one host

def roundtrip(dev: str, out: str) -> None:
    agent = start_agent(dev, 0, True, "/tmp/agent.log")
    try:
        with Pool.attach(dev, node=0) as pool:
            bt, nbytes = pool.info.geometry.block_tokens, pool.info.block_bytes
            tokens = np.random.default_rng(7).integers(0, 32000, 64 * bt).astype(np.int32)
            keys = block_hashes(tokens, block_tokens=bt, root=pool_root(pool.info))
            kv = np.stack([payload(k.tobytes(), nbytes) for k in keys])
            t0 = time.perf_counter()
            stored = pool.index.put(keys, kv, checksum=True).count("stored")
            t1 = time.perf_counter()
            hit = pool.index.lookup(keys)
            back = np.empty_like(kv)
            pool.index.read(hit, back)
            t2 = time.perf_counter()
            same = bool(np.array_equal(back, kv[:hit.hits]))
            # where the first blocks live, so the host can find them in its backing file
            blocks = [{"index": i, "offset": pool.slot_offset(int(hit.slots[i])), "length": 64,
                       "head_hex": kv[i, :64].tobytes().hex()} for i in range(4)]
            pool.index.unpin(hit)
            result = {"medium": pool.medium, "flush_mode": pool.flush_mode,
                      "block_bytes": nbytes, "blocks_put": int(stored), "hits": int(hit.hits),
                      "bytes_equal": same, "put_ms": round((t1 - t0) * 1e3, 2),
                      "lookup_read_ms": round((t2 - t1) * 1e3, 2), "blocks": blocks}
    finally:
        stop_agent(agent)
    write_json(out, result)
    if not (same and stored == len(keys) and hit.hits == len(keys)):
        raise SystemExit("e2e: the round trip did not give back what was put")


# ---------------------------------------------------------------- two hosts: setup

def setup(dev: str, out: str) -> None:
    agent = start_agent(dev, 0, True, "/tmp/agent.log")
    try:
        with Pool.attach(dev, node=0) as pool:
            nbytes = pool.info.block_bytes
            offsets = {}
            for name in (COUNTER, MAILBOX, BARRIER):
                slot = int(pool.allocator.alloc(1)[0])
                off = pool.slot_offset(slot)
                pool.publish(off, bytes(nbytes))            # zeroed on the device
                pool.objects.put(name, off, nbytes)
                offsets[name] = off
            result = {"uuid": pool.info.uuid, "medium": pool.medium,
                      "counter_offset": offsets[COUNTER], "mailbox_offset": offsets[MAILBOX],
                      "mailbox_capacity": nbytes // LINE - 1,
                      "barrier_offset": offsets[BARRIER]}
    finally:
        stop_agent(agent)
    write_json(out, result)


# ---------------------------------------------------------------- two hosts: the nodes

class Shared:
    """The setup guest's objects, found by name."""

    def __init__(self, pool: Pool):
        self.pool = pool
        found = {n: pool.objects.get(n) for n in (COUNTER, MAILBOX, BARRIER)}
        missing = [n for n, v in found.items() if v is None]
        if missing:
            raise SystemExit(f"e2e: the region has no {', '.join(missing)}: run the setup guest")
        self.counter = found[COUNTER][0]
        self.mailbox, mailbox_size = found[MAILBOX]
        self.capacity = mailbox_size // LINE - 1
        self.barrier = found[BARRIER][0]

    def arrive(self, node: int, stage: int) -> None:
        self.pool.publish_u64(self.barrier + node * LINE, stage)

    def meet(self, node: int, peer: int, stage: int) -> None:
        """Barrier: publish STAGE for NODE, wait (bounded) until PEER has reached it."""
        self.arrive(node, stage)
        wait_until(f"node {peer} to reach stage {stage}",
                   lambda: self.pool.observe_u64(self.barrier + peer * LINE) >= stage)

    def post(self, i: int, t: Ticket) -> None:
        """Writes ticket I, then publishes the count: B never sees a count ahead of its ticket."""
        line = (t.record.to_bytes(4, "little") + t.blocks.to_bytes(4, "little") +
                t.tokens.to_bytes(4, "little") + bytes(4) + bytes.fromhex(t.request_id))
        self.pool.publish(self.mailbox + (1 + i) * LINE, line.ljust(LINE, b"\0"))
        self.pool.publish_u64(self.mailbox, i + 1)

    def posted(self) -> int:
        return self.pool.observe_u64(self.mailbox)

    def ticket(self, i: int) -> Ticket:
        raw = self.pool.observe(self.mailbox + (1 + i) * LINE, LINE)
        u32 = lambda k: int.from_bytes(raw[4 * k:4 * k + 4], "little")
        return Ticket(u32(0), raw[16:32].hex(), u32(1), u32(2))


def run_counters(dev: str, node: int, offset: int, iterations: int) -> list[dict]:
    """COUNTER_PROCESSES processes on this node, each ITERATIONS locked increments."""
    procs = [subprocess.Popen([sys.executable, __file__, "counter", dev, "--node", str(node),
                               "--offset", str(offset), "--iterations", str(iterations)],
                              stdout=subprocess.PIPE, text=True)
             for _ in range(COUNTER_PROCESSES)]
    results = []
    for p in procs:
        try:
            stdout, _ = p.communicate(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise SystemExit(f"e2e: a counter process did not finish within {WAIT_S:.0f} s")
        if p.returncode != 0:
            raise SystemExit(f"e2e: a counter process failed (exit {p.returncode})")
        results.append(json.loads(stdout.strip().splitlines()[-1]))
    return results


def counter(dev: str, node: int, offset: int, iterations: int) -> None:
    """The lock issue's counter: a plain read-modify-write, correct only under the lock."""
    with Pool.attach(dev, node=node, prefault=False) as pool:
        t0 = time.perf_counter()
        for _ in range(iterations):
            pool.locks.acquire(COUNTER_LOCK, timeout=WAIT_S)
            value = pool.observe_u64(offset)
            pool.publish_u64(offset, value + 1)
            pool.locks.release(COUNTER_LOCK)
        print(json.dumps({"pid": os.getpid(), "iterations": iterations,
                          "elapsed_s": round(time.perf_counter() - t0, 3)}))


def prefill(pool: Pool, shared: Shared, requests: int) -> dict:
    """Puts every request's blocks (pinned), publishes its handoff, posts the ticket."""
    bt, nbytes = pool.info.geometry.block_tokens, pool.info.block_bytes
    root = pool_root(pool.info)
    stored = already = 0
    for r in range(requests):
        tokens = request_tokens(r, bt)
        keys = block_hashes(tokens, block_tokens=bt, root=root)
        kv = np.stack([payload(k.tobytes(), nbytes) for k in keys])
        put = pool.index.put(keys, kv, checksum=True, pin=True)
        stored += put.count("stored")
        already += put.count("already_ready")
        tail_tokens = len(tokens) - len(keys) * bt
        tail = payload(request_key(f"tail-{r}"), nbytes)
        ticket = pool.handoffs.publish(f"e2e-request-{r}", keys, len(tokens), tail=tail,
                                       tail_tokens=tail_tokens, ttl=WAIT_S)
        pool.index.unpin(put.pinned(keys))        # the handoff holds its own pins now
        shared.post(r, ticket)
    return {"blocks_stored": stored, "blocks_already_cached": already}


def decode(pool: Pool, shared: Shared, requests: int) -> dict:
    """Takes every ticket, reads the blocks through the handoff and through the
    prefix index, checks every byte against what the block's key says, acks."""
    bt, nbytes = pool.info.geometry.block_tokens, pool.info.block_bytes
    root = pool_root(pool.info)
    verified = corrupt = blocks_read = lookup_hits = 0
    for r in range(requests):
        wait_until(f"ticket {r} in the mailbox", lambda: shared.posted() > r)
        ticket = shared.ticket(r)
        tokens = request_tokens(r, bt)
        keys = block_hashes(tokens, block_tokens=bt, root=root)
        expect = np.stack([payload(k.tobytes(), nbytes) for k in keys])
        if ticket.request_id != request_key(f"e2e-request-{r}").hex() or \
                ticket.blocks != len(keys) or ticket.tokens != len(tokens):
            raise SystemExit(f"e2e: ticket {r} is not request {r}'s: {ticket}")
        rec = pool.handoffs.open(ticket)
        got = np.empty_like(expect)
        pool.handoffs.copy_blocks(rec, got, verify=True)
        bad = int((got != expect).any(axis=1).sum())
        tail = np.empty(nbytes, np.uint8)
        pool.handoffs.copy_tail(rec, tail)
        bad += int(not np.array_equal(tail, payload(request_key(f"tail-{r}"), nbytes)))
        # the same blocks, found as a prefix cache hit
        hit = pool.index.lookup(keys)
        again = np.empty((hit.hits, nbytes), np.uint8)
        pool.index.read(hit, again)
        bad += int((again != expect[:hit.hits]).any(axis=1).sum())
        pool.index.unpin(hit)
        pool.handoffs.ack(ticket)
        lookup_hits += hit.hits
        blocks_read += len(keys) + 1 + hit.hits
        corrupt += bad
        verified += int(bad == 0 and hit.hits == len(keys))
    return {"handoffs_verified": verified, "corrupt_blocks": corrupt,
            "blocks_read": blocks_read, "lookup_hits": lookup_hits}


def node(dev: str, node_id: int, part: str, params_path: str, out: str) -> None:
    with open(params_path) as f:
        params = json.load(f)
    requests, iterations = int(params["requests"]), int(params["iterations"])
    peer = 1 - node_id
    t0 = time.perf_counter()
    agent = start_agent(dev, node_id, node_id == 0, f"/tmp/agent-{node_id}.log")
    result: dict = {"node": node_id, "part": part, "counter_processes": COUNTER_PROCESSES}
    try:
        with Pool.attach(dev, node=node_id) as pool:
            shared = Shared(pool)
            if requests > shared.capacity:
                raise SystemExit(f"e2e: the mailbox holds {shared.capacity} tickets, "
                                 f"not {requests}")
            result["medium"] = pool.medium
            shared.meet(node_id, peer, 1)                       # both agents are up
            t1 = time.perf_counter()
            acquired0, wait0 = pool.locks.stats(COUNTER_LOCK)      # this node's, all processes
            run_counters(dev, node_id, shared.counter, iterations)
            acquired1, wait1 = pool.locks.stats(COUNTER_LOCK)
            result["counter_s"] = round(time.perf_counter() - t1, 2)
            result["lock_acquisitions"] = acquired1 - acquired0
            result["lock_wait_s"] = round(wait1 - wait0, 3)
            shared.meet(node_id, peer, 2)                       # both nodes' counters done
            result["counter_seen"] = pool.observe_u64(shared.counter)
            t2 = time.perf_counter()
            work = prefill if part == "prefill" else decode
            result.update(work(pool, shared, requests))
            result["handoff_phase_s"] = round(time.perf_counter() - t2, 2)
            shared.meet(node_id, peer, 3)      # B has acked everything: A's manager may stop
            # afterwards, as every host sees the region: no pins, no handoffs left
            snap = snapshot.take(pool, views=("index", "handoffs"))
            result["pins_left"] = snap["index"]["pins_total"]
            result["handoffs_left"] = len(snap["handoffs"]["in_flight"])
    finally:
        stop_agent(agent)
    result["elapsed_s"] = round(time.perf_counter() - t0, 2)
    write_json(out, result)


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    for name in ("roundtrip", "setup"):
        p = sub.add_parser(name)
        p.add_argument("dev")
        p.add_argument("--out", required=True)
    p = sub.add_parser("node")
    p.add_argument("dev")
    p.add_argument("--node", type=int, choices=(0, 1), required=True)
    p.add_argument("--part", choices=("prefill", "decode"), required=True)
    p.add_argument("--params", required=True)
    p.add_argument("--out", required=True)
    p = sub.add_parser("counter")
    p.add_argument("dev")
    p.add_argument("--node", type=int, required=True)
    p.add_argument("--offset", type=int, required=True)
    p.add_argument("--iterations", type=int, required=True)
    a = ap.parse_args()
    if a.cmd == "roundtrip":
        roundtrip(a.dev, a.out)
    elif a.cmd == "setup":
        setup(a.dev, a.out)
    elif a.cmd == "node":
        node(a.dev, a.node, a.part, a.params, a.out)
    else:
        counter(a.dev, a.node, a.offset, a.iterations)


if __name__ == "__main__":
    main()
