"""TraCT inside real vLLM under faults: every pool access of both instances
through the non-coherence simulator, a pool too small for what is asked of it,
a prefill instance killed while requests are in flight, and the negative control
of the answer comparison every vLLM test relies on: one block of a handoff made
wrong in the pool changes the decode instance's answer beyond the tolerance.

The region is small (24 MiB: ~2,300 blocks of 16 tokens) and handoffs expire
after 4 s, so a full pool and an abandoned handoff both resolve within a test.
These instances run without checksums (`"checksums": false`), so a wrong block is
loaded as it is rather than recomputed: what the answer comparison has to catch.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from tests.vllm_stack import (VLLM_PY, answer_differences, assert_answers_as_mono, complete,
                              external_hits, open_published, prefill_params, remove_vllm_debris,
                              shm_names, start_stack, stop_stack, tokens_by_source, vllm_shm,
                              wait_until_released, wait_until_saved)
from tract_cli.core.errors import HandoffError
from tract_cli.core.handoff import Ticket
from tract_cli.core.nodes import read_nodes
from tract_cli.core.pids import pid_alive
from tract_cli.core.pool import Pool
from tract_cli.serve.vllm_engine import kill_vllm

pytestmark = pytest.mark.skipif(not os.path.exists(VLLM_PY),
                                reason=f"no vLLM environment at {VLLM_PY} (.ci/setup builds it)")
TTL_S = 4.0


@pytest.fixture(scope="module")
def sim(tmp_path_factory, vllm_checkpoint, vllm_mono):
    """Prefill and decode instances of their own (the simulator, TTL_S, no
    checksums), since a test here kills one; the session's checkpoint and
    monolithic vLLM.  Their loads are asynchronous (load_mode async): the real
    engine runs that lifecycle here, and test_vllm.py's the default, synchronous
    one."""
    st = start_stack(tmp_path_factory.mktemp("vllm-sim"), "24M",
                     {"handoff_ttl_s": TTL_S, "simulate": True, "checksums": False,
                      "load_mode": "async"},
                     name="vllm-sim",
                     ckpt=vllm_checkpoint, mono=vllm_mono)
    try:
        yield st
    finally:
        stop_stack(st)


def prompt_ids(n: int, seed: int) -> list[int]:
    """N random token ids of the tiny checkpoint's vocabulary (distinct prompts)."""
    return np.random.default_rng(seed).integers(3, 400, size=n).tolist()


def test_pd_through_the_simulator_answers_as_one_vllm(sim):
    for role in ("prefill", "decode"):
        log = open(sim["tmp"] / f"{role}.log").read()
        assert "accessors sim" in log, f"the {role} instance does not run the simulator"
    for n, seed in ((40, 1), (700, 2)):
        prompt = prompt_ids(n, seed)
        params = prefill_params(sim, prompt)
        external = tokens_by_source(sim["decode"], "external_kv_transfer")
        out = complete(sim["decode"], prompt, kv_transfer_params=params)
        assert_answers_as_mono(sim, prompt, out)
        assert tokens_by_source(sim["decode"], "external_kv_transfer") - external == n


def test_a_prefix_hit_through_the_simulator_answers_as_one_vllm(sim):
    # a prompt's head computed and saved by one instance is a hit for the other,
    # each reading the region through the simulator (no coherence between them),
    # loaded on the loader thread (load_mode async) and answered as one vLLM
    head = prompt_ids(320, 3)
    complete(sim["prefill"], head, 1)
    wait_until_saved(sim["pool"])          # committed off the prefill's step
    hits = external_hits(sim["decode"])
    prompt = head + prompt_ids(37, 4)
    out = complete(sim["decode"], prompt)
    assert_answers_as_mono(sim, prompt, out)
    assert external_hits(sim["decode"]) - hits == 320


# The negative control: a 400-token prompt (25 blocks of 16 tokens) handed off by
# the prefill instance, and one block of the handoff made wrong in the pool before
# the decode request.  Measured on this prompt (top-20 logprobs, 12 tokens): the
# unchanged handoff answers exactly as one vLLM (gap 0); either garbling of block 12
# moves the answer by ~2 nats (1.9 and 2.1), twenty times the tolerance (0.1).  Over
# every middle block (1..22) of four such prompts the least either garbling moved it
# was 0.16 nats.  What no answer can show: swapping the payloads of two blocks (K and
# V together).  vLLM caches keys after RoPE, so they carry their positions, and
# attention sums over the set of (key, value) pairs: that answer is exactly one
# vLLM's (measured: gap 0).
CONTROL_BLOCK = 12


