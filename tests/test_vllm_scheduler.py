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
def seen(vllm_checkpoint, tmp_path_factory):
    ckpt = vllm_checkpoint
    pool = f"/dev/shm/tract-test-vllm-sched-{os.getpid()}.pool"
    subprocess.run([sys.executable, "-m", "tract_cli.cli", "init", pool, "--size", "64M",
                    "--model", ckpt, "--nodes", "4", "--force", "-q"], check=True, timeout=120)
    try:
        out = subprocess.run([VLLM_PY, os.path.join(ROOT, "tests", "vllm_scheduler_driver.py"),
                              ckpt, pool], capture_output=True, text=True, timeout=300,
                             cwd=ROOT, env=os.environ | {
                                 "HF_HUB_OFFLINE": "1",
                                 # what it makes (another checkpoint) under pytest's own
                                 "TMPDIR": str(tmp_path_factory.mktemp("scheduler"))})
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("OBSERVATIONS ")), None)
        assert line, f"the driver failed (code {out.returncode}): {out.stderr[-3000:]}"
        seen = json.loads(line.removeprefix("OBSERVATIONS "))
        check = subprocess.run([sys.executable, "-m", "tract_cli.cli", "check", pool],
                               capture_output=True, text=True, timeout=120)
        seen["check"] = [check.returncode, check.stdout[-2000:] + check.stderr[-2000:]]
        yield seen
    finally:
        stop_stack({"pool": pool})


def test_a_pool_hit_is_pinned_once_and_loads_asynchronously(seen):
    assert seen["hit_status"] == "WAITING_FOR_REMOTE_KVS"
    assert seen["hit_loads"] == [6]                  # 100 tokens: 6 full 16-token blocks
    assert seen["hit_pins_while_loading"] == 6
    assert seen["hit_pins_after_rematch"] == 6       # matching again takes no second pin
    assert seen["hit_rematch"] == [0, False]         # ... and promises no second load
    assert seen["hit_pins_after_load"] == 0          # given back when the worker reports
    assert seen["hit_scheduled_tokens"] == 4         # then only the 4 tokens past the hit
    assert seen["hit_computed_then"] == 100          # 96 loaded, and the 4 now scheduled


def test_an_abort_during_the_load_waits_for_the_worker_then_unpins(seen):
    assert seen["abort_status"] == "WAITING_FOR_REMOTE_KVS"
    assert seen["abort_pins_before_worker"] == 4     # the worker may still be reading them
    assert seen["abort_pins_after_worker"] == 0


def test_a_failed_load_is_recomputed_and_not_offered_again(seen):
    assert seen["bad_scheduled_tokens"] == 80
    assert seen["bad_computed_then"] == 80           # all 80 scheduled: none of the load
    assert seen["bad_rematch"] == [0, False]
    assert seen["bad_pins_after"] == 0


def test_a_synchronous_hit_is_copied_in_the_step_that_computes_the_rest(seen):
    # load_mode sync (the default): no waiting for remote KV, the 4 tokens past
    # the hit scheduled in the same step as its 6 blocks' copy
    assert seen["sync_status"] == "RUNNING"
    # (its 6 blocks end where the step's tokens begin: on a GPU the forward
    # need not wait for the whole load, past_end False)
    assert seen["sync_loads"] == [[6, True, False]] and seen["sync_step"] == [4, True]
    assert seen["sync_pins_in_step"] == 6
    assert seen["sync_pins_after"] == 0              # the step's output reported the copy
    assert seen["sync_computed"] == 100
    # a hit of the whole prompt leaves vLLM its last token to compute, which
    # lies in the last loaded block (past_end: on a GPU the forward waits for
    # the whole load)
    assert seen["sync_whole"] == [[[6, True]], 1]


def test_a_failed_synchronous_load_is_recomputed_and_not_offered_again(seen):
    # 80 of 90 tokens loaded with the 10 others; the load's pages failed: vLLM
    # computes all 90 next step, without the pool
    assert seen["sync_bad"] == [10, 90, [], [0, False]]
    assert seen["sync_pins_end"] == 0 and seen["sync_state_left"] == [0, 0]


def test_a_paired_prefill_whose_load_failed_tells_its_decode_at_once(seen):
    # computed, answered without a ticket, and its paired decode finds a record of
    # no blocks under the pair's name (HandoffLost: it computes at once)
    params, said = seen["bad_pair"]
    assert not (params or {}).get("tract_ticket")
    assert said == "HandoffLost"
    assert seen["bad_pair_after"] == 0


