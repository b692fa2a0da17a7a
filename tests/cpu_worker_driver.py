"""Drives the vLLM connector's worker half on its CPU path against a real
region, no model and no server: when a step's commit runs.  A save's commit,
off the step on the save thread, is deferred (vllm_worker.COMMIT_DEFER_S,
made long here so the test's clock cannot reach it) until the next step's
bind or shutdown, whichever comes first, and a short defer ends by itself;
the blocks are then READY and hold the bytes of vLLM's pages.  Under a
stalled lock manager a step waits claim_wait_s for its claim at
most, the steps after it queue none while that claim is out, and the claim
is given back once the locks are free.

Run in vLLM's environment: `python tests/cpu_worker_driver.py POOL`; prints one
JSON object of observations (tests/test_connector_units.py checks them).
"""
from __future__ import annotations

import dataclasses
import json
import logging
import sys
import threading
import time

import numpy as np
from worker_stand import every_lock_held, expected_blocks, worker_on

from tract_cli.connectors import vllm_worker
from tract_cli.connectors.vllm_meta import SaveSpec
from tract_cli.core.hashing import block_hashes, pool_root
from tract_cli.core.kvpages import PagedKV
from tract_cli.core.pool import Pool

PAGES = 16
WAIT_S = 10.0          # how long a commit that is due may take, at most
STALL_S = 10.0         # how long the stall below lasts unless the driver ends it


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
    # next step, that claim still out, queues no claim of its own and says so
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("vllm.tract").addHandler(handler)
    vllm_worker.GAVE_UP_LOG_S = 0.0            # each step's reason said
    waits = ws.settings
    ws.settings = dataclasses.replace(waits, claim_wait_s=0.05)
    pages6 = [12, 13]
    keys6 = block_hashes(np.arange(2 * B, dtype=np.int32) + 6000, block_tokens=B, root=root)
    save6 = SaveSpec("r6", keys6, np.full(2, B, np.uint32), np.asarray(pages6, np.int64),
                     np.zeros(2, np.int64))
    other = Pool.attach(path, node=2)
    ended = threading.Event()
    with every_lock_held(other):
        timer = threading.Timer(STALL_S, ended.set)
        timer.start()
        ws.bind([save6])
        ws.wait_for_save()
        seen["a_stalled_step_went_on"] = not ended.is_set()
        before = len(said)
        step(7, [14])
        seen["the_next_step_went_on"] = not ended.is_set()
        seen["the_next_step_queued_no_claim"] = any("still waits for an earlier step's claim"
                                                    in m for m in said[before:])
        # a step that saves a handoff's blocks (a P/D prefill's chunk) waits for
        # its claim, stall or not: still waiting 20 claim waits later
        keys8 = block_hashes(np.arange(B, dtype=np.int32) + 8000, block_tokens=B, root=root)
        handoff_step = threading.Thread(target=lambda: (
            ws.bind([SaveSpec("r8", keys8, np.full(1, B, np.uint32), np.array([15], np.int64),
                              np.zeros(1, np.int64), for_handoff=True)]),
            ws.wait_for_save()))
        handoff_step.start()
        handoff_step.join(20 * 0.05)
        seen["a_handoff_step_waits_for_its_claim"] = handoff_step.is_alive()
        timer.cancel()
    # the stall over, that step's claim is granted and its blocks saved
    handoff_step.join(WAIT_S)
    seen["the_handoff_step_went_on_after_the_stall"] = not handoff_step.is_alive()
    other.close()
    ws.settings = waits
    # once the locks are free the claim the step gave up on is done, and given
    # back (queued once it is done, then the release itself): the same blocks
    # are saved again by a later step
    seen["the_stalled_claim_given_back"] = ws._late.wait(WAIT_S) and releases.drain(WAIT_S)
    ws.bind([save6])
    ws.wait_for_save()
    ws.bind([])
    ws.wait_for_save()
    seen["saved_again_after_the_stall"] = ready_within(keys6, WAIT_S)
    seen["the_handoff_steps_blocks_saved"] = ready_within(keys8, WAIT_S)
    seen["bytes_equal_6"] = saved_bytes_equal(keys6, pages6)
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
