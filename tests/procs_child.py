"""Child side of tests/procs.py: attach, then run commands from stdin."""
from __future__ import annotations

import json
import sys
import time
import traceback

from tract_cli.core.index import PUT_CLAIMED
from tract_cli.core.locks import LOCK_OBJDIR
from tract_cli.core.pool import Pool


def main() -> None:
    args = json.loads(sys.argv[1])
    pool = Pool.attach(args["pool"], node=args["node"], simulate=args["simulate"],
                       flush_mode=args["flush_mode"], sim_evict_prob=args["sim_evict_prob"],
                       sim_seed=args["sim_seed"])
    ops = {
        "ready": lambda: {"accessors": pool.accessors, "flush_mode": pool.flush_mode},
        "store_u64": lambda off, value: pool.store_u64(off, value),
        "load_u64": lambda off: pool.load_u64(off),
        "publish_u64": lambda off, value: pool.publish_u64(off, value),
        "observe_u64": lambda off: pool.observe_u64(off),
        "sim_stats": lambda: pool.sim_stats(),
        "load_u64_times": lambda off, times: [pool.load_u64(off) for _ in range(times)][-1],
        "ping_pong": lambda **kw: ping_pong(pool, **kw),
        "counter_loop": lambda **kw: counter_loop(pool, **kw),
        # wait: the lock timeout (a call's timeout= bounds the reply)
        "lock_acquire": lambda lock_id, wait=30.0: pool.locks.acquire(lock_id, wait),
        "lock_release": lambda lock_id: pool.locks.release(lock_id),
        "lock_stats": lambda lock_id: list(pool.locks.stats(lock_id)),
        "alloc": lambda n: pool.allocator.alloc(n).tolist(),
        "free": lambda slots: pool.allocator.free(slots),
        "churn": lambda **kw: churn(pool, **kw),
        "local_free": lambda: pool.allocator.local_free().tolist(),
        "drain": lambda: pool.allocator.drain(),
        "obj_put": lambda name, offset, size: pool.objects.put(name, offset, size),
        "obj_get": lambda name: pool.objects.get(name),
        "index_put_chains": lambda **kw: index_put_chains(pool, **kw),
        "index_evict": lambda count: pool.index.evict(count),
        "index_lookup_verify": lambda **kw: index_lookup_verify(pool, **kw),
        "index_release_held": lambda: index_release_held(pool),
        "handoff_publish": lambda **kw: handoff_publish(pool, **kw),
        "handoff_publish_pinned": lambda **kw: handoff_publish_pinned(pool, **kw),
        "handoff_reserve": lambda **kw: handoff_reserve(pool, **kw),
        "handoff_find": lambda **kw: handoff_find(pool, **kw),
        "handoff_publish_lost": lambda **kw: handoff_publish_lost(pool, **kw),
        "handoff_open": lambda **kw: handoff_open(pool, **kw),
        "handoff_unreserve": lambda **kw: handoff_unreserve(pool, **kw),
        "handoff_receive": lambda **kw: handoff_receive(pool, **kw),
        "index_pin_chain": lambda chain: pool.index.lookup(_chain_keys(pool, *chain)).hits,
        "index_reserve_chain": lambda chain: index_reserve_chain(pool, chain),
        "index_claim_stripes": lambda **kw: index_claim_stripes(pool, **kw),
        "index_put_pinned_chain": lambda chain: index_put_pinned_chain(pool, chain),
        "index_put_variant": lambda **kw: index_put_variant(pool, **kw),
        "index_read_variant": lambda **kw: index_read_variant(pool, **kw),
        "index_evict_all": lambda: pool.index.evict(pool.slot_count),
        "sweep_payload": lambda: sweep_payload(pool),
        "recover_dead": lambda timeout: recover_dead(pool, timeout),
        "events_put_described": lambda **kw: events_put_described(pool, **kw),
        "events_view_open": lambda tag=None: events_view_open(pool, tag),
        "events_view_poll": lambda: events_view_state(pool, poll=True),
        "events_view_fresh": lambda tag=None: events_view_state(pool, fresh_tag=tag),
    }
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd.pop("op")
        if op == "exit":
            break
        try:
            result = ops[op](**cmd)
            reply = {"result": result}
        except Exception as exc:  # reported to the parent, which fails the test
            reply = {"error": f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    pool.close()


def counter_loop(pool: Pool, off: int, iterations: int, use_lock: bool) -> int:
    """Plain, non-atomic read-modify-write of a shared counter, under the object-directory lock or not."""
    for _ in range(iterations):
        if use_lock:
            pool.locks.acquire(LOCK_OBJDIR, timeout=60)
        value = pool.observe_u64(off)
        pool.publish_u64(off, value + 1)
        if use_lock:
            pool.locks.release(LOCK_OBJDIR)
    return iterations


def churn(pool: Pool, rounds: int, seed: int) -> list[int]:
    """Allocates and frees random batches; returns the slots it still holds."""
    import random
    rng = random.Random(seed)
    held: list[int] = []
    for _ in range(rounds):
        if held and rng.random() < 0.5:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            pool.allocator.free(held[:k])
            held = held[k:]
        else:
            try:
                held += pool.allocator.alloc(rng.randint(1, 40)).tolist()
            except Exception as exc:          # a full pool is an expected outcome here
                if "fewer than" not in str(exc):
                    raise
    return held


def ping_pong(pool: Pool, my_off: int, peer_off: int, rounds: int, first: bool,
              deadline_s: float) -> dict:
    """Alternates with a peer process: each waits for the peer's counter, then publishes its own.

    Every value must be observed in order; returns the number of rounds completed.
    """
    deadline = time.monotonic() + deadline_s
    expected_peer = 0
    for i in range(1, rounds + 1):
        if first:
            pool.publish_u64(my_off, i)
        while pool.observe_u64(peer_off) != i:
            if time.monotonic() > deadline:
                return {"completed": i - 1, "stuck_at": i}
        expected_peer = i
        if not first:
            pool.publish_u64(my_off, i)
    return {"completed": expected_peer}



def _chain_keys(pool, prefix_seed: int, prefix_blocks: int, suffix_seed: int, n_blocks: int):
    import numpy as np
    from tract_cli.core.hashing import block_hashes, pool_root
    bt = pool.info.geometry.block_tokens
    pre = np.random.default_rng(prefix_seed).integers(0, 50000, prefix_blocks * bt)
    suf = np.random.default_rng(suffix_seed).integers(0, 50000, (n_blocks - prefix_blocks) * bt)
    return block_hashes(np.concatenate([pre, suf]).astype(np.int32), root=pool_root(pool.info))


def index_put_chains(pool, chains: list, checksum: bool = True) -> dict:
    """Puts each chain (prefix_seed, prefix_blocks, suffix_seed, n_blocks); status counts."""
    import numpy as np
    from index_check import payload_for
    counts = {"stored": 0, "already_ready": 0, "already_pending": 0, "no_room": 0}
    for chain in chains:
        keys = _chain_keys(pool, *chain)
        kv = np.stack([payload_for(k.tobytes(), pool.info.block_bytes) for k in keys])
        res = pool.index.put(keys, kv, checksum=checksum)
        for name in counts:
            counts[name] += res.count(name)
    return counts


def index_lookup_verify(pool, chains: list, hold: bool = False) -> list:
    """Looks each chain up, reads and verifies every hit; returns hit counts."""
    import numpy as np
    from index_check import payload_for
    hits = []
    for chain in chains:
        keys = _chain_keys(pool, *chain)
        res = pool.index.lookup(keys)
        out = np.empty((res.hits, pool.info.block_bytes), np.uint8)
        pool.index.read(res, out)
        for i in range(res.hits):
            assert np.array_equal(out[i], payload_for(keys[i].tobytes(), pool.info.block_bytes)), \
                f"block {i} of chain {chain} has the wrong bytes"
        if not hold:
            pool.index.unpin(res)
        else:
            HELD.append(res)
        hits.append(res.hits)
    return hits


HELD: list = []


def index_reserve_chain(pool, chain: list) -> dict:
    """Reserves a chain's absent keys (PENDING, slots allocated) and stops there,
    as a writer that dies before it publishes."""
    status, slots = pool.index.reserve(_chain_keys(pool, *chain))
    claimed = status == PUT_CLAIMED
    return {"claimed": int(claimed.sum()), "slots": slots[claimed].tolist()}


def index_claim_stripes(pool, stripes: list, wait: float) -> list:
    """Claims (then gives back) one made-up key in each of STRIPES: one walk over
    exactly those stripes, each lock waited for at most WAIT s; the claims'
    statuses."""
    import numpy as np
    keys = np.random.default_rng(len(stripes)).integers(1, 256, (len(stripes), 16), np.uint8)
    keys[:, 13] = stripes           # a key's stripe: bits 40.. of its high word
    status, slots = pool.index.reserve(keys, timeout=wait)
    got = status.tolist()
    pool.index.commit(keys, status, slots, publish=False, timeout=wait)
    return got


def index_put_pinned_chain(pool, chain: list) -> int:
    """Puts a chain pinned (as a prefill worker before its handoff); the pins stay."""
    import numpy as np
    from index_check import payload_for
    keys = _chain_keys(pool, *chain)
    kv = np.stack([payload_for(k.tobytes(), pool.info.block_bytes) for k in keys])
    return len(pool.index.put(keys, kv, checksum=True, pin=True).pinned(keys))


def _variant_payload(key: bytes, nbytes: int, variant: int):
    """A block whose bytes depend on the key and on VARIANT: the same key
    written twice with other bytes (a recomputation)."""
    from index_check import payload_for
    return payload_for(key, nbytes) ^ (variant & 0xFF)


def index_put_variant(pool, chain: list, variant: int) -> list:
    """Puts a chain with variant bytes (checksummed); returns the slots it holds."""
    import numpy as np
    keys = _chain_keys(pool, *chain)
    nbytes = pool.info.block_bytes
    kv = np.stack([_variant_payload(k.tobytes(), nbytes, variant) for k in keys])
    res = pool.index.put(keys, kv, checksum=True)
    assert res.count("stored") == len(keys), f"put stored {res.count('stored')} of {len(keys)}"
    hit = pool.index.lookup(keys)
    slots = hit.slots.tolist()
    pool.index.unpin(hit)
    return slots


def sweep_payload(pool) -> int:
    """One payload sweep over every slot of the pool (what the agent does a
    slice of each heartbeat); returns how many slots became EVICTED."""
    return pool.sweep_payload(0, pool.slot_count, 1 << 40)[1]


def index_read_variant(pool, chain: list, variant: int, zero_copy: bool = False,
                       sweep_while_pinned: bool = False) -> dict:
    """Looks a chain up and checks every byte of each hit against the variant,
    by a copy (index.read) or in place (views, then the bytes as this process's
    loads see them: `checksum_slots`); returns the slots and how many of them
    the payload ledger made it evict.  sweep_while_pinned: the payload sweep
    runs between the views and the loads (it must spare these live payloads)."""
    import numpy as np
    from tract_cli.core.native import ffi, lib
    keys = _chain_keys(pool, *chain)
    nbytes = pool.info.block_bytes
    res = pool.index.lookup(keys)
    try:
        assert res.hits == len(keys), f"{res.hits} of {len(keys)} blocks hit"
        before = pool.sim_stats()["evictions"] if pool.accessors == "sim" else None
        if zero_copy:
            evicted = pool.acquire_payload(res.slots, res.tags)
            swept = None
            if sweep_while_pinned:
                pool.sweep_payload(0, pool.slot_count, 1 << 40)
                # the read slots the sweep evicted all the same
                swept = sum(lib.tract_payload_ledger(pool._r(), int(s)) != int(t)
                            for s, t in zip(res.slots, res.tags))
            seen = pool.checksum_slots(res.slots)
            for i, k in enumerate(keys):
                want = _variant_payload(k.tobytes(), nbytes, variant)
                assert int(seen[i]) == lib.tract_crc32c(ffi.from_buffer(want), nbytes), \
                    f"block {i} (slot {res.slots[i]}) holds stale bytes in place"
        else:
            evicted = swept = None
            out = np.empty((res.hits, nbytes), np.uint8)
            pool.index.read(res, out)      # verifies the checksums: a stale line fails
            for i, k in enumerate(keys):
                assert np.array_equal(out[i], _variant_payload(k.tobytes(), nbytes, variant)), \
                    f"block {i} (slot {res.slots[i]}) read back stale bytes"
        after = pool.sim_stats()["evictions"] if before is not None else None
        return {"slots": res.slots.tolist(), "evicted": evicted, "swept": swept,
                "sim_evictions": None if after is None else after - before}
    finally:
        pool.index.unpin(res)


def index_release_held(pool) -> int:
    n = len(HELD)
    while HELD:
        pool.index.unpin(HELD.pop())
    return n



def recover_dead(pool, timeout: float) -> dict:
    """One pass of the node's recovery of its dead processes (as its agent does)."""
    from tract_cli.core.recovery import recover_node
    got = recover_node(pool, orphans=False, timeout=timeout)
    return {"pins": got.dead.pins, "processes": got.dead.processes}


def tail_for(request: str, nbytes: int):
    import numpy as np
    return np.frombuffer((request.encode() * (nbytes // len(request) + 1))[:nbytes], np.uint8)


def handoff_publish(pool, chain: list, request: str, ttl: float = 30.0) -> dict:
    """Puts a chain, then publishes its handoff with a partial tail; returns the ticket."""
    index_put_chains(pool, [chain])
    keys = _chain_keys(pool, *chain)
    bt = pool.info.geometry.block_tokens
    tail = tail_for(request, pool.info.bytes_per_token * (bt // 2))
    t = pool.handoffs.publish(request, keys, len(keys) * bt + bt // 2, tail=tail,
                              tail_tokens=bt // 2, ttl=ttl)
    return t.to_dict()


def handoff_reserve(pool, request: str, blocks: int = 9, tokens: int = 144,
                    ttl: float = 30.0) -> int:
    """Reserves a record that looks free for REQUEST (what the vLLM connector's
    worker does in a P/D prefill's last step, before its commit); returns it."""
    rec = pool.handoffs.peek_free()
    pool.handoffs.reserve_record(rec, request, blocks, tokens, ttl=ttl)
    return rec


def handoff_find(pool, requests: list) -> list:
    """The record Handoffs.find names for each of REQUESTS (-1: none)."""
    import numpy as np
    from tract_cli.core.handoff import request_key
    keys = np.frombuffer(b"".join(request_key(r) for r in requests), np.uint8).reshape(-1, 16)
    return [int(r) for r in pool.handoffs.find(keys)]


def handoff_publish_lost(pool, request: str, ttl: float = 30.0) -> dict:
    """What a prefill whose handoff will not be published leaves under REQUEST's
    name (Handoffs.publish_lost); returns its ticket."""
    return pool.handoffs.publish_lost(request, ttl=ttl).to_dict()


def handoff_open(pool, record: int, request: str, blocks: int, tokens: int,
                 ack_lost: bool = False) -> str:
    """What a decode side's open of RECORD under REQUEST's name, expecting BLOCKS
    and TOKENS, says: "ok", "lost" (ACK_LOST: then acknowledged, as the vLLM
    connector's scheduler does), "pending", or the error's type."""
    from tract_cli.core.errors import HandoffError, HandoffLost, HandoffPending
    from tract_cli.core.handoff import Ticket, request_key
    ticket = Ticket(record, request_key(request).hex(), blocks, tokens)
    try:
        pool.handoffs.open(ticket)
        return "ok"
    except HandoffLost:
        if ack_lost:
            pool.handoffs.ack(Ticket(record, ticket.request_id, 0, 0))
        return "lost"
    except HandoffPending:
        return "pending"
    except HandoffError as exc:
        return type(exc).__name__


def handoff_unreserve(pool, record: int, request: str) -> bool:
    """Gives back RECORD's reservation for REQUEST."""
    return pool.handoffs.unreserve(record, request)


def handoff_publish_pinned(pool, chain: list, request: str, ttl: float = 30.0,
                           ready: list | None = None, record: int | None = None,
                           reserved: bool = False) -> dict:
    """What the vLLM connector's worker does for a P/D prefill: puts READY (another
    request's blocks, already in the pool) first, then claims the chain's blocks
    with pins (those READY pinned as they are), writes the claimed ones, commits
    them pinned and publishes the handoff in RECORD (default: peek_free's;
    RESERVED: its reservation for REQUEST) with the pins it holds; returns the
    ticket."""
    import numpy as np
    from index_check import payload_for
    from tract_cli.core.index import PUT_CLAIMED
    if ready:
        index_put_chains(pool, [ready])
    keys = _chain_keys(pool, *chain)
    bt = pool.info.geometry.block_tokens
    status, slots = pool.index.reserve(keys, pin=True)
    claimed = status == PUT_CLAIMED
    for i in np.flatnonzero(claimed):
        view = pool.slot_bytes(int(slots[i]))
        view[:] = payload_for(keys[i].tobytes(), pool.info.block_bytes)
        del view
    pool.index.commit(keys, status, slots, pin=True,
                      checksums=np.where(claimed, pool.checksum_slots(slots), 0))
    rec = pool.handoffs.peek_free() if record is None else record
    t = pool.handoffs.publish_pinned(rec, request, keys, len(keys) * bt, ttl=ttl,
                                     reserved=reserved)
    return t.to_dict()


def handoff_receive(pool, ticket: dict, chain: list, request: str, ack: bool = True,
                    zero_copy: bool = False) -> int:
    """Opens a handoff, checks every byte (blocks and tail), acknowledges."""
    import numpy as np
    from index_check import payload_for
    from tract_cli.core.handoff import Ticket
    t = Ticket.from_dict(ticket)
    rec = pool.handoffs.open(t)
    keys = _chain_keys(pool, *chain)
    nbytes = pool.info.block_bytes
    if zero_copy:
        blocks = [v.view(np.uint8).reshape(-1) for v in pool.handoffs.views(rec)]
    else:
        out = np.empty((len(rec.slots), nbytes), np.uint8)
        pool.handoffs.copy_blocks(rec, out)
        blocks = list(out)
    for i, b in enumerate(blocks):
        assert np.array_equal(b, payload_for(keys[i].tobytes(), nbytes)), f"block {i} differs"
    tail = np.empty(pool.info.bytes_per_token * rec.tail_tokens, np.uint8)
    pool.handoffs.copy_tail(rec, tail)
    assert np.array_equal(tail, tail_for(request, tail.size)), "tail differs"
    del blocks
    if ack:
        pool.handoffs.ack(t)
    return len(rec.slots)


def events_put_described(pool, chains: list, tag: str) -> dict:
    """Puts each chain (as index_put_chains) described for KV events with TAG (hex)."""
    import numpy as np
    from tract_cli.core.events import describe
    from tract_cli.core.hashing import pool_root
    from index_check import payload_for
    bt = pool.info.geometry.block_tokens
    stored = 0
    for prefix_seed, prefix_blocks, suffix_seed, n_blocks in chains:
        pre = np.random.default_rng(prefix_seed).integers(0, 50000, prefix_blocks * bt)
        suf = np.random.default_rng(suffix_seed).integers(0, 50000, (n_blocks - prefix_blocks) * bt)
        toks = np.concatenate([pre, suf]).astype(np.int32)
        keys = _chain_keys(pool, prefix_seed, prefix_blocks, suffix_seed, n_blocks)
        kv = np.stack([payload_for(k.tobytes(), pool.info.block_bytes) for k in keys])
        res = pool.index.put(keys, kv, described=describe(keys, toks, bt, bytes.fromhex(tag)))
        stored += res.count("stored")
    return {"stored": stored}


_VIEW = {}


def events_view_open(pool, tag):
    from tract_cli.core.events import RegionView
    _VIEW["view"] = RegionView(pool, bytes.fromhex(tag) if tag else None)
    return len(_VIEW["view"].blocks)


def _view_digest(view) -> dict:
    """Every block of a view as (key, hash, parent, tokens, node), hex and lists."""
    return {k.hex(): [b.hash.hex(), b.parent.hex() if b.parent else None, list(b.token_ids),
                      b.node] for k, b in view.blocks.items()}


def events_view_state(pool, poll: bool = False, fresh_tag=None) -> dict:
    from tract_cli.core.events import RegionView
    if poll:
        view = _VIEW["view"]
        view.poll()
    else:
        view = RegionView(pool, bytes.fromhex(fresh_tag) if fresh_tag else None)
    return {"blocks": _view_digest(view), "resyncs": view.resyncs,
            "events_read": view.events_read}


if __name__ == "__main__":
    main()