def test_a_failed_synchronous_load_saves_nothing_computed_on_it(seen):
    # its pages to recompute; the step's 2 new blocks not in the pool; no handoff;
    # only the test's own lookup pins (4) left: the handoff's were given back
    errors, ready, left = seen["failed_sync_save"]
    assert errors == [10, 11] and ready == 0
    assert left == {"pins": 4, "pending": 0, "handoffs": 0}


def test_each_cpu_isas_page_layout_round_trips_bytes_for_bytes(seen):
    # AMX's, the vector ISAs' (vec: a page of 32 tokens; vec16: the ISA vLLM picks
    # for 16-token pages): each measured with vLLM's own cache writer for it
    layouts = {}
    for isa, (layout, hits, errors, equal, nonzero) in seen["isa_roundtrip"].items():
        assert hits == 4 and errors == [] and equal and nonzero, isa
        layouts[isa] = layout
    # AMX packs its pages otherwise: a layout of its own, so a digest, so keys,
    # of its own (an instance of one never reads the other's blocks)
    assert layouts["amx"] != layouts["vec"] == layouts["vec16"]


def test_a_synchronous_load_is_copied_before_start_load_kv_returns(seen):
    # reported with the step's output (worker meta), once, never by get_finished
    assert seen["sync_roundtrip"] == [[], [], ["loaded-sync"], True]
    assert seen["sync_roundtrip_equal"]


def test_vllms_default_load_failure_policy_is_said_at_start(seen):
    # fail (vLLM's default) fails a request whose pool block fails its checksum:
    # said once, by the scheduler half; recompute says nothing
    assert seen["fail_policy_said"] == 1
    assert seen["recompute_policy_said"] == 0


def test_a_prefill_for_a_remote_decode_publishes_a_handoff(seen):
    params = seen["pd_params"]
    assert params["do_remote_prefill"] is True and params["do_remote_decode"] is False
    ticket = params["tract_ticket"]
    assert ticket["tokens"] == 40 and ticket["blocks"] == 3      # 2 full blocks + the tail
    # published by the worker in the step that completed the prompt, in the record
    # the scheduler chose for it then (node 1's share of the 1024 records: from 256),
    # with the save's own pins: one a block, the record's
    assert seen["pd_in_step"] == [ticket["record"]] == [256]
    assert seen["pd_pins"] == 3                                  # held for the decode side


def test_a_handoff_whose_record_was_taken_is_not_published_and_holds_nothing(seen):
    promised, before, during, opened = seen["taken_record"]
    assert promised and before == {"pins": 0, "pending": 0, "handoffs": 0}
    # only the other publisher's record and its 2 pins: the 3 the step's claim
    # took for the handoff were given back
    assert during == {"pins": 2, "pending": 0, "handoffs": 1}
    assert opened == "not published"
    assert seen["taken_after"] == {"pins": 0, "pending": 0, "handoffs": 0}


def test_a_handoff_aborted_while_its_step_runs_is_given_back_after_it(seen):
    held, published, still, after = seen["aborted_handoff"]
    assert held and published == 1 and not still
    assert after == {"pins": 0, "pending": 0, "handoffs": 0}


def test_two_handoffs_of_one_step_sharing_blocks_each_hold_their_own_pins(seen):
    # 3 blocks each, 2 in common: 6 pins in all, two records, both planned in the
    # step and published by the worker (the shared blocks pinned again for the
    # second), each whole
    for mode, name in (("after_step", "share"), ("in_step", "sharei")):
        tickets, held, planned, opened, after = seen["shared"][mode]
        assert tickets == 2 and held == {"pins": 6, "pending": 0, "handoffs": 2}, mode
        assert planned == [f"{name}-a", f"{name}-b"] and opened == [3, 3], mode
        assert after == {"pins": 0, "pending": 0, "handoffs": 0}, mode
    # the second failing on the way (injected: its shared blocks' pins refused, or
    # only the first of them pinned, or its publish refused once they were): it
    # alone is lost, its reservation given back (its decode finds the record free
    # and computes), and nothing stays pinned
    for how in ("lookup", "partial", "publish"):
        tickets, outcome, after = seen["shared_refused"][how]
        assert tickets == 2, how
        assert outcome == {"a": "published", "b": "HandoffGone"}, how
        assert after == {"pins": 0, "pending": 0, "handoffs": 0}, how


