"""TraCT inside real vLLM (its CPU build): P/D through the pool, the front door,
prefix sharing between instances, tenants, load failures, bad configuration.

The servers are real `vllm.entrypoints.openai.api_server` processes started
by the product's own launcher (`serve.vllm_engine.VllmServer`) in vLLM's
environment (`.ci/setup` builds it in `.peers/vllm`; TRACT_VLLM_PYTHON names
another), on a tiny random-weight checkpoint made locally.  They are shared
by the module (the prefill and decode instances) and by the session (the
checkpoint, and the monolithic vLLM that tests/test_vllm_faults.py compares
with too): three engines start together once (~1.5 min on two cores).  Every
answer is compared with a monolithic vLLM's (no connector) at temperature 0, by
the logprobs of its tokens' top candidates (`tests.vllm_stack.answer_gap`), on
a model whose answers move with every block of the prompt (tests/vllm_model.py):
wrong KV shows (tests/test_vllm_faults.py has the negative control).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

import background
from background import Check, uses
from tests.servers import request
from tests.vllm_stack import (ANSWER_FIELDS, ARGS, KV_CACHE_BYTES, VLLM_PY,
                              assert_answers_as_mono, background_checkpoint, complete,
                              external_hits, kill_marked, open_published, port, prefill_params,
                              remove_vllm_debris, server_model, shm_names, start_stack,
                              stop_stack, tokens_by_source, wait_until_released,
                              wait_until_saved)
from tract_cli.core.agent_launch import IDLE_EXIT_S
from tract_cli.core.handoff import Ticket
from tract_cli.core.medium import processes_mapping
from tract_cli.core.pool import Pool
from tract_cli.core.region import remove_region
from tract_cli.serve.vllm_engine import READY_TIMEOUT_S

PROMPT = "Prefill computes the prompt's KV cache; decode reads it one token at a time. "
PAIR_WAIT_S = 15.0

pytestmark = pytest.mark.skipif(not os.path.exists(VLLM_PY),
                                reason=f"no vLLM environment at {VLLM_PY} (.ci/setup builds it)")


@pytest.fixture(scope="module")
def stack(tmp_path_factory, vllm_checkpoint, vllm_mono):
    """A region, a prefill and a decode instance on it (nodes 1, 2; kv_both),
    and the session's monolithic vLLM; the two stopped, with their node agents,
    afterwards."""
    # the decode instance publishes vLLM's KV events (with a replay endpoint, so a
    # subscriber misses nothing published before it connected)
    events = {"endpoint": f"tcp://127.0.0.1:{port()}", "replay": f"tcp://127.0.0.1:{port()}"}
    kv_events = {"enable_kv_cache_events": True, "publisher": "zmq",
                 "endpoint": events["endpoint"].replace("127.0.0.1", "*"),
                 "replay_endpoint": events["replay"].replace("127.0.0.1", "*")}
    # TRACT_CONNECTOR_REFERENCE as `tract bench --engine vllm` sets it: a request
    # that asks has a memcpy timed beside its copies (none of the others ask)
    # pair_wait_s: a paired decode whose prefill never comes is computed after it
    st = start_stack(tmp_path_factory.mktemp("vllm"), "128M",
                     {"handoff_ttl_s": 60.0, "pair_wait_s": PAIR_WAIT_S},
                     ckpt=vllm_checkpoint, mono=vllm_mono,
                     decode_args=("--kv-events-config", json.dumps(kv_events)),
                     env={"TRACT_CONNECTOR_REFERENCE": "1"})
    st["events"] = events
    try:
        yield st
    finally:
        stop_stack(st)


@pytest.mark.parametrize("repeat", [1, 3, 7, 20])
def test_decode_through_the_pool_answers_as_one_vllm(stack, repeat):
    # 1 repeat: 17 tokens (one block and a 1-token tail); 20: ~340 tokens over 3 vLLM pages
    prompt = PROMPT * repeat
    params = prefill_params(stack, prompt)
    ticket = params["tract_ticket"]
    external = tokens_by_source(stack["decode"], "external_kv_transfer")
    local = tokens_by_source(stack["decode"], "local_compute")
    out = complete(stack["decode"], prompt, kv_transfer_params=params)
    assert_answers_as_mono(stack, prompt, out)
    n = out["usage"]["prompt_tokens"]
    assert ticket["tokens"] == n and ticket["blocks"] == -(-n // 16)
    # every prompt token but the last came from the pool: a synchronous load (the
    # default load_mode) leaves the step that copies it the last token to compute,
    # for its logits (an asynchronous one recomputes it too, counted as loaded)
    assert tokens_by_source(stack["decode"], "external_kv_transfer") - external == n - 1
    assert tokens_by_source(stack["decode"], "local_compute") == local + 1


def test_the_memcpy_reference_is_timed_only_for_a_request_that_asks(stack):
    """With TRACT_CONNECTOR_REFERENCE=1 (what the bench sets), a request whose
    kv_transfer_params ask (kvlog.REFERENCE_PARAM: the bench's warm-ups) has a
    memcpy timed beside its save and, through its ticket, beside its decode's
    load (one of them in the step, right before the copy), and still answers as
    one vLLM; a request that does not ask has none
    (no measured request pays the extra copies in its steps)."""
    from tract_cli.core import kvlog
    logs = {role: str(stack["tmp"] / f"{role}.log") for role in ("prefill", "decode")}
    for asked in (True, False):
        prompt = f"The bench times a memcpy beside its warm-ups' copies ({asked}). " * 4
        since = {role: os.path.getsize(path) for role, path in logs.items()}
        ask = {"do_remote_decode": True} | ({kvlog.REFERENCE_PARAM: True} if asked else {})
        params = complete(stack["prefill"], prompt, 1, kv_transfer_params=ask)["kv_transfer_params"]
        assert "tract_ticket" in params and (params.get(kvlog.REFERENCE_PARAM) is True) == asked
        out = complete(stack["decode"], prompt, kv_transfer_params=params)
        assert_answers_as_mono(stack, prompt, out)
        # both lines are logged in the step, before its reply
        lines = {role: [(kind, row) for kind, row in kvlog.read_since(path, since[role])
                        if kind.endswith("_memcpy")] for role, path in logs.items()}
        timed = {role: [kind for kind, _ in got] for role, got in lines.items()}
        assert timed == ({"prefill": ["save_memcpy"], "decode": ["load_memcpy"]} if asked
                         else {"prefill": [], "decode": []}), (asked, timed)
        # with the memcpy in the step, right before the copy, among them
        assert all(row["step_ms"] > 0 for got in lines.values() for _, row in got), lines


def test_vllms_kv_cache_is_in_huge_pages_as_tract_starts_it(stack):
    """The instances TraCT starts (VllmServer) run with THP_MEM_ALLOC_ENABLE=1, so
    vLLM's CPU KV cache is in 2 MiB pages and a KV copy meets a page walk per
    2 MiB; the connector's worker says how much of it is (and warns, with the
    fix, where the kernel gives none)."""
    with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
        thp = "[never]" not in f.read()
    for role in ("prefill", "decode"):
        text = open(stack["tmp"] / f"{role}.log", errors="replace").read()
        share = re.search(r"TraCT connector worker: (\d+)% of vLLM's KV cache in huge pages"
                          r"|\((\d+)% in huge pages\)", text)
        assert share, role
        # torch asked for them (without the variable: 0); how many the kernel
        # found room for depends on how fragmented this host's memory is
        assert int(share[1] or share[2]) > 0 if thp else share[2] == "0", (role, share[0])


def test_a_kv_cache_size_in_vllms_arguments_wins_over_the_launchers(stack):
    """The stack passes --kv-cache-memory-bytes among vLLM's arguments: the
    launcher clears VLLM_CPU_KVCACHE_SPACE, which vLLM's CPU platform would put
    over the flag, so the cache is the flag's 128 MiB, not the launcher's 1 GiB."""
    for role in ("prefill", "decode"):
        text = open(stack["tmp"] / f"{role}.log", errors="replace").read()
        got = re.search(r"Explicitly set \(([\d.]+)/[\d.]+\) GiB for KV cache", text)
        assert got, role
        assert abs(float(got[1]) - KV_CACHE_BYTES / (1 << 30)) < 0.01, (role, got[0])


def test_a_prefix_one_instance_computed_is_a_hit_for_another(stack):
    head = "CXL shared memory lets every host in a rack load and store the same bytes. " * 8
    complete(stack["prefill"], head, 1)
    wait_until_saved(stack["pool"])       # committed off the prefill's step
    hits = external_hits(stack["decode"])
    prompt = head + "A prefix cache reuses the blocks of prompts that start alike."
    out = complete(stack["decode"], prompt)
    assert_answers_as_mono(stack, prompt, out)
    n_head = complete(stack["mono"], head, 1)["usage"]["prompt_tokens"]
    assert external_hits(stack["decode"]) - hits >= n_head // 16 * 16 > 0


def test_cache_salt_keeps_tenants_apart(stack):
    prompt = "Tenant data that must never be shared across salts. " * 6
    complete(stack["prefill"], prompt, 1, cache_salt="tenant-a")
    wait_until_saved(stack["pool"])
    hits = external_hits(stack["decode"])
    complete(stack["decode"], prompt, 1, cache_salt="tenant-b")
    assert external_hits(stack["decode"]) == hits
    complete(stack["decode"], prompt, 1, cache_salt="tenant-a")
    assert external_hits(stack["decode"]) > hits


def test_a_block_failing_its_checksum_is_recomputed(stack):
    prompt = "A corrupted block must never be served: vLLM recomputes it. " * 5
    params = prefill_params(stack, prompt)
    ticket = Ticket.from_dict(params["tract_ticket"])
    with Pool.attach(stack["pool"], node=3) as pool:
        rec = open_published(pool, ticket)
        view = pool.slot_bytes(int(rec.slots[1]))
        view[:64] ^= 0xFF                   # one cache line of the second block
        del view
    log_path = stack["tmp"] / "decode.log"
    seen = len(open(log_path).read())
    out = complete(stack["decode"], prompt, kv_transfer_params=params)
    assert_answers_as_mono(stack, prompt, out)
    # the bad block's vLLM page (128 tokens: the whole prompt) was computed again:
    # vLLM's own account of it (its token-source counters count a synchronous
    # load's tokens when first scheduled, before the failure)
    log = open(log_path).read()[seen:]
    assert "fails its checksum" in log
    recovered = re.findall(r"Recovered from KV load failure: 1 request\(s\) rescheduled "
                           r"\((\d+) tokens affected\)", log)
    assert [int(n) for n in recovered] == [out["usage"]["prompt_tokens"] - 1]


def test_a_handoff_gone_before_decode_is_recomputed(stack):
    prompt = "This handoff expires before the decode instance reads it. " * 4
    params = prefill_params(stack, prompt)
    ticket = Ticket.from_dict(params["tract_ticket"])
    with Pool.attach(stack["pool"], node=3) as pool:    # as the agent's expiry would
        # once published: the prefill's reply may leave before its publish, and an
        # ack of a record still reserved finds nothing to release (then the publish
        # pins it for its whole TTL)
        open_published(pool, ticket)
        pool.handoffs.ack(ticket)
    out = complete(stack["decode"], prompt, kv_transfer_params=params)
    assert_answers_as_mono(stack, prompt, out)
    assert "is not published (acknowledged, expired" in open(stack["tmp"] / "decode.log").read()


@pytest.mark.parametrize("ticket", [
    {"record": 2**40, "request_id": "00" * 16, "blocks": 1, "tokens": 1},
    {"record": 1.5, "request_id": "00" * 16, "blocks": 1, "tokens": 1},
    {"record": -1, "request_id": "00" * 16, "blocks": 1, "tokens": 1},
    {"record": 0, "request_id": "", "blocks": 1, "tokens": 1},
    {"record": 0, "request_id": "zz", "blocks": 2**40, "tokens": 1},
    "not an object",
])
def test_a_hostile_ticket_is_computed_never_fatal(stack, ticket):
    prompt = "A ticket from the network is input like any other. " * 3
    out = complete(stack["decode"], prompt, kv_transfer_params={
        "do_remote_prefill": True, "tract_ticket": ticket})
    assert_answers_as_mono(stack, prompt, out)


def test_another_prompts_ticket_loads_nothing_of_it(stack):
    """The record's own key list decides: a ticket sent with a different prompt of the
    same length is not loaded (that would serve one tenant another's KV)."""
    victim = "The victim's confidential prompt, some forty tokens long ok. " * 2
    params = prefill_params(stack, victim)
    n = params["tract_ticket"]["tokens"]
    other = complete(stack["mono"], "x", 1)                 # its model name, and a warm-up
    del other
    # a prompt of the same token count with other tokens
    thief = list(range(20, 20 + n))
    external = tokens_by_source(stack["decode"], "external_kv_transfer")
    out = complete(stack["decode"], thief, kv_transfer_params=params)
    assert_answers_as_mono(stack, thief, out)
    assert tokens_by_source(stack["decode"], "external_kv_transfer") == external
    # the victim's handoff is intact: its own decode still loads it
    mine = complete(stack["decode"], victim, kv_transfer_params=params)
    assert_answers_as_mono(stack, victim, mine)
    assert tokens_by_source(stack["decode"], "external_kv_transfer") - external == n - 1


@pytest.mark.parametrize("paired", [False, True], ids=["two-step", "paired"])
def test_front_door_runs_the_p_d_flow_over_http(stack, paired):
    door_port = port()
    door = subprocess.Popen(
        [VLLM_PY, "-c", "import sys; from tract_cli.serve.vllm_proxy import serve; "
                        "serve([sys.argv[1]], sys.argv[2], '127.0.0.1', int(sys.argv[3]), "
                        "paired=sys.argv[4] == '1')",
         stack["prefill"].url, stack["decode"].url, str(door_port), str(int(paired))],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{door_port}"
    try:
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline and status != 200:
            assert door.poll() is None, door.stderr.read()
            try:
                status, _ = request(url + "/health", timeout=5)
            except OSError:
                time.sleep(0.2)   # the front door starting up, bounded
        assert status == 200, "the front door did not become ready within 60 s"
        prompt = PROMPT * (5 if paired else 4)
        external = tokens_by_source(stack["decode"], "external_kv_transfer")
        status, body = request(url + "/v1/completions", {
            "model": server_model(stack["decode"]), "prompt": prompt, "max_tokens": 12,
            "temperature": 0} | ANSWER_FIELDS)
        assert status == 200, body
        assert_answers_as_mono(stack, prompt, body)
        assert tokens_by_source(stack["decode"], "external_kv_transfer") - external == \
            body["usage"]["prompt_tokens"] - 1      # all but the last: loaded synchronously
    finally:
        door.terminate()
        door.wait(timeout=30)


def _requests_waiting(server) -> float:
    """vLLM's gauge of the requests in its waiting queue."""
    import urllib.request
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        lines = resp.read().decode().splitlines()
    return sum(float(line.split()[-1]) for line in lines
               if line.startswith("vllm:num_requests_waiting"))


def _paired(role: str, pair: str) -> dict:
    """A paired request's kv_transfer_params (what the front door sends)."""
    return ({"do_remote_decode": True, "tract_pair": pair} if role == "prefill"
            else {"do_remote_prefill": True, "tract_pair": pair})


def _in_background(call) -> tuple:
    """CALL() on a thread of its own: (the thread, a box its result or error lands in)."""
    import threading
    box: dict = {}

    def run():
        try:
            box["out"] = call()
        except BaseException as exc:     # re-raised by the test that reads the box
            box["error"] = exc
        box["done_at"] = time.monotonic()
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _result(thread, box: dict, timeout: float = 120):
    thread.join(timeout)
    assert not thread.is_alive(), f"the request did not answer within {timeout:.0f} s"
    if "error" in box:
        raise box["error"]
    return box["out"]


def test_a_paired_decode_sent_before_its_prefill_waits_for_it_and_loads_its_handoff(stack):
    """The front door's flow with the decode request first: it is in vLLM,
    told "not yet" by the connector, before the prefill request is even sent;
    once the prefill publishes, the decode finds the record by the pair's name
    (no ticket ever reaches it) and loads every prompt token but the last."""
    import uuid

    from tract_cli.core.handoff import pair_key
    prompt = "A paired decode finds its prefill's handoff in the pool by a name. " * 4
    pair = uuid.uuid4().hex
    external = tokens_by_source(stack["decode"], "external_kv_transfer")
    waiting = _requests_waiting(stack["decode"])
    thread, box = _in_background(lambda: complete(stack["decode"], prompt,
                                                  kv_transfer_params=_paired("decode", pair)))
    deadline = time.monotonic() + 60
    while _requests_waiting(stack["decode"]) <= waiting:
        assert thread.is_alive() and time.monotonic() < deadline, \
            box.get("error") or box.get("out") or "the decode was not waiting within 60 s"
        time.sleep(0.05)    # polling the other process's gauge, bounded
    params = complete(stack["prefill"], prompt, 1,
                      kv_transfer_params=_paired("prefill", pair))["kv_transfer_params"]
    # the prefill's record is named by the pair
    assert params["tract_ticket"]["request_id"] == pair_key(pair).hex()
    out = _result(thread, box)
    assert_answers_as_mono(stack, prompt, out)
    n = out["usage"]["prompt_tokens"]
    assert tokens_by_source(stack["decode"], "external_kv_transfer") - external == n - 1


def test_a_paired_decode_of_another_prompt_computes_it_and_leaves_the_handoff(stack):
    """A pair's name finds a record, never loads it: a decode whose prompt is
    not the prefill's (the same pair's name, by a client's mistake or on
    purpose) is refused by the record's key list and computes its prompt; the
    handoff stays whole for the decode of its own prompt."""
    import uuid
    prompt = "The key list of a record, not its name, says whose KV it holds. " * 4
    other = "Another prompt under the same pair's name loads nothing of it. " * 4
    pair = uuid.uuid4().hex
    complete(stack["prefill"], prompt, 1, kv_transfer_params=_paired("prefill", pair))
    external = tokens_by_source(stack["decode"], "external_kv_transfer")
    out = complete(stack["decode"], other, kv_transfer_params=_paired("decode", pair))
    assert_answers_as_mono(stack, other, out)
    assert tokens_by_source(stack["decode"], "external_kv_transfer") == external
    mine = complete(stack["decode"], prompt, kv_transfer_params=_paired("decode", pair))
    assert_answers_as_mono(stack, prompt, mine)
    assert tokens_by_source(stack["decode"], "external_kv_transfer") - external == \
        mine["usage"]["prompt_tokens"] - 1


def test_a_paired_decode_whose_handoff_is_lost_computes_at_once(stack):
    """A paired prefill whose handoff will not be published once its ticket has
    left (here a block of its prompt is another node's PENDING claim, so not
    this step's to save) leaves a record of no blocks under the pair's name:
    its paired decode, which has no ticket to find the record gone, computes
    the prompt at once instead of waiting pair_wait_s."""
    import uuid

    from tract_cli.core.index import PUT_CLAIMED
    prompt = "A lost handoff says so under its pair's name, and the decode computes. " * 4
    # the prompt's keys, from a handoff of it (the two-step flow), then given back
    # and evicted, so that another node can claim its first block
    ticket = Ticket.from_dict(prefill_params(stack, prompt)["tract_ticket"])
    log_path = stack["tmp"] / "decode.log"
    with Pool.attach(stack["pool"], node=3) as other:
        keys = open_published(other, ticket).keys.copy()
        other.handoffs.ack(ticket)
        other.index.evict(1 << 20)
        status, slots = other.index.reserve(keys[:1])
        try:
            assert status[0] == PUT_CLAIMED, status
            seen = len(open(log_path).read())
            external = tokens_by_source(stack["decode"], "external_kv_transfer")
            pair = uuid.uuid4().hex
            thread, box = _in_background(lambda: complete(
                stack["decode"], prompt, kv_transfer_params=_paired("decode", pair)))
            complete(stack["prefill"], prompt, 1, kv_transfer_params=_paired("prefill", pair))
            answered = time.monotonic()
            out = _result(thread, box, timeout=PAIR_WAIT_S + 120)
        finally:
            other.index.commit(keys[:1], status, slots, publish=False)
    waited = box["done_at"] - answered
    assert waited < PAIR_WAIT_S / 2, f"the decode answered {waited:.1f} s after its prefill"
    assert_answers_as_mono(stack, prompt, out)
    assert tokens_by_source(stack["decode"], "external_kv_transfer") == external
    assert "lost by its prefill, computing it" in open(log_path).read()[seen:]
    assert "not published (a block of it is not this step's to save)" in \
        open(stack["tmp"] / "prefill.log").read()


def test_a_paired_decode_whose_prefill_never_comes_is_computed_after_pair_wait_s(stack):
    """A decode paired with a prefill that never arrives (its front door gone
    before sending it) waits pair_wait_s at most, then computes the prompt:
    the same answer, nothing taken from the pool; meanwhile the instance
    serves other requests."""
    import uuid
    prompt = "A prefill that never comes costs its decode the wait, then a compute. " * 4
    t0 = time.monotonic()
    thread, box = _in_background(lambda: complete(
        stack["decode"], prompt, kv_transfer_params=_paired("decode", uuid.uuid4().hex)))
    # another request, sent while the paired one waits, is answered meanwhile
    other = "While a paired decode waits for its prefill, its instance serves others. " * 3
    assert_answers_as_mono(stack, other, complete(stack["decode"], other))
    other_done = time.monotonic()
    external = tokens_by_source(stack["decode"], "external_kv_transfer")
    out = _result(thread, box, timeout=PAIR_WAIT_S + 120)
    waited = box["done_at"] - t0
    assert waited >= PAIR_WAIT_S, f"computed after {waited:.1f} s, before pair_wait_s"
    assert other_done < box["done_at"], "the other request was not served while it waited"
    assert_answers_as_mono(stack, prompt, out)
    assert tokens_by_source(stack["decode"], "external_kv_transfer") == external


def test_pins_and_claims_are_given_back(stack):
    """After the requests above, nothing the instances took is left pinned or PENDING
    (acknowledged handoffs release their pins; lookups unpin after loading)."""
    wait_until_released(stack["pool"], timeout=30)


def _serve_on_another_models_region() -> dict:
    """`tract serve-prefill --engine vllm` on a region formatted for another model,
    as a background check (tests/background.py: a vLLM start that fails, a
    minute of imports that shares nothing with the stack's tests): what it
    said, and the processes still mapping the region after it (whatever it
    left is then killed and removed)."""
    ckpt = background_checkpoint()
    work = background.session_dir("tract-vllm-other-model-")
    region = f"/dev/shm/tract-test-other-model-{os.getpid()}.pool"
    mark = ("TRACT_TEST_VLLM_OTHER_MODEL", str(os.getpid()))
    env = background.environment() | {"TRACT_VLLM_PYTHON": VLLM_PY, "TMPDIR": work,
                                      mark[0]: mark[1]}
    before = shm_names()
    try:
        made = background.run([sys.executable, "-m", "tract_cli.cli", "init", region, "--size",
                               "32M", "--model", "tiny", "--nodes", "4", "-q", "--force"],
                              timeout=120, env=env)
        assert made.returncode == 0, made.stderr
        try:
            # past vLLM's own start bound (READY_TIMEOUT_S), which it reports itself
            res = background.run([sys.executable, "-m", "tract_cli.cli", "serve-prefill",
                                  "--engine", "vllm", "--model", ckpt, "--pool", region,
                                  "--node", "1", "--port", "0",
                                  *[f"--vllm-arg={a}" for a in ARGS]],
                                 timeout=READY_TIMEOUT_S + 120, term_grace=60, env=env)
        except subprocess.TimeoutExpired as exc:
            raise AssertionError(f"tract serve-prefill ran past its own start bound: "
                                 f"{(exc.stderr or '')[-2000:]}") from None
        # the node agent its connector started stops once its node is idle
        # (IDLE_EXIT_S): given that, bounded, before anything counts as left
        deadline = time.monotonic() + IDLE_EXIT_S + 30
        while (processes_mapping([region])[region] and time.monotonic() < deadline
               and not background.stopping()):
            time.sleep(1.0)        # waiting for other processes to exit, bounded
        return {"res": res, "mapped": processes_mapping([region])[region]}
    finally:
        kill_marked(*mark)
        remove_vllm_debris(before)      # a vLLM that fails at start leaves its shm behind
        remove_region(region)


OTHER_MODEL_START = Check("vllm: a region of another model", _serve_on_another_models_region,
                          cost=60)


@uses(OTHER_MODEL_START)
def test_a_region_of_another_model_stops_vllm_at_start_with_one_line():
    """vLLM started by `tract serve-prefill` on a region of another model's KV
    geometry stops at start; the command says why in one line, with the fix,
    exits 1, and nothing it started maps the region once its agent's idle
    time is past."""
    got = OTHER_MODEL_START.result()
    res = got["res"]
    assert res.returncode == 1, res.stderr[-2000:]
    assert "Traceback" not in res.stderr, res.stderr[-2000:]
    errors = [ln for ln in res.stderr.splitlines() if ln.startswith("tract: error:")]
    assert len(errors) == 1, res.stderr[-2000:]
    assert "TraCT connector:" in errors[0] and "holds KV blocks of tiny" in errors[0], errors
    assert "tract init" in errors[0]
    assert not got["mapped"], got["mapped"]


# ---- KV events for routers (docs/VLLM.md, "KV events for routers") ----

class Subscriber:
    """tests/kv_event_subscriber.py in vLLM's environment: a router's SUB socket
    decoding with vLLM's own KVEventBatch; `events()` the lines so far."""

    def __init__(self, endpoint: str, replay: str | None, out):
        self.out = out
        self.proc = subprocess.Popen(
            [VLLM_PY, os.path.join(os.path.dirname(__file__), "kv_event_subscriber.py"),
             endpoint, replay or "-", str(out), "300"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            self.wait(lambda rows: any(r.get("connected") for r in rows), 120, "its connection")
        except BaseException:
            self.proc.kill()          # nothing of the test's outlives it
            self.proc.wait(30)
            raise

    def rows(self) -> list:
        if not self.out.exists():
            return []
        return [json.loads(x) for x in self.out.read_text().splitlines() if x.strip()]

    def wait(self, done, timeout: float, what: str, each=None) -> list:
        """Waits (bounded) until DONE(rows); EACH() is called every round (what makes
        the publisher step)."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.rows()
            if done(rows):
                return rows
            assert self.proc.poll() is None, self.proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, f"no {what} within {timeout:.0f} s: {rows[-5:]}"
            if each is not None:
                each()
            else:
                time.sleep(0.2)   # polling a file another process writes, bounded

    def stop(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def _blocks(rows: list, medium: str = "CPU") -> dict:
    """hash -> (tokens, parent, locality, ownership, block_size) of every block the
    BlockStored rows of MEDIUM tell (a run's blocks: each one's parent the one before)."""
    out = {}
    for r in rows:
        if r.get("type") != "BlockStored" or r["medium"] != medium:
            continue
        bs, parent = r["block_size"], r["parent_block_hash"]
        for i, h in enumerate(r["block_hashes"]):
            out[h] = (r["token_ids"][i * bs:(i + 1) * bs], parent, r["locality"],
                      r["ownership"], bs)
            parent = h
    return out


def _removed(rows: list, medium: str = "CPU") -> set:
    return {h for r in rows if r.get("type") == "BlockRemoved" and r["medium"] == medium
            for h in r["block_hashes"]}


def _tokens(server, prompt: str) -> list[int]:
    status, body = request(server.url + "/tokenize", {"model": server_model(server),
                                                      "prompt": prompt})
    assert status == 200, body
    return body["tokens"]


def _key_tag(server) -> bytes:
    text = open(server.log_path, errors="replace").read()
    found = re.findall(r"publishing the region's blocks of key tag ([0-9a-f]{32})", text)
    assert found, "the decode instance logged no KV events start"
    return bytes.fromhex(found[-1])


def _wanted(pool_path: str, tag: bytes, tokens: list[int]) -> tuple[list, int]:
    """The event hashes of TOKENS' full blocks (vLLM's int form), from the tokens."""
    from tract_cli.connectors.keys import prompt_keys
    from tract_cli.core.events import wire_hash
    with Pool.attach(pool_path, readonly=True, prefault=False) as p:
        g = p.geometry.block_tokens
        pk = prompt_keys(p.info, tag, g, tokens)
    return [wire_hash(bytes(h)) for h in pk.hashes], g


def test_routers_see_from_one_instance_the_blocks_another_stored_and_their_eviction(
        stack, tmp_path):
    """Instance A (prefill, node 1) computes a prompt; instance B (decode, node 2)
    tells, in vLLM's own KV event stream, every full block of it as stored in the
    region (REMOTE: A wrote it), with its tokens and parent, and as removed once
    the pool evicts it; a subscriber decodes the stream with vLLM's KVEventBatch."""
    sub = Subscriber(stack["events"]["endpoint"], stack["events"]["replay"],
                     tmp_path / "events.jsonl")
    try:
        prompt = "A KV-aware router sends each request where its prefix is cached. " * 7
        complete(stack["prefill"], prompt, 1)
        tokens = _tokens(stack["prefill"], prompt)
        want, g = _wanted(stack["pool"], _key_tag(stack["decode"]), tokens)
        assert len(want) == len(tokens) // g >= 4

        def poke():                 # B tells the region's changes at its steps
            complete(stack["decode"], "poke", 1)

        rows = sub.wait(lambda r: set(want) <= set(_blocks(r)), 60, "stored blocks", poke)
        told = _blocks(rows)
        with Pool.attach(stack["pool"], readonly=True, prefault=False) as p:
            uuid = p.info.uuid
        for i, h in enumerate(want):
            toks, parent, locality, ownership, bs = told[h]
            assert toks == tokens[i * g:(i + 1) * g] and bs == g
            assert parent == (want[i - 1] if i else None)
            assert locality == "REMOTE" and ownership == f"tract:{uuid}"
        # the check above can fail: one token changed, the hashes are not those told
        other, _ = _wanted(stack["pool"], _key_tag(stack["decode"]),
                           tokens[:g] + [tokens[g] + 1] + tokens[g + 1:])
        assert other[0] == want[0] and not set(other[1:]) & set(told)
        # the pool filled by another writer (node 3): A's blocks are evicted, and B
        # tells their removal
        from tract_cli.core.agent_launch import start_node_agent
        start_node_agent(stack["pool"], 3)
        with Pool.attach(stack["pool"], node=3) as p:
            rng = np.random.default_rng(7)
            batch = np.zeros((512, p.info.block_bytes), np.uint8)
            for _ in range(p.slot_count // 512 + 2):
                p.index.put(rng.integers(0, 256, (512, 16), dtype=np.uint8), batch)
        sub.wait(lambda r: set(want) <= _removed(r), 60, "removed blocks", poke)
    finally:
        sub.stop()


def test_tract_events_serves_the_region_in_vllms_wire_format(stack, tmp_path):
    """`tract events --zmq`: the region's stream without an engine, decoded by
    vLLM's own KVEventBatch; a subscriber that joins late is told the whole state
    (blocks stored before it connected), then each change."""
    from tract_cli.core.events import describe, wire_hash
    from tract_cli.core.hashing import block_hashes, pool_root
    tag = b"T" * 16

    def put(start: int):
        with Pool.attach(stack["pool"], node=3) as p:
            g = p.geometry.block_tokens
            toks = np.arange(3 * g, dtype=np.int32) + start
            keys = block_hashes(toks, root=pool_root(p.info))
            p.index.put(keys, np.zeros((3, p.info.block_bytes), np.uint8),
                        described=describe(keys, toks, g, tag))
        return [wire_hash(bytes(k)) for k in keys], toks, g

    before, toks, g = put(1000)
    endpoint = f"tcp://127.0.0.1:{port()}"
    proc = subprocess.Popen([sys.executable, "-m", "tract_cli.cli", "events", stack["pool"],
                             "--zmq", endpoint, "--node", "3", "--tag", tag.hex(),
                             "--interval", "0.02"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    sub = None
    try:
        sub = Subscriber(endpoint, None, tmp_path / "events.jsonl")
        rows = sub.wait(lambda r: set(before) <= set(_blocks(r)), 30, "the state at joining")
        told = _blocks(rows)
        assert [told[h][0] for h in before] == [toks[i * g:(i + 1) * g].tolist()
                                                for i in range(3)]
        assert {told[h][2] for h in before} == {"LOCAL"}     # node 3 wrote them, as it serves
        after, _, _ = put(5000)
        sub.wait(lambda r: set(after) <= set(_blocks(r)), 30, "blocks stored after joining")
    finally:
        if sub is not None:
            sub.stop()
        proc.terminate()
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, proc.stderr.read().decode()[-2000:]


def test_the_vllm_scheme_is_vllms_own_block_hash():
    """With `--hash-scheme vllm` the hashes published are those vLLM computes
    (sha256_cbor, its NONE_HASH): checked against vLLM's own functions, salted too."""
    from tract_cli.core.events import wire_hash
    from tract_cli.core.hashing import block_hashes
    toks = list(range(3, 3 + 5 * 16))
    script = (
        "import json, sys\n"
        "from vllm.utils.hashing import sha256_cbor\n"
        "from vllm.v1.core import kv_cache_utils as k\n"
        "from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash\n"
        "k.init_none_hash(sha256_cbor)\n"
        "toks = json.loads(sys.argv[1]); out = {}\n"
        "for salt in (None, 'tenant'):\n"
        "    parent, hs = None, []\n"
        "    for i in range(0, len(toks), 16):\n"
        "        extra = (salt,) if salt and i == 0 else None\n"
        "        parent = k.hash_block_tokens(sha256_cbor, parent, toks[i:i + 16], extra)\n"
        "        hs.append(maybe_convert_block_hash(parent))\n"
        "    out[str(salt)] = hs\n"
        "print(json.dumps(out))\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    res = subprocess.run([VLLM_PY, "-c", script, json.dumps(toks)], capture_output=True,
                         text=True, timeout=300, env=env)
    assert res.returncode == 0, res.stderr[-2000:]
    theirs = json.loads(res.stdout.splitlines()[-1])
    ours = [wire_hash(bytes(h)) for h in block_hashes(np.array(toks, np.int32), "vllm", 16)]
    salted = [wire_hash(bytes(h)) for h in block_hashes(np.array(toks, np.int32), "vllm", 16,
                                                         salt="tenant")]
    assert ours == theirs["None"] and salted == theirs["tenant"] and ours != salted
