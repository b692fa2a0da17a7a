"""TraCT inside real vLLM under faults: every pool access of both instances
through the non-coherence simulator, a pool too small for what is asked of it,
and a prefill instance killed while requests are in flight.

The region is small (24 MiB: ~2,300 blocks of 16 tokens) and handoffs expire
after 4 s, so a full pool and an abandoned handoff both resolve within a test.
"""
from __future__ import annotations

import os
import subprocess
import sys
import threading

import numpy as np
import pytest

from tests.vllm_stack import (VLLM_PY, complete, prefill_params, remove_vllm_debris,
                              shm_names, start_stack, stop_stack, tokens_by_source, vllm_shm,
                              wait_until_released)
from tract_cli.serve.vllm_engine import kill_vllm

pytestmark = pytest.mark.skipif(not os.path.exists(VLLM_PY),
                                reason=f"no vLLM environment at {VLLM_PY} (.ci/setup builds it)")
TTL_S = 4.0


@pytest.fixture(scope="module")
def sim(tmp_path_factory, vllm_checkpoint, vllm_mono):
    """Prefill and decode instances of their own (the simulator, TTL_S), since a
    test here kills one; the session's checkpoint and monolithic vLLM."""
    st = start_stack(tmp_path_factory.mktemp("vllm-sim"), "24M",
                     {"handoff_ttl_s": TTL_S, "simulate": True}, name="vllm-sim",
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
        assert out["choices"][0]["text"] == complete(sim["mono"], prompt)["choices"][0]["text"]
        assert tokens_by_source(sim["decode"], "external_kv_transfer") - external == n


def test_a_full_pool_means_vllm_computes(sim):
    """Handoffs nobody reads keep their blocks pinned until they expire: once every
    slot is pinned, a prefill answers without a ticket and the decode computes."""
    untaken = 0
    for seed in range(100, 140):
        prompt = prompt_ids(1500, seed)
        body = complete(sim["prefill"], prompt, 1, kv_transfer_params={"do_remote_decode": True})
        params = body.get("kv_transfer_params")
        if not (params and "tract_ticket" in params):
            out = complete(sim["decode"], prompt, kv_transfer_params=params)
            assert out["choices"][0]["text"] == \
                complete(sim["mono"], prompt)["choices"][0]["text"]
            break
        untaken += 1
    else:
        pytest.fail("40 pinned handoffs of 1500 tokens did not fill a 24 MiB pool")
    assert untaken > 5
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

