"""TraCT inside real vLLM under a stalled lock manager (every lock of the
region held by another node): a P/D prefill's step waits `claim_wait_s` for
its save's claim at most, as every step does, then goes on; that request's
handoff is lost and its decode computes the prompt (the same answer), and
once the locks are free the next request is handed over again.  A stall
costs a request its handoff, never the engine its step (docs/VLLM.md, "A
step waits for its claim `claim_wait_s` at most, a P/D prefill's too").

The instances run with the shipped `claim_wait_s` (the other real-vLLM
stacks wait 60 s, so busy CI cores never lose a block) and a lock wait
(`step_timeout_s`) of 30 s: a step that waited for its locks, as a P/D
prefill's did before it was bounded, would wait the stall out.
"""
from __future__ import annotations

import os
import time

import pytest

from tests.vllm_stack import (VLLM_PY, assert_answers_as_mono, complete, prefill_params,
                              start_stack, stop_stack, tokens_by_source, wait_until_released)
from tests.worker_stand import every_lock_held
from tract_cli.connectors.settings import ConnectorSettings
from tract_cli.core.pool import Pool

pytestmark = pytest.mark.skipif(not os.path.exists(VLLM_PY),
                                reason=f"no vLLM environment at {VLLM_PY} (.ci/setup builds it)")
LOCK_WAIT_S = 30.0
PROMPT = "A stalled lock manager costs this prompt its handoff, never the engine its step. "


@pytest.fixture(scope="module")
def stack(tmp_path_factory, vllm_checkpoint, vllm_mono):
    """Prefill and decode instances with the shipped claim_wait_s and a 30 s
    lock wait; the session's checkpoint and monolithic vLLM."""
    st = start_stack(tmp_path_factory.mktemp("vllm-stall"), "64M",
                     {"claim_wait_s": ConnectorSettings.claim_wait_s,
                      "step_timeout_s": LOCK_WAIT_S},
                     name="vllm-stall", ckpt=vllm_checkpoint, mono=vllm_mono)
    try:
        yield st
    finally:
        stop_stack(st)


def decode(stack, prompt: str, params: dict | None) -> tuple[dict, float]:
    """The decode instance's answer to PROMPT with the prefill's PARAMS, and how
    many of its prompt tokens it loaded from the pool."""
    before = tokens_by_source(stack["decode"], "external_kv_transfer")
    out = complete(stack["decode"], prompt, **({"kv_transfer_params": params} if params else {}))
    return out, tokens_by_source(stack["decode"], "external_kv_transfer") - before


def test_a_stalled_lock_manager_costs_a_p_d_request_its_handoff_never_the_step(stack):
    prefill_log = stack["tmp"] / "prefill.log"
    seen = len(open(prefill_log).read())
    stalled = "0 " + PROMPT * 8          # a prompt the pool does not hold: no lookup waits
    with Pool.attach(stack["pool"], node=3) as other, every_lock_held(other):
        t0 = time.monotonic()
        body = complete(stack["prefill"], stalled, 1, kv_transfer_params={"do_remote_decode": True})
        took = time.monotonic() - t0
    # the step went on after claim_wait_s (0.1 s), not after a lock wait (30 s),
    # and said so in the step
    assert took < LOCK_WAIT_S / 3, f"the stalled prefill answered after {took:.1f} s"
    assert "its claim not done within 100 ms of the forward" in open(prefill_log).read()[seen:]
    out, loaded = decode(stack, stalled, body.get("kv_transfer_params"))
    assert loaded == 0                     # computed: the handoff was lost
    assert_answers_as_mono(stack, stalled, out)
    # once the locks are free the late claim is given back (its handoff said
    # lost as it is), nothing stays held, and the next request is handed over
    wait_until_released(stack["pool"])
    assert "not published (the step did not wait 100 ms for its claim)" in \
        open(prefill_log).read()[seen:]
    after = "1 " + PROMPT * 8
    out, loaded = decode(stack, after, prefill_params(stack, after))
    assert loaded == out["usage"]["prompt_tokens"] - 1
    assert_answers_as_mono(stack, after, out)
    wait_until_released(stack["pool"])
