"""Drives the vLLM connector's worker half on its CPU path against a real
region, no model and no server: when a step's commit runs.  A save's commit,
off the step on the save thread, is deferred (vllm_worker.COMMIT_DEFER_S,
made long here so the test's clock cannot reach it) until the next step's
bind or shutdown, whichever comes first, and a short defer ends by itself;
the blocks are then READY and hold the bytes of vLLM's pages.  Under a
stalled lock manager a step waits claim_wait_s for its claim at most (a P/D
prefill's step too, for its claim and its handoff's record: that handoff is
not published), the steps after it queue none while that claim is out, and
the claim is given back once the locks are free.

Run in vLLM's environment: `python tests/cpu_worker_driver.py POOL`; prints one
JSON object of observations (tests/test_connector_units.py checks them).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import sys
import threading
import time

import numpy as np
from worker_stand import acked, every_lock_held, expected_blocks, find_record, told, worker_on

from tract_cli.connectors import vllm_worker
from tract_cli.connectors.vllm_meta import HandoffSpec, SaveSpec
from tract_cli.core.handoff import pair_key, request_key
from tract_cli.core.hashing import block_hashes, pool_root
from tract_cli.core.locks import LOCK_TRANSFER
from tract_cli.core.kvpages import PagedKV
from tract_cli.core.pool import Pool
from tract_cli.inspect.snapshot import take

PAGES = 16
WAIT_S = 10.0          # how long a commit that is due may take, at most
STALL_S = 10.0         # how long the stall below lasts unless the driver ends it


def claim_done(ws) -> None:
    """Waits (bounded) until the step's claim, on the save thread, is done, as
    a forward longer than it would."""
    deadline = time.monotonic() + WAIT_S
    while not ws._reserving.done():
        assert time.monotonic() < deadline, "the claim was not done within WAIT_S"
        time.sleep(0.001)      # polling the save thread, bounded


@contextlib.contextmanager
def stalled(path: str, hold):
    """A stall: HOLD(another node's pool) held (every lock, or one) while the
    steps inside run, none of which may wait it out; yields an Event set once
    STALL_S has passed (a step that waited that long)."""
    other = Pool.attach(path, node=2)
    ended = threading.Event()
    timer = threading.Timer(STALL_S, ended.set)
    try:
        with hold(other):
            timer.start()
            yield ended
    finally:
        timer.cancel()
        other.close()


def main(path: str) -> dict:
    vllm_worker.COMMIT_DEFER_S = 60.0      # past anything this driver waits for
    # a lock wait of the save thread's longer than the whole stall below: a step
    # that waited for its claim would wait for the stall's end.  Steps here have
    # no forward to hide a claim behind: they wait for it, but in the stall
    stand = worker_on(path, PAGES, seed=7, step_timeout_s=STALL_S * 3, claim_wait_s=STALL_S * 3)
    pool, ws, releases = stand.pool, stand.ws, stand.releases
    B = pool.geometry.block_tokens
    ws._paged = PagedKV(pool, ws.layout, stand.tensors)
    root = pool_root(pool.info)
    seen: dict = {}
    expected = lambda pages: expected_blocks(stand, pages)

    def step(n: int, pages) -> np.ndarray:
        """One step that saves PAGES (a request's blocks); its keys."""
        keys = block_hashes(np.arange(len(pages) * B, dtype=np.int32) + 1000 * n,
                            block_tokens=B, root=root)
        ws.bind([SaveSpec(f"r{n}", keys, np.full(len(pages), B, np.uint32),
                          np.asarray(pages, np.int64), np.zeros(len(pages), np.int64))])
        ws.wait_for_save()
        return keys

    def hits(keys) -> int:
        """How many of KEYS, from the first, are READY (found by a lookup)."""
        hit = pool.index.lookup(keys)
        if hit.hits:
            pool.index.unpin(hit)
        return hit.hits

    def ready_within(keys, timeout: float) -> bool:
        """Whether every key of KEYS is READY within TIMEOUT seconds."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout:
            if hits(keys) == len(keys):
                return True
            time.sleep(0.005)     # polling the save thread's commit, bounded
        return False

    def saved_bytes_equal(keys, pages) -> bool:
        hit = pool.index.lookup(keys)
        if hit.hits != len(keys):
            if hit.hits:
                pool.index.unpin(hit)
            return False
        try:
            got = np.stack([pool.slot_array(int(s)).reshape(-1).view(np.float32)
                            for s in hit.slots])
            return bool(np.array_equal(got, expected(pages)))
        finally:
            pool.index.unpin(hit)

    def handoff_save(req: str, keys, pages, record: int, pair: bytes | None = None) -> SaveSpec:
        """A P/D prefill's last step: it saves KEYS from PAGES (the whole prompt)
        and hands them off in RECORD, which its ticket names (two-step), or
        under PAIR's name (paired)."""
        return SaveSpec(req, keys, np.full(len(pages), B, np.uint32), np.asarray(pages, np.int64),
                        np.zeros(len(pages), np.int64),
                        handoff=HandoffSpec(record, req, keys, len(pages) * B, 30.0,
                                            pair or request_key(req)))

    find = lambda name: find_record(pool, name)
    opened = lambda record, name, blocks: told(pool, record, name, blocks, blocks * B)
    ack = lambda record, name: acked(pool, record, name)

    def published_within(record: int, name: bytes, blocks: int, timeout: float) -> str:
        """What opening RECORD tells, once it is published or TIMEOUT passed."""
        deadline = time.monotonic() + timeout
        while (got := opened(record, name, blocks)) == "HandoffPending" \
                and time.monotonic() < deadline:
            time.sleep(0.005)     # polling the save thread's publish, bounded
        return got

    def given_back() -> bool:
        """Whether the claim a step gave up on is done and given back (False: no
        step gave one up)."""
        return ws._late is not None and ws._late.wait(WAIT_S) and releases.drain(WAIT_S)

    def in_flight() -> dict:
        """Pins, reserved or published handoff records, PENDING entries."""
        snap = take(pool)
        return {"pins": snap["index"]["pins_total"],
                "handoffs": len(snap["handoffs"]["in_flight"]),
                "pending": snap["index"]["states"]["PENDING"]}

    # a step's commit waits: nothing READY after its step, while no step follows
    keys = step(1, [3, 9, 4])
    seen["after_its_step"] = hits(keys)
    # not a synchronization: a commit not deferred (~1 ms) would be READY by now
    time.sleep(0.2)
    seen["a_while_after"] = hits(keys)
    # the next step's bind (no saves of its own) starts it
    ws.bind([])
    ws.wait_for_save()
    seen["after_the_next_bind"] = ready_within(keys, WAIT_S)
    seen["bytes_equal"] = saved_bytes_equal(keys, [3, 9, 4])
    # a step that saves too: the previous commit first, then this step's claim
    keys2 = step(2, [5, 6])
    keys3 = step(3, [7])
    seen["a_commit_before_the_next_steps_claim"] = hits(keys2) == len(keys2)
    seen["the_last_step_still_waits"] = hits(keys3)
    # a short defer ends by itself: no step follows step 4, nothing else ends it
    vllm_worker.COMMIT_DEFER_S = 0.05
    keys4 = step(4, [8])
    seen["a_short_defer_ends_by_itself"] = ready_within(keys4, WAIT_S)
    seen["bytes_equal_3"] = saved_bytes_equal(keys3, [7])
    # a stalled lock manager (every lock held by another node): a step that saves
    # waits claim_wait_s for its claim and goes on without saving, well before
    # the stall ends (a timer ends it, should the step wait that long); the
    # next steps, that claim still out, queue no claim of their own and say so.
    # A P/D prefill's step is no exception: steps 6 and 8 carry a paired
    # handoff each (its decode finds the record by the pair's name), step 6's
    # claim out, step 8's never queued; neither is published, and each paired
    # decode is told so by a record of no blocks under the pair's name
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("vllm.tract").addHandler(handler)
    ws._gave_up_said.period_s = 0.0            # each step's reason said
    waits = ws.settings
    ws.settings = dataclasses.replace(waits, claim_wait_s=0.05)
    pages6 = [12, 13]
    keys6 = block_hashes(np.arange(2 * B, dtype=np.int32) + 6000, block_tokens=B, root=root)
    save6 = lambda handoff=None: SaveSpec("r6", keys6, np.full(2, B, np.uint32),
                                          np.asarray(pages6, np.int64), np.zeros(2, np.int64),
                                          handoff=handoff)
    r6 = pool.handoffs.peek_free()
    pair6, pair8 = pair_key("pair-6"), pair_key("pair-8")
    keys8 = block_hashes(np.arange(B, dtype=np.int32) + 8000, block_tokens=B, root=root)
    r8 = pool.handoffs.peek_free(r6 + 1)
    with stalled(path, every_lock_held) as ended:
        ws.bind([save6(HandoffSpec(r6, "r6", keys6, 2 * B, 30.0, pair6))])
        ws.wait_for_save()
        seen["a_stalled_handoff_step_went_on"] = not ended.is_set()
        before = len(said)
        step(7, [14])
        seen["the_next_step_went_on"] = not ended.is_set()
        seen["the_next_step_queued_no_claim"] = any("still waits for an earlier step's claim"
                                                    in m for m in said[before:])
        before = len(said)
        ws.bind([handoff_save("r8", keys8, [15], r8, pair8)])
        ws.wait_for_save()
        seen["a_handoff_step_behind_it_went_on"] = not ended.is_set()
        seen["its_handoff_said_lost"] = any("handoff of request r8 not published" in m
                                            for m in said[before:])
    # once the locks are free the claim the step gave up on is done, and given
    # back (queued once it is done, then the release itself): each paired
    # decode finds a record of no blocks (it computes at once), nothing stays
    # pinned or reserved, and the same blocks are saved again by a later step
    seen["the_stalled_claim_given_back"] = given_back()
    seen["the_paired_decodes_told"] = [opened(find(pair6), pair6, 2),
                                       opened(find(pair8), pair8, 1)]
    seen["after_the_stall"] = in_flight()
    ws.settings = waits
    ws.bind([save6()])
    ws.wait_for_save()
    ws.bind([])
    ws.wait_for_save()
    seen["saved_again_after_the_stall"] = ready_within(keys6, WAIT_S)
    seen["bytes_equal_6"] = saved_bytes_equal(keys6, pages6)
    ack(find(pair6), pair6)
    ack(find(pair8), pair8)

    # the transfer table's lock alone held (the claim is granted, the handoff's
    # record cannot be reserved): the step waits claim_wait_s for the
    # reservation and goes on; once the lock is free the reservation is given
    # back, the claimed blocks too, and its ticket's record is never published.
    # The same step with the lock free publishes its handoff
    ws.settings = dataclasses.replace(waits, claim_wait_s=0.05)
    keys10 = block_hashes(np.arange(B, dtype=np.int32) + 10000, block_tokens=B, root=root)
    r10 = pool.handoffs.peek_free()
    before = len(said)
    with stalled(path, lambda other: other.locks.hold(LOCK_TRANSFER, timeout=30)) as ended:
        ws.bind([handoff_save("r10", keys10, [15], r10)])
        claim_done(ws)
        ws.wait_for_save()
        seen["a_step_whose_record_stalls_went_on"] = not ended.is_set()
        seen["its_records_said_late"] = any("records' reservation not done within 50 ms" in m
                                            for m in said[before:])
    seen["its_claim_given_back"] = given_back()
    seen["its_ticket"] = opened(r10, request_key("r10"), 1)
    seen["its_blocks"] = hits(keys10)
    seen["after_the_record_stall"] = in_flight()
    ws.settings = waits
    ws.bind([handoff_save("r10", keys10, [15], r10)])
    ws.wait_for_save()
    ws.bind([])
    ws.wait_for_save()
    seen["published_without_the_stall"] = published_within(r10, request_key("r10"), 1, WAIT_S)
    ack(r10, request_key("r10"))
    seen["after_its_ack"] = in_flight()

    # a step that waits for its commit (SaveSpec.handoff_follows: its handoff
    # published in the step, handoff_publish in_step) waits claim_wait_s at
    # most: its claim
    # granted, every lock then held, it goes on and says so; once the locks
    # are free its blocks are READY all the same (saved), and its in-step
    # handoff, whose step stopped waiting, is not published
    ws.settings = dataclasses.replace(waits, claim_wait_s=0.05)
    keys11 = block_hashes(np.arange(B, dtype=np.int32) + 11000, block_tokens=B, root=root)
    in_step = handoff_save("r11", keys11, [9], pool.handoffs.peek_free())
    in_step.handoff_follows = True
    ws.bind([in_step])
    claim_done(ws)
    before = len(said)
    with stalled(path, every_lock_held) as ended:
        ws.wait_for_save()
        seen["a_step_whose_commit_stalls_went_on"] = not ended.is_set()
        seen["its_commit_said_late"] = any("not done within 50 ms (claim_wait_s)" in m
                                           for m in said[before:])
    ws.settings = waits
    seen["its_blocks_saved_after_the_stall"] = ready_within(keys11, WAIT_S)
    # the save thread's jobs so far (the commit and what follows it), then the
    # releases they queued
    ws._saver.submit(lambda: None).result(WAIT_S)
    releases.drain(WAIT_S)
    seen["its_in_step_handoff"] = opened(in_step.handoff.record, request_key("r11"), 1)
    seen["after_the_commit_stall"] = in_flight()

    # shutdown starts a commit still deferred, and waits for it
    vllm_worker.COMMIT_DEFER_S = 60.0
    keys5 = step(5, [10, 11])
    ws.shutdown()
    seen["after_shutdown"] = hits(keys5)
    seen["bytes_equal_5"] = saved_bytes_equal(keys5, [10, 11])
    releases.close(10.0)
    pool.close()
    return seen


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
