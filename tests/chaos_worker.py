"""One process of the chaos test (tests/chaos.py): a prefill or a decode
worker on an emulated node, looping until SIGTERM (or SIGKILL, which is the
point). It prints one JSON line per completed operation, flushed, so what a
killed worker did before it died is still counted.

prefill: puts a chain pinned (copying put, or zero-copy reserve/commit on
alternate rounds), publishes its handoff (short TTL), unpins, appends the
ticket to its ticket file.  Every fourth round is the vLLM connector's P/D
prefill: it reserves a record first and appends the ticket at once, then
claims, writes and commits the chain pinned and publishes the reserved
record with those pins (a decoder may open it before: it waits).
decode: takes the tickets of the prefill workers assigned to it, opens each
handoff (waiting, bounded, while it is reserved), copies the blocks with
checksum verification, compares every byte
with what the key says, acknowledges; between tickets, looks a random chain
up and verifies what it finds. A handoff that expired (its decoder was
killed) is skipped: the agent reclaims it.
"""
from __future__ import annotations

import glob
import json
import os
import signal
import sys
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from index_check import payload_for  # noqa: E402
from procs_child import _chain_keys  # noqa: E402
from tract_cli.core.errors import HandoffPending, TractError  # noqa: E402
from tract_cli.core.handoff import Ticket  # noqa: E402
from tract_cli.core.index import PUT_CLAIMED  # noqa: E402
from tract_cli.core.errors import ChecksumMismatch, PoolFull  # noqa: E402
from tract_cli.core.pool import Pool  # noqa: E402

CHAINS = 24
TTL_S = 2.0
stopping = False


def emit(**ev) -> None:
    sys.stdout.write(json.dumps(ev) + "\n")
    sys.stdout.flush()


def chain_of(c: int) -> list:
    """Chains share 4-block prefixes in groups of 6 (prefix hits and pins on shared keys)."""
    return [c % 4, 4, 1000 + c, 8 + c % 9]


def blocks_for(pool: Pool, keys) -> np.ndarray:
    nbytes = pool.info.block_bytes
    return np.stack([payload_for(k.tobytes(), nbytes) for k in keys]) if len(keys) \
        else np.zeros((0, nbytes), np.uint8)


def prefill(pool: Pool, rng, tickets_path: str, chains: int) -> None:
    bt = pool.info.geometry.block_tokens
    with open(tickets_path, "a") as tickets:
        n = 0
        while not stopping:
            c = int(rng.integers(chains))
            keys = _chain_keys(pool, *chain_of(c))
            kv = blocks_for(pool, keys)
            if n % 4 == 3:
                reserved_round(pool, tickets, c, keys, kv, f"p{os.getpid()}-{n}")
                n += 1
                continue
            try:
                if n % 2:
                    status, slots = pool.index.reserve(keys, pin=True)
                    for i in np.flatnonzero(status == PUT_CLAIMED):
                        pool.slot_bytes(int(slots[i]))[:] = kv[i]
                    put = pool.index.commit(keys, status, slots, pin=True)
                else:
                    put = pool.index.put(keys, kv, checksum=True, pin=True)
            except PoolFull:
                # a small region (--region-mib) under pinned handoffs: a
                # serving worker's answer too; nothing was kept pinned
                emit(ev="pool_full")
                n += 1
                continue
            held = put.pinned(keys)
            if os.environ.get("CHAOS_NO_HANDOFF"):
                pool.index.unpin(held)
                n += 1
                continue
            try:
                t = pool.handoffs.publish(f"p{os.getpid()}-{n}", keys, len(keys) * bt, ttl=TTL_S,
                                          wait_s=5.0)
            except TractError as exc:
                emit(ev="publish_failed", why=exc.problem)
                pool.index.unpin(held)
                n += 1
                continue
            pool.index.unpin(held)
            tickets.write(json.dumps({"chain": c, **t.to_dict()}) + "\n")
            tickets.flush()
            emit(ev="published", blocks=len(keys))
            n += 1