def test_finishing_prefills_make_no_pool_call_in_the_scheduler_loop(seen):
    # every lock held by another node while the step's output comes in:
    # request_finished answers both handoffs (one paired, named by its pair)
    # with their tickets at once, where one lock wait would take claim_wait_s (5 s)
    finished, tickets, held_s = seen["stalled_finish"]
    assert finished == tickets == ["stall-a", "stall-b"]
    assert held_s < 1.0, f"the scheduler loop waited {held_s} s finishing them"
    assert seen["stalled_pair_record"] is True
    assert seen["stalled_finish_after"] == {"pins": 0, "pending": 0, "handoffs": 0}


def test_a_request_without_pages_holds_no_pins_while_it_waits(seen):
    assert seen["queued_status"] == ["RUNNING", "WAITING"]
    assert seen["queued_pins"] == 0


def test_another_checkpoint_of_one_geometry_shares_no_block_and_no_handoff(seen):
    assert seen["other_identity_differs"]
    assert seen["same_match"] == [96, True]         # the model that stored them hits
    assert seen["other_match"] == [0, False]         # the other weights do not
    assert seen["other_handoff_match"] == [0, False]
    assert seen["pd_params"]["tract_ticket"]["model"]


def test_a_flood_of_remote_decode_requests_pins_nothing_past_the_bound(seen):
    assert seen["consumer_tickets"] == 0 and seen["consumer_records"] == 0
    assert seen["producer_tickets"] == 3 and seen["producer_records"] == 3


def test_lock_timeouts_in_unpin_commit_and_ack_leave_nothing_behind(seen):
    pinned, held, pending = seen["timeouts_unpin_held"]
    assert pinned == held == 6 and pending == 1          # kept, queued, while locks are held
    assert seen["timeouts_commit_pending_held"] == [4, 1]
    assert seen["timeouts_after_unpin_commit"] == {"pins": 0, "pending": 0, "handoffs": 0}
    assert min(seen["timeouts_retries"]) >= 1
    assert seen["timeouts_ack_errors"] == []      # the load stands: still published after it
    assert seen["timeouts_ack_equal"]
    assert seen["timeouts_ack_record_held"] == 1          # its ack retried meanwhile
    assert seen["timeouts_after_ack"] == {"pins": 0, "pending": 0, "handoffs": 0}


def test_a_save_is_committed_off_the_step_unless_a_handoff_follows_it(seen):
    # every lock held: the step returned, its 4 blocks still PENDING, none READY
    assert seen["off_step_commit_held"] == [4, 0]
    assert seen["off_step_commit_after"] == [4, 0]        # committed once the locks are free
    # a P/D prefill's last step, its handoff planned in-step, does not wait: its
    # record was reserved with the claim, and a decode opening it meanwhile is
    # told to wait; published once the commit is done
    assert seen["handoff_step_returns"]
    assert seen["handoff_step_held"] == ["pending", 0]
    assert seen["handoff_step_after"] == ["published", 4]
    # ... only with handoff_publish in_step does a P/D prefill's last step wait for
    # its commit and publish, reserving nothing: its record is published on return
    assert not seen["in_step_reserves"]
    assert seen["in_step_handoff_waits"]
    assert seen["in_step_handoff_held"] == "not published"
    assert seen["in_step_handoff_after"] == [True, "published"]
    # a commit that raised (not a pool error): the step went on, nothing saved,
    # no claim left PENDING
    assert seen["failed_commit"] == [[True], 0, 0]


def test_a_handoff_released_during_its_copy_is_recomputed(seen):
    # acknowledged by another party between the copy and the check: the slots may
    # have been reused under the copy, so vLLM recomputes the pages
    assert seen["released_errors"] == [6, 7]
    assert seen["released_after"] == {"pins": 0, "pending": 0, "handoffs": 0}


def test_a_save_never_waited_for_gives_its_claims_back(seen):
    assert seen["dropped_pending"] == 4                   # claimed during "the forward"
    assert seen["dropped_after"] == {"pins": 0, "pending": 0, "handoffs": 0}


def test_saved_kv_loads_back_into_vllm_pages_bytes_for_bytes(seen):
    # saved and loaded by the worker's C path, in the page layout vLLM picked here
    assert seen["roundtrip_errors"] == []
    assert seen["roundtrip_nonzero"] and seen["roundtrip_equal"]


