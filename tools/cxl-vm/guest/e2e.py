"""The TraCT parts of the emulated-CXL end-to-end test, run inside the guests.

    e2e.py roundtrip DEV --out F [--shared-out F2]
                                      one host: put / lookup / read on the device;
                                      with --shared-out, also create the two-host
                                      test's counter, mailbox and barrier
    e2e.py node DEV --node N --part prefill|decode --params F --out F --record DIR
                                      a host of the two: attach the namespace the
                                      first guest made (provision only), the
                                      shared counter, the handoffs, `tract check`

Under the emulator every new Python process costs ~45 s of start-up, so the
node agent and the counter processes are forked from this one, and the
node's provisioning and check run in it through the functions `tract init
--provision-only` and `tract check` call (their output recorded as theirs).

Everything goes through the region: the two guests have no network. A's
tickets reach B through a mailbox in the region (publish / observe, the same
accessors as every other shared metadata), the guests meet at barriers in the
region, and the lock test is a shared counter: plain
read-modify-writes under the two-tier lock, from processes on both nodes.
Every wait is bounded and fails with a message. Results are JSON files the
host driver (../cxlvm.py) checks.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import multiprocessing
import os
import signal
import time

import numpy as np

from tract_cli.core.agent import AgentOptions, run_foreground
from tract_cli.core.handoff import Ticket, request_key
from tract_cli.core.hashing import block_hashes, pool_root
from tract_cli.core.locks import LOCK_OBJDIR
from tract_cli.core.nodes import read_nodes
from tract_cli.core.pool import Pool
from tract_cli.inspect import snapshot

COUNTER, MAILBOX, BARRIER = "e2e-counter", "e2e-mailbox", "e2e-barrier"
LINE = 64
COUNTER_LOCK = LOCK_OBJDIR      # the lock the lock tests' counter uses
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


_FORK = multiprocessing.get_context("fork")


def _agent_child(dev: str, node: int, manager: bool, log: str) -> None:
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 2)
    run_foreground(AgentOptions(dev, node, manager))


def start_agent(dev: str, node: int, manager: bool, log: str):
    """The node agent (`tract agent`'s run_foreground), in a child forked from
    this process; returns once its heartbeat shows in the node table."""
    proc = _FORK.Process(target=_agent_child, args=(dev, node, manager, log))
    proc.start()
    with Pool.attach(dev, node=node, readonly=True, prefault=False) as pool:
        def up():
            if not proc.is_alive():
                raise SystemExit(f"e2e: node {node}'s agent exited ({proc.exitcode}); see {log}")
            rec = read_nodes(pool)[node]
            return rec.agent_pid == proc.pid and rec.alive()
        wait_until(f"node {node}'s agent to heartbeat", up)
    return proc


def stop_agent(proc) -> None:
    if proc is not None and proc.is_alive():
        os.kill(proc.pid, signal.SIGTERM)
        proc.join(timeout=60)
        if proc.is_alive():
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

def roundtrip(dev: str, out: str, shared_out: str | None = None) -> None:
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
            if shared_out:
                write_json(shared_out, make_shared(pool))
    finally:
        stop_agent(agent)
    write_json(out, result)
    if not (same and stored == len(keys) and hit.hits == len(keys)):
        raise SystemExit("e2e: the round trip did not give back what was put")


# ---------------------------------------------------------------- two hosts: the shared objects

def make_shared(pool: Pool) -> dict:
    """Creates the two-host test's counter, mailbox and barrier (zeroed on the device)."""
    nbytes = pool.info.block_bytes
    offsets = {}
    for name in (COUNTER, MAILBOX, BARRIER):
        slot = int(pool.allocator.alloc(1)[0])
        off = pool.slot_offset(slot)
        pool.publish(off, bytes(nbytes))
        pool.objects.put(name, off, nbytes)
        offsets[name] = off
    return {"uuid": pool.info.uuid, "medium": pool.medium,
            "counter_offset": offsets[COUNTER], "mailbox_offset": offsets[MAILBOX],
            "mailbox_capacity": nbytes // LINE - 1, "barrier_offset": offsets[BARRIER]}


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


def _counter_child(dev: str, node: int, offset: int, iterations: int, conn) -> None:
    conn.send(counter(dev, node, offset, iterations))
    conn.close()


def run_counters(dev: str, node: int, offset: int, iterations: int) -> list[dict]:
    """COUNTER_PROCESSES processes on this node (forked), each ITERATIONS locked increments."""
    procs = []
    for _ in range(COUNTER_PROCESSES):
        parent, child = _FORK.Pipe(duplex=False)
        p = _FORK.Process(target=_counter_child, args=(dev, node, offset, iterations, child))
        p.start()
        child.close()
        procs.append((p, parent))
    results = []
    deadline = time.monotonic() + WAIT_S
    for p, conn in procs:
        if not conn.poll(max(0.0, deadline - time.monotonic())):
            for q, _ in procs:
                q.kill()
            raise SystemExit(f"e2e: a counter process did not finish within {WAIT_S:.0f} s")
        results.append(conn.recv())
        p.join(timeout=60)
        if p.exitcode != 0:
            raise SystemExit(f"e2e: a counter process failed (exit {p.exitcode})")
    return results


def counter(dev: str, node: int, offset: int, iterations: int) -> dict:
    """The shared counter: a plain read-modify-write, correct only under the lock."""
    with Pool.attach(dev, node=node, prefault=False) as pool:
        t0 = time.perf_counter()
        for _ in range(iterations):
            pool.locks.acquire(COUNTER_LOCK, timeout=WAIT_S)
            value = pool.observe_u64(offset)
            pool.publish_u64(offset, value + 1)
            pool.locks.release(COUNTER_LOCK)
        return {"pid": os.getpid(), "iterations": iterations,
                "elapsed_s": round(time.perf_counter() - t0, 3)}


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


def record(folder: str, seq: int, command: str, fn) -> None:
    """Runs FN, keeping what it prints as lib.sh `record` keeps a command's
    output (NN_<command>.txt: "# command: ...", the output, "# rc=N"); a
    failure ends the script with that output, as `must` does."""
    buf = io.StringIO()
    rc = 0
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
        try:
            fn()
        except SystemExit as exc:
            rc = exc.code if isinstance(exc.code, int) else 1
        except Exception as exc:   # recorded with its message, then the script fails
            print(f"{type(exc).__name__}: {exc}")
            rc = 1
    name = "".join(c if c.isalnum() else "_" for c in command.replace("/dev/", ""))
    while "__" in name:
        name = name.replace("__", "_")
    with open(os.path.join(folder, f"{seq:02d}_{name[:60]}.txt"), "w") as f:
        f.write(f"# command: {command}\n{buf.getvalue()}# rc={rc}\n")
    print(f"$ {command}\n{buf.getvalue()}", end="")
    if rc:
        raise SystemExit(f"e2e: '{command}' failed with exit code {rc}")


def provision_only(dev: str) -> None:
    """What `tract init DEV --provision-only` runs (cli/init_cmd.py)."""
    from tract_cli.provision.provision import provision
    steps = provision(dev, echo=print)
    if not steps:
        print(f"{dev} is ready: nothing to provision")
    print(f"{dev} is provisioned (not formatted: --provision-only)")


def check(dev: str) -> None:
    """What `tract check DEV` runs (cli/check_cmd.py): exit 1 on a violation."""
    from tract_cli.inspect.check import verify
    from tract_cli.inspect.snapshot import open_pool
    with open_pool(dev) as p:
        violations, stats = verify(p, data=True)
    for v in violations:
        print(f"{v.check}: {v.detail}")
    print(f"{'FAILED' if violations else 'OK'}: {stats['ready']} READY blocks "
          f"({stats['checksums_verified']} checksums verified), {stats['pending']} PENDING, "
          f"{stats['slots_taken']}/{stats['slots']} slots taken, {stats['handoffs']} handoffs")
    if violations:
        raise SystemExit(1)


def node(dev: str, node_id: int, part: str, params_path: str, out: str, folder: str) -> None:
    with open(params_path) as f:
        params = json.load(f)
    requests, iterations = int(params["requests"]), int(params["iterations"])
    peer = 1 - node_id
    t_prov = time.perf_counter()
    record(folder, 0, f"tract init {dev} --provision-only", lambda: provision_only(dev))
    write_json(os.path.join(folder, "timings.json"),
               {"provision_s": round(time.perf_counter() - t_prov, 3)})
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
    # what the node's agent said (takeovers, a host declared dead, recovery):
    # the guest's /tmp is gone with it, so the lines travel in the result
    try:
        with open(f"/tmp/agent-{node_id}.log", errors="replace") as f:
            result["agent_log"] = f.read().splitlines()[-40:]
    except OSError:
        result["agent_log"] = []
    write_json(out, result)
    record(folder, 2, f"tract check {dev}", lambda: check(dev))


def main() -> None:
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("roundtrip")
    p.add_argument("dev")
    p.add_argument("--out", required=True)
    p.add_argument("--shared-out", help="also create the two-host test's objects; their offsets here")
    p = sub.add_parser("node")
    p.add_argument("dev")
    p.add_argument("--node", type=int, choices=(0, 1), required=True)
    p.add_argument("--part", choices=("prefill", "decode"), required=True)
    p.add_argument("--params", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--record", required=True, help="folder for the recorded command outputs")
    a = ap.parse_args()
    if a.cmd == "roundtrip":
        roundtrip(a.dev, a.out, a.shared_out)
    else:
        node(a.dev, a.node, a.part, a.params, a.out, a.record)


if __name__ == "__main__":
    main()