def reserved_round(pool: Pool, tickets, c: int, keys, kv, rid: str) -> None:
    """The vLLM connector's P/D prefill: the record reserved and the ticket out
    before the blocks are committed; the reserved record published after."""
    bt = pool.info.geometry.block_tokens
    rec = pool.handoffs.peek_free()
    try:
        if rec is None:
            raise TractError("no record looks free", "")
        t = pool.handoffs.reserve_record(rec, rid, len(keys), len(keys) * bt, ttl=TTL_S)
    except TractError as exc:
        emit(ev="reserve_failed", why=exc.problem)
        return
    tickets.write(json.dumps({"chain": c, **t.to_dict()}) + "\n")
    tickets.flush()
    try:
        status, slots = pool.index.reserve(keys, pin=True)
    except PoolFull:
        emit(ev="pool_full")
        pool.handoffs.unreserve(rec, rid)
        return
    for i in np.flatnonzero(status == PUT_CLAIMED):
        pool.slot_bytes(int(slots[i]))[:] = kv[i]
    put = pool.index.commit(keys, status, slots, pin=True)
    held = put.pinned(keys)
    if len(held) != len(keys):
        # a block another writer held PENDING (no pin of ours on it): the record
        # would name a pin this process never took
        emit(ev="publish_failed", why="a block is another writer's")
        pool.index.unpin(held)
        pool.handoffs.unreserve(rec, rid)
        return
    try:
        pool.handoffs.publish_pinned(rec, rid, keys, len(keys) * bt, ttl=TTL_S, reserved=True)
    except TractError as exc:
        emit(ev="publish_failed", why=exc.problem)
        pool.index.unpin(held)
        pool.handoffs.unreserve(rec, rid)
        return
    emit(ev="published", blocks=len(keys), reserved=True)


def decode(pool: Pool, rng, ticket_glob: str, index: int, of: int, chains: int) -> None:
    done: dict[str, int] = {}
    # tickets whose record is reserved, its publish to come: (deadline, ticket),
    # tried again each round, not waited for one by one (a killed prefill's
    # reservation would hold up every ticket behind it until those expired too)
    waiting: list = []
    while not stopping:
        waiting, tried = [], waiting
        for deadline, ticket in tried:
            take(pool, ticket, deadline, waiting)
            if stopping:
                return
        for path in sorted(glob.glob(ticket_glob)):
            if zlib.crc32(os.path.basename(path).encode()) % of != index:
                continue
            try:      # every ticket of a file untouched for longer than the TTL has expired
                if path not in done and os.path.getmtime(path) < time.time() - 2 * TTL_S:
                    continue
            except OSError:
                continue
            with open(path) as f:
                f.seek(done.get(path, 0))
                lines = f.read()
            end = lines.rfind("\n") + 1          # a killed writer may leave half a line
            done[path] = done.get(path, 0) + end
            for line in lines[:end].splitlines():
                take(pool, json.loads(line), time.monotonic() + 2 * TTL_S, waiting)
                if stopping:
                    return
        c = int(rng.integers(chains))
        keys = _chain_keys(pool, *chain_of(c))
        hit = pool.index.lookup(keys)
        out = np.empty((hit.hits, pool.info.block_bytes), np.uint8)
        pool.index.read(hit, out)
        bad = int((out != blocks_for(pool, keys[:hit.hits])).any(axis=1).sum())
        pool.index.unpin(hit)
        emit(ev="lookup", blocks=int(hit.hits), bad=bad)


def take(pool: Pool, ticket: dict, deadline: float, waiting: list) -> None:
    """Receives TICKET (a prefill's line: the ticket and its chain) and checks
    its blocks; one whose record is still reserved is put on WAITING until
    DEADLINE (its prefill's publish to come, or its prefill killed: its agent
    frees the reservation, or it expires), then counted expired."""
    t = Ticket.from_dict({k: v for k, v in ticket.items() if k != "chain"})
    try:
        rec = pool.handoffs.open(t)
    except HandoffPending:
        if time.monotonic() > deadline:
            emit(ev="expired")
        else:
            waiting.append((deadline, ticket))
        return
    except TractError:
        emit(ev="expired")      # its TTL passed before this decoder got to it
        return
    chain = ticket["chain"]
    keys = _chain_keys(pool, *chain_of(chain))
    out = np.empty((len(rec.slots), pool.info.block_bytes), np.uint8)
    try:
        pool.handoffs.copy_blocks(rec, out, verify=True)
        bad = int((out != blocks_for(pool, keys)).any(axis=1).sum())
    except ChecksumMismatch:
        bad = len(keys)
    try:
        pool.handoffs.ack(t)
    except TractError:
        # it expired while this decoder read it: the agent may have released
        # its blocks meanwhile, so what was read proves nothing either way
        emit(ev="received_late", blocks=len(keys))
        return
    emit(ev="received", blocks=len(keys), bad=bad)


def main() -> None:
    args = json.loads(sys.argv[1])

    def stop(*_):
        global stopping
        stopping = True
    signal.signal(signal.SIGTERM, stop)
    rng = np.random.default_rng(args["seed"])
    with Pool.attach(args["pool"], node=args["node"], simulate=args.get("simulate", False)) as pool:
        emit(ev="ready")
        chains = args.get("chains", CHAINS)
        if args["role"] == "prefill":
            prefill(pool, rng, args["tickets"], chains)
        else:
            decode(pool, rng, args["tickets"], args["index"], args["of"], chains)
    emit(ev="stopped")


if __name__ == "__main__":
    main()