def shift_half_a_block(pool, slots):
    """Half of the block's bytes of each layer and K|V half overwritten by the other
    half (a sub-block off by half a block, were the slot in the canonical
    `[K|V][token][head][dim]` order; the region holds vLLM's CPU page in its own
    order, which slot_array's canonical shape does not know, so here it is half
    the block's elements wrong, in that order)."""
    rows = pool.slot_array(slots[CONTROL_BLOCK])     # shaped (layer, K|V, token, head, dim)
    rows[:, :, :8] = rows[:, :, 8:].copy()


def the_next_blocks_payload(pool, slots):
    """The block holds the next block's KV: a slot list off by one at that block."""
    pool.slot_bytes(slots[CONTROL_BLOCK])[:] = pool.slot_bytes(slots[CONTROL_BLOCK + 1])


@pytest.mark.parametrize("garble", [shift_half_a_block, the_next_blocks_payload])
def test_one_wrong_block_of_a_handoff_changes_the_answer(sim, garble):
    prompt = prompt_ids(400, 12)
    ref = complete(sim["mono"], prompt)

    def handed_off(salt: str, make_wrong=None) -> dict:
        # a salt of its own: neither instance's vLLM prefix cache nor the pool holds
        # this prompt's blocks already, so the decode instance loads the handoff
        params = prefill_params(sim, prompt, cache_salt=salt)
        assert params["tract_ticket"]["blocks"] == 25
        if make_wrong is not None:
            with Pool.attach(sim["pool"], node=3) as pool:
                rec = open_published(pool, Ticket.from_dict(params["tract_ticket"]))
                make_wrong(pool, [int(s) for s in rec.slots])  # in prompt block order
        external = tokens_by_source(sim["decode"], "external_kv_transfer")
        local = tokens_by_source(sim["decode"], "local_compute")
        out = complete(sim["decode"], prompt, kv_transfer_params=params, cache_salt=salt)
        # every prompt token came from the pool: the answer is the loaded blocks'
        assert tokens_by_source(sim["decode"], "external_kv_transfer") - external == 400
        assert tokens_by_source(sim["decode"], "local_compute") == local
        return out

    assert not answer_differences(handed_off(f"as-is-{garble.__name__}"), ref)
    wrong = handed_off(f"wrong-{garble.__name__}", garble)
    assert answer_differences(wrong, ref), "one wrong block did not change the answer"


def _pin_every_slot(pool: Pool, batches: list) -> None:
    """Fills the pool with blocks this node stores pinned (evicting what is not
    pinned) until no slot is left; appends the keys of each put to BATCHES as
    it goes (the caller unpins them, whatever happens here)."""
    from tract_cli.core.errors import PoolFull
    rng = np.random.default_rng(7)
    for n in (64, 1):                   # big batches, then the last few slots
        data = np.zeros((n, pool.info.block_bytes), np.uint8)
        while True:
            keys = rng.integers(0, 256, (n, 16), dtype=np.uint8)
            try:
                pool.index.put(keys, data, pin=True, timeout=30)
            except PoolFull:
                break
            batches.append(keys)