def test_a_stalled_lock_manager_delays_the_pool_never_scheduling(seen):
    # every lock held: a prompt the pool does not hold is answered by a look
    # without a lock and scheduled at once; the hit's lookup waits off the
    # scheduler loop, which answers "not yet" for it and schedules the others
    assert seen["stall_schedule_s"] < 1.0 and seen["stall_max_schedule_s"] < 1.0
    assert seen["stall_scheduled"] == ["short", "stalled-miss"]
    assert seen["stall_waiting"] == ["WAITING", "RUNNING"]
    # past lookup_patience_s (0.5 s) the hit is computed, not loaded
    late = seen["stall_scheduled_after_s"]
    assert late["stalled-miss"] < 0.4 <= late["stalled-hit"] < 5.0
    assert seen["stall_loads"] == []
    # the locks free: nothing stays pinned, and a hit loads again
    assert seen["stall_loads_after"] == ["after-stall"]
    assert seen["stall_pins_after"] == 0


def test_a_decode_waits_for_a_reserved_handoff_and_gives_up_past_handoff_wait_s(seen):
    # reserved: "not yet" (None) each time vLLM asks, never "compute it"; once
    # published, the whole prompt is loaded (asynchronously, as this driver's
    # scheduler loads)
    assert seen["reserved_ticket_answers"] == [[None, False]] * 3 + [[40, True]]
    # a ticket of another prompt (as many blocks, one token more) is refused at
    # once while its record is reserved, never waited for
    answer, refused = seen["reserved_other_prompt"]
    assert answer != [None, False] and refused       # (its blocks may hit as a prefix)
    # never published: "not yet" at first, computed past handoff_wait_s (0.2 s),
    # and the reservation given back (a publish after it would be refused)
    assert seen["reserved_never"] == [[None, False], True, [0, False]]
    assert seen["reserved_never_record"] == "HandoffGone"
    assert seen["reserved_after"] == seen["reserved_before"]   # nothing left of either


def test_a_paired_decode_whose_reserved_record_is_given_back_reads_the_lost_record(seen):
    """A paired decode waiting on its prefill's RESERVED record, which the prefill
    gives back and marks lost (a record of no blocks under the pair's name):
    it looks for the pair again, computes at once (well within pair_wait_s,
    60 s here; nothing loaded) and gives that record back."""
    assert seen["paired_lost_first"] == [0, True]        # waiting on the reservation
    assert seen["paired_lost_unreserved"] is True
    assert seen["paired_lost_computed_after_s"] < 10, seen["paired_lost_computed_after_s"]
    assert seen["paired_lost_loads"] == []
    assert seen["paired_lost_record_left"] == -1


def test_a_ticket_of_another_page_layout_is_refused_and_no_layout_no_pool(seen):
    assert seen["layout_ticket_refused"] == [True, True]
    assert seen["no_handshake_match"] == [0, False] and seen["no_handshake_key_tag"] is None


def test_chunked_prefill_saves_each_block_once_over_several_steps(seen):
    # a 64-token budget: 200 tokens in 4 steps, 4 blocks saved per full chunk, the
    # partial tail with the last; the handoff at the end names all 13 blocks,
    # planned in the last step (its record reserved there), and no step waits
    # for its commit
    assert seen["chunked_steps"] == [[64, 4, False, False], [64, 4, False, False],
                                     [64, 4, False, False], [8, 1, False, True]]
    assert seen["chunked_saved_once_each"]
    assert seen["chunked_ticket_blocks"] == 13


def test_a_request_preempted_after_its_load_loads_again_and_unpins(seen):
    assert seen["preempt_status"] == "PREEMPTED"
    assert seen["preempt_loads"] == [[6], [6]]      # loaded, then again once resumed
    assert seen["preempt_pins_reloading"] == 6
    assert seen["preempt_scheduled_after"] == 5     # 100 prompt + 1 output - 96 loaded
    assert seen["preempt_pins_after"] == 0


def test_two_kv_cache_groups_are_refused_at_start_in_one_line(seen):
    line = seen["two_groups"]
    assert line and line.startswith("ConnectorError: TraCT connector: vLLM has 2 KV cache group")
    assert "\n" not in line and "; " in line


def test_the_region_checks_clean_after_all_of_it(seen):
    rc, out = seen["check"]
    assert rc == 0, out


def test_no_request_state_is_left_behind(seen):
    assert seen["state_left"] == [0, 0, 0]
