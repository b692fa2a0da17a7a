"""The connector's scheduler-side lifecycle under vLLM's own Scheduler, with no
model and no server (tests/vllm_scheduler_driver.py runs in vLLM's
environment against a real region and reports what it saw)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.vllm_stack import ROOT, VLLM_PY, stop_stack

pytestmark = pytest.mark.skipif(not os.path.exists(VLLM_PY),
                                reason=f"no vLLM environment at {VLLM_PY} (.ci/setup builds it)")


@pytest.fixture(scope="module")
def seen(vllm_checkpoint):
    ckpt = vllm_checkpoint
    pool = f"/dev/shm/tract-test-vllm-sched-{os.getpid()}.pool"
    subprocess.run([sys.executable, "-m", "tract_cli.cli", "init", pool, "--size", "64M",
                    "--model", ckpt, "--nodes", "4", "--force", "-q"], check=True, timeout=120)
    try:
        out = subprocess.run([VLLM_PY, os.path.join(ROOT, "tests", "vllm_scheduler_driver.py"),
                              ckpt, pool], capture_output=True, text=True, timeout=300,
                             cwd=ROOT, env=os.environ | {"HF_HUB_OFFLINE": "1"})
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("OBSERVATIONS ")), None)
        assert line, f"the driver failed (code {out.returncode}): {out.stderr[-3000:]}"
        yield json.loads(line.removeprefix("OBSERVATIONS "))
    finally:
        stop_stack({"pool": pool})


def test_a_pool_hit_is_pinned_once_and_loads_asynchronously(seen):
    assert seen["hit_status"] == "WAITING_FOR_REMOTE_KVS"
    assert seen["hit_loads"] == [6]                  # 100 tokens: 6 full 16-token blocks
    assert seen["hit_pins_while_loading"] == 6
    assert seen["hit_pins_after_rematch"] == 6       # matching again takes no second pin
    assert seen["hit_pins_after_load"] == 0          # given back when the worker reports
    assert seen["hit_scheduled_tokens"] == 4         # then only the 4 tokens past the hit


def test_an_abort_during_the_load_waits_for_the_worker_then_unpins(seen):
    assert seen["abort_status"] == "WAITING_FOR_REMOTE_KVS"
    assert seen["abort_pins_before_worker"] == 4     # the worker may still be reading them
    assert seen["abort_pins_after_worker"] == 0


def test_a_failed_load_is_recomputed_and_not_offered_again(seen):
    assert seen["bad_scheduled_tokens"] == 80
    assert seen["bad_rematch"] == [0, False]
    assert seen["bad_pins_after"] == 0


def test_a_prefill_for_a_remote_decode_publishes_a_handoff(seen):
    params = seen["pd_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    ticket = params["tract_ticket"]
    assert ticket["tokens"] == 40 and ticket["blocks"] == 3      # 2 full blocks + the tail
    assert seen["pd_pins"] == 3                                  # held for the decode side


def test_no_request_state_is_left_behind(seen):
    assert seen["state_left"] == [0, 0, 0]