def test_a_full_pool_means_vllm_computes(sim):
    """Handoffs nobody reads keep their blocks pinned until they expire: once every
    slot is pinned, a prefill's handoff is not published (its ticket, promised
    when the step was planned, names no record of it) and the decode computes.
    Every slot but room for one handoff is pinned first by another node (a
    filler), so the pool is full at the second request unless one request
    outlasts the first handoff's TTL_S."""
    def published(params) -> bool:
        with Pool.attach(sim["pool"], readonly=True, prefault=False, local=False) as p:
            try:
                open_published(p, Ticket.from_dict(params["tract_ticket"]))
                return True
            except HandoffError:
                return False

    room = 1500 // 16 + 1 + 8                 # one handoff's blocks, and a few
    batches: list = []
    with Pool.attach(sim["pool"], node=3) as filler:
        given_back = np.zeros(0, np.uint8)    # unpinned so far: one flag per key
        try:
            _pin_every_slot(filler, batches)
            keys = np.vstack(batches)
            given_back = np.zeros(len(keys), np.uint8)
            filler.index.unpin(keys[:room], timeout=30, done=given_back[:room])
            untaken = 0
            for seed in range(100, 110):
                prompt = prompt_ids(1500, seed)
                body = complete(sim["prefill"], prompt, 1,
                                kv_transfer_params={"do_remote_decode": True})
                params = body.get("kv_transfer_params")
                if not (params and "tract_ticket" in params and published(params)):
                    external = tokens_by_source(sim["decode"], "external_kv_transfer")
                    out = complete(sim["decode"], prompt, kv_transfer_params=params)
                    assert_answers_as_mono(sim, prompt, out)
                    assert tokens_by_source(sim["decode"], "external_kv_transfer") == external
                    break
                untaken += 1
            else:
                pytest.fail("10 pinned handoffs of 1500 tokens did not fill the room left")
        finally:
            # every pin the filler took goes back, even after a failure above
            # (the module's later tests share this region)
            if batches:
                keys = np.vstack(batches)
                if len(given_back) != len(keys):
                    given_back = np.zeros(len(keys), np.uint8)
                filler.index.unpin(keys, timeout=30, done=given_back)
    assert untaken >= 1, "no handoff was published before the pool was full"
    assert "not published" in open(sim["tmp"] / "prefill.log").read()
    # the abandoned handoffs expire and node agents reclaim them
    wait_until_released(sim["pool"], timeout=TTL_S + 60)


def test_a_killed_prefill_leaves_nothing_behind(sim):
    """SIGKILL of a prefill vLLM (engine, workers) while requests are in flight: its
    node's agent gives back what its dead processes held, the handoffs it published
    expire, and the region checks clean."""
    answered = threading.Event()
    errors = []

    def send(seed):
        try:
            complete(sim["prefill"], prompt_ids(1800, seed), 1,
                     kv_transfer_params={"do_remote_decode": True})
            answered.set()
        except Exception as exc:          # the kill cuts the others off
            errors.append(exc)

    shm, before = vllm_shm(sim["prefill"]), shm_names()
    threads = [threading.Thread(target=send, args=(500 + i,), daemon=True) for i in range(6)]
    for t in threads:
        t.start()
    assert answered.wait(120), "no prefill request was answered within 120 s"
    kill_vllm(sim["prefill"].proc.pid)    # its resource tracker survives, to unlink its shm
    for t in threads:
        t.join(60)
    sim["prefill"].stop()
    try:
        assert len(shm) >= 2 and not shm & shm_names(), "vLLM's shared memory outlived it"
    finally:
        remove_vllm_debris(before - shm)     # the kill's own debris, even when it fails
    wait_until_released(sim["pool"], timeout=TTL_S + 60)
    check = subprocess.run([sys.executable, "-m", "tract_cli.cli", "check", sim["pool"]],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr



def test_stopped_instances_leave_nothing_once_the_region_is_removed(sim):
    """Last of the module: the prefill instance was SIGKILLed above; the decode one is
    stopped by SIGTERM here, then the region file is removed as a user's `rm` would.
    The node agents their connectors started stop by themselves and nothing of the
    region stays in /dev/shm (no segment, no agent); vLLM's IPC sockets went to
    each server's own directory, removed with it, the SIGKILLed prefill's too."""
    assert sim["decode"].rpc_dir and sim["prefill"].rpc_dir, \
        "no RPC directory of its own (VLLM_RPC_BASE_PATH set outside, or TMPDIR too long)"
    used = os.listdir(sim["decode"].rpc_dir)
    sim["prefill"].stop()
    sim["decode"].stop()
    assert used, "vLLM made no socket in its own VLLM_RPC_BASE_PATH: they are elsewhere"
    assert not os.path.exists(sim["prefill"].rpc_dir) and not os.path.exists(sim["decode"].rpc_dir)
    with Pool.attach(sim["pool"], readonly=True, prefault=False) as p:
        uuid, agents = p.info.uuid, [n.agent_pid for n in read_nodes(p) if n.agent_pid]
    assert agents, "the connectors started no node agent"
    os.unlink(sim["pool"])
    deadline = time.monotonic() + 90
    while True:
        left = [n for n in os.listdir("/dev/shm") if n.startswith(f"tract-{uuid}-")]
        running = [pid for pid in agents if pid_alive(pid)]
        if not left and not running:
            break
        assert time.monotonic() < deadline, \
            f"90 s after the region was removed: {left} in /dev/shm, agents {running} run"
        time.sleep(0.2)           # waiting for other processes to notice and exit, bounded
