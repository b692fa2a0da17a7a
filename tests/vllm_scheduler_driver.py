"""Drives vLLM's own Scheduler with TraCT's connector, no model and no server (as
vLLM's tests/v1/kv_connector/unit do): the scheduler-side lifecycle of pool
hits, handoffs, aborts and repeated matching against a real region.

Run in vLLM's environment: `python tests/vllm_scheduler_driver.py CKPT POOL`;
prints one JSON object of observations (tests/test_vllm_scheduler.py checks them).
"""
from __future__ import annotations

import json
import logging
import os
import sys
import tempfile
import time

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                         SchedulerConfig, VllmConfig, set_current_vllm_config)
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.model_executor.layers.attention import Attention
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from tract_cli.connectors.keys import prompt_keys
from tract_cli.connectors.vllm import LoadSpec, SaveSpec, TractConnector, TractConnectorMetadata
from tract_cli.connectors.vllm_meta import HandoffSpec, TractWorkerMeta
from tract_cli.core.handoff import request_key
from tract_cli.core.pool import Pool
from worker_stand import acked, every_lock_held, find_record, told

PAGE = 32          # vLLM's block size here: two 16-token region blocks per page
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
CONNECTORS: list = []      # every connector made here (settle() waits for their releases)


def configs(ckpt: str, pool: str, num_blocks: int, role: str = "kv_both",
            extra: dict | None = None, budget: int = 4096,
            prefix_caching: bool = True,
            failure_policy: str = "recompute") -> tuple[VllmConfig, KVCacheConfig]:
    model = ModelConfig(model=ckpt, dtype="bfloat16", seed=0)
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=budget,
                                         max_model_len=2048, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=PAGE, enable_prefix_caching=prefix_caching),
        kv_transfer_config=KVTransferConfig(
            kv_connector="TractConnector", kv_connector_module_path="tract_cli.connectors.vllm",
            kv_role=role, kv_load_failure_policy=failure_policy,
            # (its steps have no forward to hide a claim behind: they wait for it)
            kv_connector_extra_config={"pool": pool, "node": 1, "claim_wait_s": 60.0}
            | (extra or {})),
        device_config=DeviceConfig("cpu"))
    config.cache_config.num_gpu_blocks = num_blocks
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(LAYERS, FullAttentionSpec(block_size=PAGE, num_kv_heads=2, head_size=32,
                                                   dtype=torch.bfloat16))])
    return config, kv


HANDSHAKE: dict = {}       # the worker's layout, as vLLM hands it to a scheduler at start-up


def scheduler(ckpt: str, pool: str, num_blocks: int, role: str = "kv_both",
              extra: dict | None = None, handshake: bool = True, **kw) -> Scheduler:
    """vLLM's scheduler with TraCT's connector, handed the worker's page layout as
    vLLM's engine core does at start-up.  Its lookups are waited for (a generous
    lookup_wait_s) unless EXTRA says otherwise: what a step schedules is then the
    same on a busy machine; the "not yet" answer has its own case.  Loads are
    asynchronous unless EXTRA sets load_mode "sync"."""
    if "handshake" not in HANDSHAKE:
        w, _ = worker(ckpt, pool, 16)
        HANDSHAKE["handshake"] = w.get_handshake_metadata()
    # the cases below follow an asynchronous load's lifecycle unless EXTRA asks
    # for the default, synchronous one (its own case)
    config, kv = configs(ckpt, pool, num_blocks, role,
                         {"lookup_wait_s": 30, "load_mode": "async"} | (extra or {}), **kw)
    s = Scheduler(vllm_config=config, kv_cache_config=kv,
                  structured_output_manager=StructuredOutputManager(config), block_size=PAGE,
                  log_stats=True)
    if handshake:
        s.connector.set_xfer_handshake_metadata({0: HANDSHAKE["handshake"]})
    CONNECTORS.append(s.connector)
    return s


def worker(ckpt: str, pool: str, num_blocks: int, extra: dict | None = None,
           isa: str | None = None):
    """The connector's worker side over KV cache tensors shaped as vLLM's CPU backend
    makes them, with the attention layers vLLM's model would register (the ISA set
    on them as the backend does, or ISA, as it would on a CPU that picks it):
    (connector, {layer name: tensor})."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    config, kv = configs(ckpt, pool, num_blocks, extra=extra)
    with set_current_vllm_config(config):
        for name in LAYERS:
            layer = Attention(num_heads=4, head_size=32, scale=32 ** -0.5, num_kv_heads=2,
                              prefix=name, cache_config=config.cache_config)
            layer.isa = isa or _get_attn_isa(torch.bfloat16, PAGE, 32, "auto")
    w = TractConnector(config, KVConnectorRole.WORKER, kv)
    CONNECTORS.append(w)
    caches = {name: torch.zeros(num_blocks, 2, PAGE, 64, dtype=torch.bfloat16) for name in LAYERS}
    w.register_kv_caches(caches)
    return w, caches


def loaded(w, req_ids: set[str], timeout: float = 60) -> set[int]:
    """Waits (bounded) until the worker W reports REQ_IDS' loads finished, as vLLM's
    step output would; the vLLM pages it reports to recompute."""
    done: set[str] = set()
    deadline = time.monotonic() + timeout
    while not req_ids <= done:
        assert time.monotonic() < deadline, f"loads of {sorted(req_ids - done)} not done " \
                                            f"within {timeout:.0f} s"
        done |= w.get_finished(set())[1] or set()
        time.sleep(0.01)          # polling the loader thread's progress, bounded
    return w.get_block_ids_with_load_errors()


def wait_for(cond, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"{what} did not happen within {timeout:.0f} s"
        time.sleep(0.01)          # polling another thread's progress, bounded


def request(rid: str, tokens: list[int], max_tokens: int = 4, params=None) -> Request:
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, 1)
    req = Request(request_id=rid, prompt_token_ids=tokens, sampling_params=sp,
                  pooling_params=None, mm_features=None,
                  block_hasher=get_request_block_hasher(PAGE, sha256))
    req.kv_transfer_params = params
    return req


def output(reqs, finished_recving=None, invalid=None, synced=None) -> ModelRunnerOutput:
    """A step's output: a sampled token for each of REQS whose prompt is all
    computed (none for a prefill chunk short of its end); SYNCED, the requests
    whose synchronous loads the worker reports copied in the step."""
    ids = [r.request_id for r in reqs]
    kvo = KVConnectorOutput(finished_recving=finished_recving, invalid_block_ids=invalid or set(),
                            kv_connector_worker_meta=TractWorkerMeta(set(synced))
                            if synced else None)
    sampled = [[5] if r.num_computed_tokens >= r.num_prompt_tokens else [] for r in reqs]
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=sampled, logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kvo)


def put_prompt(pool: Pool, tag: bytes, tokens: list[int], with_tail: bool = False) -> None:
    """Stores the prompt's full blocks (and its tagged partial tail) as a prefill of the
    model whose identity tag is TAG would, with random KV bytes."""
    pk = prompt_keys(pool.info, tag, 16, tokens)
    keys, tok = pk.keys, [16] * len(pk.keys)
    if with_tail and pk.tail_key is not None:
        keys, tok = np.vstack([keys, pk.tail_key]), tok + [pk.tail_tokens]
    kv = np.random.default_rng(len(tokens)).integers(0, 256, (len(keys), pool.info.block_bytes),
                                                     dtype=np.uint8)
    pool.index.put(keys, kv, tokens=tok, checksum=True)


def committed(w) -> None:
    """Waits (bounded) until worker W's queued commits are done (a save's commit
    runs on the worker's save thread, off the step, unless the step publishes a
    handoff): its blocks are then READY, or their claims given back."""
    side = getattr(w, "worker_side", w)
    if side is not None:
        side._saver.submit(lambda: None).result(60)


def settle() -> None:
    """Waits (bounded) until every connector made here has done its queued commits
    and releases: what the region shows is then what the connectors hold, not a
    commit or a release in flight."""
    for conn in CONNECTORS:
        committed(conn)
        assert conn.releases.drain(60), "a connector's releases were not done within 60 s"


def add_hit(s: Scheduler, pool: Pool, tag: bytes, rid: str, tokens: list[int]):
    """Stores TOKENS' blocks, adds a request of them to S and schedules a step (its
    load): (the request, the step's output)."""
    put_prompt(pool, tag, tokens)
    r = request(rid, tokens)
    s.add_request(r)
    return r, s.schedule()


def prefill_step(s: Scheduler, pool: Pool, tag: bytes, rid: str, tokens: list[int]):
    """A prefill for a remote decode (max_tokens 1) of TOKENS, its blocks put
    first (a pool hit, loaded asynchronously), scheduled up to the step that
    completes its prompt: (the request, that step, the records its in-step
    handoffs were promised)."""
    put_prompt(pool, tag, tokens, with_tail=True)
    r = request(rid, tokens, max_tokens=1, params={"do_remote_decode": True})
    s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, output([], finished_recving={rid}))
    out = s.schedule()
    return r, out, [sp.handoff.record for sp in out.kv_connector_metadata.saves if sp.handoff]


def pins(pool: Pool, *conns) -> int:
    """The region's pin count once every connector's queued releases are done."""
    from tract_cli.inspect.snapshot import take
    settle()
    return take(pool)["index"]["pins_total"]


def region(pool: Pool, settled: bool = True) -> dict:
    """Pins, PENDING entries and handoffs in flight (after settle(), unless SETTLED is
    false: while locks are held on purpose, releases cannot finish)."""
    from tract_cli.inspect.snapshot import take
    if settled:
        settle()
    snap = take(pool)
    return {"pins": snap["index"]["pins_total"], "pending": snap["index"]["states"]["PENDING"],
            "handoffs": len(snap["handoffs"]["in_flight"])}


STEP: dict = {}            # the worker that runs the in-step handoffs of scheduler-only cases


def publish_in_step(out) -> None:
    """The worker's part of a step the case runs only a scheduler for: the step's
    in-step handoffs (SaveSpec.handoff) reserved in the step and published after
    its commit, off it, which is waited for here, so the case sees them
    published (their blocks are in the pool: the case put them; any missing is
    written from the worker's zero pages)."""
    saves = out.kv_connector_metadata.saves
    if not any(sp.handoff is not None for sp in saves):
        return
    STEP.setdefault("in_step", []).extend(sp.req_id for sp in saves if sp.handoff is not None)
    if "worker" not in STEP:
        STEP["worker"] = worker(STEP["ckpt"], STEP["pool"], 64)[0]
    w = STEP["worker"]
    w.bind_connector_metadata(TractConnectorMetadata(saves=saves))
    w.wait_for_save()
    committed(w)


def finish(s: Scheduler, reqs: list[Request]) -> dict:
    """Runs REQS (max_tokens 1) to their end through S; their kv_transfer_params."""
    for r in reqs:
        s.add_request(r)
    ids = {r.request_id for r in reqs}
    params = {}
    for _ in range(20):
        out = s.schedule()
        publish_in_step(out)
        loads = {ld.req_id for ld in out.kv_connector_metadata.loads}
        running = [r for r in reqs if out.num_scheduled_tokens.get(r.request_id)]
        eng = s.update_from_output(out, output(running, finished_recving=loads or None))
        for outs in eng.values():
            for o in outs.outputs:
                if o.finished:
                    params[o.request_id] = o.kv_transfer_params
        if set(params) == ids:
            return params
    raise AssertionError(f"requests {sorted(ids - set(params))} did not finish in 20 steps")


def main(ckpt: str, pool_path: str) -> dict:
    init_none_hash(sha256)
    STEP.update(ckpt=ckpt, pool=pool_path)
    obs = {}
    pool = Pool.attach(pool_path, node=3)
    # 0. vLLM's default load-failure policy (fail: a block that fails its checksum
    #    fails the request) is said at start, once, by the scheduler half; recompute
    #    is not
    said = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("vllm.tract").addHandler(handler)
    scheduler(ckpt, pool_path, num_blocks=16, failure_policy="fail").connector.shutdown()
    obs["fail_policy_said"] = sum("kv_load_failure_policy is 'fail'" in m for m in said)
    s = scheduler(ckpt, pool_path, num_blocks=64)
    obs["recompute_policy_said"] = sum("kv_load_failure_policy" in m for m in said) - \
        obs["fail_policy_said"]
    logging.getLogger("vllm.tract").removeHandler(handler)
    conn = s.connector
    tag = conn.key_tag

    # 1. a prefix hit: pinned once however often it is matched, loaded asynchronously,
    #    unpinned when the worker reports the load, then scheduled past the hit
    hit = list(range(10, 10 + 100))                  # 6 full region blocks + 4 tokens
    put_prompt(pool, tag, hit)
    r1 = request("hit", hit)
    s.add_request(r1)
    out = s.schedule()
    obs["hit_status"] = r1.status.name
    obs["hit_loads"] = [len(l.slots) for l in out.kv_connector_metadata.loads]
    obs["hit_pins_while_loading"] = pins(pool, conn)
    obs["hit_rematch"] = list(conn.get_num_new_matched_tokens(r1, 0))   # no second pin
    obs["hit_pins_after_rematch"] = pins(pool, conn)
    s.update_from_output(out, output([], finished_recving={"hit"}))
    obs["hit_pins_after_load"] = pins(pool, conn)
    out = s.schedule()
    obs["hit_computed_then"] = r1.num_computed_tokens
    obs["hit_scheduled_tokens"] = out.num_scheduled_tokens.get("hit")
    s.finish_requests("hit", RequestStatus.FINISHED_ABORTED)
    s.update_from_output(out, output([r1]))

    # 2. aborted while its load runs: the pins wait for the worker, then go
    ab = list(range(300, 300 + 64))
    put_prompt(pool, tag, ab)
    r2 = request("aborted", ab)
    s.add_request(r2)
    out = s.schedule()
    obs["abort_status"] = r2.status.name
    s.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)
    obs["abort_pins_before_worker"] = pins(pool, conn)
    s.update_from_output(out, output([], finished_recving={"aborted"}))
    obs["abort_pins_after_worker"] = pins(pool, conn)

    # 3. a failed load: the request is recomputed and never offered the blocks again
    bad = list(range(600, 600 + 80))
    put_prompt(pool, tag, bad)
    r3 = request("bad", bad)
    s.add_request(r3)
    out = s.schedule()
    pages = set(out.kv_connector_metadata.loads[0].pages.tolist())
    s.update_from_output(out, output([], finished_recving={"bad"}, invalid=pages))
    out = s.schedule()
    obs["bad_computed_then"] = r3.num_computed_tokens
    obs["bad_scheduled_tokens"] = out.num_scheduled_tokens.get("bad")
    obs["bad_rematch"] = list(conn.get_num_new_matched_tokens(r3, 0))
    s.finish_requests("bad", RequestStatus.FINISHED_ABORTED)
    obs["bad_pins_after"] = pins(pool, conn)

    # 3p. a paired P/D prefill (do_remote_decode, tract_pair) whose prefix load
    #     failed: computed, no handoff planned for it (a failed load's request
    #     makes none), its reply without a ticket, and its paired decode, which has
    #     no ticket to find none, told at once by a record of no blocks under the
    #     pair's name (queued), not left to pair_wait_s
    from tract_cli.core.handoff import pair_key
    badp = list(range(4000, 4000 + 80))
    put_prompt(pool, tag, badp)
    pair3 = "3p" * 16
    r3p = request("bad-pair", badp, 1, {"do_remote_decode": True, "tract_pair": pair3})
    s.add_request(r3p)
    out = s.schedule()
    pages = set(out.kv_connector_metadata.loads[0].pages.tolist())
    s.update_from_output(out, output([], finished_recving={"bad-pair"}, invalid=pages))
    params3p = "unfinished"
    for _ in range(10):
        out = s.schedule()
        publish_in_step(out)
        running = [r3p] if out.num_scheduled_tokens.get("bad-pair") else []
        eng = s.update_from_output(out, output(running))
        done = [o for outs in eng.values() for o in outs.outputs
                if o.request_id == "bad-pair" and o.finished]
        if done:
            params3p = done[0].kv_transfer_params
            break
    settle()
    lost3 = pair_key(pair3)
    obs["bad_pair"] = [params3p, told(pool, find_record(pool, lost3), lost3, 5, 80)]
    acked(pool, find_record(pool, lost3), lost3)
    obs["bad_pair_after"] = pins(pool, conn)

    # 3s. synchronous loads (the default load_mode): a hit is copied in the step that
    #     computes the rest of its prompt, and its pins are given back when that
    #     step's output reports the copy; a whole-prompt hit leaves vLLM its last
    #     token; a block that fails is recomputed and not offered again
    ss = scheduler(ckpt, pool_path, num_blocks=64, extra={"load_mode": "sync"})
    cs = ss.connector
    # 6 full region blocks + 4 tokens
    rs, out = add_hit(ss, pool, tag, "sync", list(range(1200, 1200 + 100)))
    obs["sync_status"] = rs.status.name
    obs["sync_loads"] = [[len(ld.slots), ld.sync, ld.past_end]
                         for ld in out.kv_connector_metadata.loads]
    obs["sync_step"] = [out.num_scheduled_tokens.get("sync"), out.has_sync_kv_loads]
    obs["sync_pins_in_step"] = pins(pool, cs)
    ss.update_from_output(out, output([rs], synced={"sync"}))
    obs["sync_pins_after"] = pins(pool, cs)
    obs["sync_computed"] = rs.num_computed_tokens
    ss.finish_requests("sync", RequestStatus.FINISHED_ABORTED)
    rw, out = add_hit(ss, pool, tag, "whole", list(range(1400, 1400 + 96)))   # 6 blocks exactly
    obs["sync_whole"] = [[[len(ld.slots), ld.past_end]
                          for ld in out.kv_connector_metadata.loads],
                         out.num_scheduled_tokens.get("whole")]
    ss.update_from_output(out, output([rw], synced={"whole"}))
    ss.finish_requests("whole", RequestStatus.FINISHED_ABORTED)
    rb, out = add_hit(ss, pool, tag, "sync-bad", list(range(1600, 1600 + 90)))  # 5 blocks + 10
    pages = set(out.kv_connector_metadata.loads[0].pages.tolist())
    first = out.num_scheduled_tokens.get("sync-bad")
    ss.update_from_output(out, output([rb], invalid=pages, synced={"sync-bad"}))
    out = ss.schedule()
    obs["sync_bad"] = [first, out.num_scheduled_tokens.get("sync-bad"),
                       [len(ld.slots) for ld in out.kv_connector_metadata.loads],
                       list(cs.get_num_new_matched_tokens(rb, 0))]
    ss.finish_requests("sync-bad", RequestStatus.FINISHED_ABORTED)
    ss.update_from_output(out, output([]))
    obs["sync_pins_end"] = pins(pool, cs)
    obs["sync_state_left"] = [len(cs.scheduler_side._reqs), len(cs.scheduler_side._loading_done)]

    # 4. a prefill for a remote decode: the handoff is published when it finishes and its
    #    kv_transfer_params carry the ticket; the blocks stay pinned for the decode side
    pd = list(range(900, 900 + 40))
    r4, out, obs["pd_in_step"] = prefill_step(s, pool, tag, "pd", pd)
    publish_in_step(out)
    eng = s.update_from_output(out, output([r4]))
    params = [o.kv_transfer_params for outs in eng.values() for o in outs.outputs
              if o.request_id == "pd"]
    obs["pd_params"] = params[0] if params else None
    obs["pd_pins"] = pins(pool, conn)

    # 4b. a ticket naming another KV page layout is refused (its blocks are in an
    #     order this instance does not read), and a scheduler never handed its
    #     worker's layout uses no pool
    if obs["pd_params"]:
        forged = json.loads(json.dumps(obs["pd_params"]))
        forged["tract_ticket"]["layout"] = "ab" * 32
        r4b = request("other-layout", pd, params=forged)
        conn.get_num_new_matched_tokens(r4b, 0)
        st4b = conn.scheduler_side._reqs["other-layout"]
        obs["layout_ticket_refused"] = [st4b.handoff_failed, st4b.received is None]
        conn.request_finished(r4b, [])
    # 4c. a ticket whose record is reserved, not yet published (its prefill's
    #     commit runs off its step): "not yet" until it is published, then
    #     loaded; one not published within handoff_wait_s is computed, and its
    #     reservation given back (a publish after that is refused)
    from tract_cli.core.errors import HandoffError as _HandoffError
    from tract_cli.core.handoff import Ticket as _Ticket
    from tract_cli.core.handoff import request_key as _request_key
    obs["reserved_before"] = region(pool)                  # case 4's handoff still in flight
    waited = list(range(1300, 1300 + 40))                  # 2 full blocks + an 8-token tail
    put_prompt(pool, tag, waited, with_tail=True)
    wk = prompt_keys(pool.info, tag, 16, waited)
    wkeys = np.vstack([wk.keys, wk.tail_key])
    rec = pool.handoffs.peek_free()
    pool.handoffs.reserve_record(rec, "waited", 3, 40)
    prefill_req = request("waited", waited, 1, {"do_remote_decode": True})
    tparams = conn.scheduler_side._ticket_params(
        prefill_req, _Ticket(rec, _request_key("waited").hex(), 3, 40))
    r4c = request("waited-decode", waited, params=tparams)
    asked = [conn.get_num_new_matched_tokens(r4c, 0) for _ in range(3)]
    # ... a decode of another prompt (one token more, as many blocks) with that
    # ticket: refused at once, not waited for
    r4e = request("other-prompt-decode", waited + [7], params=tparams)
    obs["reserved_other_prompt"] = [list(conn.get_num_new_matched_tokens(r4e, 0)),
                                    conn.scheduler_side._reqs["other-prompt-decode"]
                                    .handoff_failed]
    conn.request_finished(r4e, [])
    pool.index.lookup(wkeys)                               # the prefill's pins, journaled
    pool.handoffs.publish_pinned(rec, "waited", wkeys, 40, reserved=True)
    asked.append(conn.get_num_new_matched_tokens(r4c, 0))
    obs["reserved_ticket_answers"] = [list(a) for a in asked]
    conn.request_finished(r4c, [])                          # opened, never loaded: released
    gave_up = scheduler(ckpt, pool_path, num_blocks=64, extra={"handoff_wait_s": 0.2}).connector
    rec = pool.handoffs.peek_free()
    pool.handoffs.reserve_record(rec, "never", 3, 40)
    r4d = request("never-decode", list(range(7700, 7740)), params=gave_up.scheduler_side
                  ._ticket_params(request("never", list(range(7700, 7740))),
                                  _Ticket(rec, _request_key("never").hex(), 3, 40)))
    t0 = time.monotonic()
    first = list(gave_up.get_num_new_matched_tokens(r4d, 0))
    wait_for(lambda: gave_up.get_num_new_matched_tokens(r4d, 0) != (None, False),
             "the decode's give-up on a reservation never published", 30)
    obs["reserved_never"] = [first, time.monotonic() - t0 >= 0.2,
                             list(gave_up.get_num_new_matched_tokens(r4d, 0))]
    assert gave_up.releases.drain(60), "the reservation's give-back was not done within 60 s"
    try:
        pool.handoffs.open(_Ticket(rec, _request_key("never").hex(), 3, 40))
        obs["reserved_never_record"] = "still there"
    except _HandoffError as exc:
        obs["reserved_never_record"] = type(exc).__name__
    gave_up.request_finished(r4d, [])
    obs["reserved_after"] = region(pool)

    blind = scheduler(ckpt, pool_path, num_blocks=64, handshake=False)
    obs["no_handshake_match"] = list(blind.connector.get_num_new_matched_tokens(
        request("blind", hit), 0))
    obs["no_handshake_key_tag"] = blind.connector.key_tag

    # 5. a request vLLM has no pages for keeps no pins while it waits: a long prompt
    #    takes 60 of the 64 pages, then a pool hit of 10 pages cannot be given pages
    big = request("big", list(range(1000, 1000 + 60 * PAGE)))
    queued_prompt = list(range(3000, 3000 + 10 * PAGE))
    put_prompt(pool, tag, queued_prompt)
    before = pins(pool, conn)
    queued = request("queued", queued_prompt)
    s.add_request(big)
    s.add_request(queued)
    out = s.schedule()
    obs["queued_status"] = [big.status.name, queued.status.name]
    obs["queued_pins"] = pins(pool, conn) - before
    s.finish_requests(["big", "queued"], RequestStatus.FINISHED_ABORTED)
    s.update_from_output(out, output([big]))

    # 6. another checkpoint of the same geometry (other weights) on the same region:
    #    none of the first model's blocks is a hit for it, nor is its handoff loaded
    other_dir = os.path.join(tempfile.mkdtemp(), "other")
    from vllm_model import make_checkpoint      # beside this script
    make_checkpoint(other_dir, seed=1)
    s_other = scheduler(other_dir, pool_path, num_blocks=64)
    other = s_other.connector
    obs["other_identity_differs"] = other.identity.digest != conn.identity.digest
    r6 = request("other-hit", hit)
    obs["other_match"] = list(other.get_num_new_matched_tokens(r6, 0))
    obs["same_match"] = list(conn.get_num_new_matched_tokens(request("same-hit", hit), 0))
    conn.request_finished(request("same-hit", hit), [])
    r7 = request("other-pd", pd, params=dict(obs["pd_params"] or {}))
    obs["other_handoff_match"] = list(other.get_num_new_matched_tokens(r7, 0))
    other.request_finished(r7, [])
    obs["other_pins"] = pins(pool, conn, other)
    if obs["pd_params"]:                       # the decode side's part, done here
        from tract_cli.core.handoff import Ticket
        pool.handoffs.ack(Ticket.from_dict(obs["pd_params"]["tract_ticket"]))

    # 6b. the record a handoff was promised is taken before its step runs (another
    #     instance chose it too): the worker does not publish it, gives its pins
    #     back, and the ticket the prefill answers with opens as not published
    #     (its decode computes the prompt)
    from tract_cli.core.errors import HandoffError
    from tract_cli.core.handoff import Ticket
    r6b, out, promised = prefill_step(s, pool, tag, "pd-taken", list(range(1900, 1900 + 40)))
    before = region(pool)
    other_keys = prompt_keys(pool.info, b"\x01" * 16, 16, list(range(1950, 1950 + 32))).keys
    st6b, sl6b = pool.index.reserve(other_keys, pin=True)
    pool.index.commit(other_keys, st6b, sl6b, pin=True)
    blocker = pool.handoffs.publish_pinned(promised[0], "blocker", other_keys, 32)
    publish_in_step(out)
    eng = s.update_from_output(out, output([r6b]))
    params = [o.kv_transfer_params for outs in eng.values() for o in outs.outputs
              if o.request_id == "pd-taken"][0]
    try:
        pool.handoffs.open(Ticket.from_dict(params["tract_ticket"]))
        opened = "opened"
    except HandoffError:
        opened = "not published"
    obs["taken_record"] = [promised == [params["tract_ticket"]["record"]], before,
                           region(pool), opened]
    pool.handoffs.ack(blocker)
    obs["taken_after"] = region(pool)

    # 7. a flood of do_remote_decode requests: a decode-only instance (kv_consumer)
    #    publishes nothing; a producer publishes at most max_handoffs
    consumer = scheduler(ckpt, pool_path, num_blocks=64, role="kv_consumer")
    flood = [list(range(5000 + 50 * i, 5000 + 50 * i + 40)) for i in range(12)]
    for prompt in flood:
        put_prompt(pool, tag, prompt, with_tail=True)
    handoffs_before = region(pool)["handoffs"]
    got = finish(consumer, [request(f"c{i}", p, 1, {"do_remote_decode": True})
                            for i, p in enumerate(flood)])
    obs["consumer_tickets"] = sum(1 for p in got.values() if p)
    obs["consumer_records"] = region(pool)["handoffs"] - handoffs_before
    producer = scheduler(ckpt, pool_path, num_blocks=64, role="kv_producer",
                         extra={"max_handoffs": 3})
    got = finish(producer, [request(f"p{i}", p, 1, {"do_remote_decode": True})
                            for i, p in enumerate(flood)])
    obs["producer_tickets"] = sum(1 for p in got.values() if p and "tract_ticket" in p)
    obs["producer_records"] = region(pool)["handoffs"] - handoffs_before
    for p in got.values():                    # the decode side's part: acknowledge them
        if p and "tract_ticket" in p:
            from tract_cli.core.handoff import Ticket
            pool.handoffs.ack(Ticket.from_dict(p["tract_ticket"]))

    # 6c. aborted while the step that publishes its handoff still runs (vLLM's
    #     asynchronous scheduling): the record stays promised until the step's
    #     output is in, then the handoff the step published is given back
    r6c, out, promised = prefill_step(s, pool, tag, "pd-aborted", list(range(2000, 2000 + 40)))
    s.finish_requests("pd-aborted", RequestStatus.FINISHED_ABORTED)
    held = promised[0] in conn.scheduler_side._planned
    publish_in_step(out)                             # the step, finishing after the abort
    published = region(pool)["handoffs"]
    s.update_from_output(out, output([]))
    obs["aborted_handoff"] = [held, published, promised[0] in conn.scheduler_side._planned,
                              region(pool)]

    # 7b. two prefills of one step that share blocks: a handoff needs a pin of each
    #     of its blocks, and a step's pinning claim takes one, so the worker pins the
    #     shared blocks again for the second (a lookup, on its save thread) and both
    #     are published after the step, in the records the scheduler promised; with
    #     handoff_publish in_step both before their step ends (the lookup then within
    #     the step's wait for its commit)
    obs["shared"] = {}
    for mode, name, base in (("after_step", "share", 2100), ("in_step", "sharei", 5700)):
        s7 = scheduler(ckpt, pool_path, num_blocks=64, extra={"handoff_publish": mode})
        shared = list(range(base, base + 32))               # 2 region blocks in common
        got = finish(s7, [request(f"{name}-a", shared + list(range(base + 100, base + 108)),
                                  1, {"do_remote_decode": True}),
                          request(f"{name}-b", shared + list(range(base + 200, base + 208)),
                                  1, {"do_remote_decode": True})])
        tickets = [Ticket.from_dict(p["tract_ticket"]) for p in got.values()
                   if p and "tract_ticket" in p]
        held = region(pool)
        planned = sorted(r for r in STEP["in_step"] if r.startswith(f"{name}-"))
        opened = []
        for t in tickets:
            opened.append(len(pool.handoffs.open(t).keys))
            pool.handoffs.ack(t)
        obs["shared"][mode] = [len(tickets), held, planned, opened, region(pool)]
        s7.connector.shutdown()

    # 7b'. the same where the second's handoff fails on the way (injected): its
    #      shared blocks' lookup refused (a lock not granted), or pinning only the
    #      first of them, or its publish refused once they were pinned again. That
    #      handoff alone is lost, its reservation given back (its decode, finding
    #      the record free, computes at once), and nothing of it stays pinned;
    #      the first is published as ever
    from tract_cli.core.errors import LockTimeout, TransferTableFull
    w = STEP.get("worker") or worker(STEP["ckpt"], STEP["pool"], 64)[0]
    STEP["worker"] = w
    index, handoffs = w.worker_side.pool.index, w.worker_side.pool.handoffs
    real_lookup, real_publish = index.lookup, handoffs.publish_pinned

    def refused(keys, timeout=0):
        raise LockTimeout("injected: a stripe lock not granted", "none")

    def partial(keys, timeout=0):
        return real_lookup(keys[:1], timeout=timeout)     # the first pinned, then short

    def publish_refused(record, name, *args, **kw):
        if bytes(name) == request_key("sharef-publish-b"):
            raise TransferTableFull("injected: the record is taken", "none")
        return real_publish(record, name, *args, **kw)

    obs["shared_refused"] = {}
    for n, (how, target, inject) in enumerate((("lookup", index, refused),
                                               ("partial", index, partial),
                                               ("publish", handoffs, publish_refused))):
        s7f = scheduler(ckpt, pool_path, num_blocks=64)
        shared = list(range(2700 + 1000 * n, 2700 + 1000 * n + 32))
        attr = "lookup" if how != "publish" else "publish_pinned"
        setattr(target, attr, inject)
        try:
            got = finish(s7f, [request(f"sharef-{how}-a", shared + list(range(2800 + 1000 * n,
                                                                               2808 + 1000 * n)),
                                       1, {"do_remote_decode": True}),
                               request(f"sharef-{how}-b", shared + list(range(2900 + 1000 * n,
                                                                               2908 + 1000 * n)),
                                       1, {"do_remote_decode": True})])
            committed(w)
        finally:
            delattr(target, attr)            # the class's own again
        settle()                             # the lost one's reservation given back
        tickets = {rid: Ticket.from_dict(p["tract_ticket"]) for rid, p in got.items()
                   if p and "tract_ticket" in p}
        outcome = {}
        for rid, t in sorted(tickets.items()):
            try:
                pool.handoffs.open(t)
                outcome[rid[len(f"sharef-{how}-"):]] = "published"
                pool.handoffs.ack(t)
            except HandoffError as exc:
                outcome[rid[len(f"sharef-{how}-"):]] = type(exc).__name__
        obs["shared_refused"][how] = [len(tickets), outcome, region(pool)]
        s7f.connector.shutdown()

    # 7c. two such prefills with every lock held by another node while the step's
    #     output comes in (a stalled lock manager): request_finished makes no pool
    #     call, so the scheduler loop answers both with their tickets at once, where a
    #     lock wait of claim_wait_s (5 s here) would show
    s7c = scheduler(ckpt, pool_path, num_blocks=64,
                    extra={"step_timeout_s": 60, "claim_wait_s": 5})
    shared = list(range(2400, 2400 + 32))
    stall_pair = "7c" * 16
    pair = [request("stall-a", shared + list(range(2500, 2508)), 1, {"do_remote_decode": True}),
            request("stall-b", shared + list(range(2600, 2608)), 1,
                    {"do_remote_decode": True, "tract_pair": stall_pair})]
    for r in pair:
        s7c.add_request(r)
    got, held_s = {}, 0.0
    for _ in range(20):
        out = s7c.schedule()
        publish_in_step(out)
        running = [r for r in pair if out.num_scheduled_tokens.get(r.request_id)]
        with every_lock_held(pool):
            t0 = time.monotonic()
            eng = s7c.update_from_output(out, output(running))
            held_s = max(held_s, time.monotonic() - t0)
        got |= {o.request_id: o.kv_transfer_params for outs in eng.values()
                for o in outs.outputs if o.finished}
        if len(got) == 2:
            break
    tickets = {rid: Ticket.from_dict(p["tract_ticket"]) for rid, p in got.items()
               if p and "tract_ticket" in p}
    obs["stalled_finish"] = [sorted(got), sorted(tickets), round(held_s, 3)]
    from tract_cli.core.handoff import pair_key
    obs["stalled_pair_record"] = tickets["stall-b"].request_id == pair_key(stall_pair).hex() \
        if "stall-b" in tickets else None
    for t in tickets.values():
        pool.handoffs.ack(t)
    obs["stalled_finish_after"] = region(pool)
    s7c.connector.shutdown()

    # 8. lock timeouts injected into unpin, commit and ack (every lock held by another
    #    node): each release is retried off the request path until it succeeds
    fast = {"lookup_timeout_s": 0.3}
    s8 = scheduler(ckpt, pool_path, num_blocks=64, extra=fast)
    c8 = s8.connector
    r8, out = add_hit(s8, pool, tag, "slow", list(range(7000, 7000 + 96)))
    pinned = pins(pool, c8)
    w, caches = worker(ckpt, pool_path, num_blocks=16, extra=fast)
    with every_lock_held(pool):
        s8.update_from_output(out, output([], finished_recving={"slow"}))    # unpin
        wait_for(lambda: c8.releases.retries >= 1, "the unpin's first retry")
        obs["timeouts_unpin_held"] = [pinned, region(pool, False)["pins"],
                                      c8.releases.pending()]
    # ... commit: the save claims its blocks, the commit times out, the claims are
    # abandoned once the locks are free
    saved = list(range(8000, 8000 + 64))
    keys = prompt_keys(pool.info, tag, 16, saved).keys
    for name in LAYERS:
        caches[name].copy_(torch.randn(caches[name].shape, generator=torch.Generator()
                                       .manual_seed(8)).to(torch.bfloat16))
    spec = SaveSpec("saved", keys, np.full(4, 16, np.uint32), np.array([0, 0, 1, 1], np.int64),
                    np.array([0, 1, 0, 1], np.int64))
    w.bind_connector_metadata(TractConnectorMetadata(saves=[spec]))
    for name in LAYERS:
        w.save_kv_layer(name, caches[name], None)
    # the claim runs during the forward, on its own thread: done before the locks go
    wait_for(lambda: w.worker_side._reserving.done(), "the save's reserve")
    with every_lock_held(pool):
        w.wait_for_save()
        wait_for(lambda: w.releases.retries >= 1, "the abandon's first retry")
        obs["timeouts_commit_pending_held"] = [region(pool, False)["pending"],
                                               w.releases.pending()]
    assert w.releases.drain(60) and c8.releases.drain(60), "releases not done within 60 s"
    obs["timeouts_after_unpin_commit"] = region(pool)
    obs["timeouts_retries"] = [c8.releases.retries, w.releases.retries]
    # ... the same save without the fault: committed, then loaded into other pages of
    # vLLM's layout and compared, bytes for bytes (real KV through the page map)
    w.bind_connector_metadata(TractConnectorMetadata(saves=[spec]))
    for name in LAYERS:
        w.save_kv_layer(name, caches[name], None)
    w.wait_for_save()
    committed(w)
    look = pool.index.lookup(keys)
    load = LoadSpec("loaded", look.slots, look.checksums, np.array([4, 4, 5, 5], np.int64),
                    np.array([0, 1, 0, 1], np.int64), tags=look.tags)
    w.bind_connector_metadata(TractConnectorMetadata(loads=[load]))
    w.start_load_kv(None)
    obs["roundtrip_errors"] = sorted(loaded(w, {"loaded"}))
    obs["roundtrip_equal"] = all(bool(torch.equal(caches[n][0:2], caches[n][4:6])) for n in LAYERS)
    obs["roundtrip_nonzero"] = all(bool(caches[n][4:6].abs().sum() > 0) for n in LAYERS)
    # ... and synchronously (load_mode sync): copied in start_load_kv itself, before
    # the forward, and reported with the step's output, not by get_finished
    load = LoadSpec("loaded-sync", look.slots, look.checksums, np.array([8, 8, 9, 9], np.int64),
                    np.array([0, 1, 0, 1], np.int64), tags=look.tags, sync=True)
    w.bind_connector_metadata(TractConnectorMetadata(loads=[load]))
    w.start_load_kv(None)
    meta = w.build_connector_worker_meta()
    obs["sync_roundtrip"] = [sorted(w.get_block_ids_with_load_errors()),
                             sorted(w.get_finished(set())[1] or ()),
                             sorted(meta.loaded) if meta else None,
                             w.build_connector_worker_meta() is None]
    obs["sync_roundtrip_equal"] = all(bool(torch.equal(caches[n][0:2], caches[n][8:10]))
                                      for n in LAYERS)
    # ... in the page layout of each CPU ISA vLLM picks somewhere (each one's cache
    #     writer runs on this CPU, whichever vLLM picks here: AMX's lays its pages
    #     out without AMX instructions): measured with that writer, saved, and
    #     loaded back into other pages bytes for bytes
    obs["isa_roundtrip"] = {}
    for i, isa in enumerate(("amx", "vec", "vec16")):
        wi, ci = worker(ckpt, pool_path, 16, isa=isa)
        for name in LAYERS:
            ci[name].copy_(torch.randn(ci[name].shape, generator=torch.Generator()
                                       .manual_seed(20 + i)).to(torch.bfloat16))
        ikeys = prompt_keys(pool.info, tag, 16,
                            list(range(11000 + 100 * i, 11000 + 100 * i + 64))).keys
        wi.bind_connector_metadata(TractConnectorMetadata(saves=[SaveSpec(
            f"isa-{isa}", ikeys, np.full(4, 16, np.uint32), np.array([0, 0, 1, 1], np.int64),
            np.array([0, 1, 0, 1], np.int64))]))
        for name in LAYERS:
            wi.save_kv_layer(name, ci[name], None)
        wi.wait_for_save()
        committed(wi)
        ilook = pool.index.lookup(ikeys)
        wi.bind_connector_metadata(TractConnectorMetadata(loads=[LoadSpec(
            f"isa-{isa}-load", ilook.slots, ilook.checksums, np.array([4, 4, 5, 5], np.int64),
            np.array([0, 1, 0, 1], np.int64), tags=ilook.tags, sync=True)]))
        wi.start_load_kv(None)
        wi.build_connector_worker_meta()
        obs["isa_roundtrip"][isa] = [
            wi.get_handshake_metadata().layout, ilook.hits,
            sorted(wi.get_block_ids_with_load_errors()),
            all(bool(torch.equal(ci[n][0:2], ci[n][4:6])) for n in LAYERS),
            all(bool(ci[n][4:6].abs().sum() > 0) for n in LAYERS)]
        pool.index.unpin(ilook)
    # ... a synchronous load that fails (every checksum wrong) in the step that also
    # saves the request's next 2 blocks and publishes its handoff: what the step
    # computes on the failed load is not saved, and the handoff is not published
    longer = prompt_keys(pool.info, tag, 16, list(range(8000, 8000 + 96))).keys
    record = pool.handoffs.peek_free()
    load = LoadSpec("fail-sync", look.slots, look.checksums ^ 1, np.array([10, 10, 11, 11]),
                    np.array([0, 1, 0, 1]), tags=look.tags, sync=True)
    save = SaveSpec("fail-sync", longer[4:6], np.full(2, 16, np.uint32), np.array([12, 12]),
                    np.array([0, 1]), HandoffSpec(record, "fail-sync", longer, 96, 30.0,
                                                  request_key("fail-sync")))
    w.bind_connector_metadata(TractConnectorMetadata(loads=[load], saves=[save]))
    w.start_load_kv(None)
    wait_for(lambda: w.worker_side._reserving.done(), "the failed step's reserve")
    w.wait_for_save()
    committed(w)
    obs["failed_sync_save"] = [sorted(w.get_block_ids_with_load_errors()),
                               pool.index.peek(longer[4:5]), region(pool)]
    w.build_connector_worker_meta()
    pool.index.unpin(look)
    # ... ack: a handoff loaded while every lock is held stands (its record is still
    # published after the copy: read without a lock), and its acknowledgement, which
    # cannot get the transfer lock, is retried off the engine's path until it succeeds
    ticket = pool.handoffs.publish("acked", keys, len(saved))
    rec = pool.handoffs.open(ticket)
    load = LoadSpec("acked", rec.slots, rec.checksums, np.array([6, 6, 7, 7], np.int64),
                    np.array([0, 1, 0, 1], np.int64), ticket.to_dict(), rec.tags)
    w.bind_connector_metadata(TractConnectorMetadata(loads=[load]))
    with every_lock_held(pool):
        tried = w.releases.retries         # the abandon's above counted already
        w.start_load_kv(None)
        obs["timeouts_ack_errors"] = sorted(loaded(w, {"acked"}))
        # the acknowledgement after it (tried once the release's defer is over)
        # times out on the held locks and is queued again
        wait_for(lambda: w.releases.retries > tried, "the acknowledgement tried and queued "
                 "for retry")
        obs["timeouts_ack_record_held"] = region(pool, False)["handoffs"]
    obs["timeouts_ack_equal"] = all(bool(torch.equal(caches[n][0:2], caches[n][6:8]))
                                    for n in LAYERS)
    assert w.releases.drain(60), "the acknowledgement was not done within 60 s"
    obs["timeouts_after_ack"] = region(pool)
    # ... a handoff released while its blocks are copied (here acknowledged by
    # another party right after the copy, as an expired record's reclaim would):
    # the copy may have read reused slots, so the load does not stand
    ticket = pool.handoffs.publish("released", keys, len(saved))
    rec = pool.handoffs.open(ticket)
    load = LoadSpec("released", rec.slots, rec.checksums, np.array([6, 6, 7, 7], np.int64),
                    np.array([0, 1, 0, 1], np.int64), ticket.to_dict(), rec.tags)
    real_load = w.worker_side._paged.load

    def load_then_release(*args, **kw):
        crcs = real_load(*args, **kw)
        pool.handoffs.ack(ticket)
        return crcs

    w.worker_side._paged.load = load_then_release
    w.bind_connector_metadata(TractConnectorMetadata(loads=[load]))
    w.start_load_kv(None)
    obs["released_errors"] = sorted(loaded(w, {"released"}))
    w.worker_side._paged.load = real_load
    obs["released_after"] = region(pool)
    # ... a save bound and never waited for (a step that failed before its end):
    # the next step's bind gives its claims back off the step
    dropped = prompt_keys(pool.info, tag, 16, list(range(9000, 9000 + 64))).keys
    w.bind_connector_metadata(TractConnectorMetadata(saves=[SaveSpec(
        "dropped", dropped, np.full(4, 16, np.uint32), np.array([0, 0, 1, 1], np.int64),
        np.array([0, 1, 0, 1], np.int64))]))
    wait_for(lambda: w.worker_side._reserving.done(), "the dropped save's reserve")
    obs["dropped_pending"] = region(pool, False)["pending"]
    w.bind_connector_metadata(TractConnectorMetadata(saves=[]))
    assert w.releases.drain(60), "the abandon was not done within 60 s"
    obs["dropped_after"] = region(pool)

    # ... the commit runs off the step: with every lock held, wait_for_save returns
    # with the step's blocks still PENDING (their commit waits on the worker's save
    # thread), and they are READY once the locks are free; so does a P/D prefill's
    # last step, its handoff's record reserved with its claim (a decode that opens
    # it first is told to wait); only a step that publishes its handoff in it
    # (handoff_publish in_step: handoff_follows) waits for its commit
    import threading

    from tract_cli.core.errors import HandoffError
    from tract_cli.core.handoff import Ticket
    wl, _ = worker(ckpt, pool_path, 16, extra={"step_timeout_s": 30})
    pages, subs = np.array([0, 0, 1, 1], np.int64), np.array([0, 1, 0, 1], np.int64)
    off = prompt_keys(pool.info, tag, 16, list(range(9100, 9100 + 64))).keys
    wl.bind_connector_metadata(TractConnectorMetadata(saves=[SaveSpec(
        "off", off, np.full(4, 16, np.uint32), pages, subs)]))
    wait_for(lambda: wl.worker_side._reserving.done(), "the off-step save's reserve")
    with every_lock_held(pool):
        wl.wait_for_save()
        obs["off_step_commit_held"] = [region(pool, False)["pending"], pool.index.peek(off)]
    committed(wl)
    obs["off_step_commit_after"] = [pool.index.peek(off), region(pool)["pending"]]
    follows = prompt_keys(pool.info, tag, 16, list(range(9200, 9200 + 64))).keys
    record = pool.handoffs.peek_free()
    wl.bind_connector_metadata(TractConnectorMetadata(saves=[SaveSpec(
        "follows", follows, np.full(4, 16, np.uint32), pages, subs,
        HandoffSpec(record, "follows", follows, 64, 30.0, request_key("follows")))]))
    wait_for(lambda: wl.worker_side._records.done(), "the handoff step's reserve")
    stepped = threading.Event()

    def step() -> None:
        wl.wait_for_save()
        stepped.set()

    from tract_cli.core.errors import HandoffPending
    ticket = Ticket(record, request_key("follows").hex(), 4, 64)

    def opened() -> str:
        try:
            pool.handoffs.open(ticket)
            return "published"
        except HandoffPending:
            return "pending"
        except HandoffError:
            return "not published"

    with every_lock_held(pool):
        stepping = threading.Thread(target=step)
        stepping.start()
        # a P/D prefill's last step with its handoff planned in-step: its record
        # was reserved with the claim, so the step returns without its commit,
        # and a decode that opens the record meanwhile is told to wait
        obs["handoff_step_returns"] = stepped.wait(20)
        obs["handoff_step_held"] = [opened(), pool.index.peek(follows)]
    stepping.join(60)
    committed(wl)
    obs["handoff_step_after"] = [opened(), pool.index.peek(follows)]
    if obs["handoff_step_after"][0] == "published":
        pool.handoffs.ack(ticket)
    # ... only a P/D prefill's last step with handoff_publish in_step waits for its
    # commit: its handoff is published, into a record not reserved, before the step
    # returns
    wi, _ = worker(ckpt, pool_path, 16, extra={"step_timeout_s": 30,
                                               "handoff_publish": "in_step"})
    inside = prompt_keys(pool.info, tag, 16, list(range(9350, 9350 + 64))).keys
    record = pool.handoffs.peek_free()
    wi.bind_connector_metadata(TractConnectorMetadata(saves=[SaveSpec(
        "inside", inside, np.full(4, 16, np.uint32), pages, subs,
        HandoffSpec(record, "inside", inside, 64, 30.0, request_key("inside")),
        handoff_follows=True)]))
    wait_for(lambda: wi.worker_side._reserving.done(), "the in-step handoff's reserve")
    obs["in_step_reserves"] = wi.worker_side._records is not None
    stepped = threading.Event()

    def step_inside() -> None:
        wi.wait_for_save()
        stepped.set()

    ticket = Ticket(record, request_key("inside").hex(), 4, 64)
    with every_lock_held(pool):
        stepping = threading.Thread(target=step_inside)
        stepping.start()
        obs["in_step_handoff_waits"] = not stepped.wait(1.0)
        obs["in_step_handoff_held"] = opened()          # nothing reserved meanwhile
    stepping.join(60)
    obs["in_step_handoff_after"] = [stepped.is_set(), opened()]
    if obs["in_step_handoff_after"][1] == "published":
        pool.handoffs.ack(ticket)
    # ... a commit that fails with anything, not only a pool error: the step
    # is not troubled, and the claims are given back off it
    broken = prompt_keys(pool.info, tag, 16, list(range(9400, 9400 + 64))).keys
    index = wl.worker_side.pool.index
    real_commit, failed = index.commit, []

    def commit_once_failing(*args, **kw):
        if not failed:
            failed.append(True)
            raise RuntimeError("a bug in the commit")
        return real_commit(*args, **kw)

    index.commit = commit_once_failing
    try:
        wl.bind_connector_metadata(TractConnectorMetadata(saves=[SaveSpec(
            "broken", broken, np.full(4, 16, np.uint32), pages, subs)]))
        wl.wait_for_save()
        committed(wl)
    finally:
        index.commit = real_commit
    obs["failed_commit"] = [failed, pool.index.peek(broken), region(pool)["pending"]]

    # 9. chunked prefill over several steps (64-token budget): each step saves the blocks
    #    it completed, once each, the tail with the last chunk; the worker runs every
    #    step's saves, so the handoff at the end finds all 13 blocks READY
    s9 = scheduler(ckpt, pool_path, num_blocks=64, budget=64)
    w9, caches9 = worker(ckpt, pool_path, num_blocks=64)
    chunked = list(range(9000, 9000 + 200))                 # 12 full blocks + 8 tokens
    r9 = request("chunked", chunked, 1, {"do_remote_decode": True})
    s9.add_request(r9)
    per_step, saved_keys, params9 = [], [], None
    for _ in range(10):
        out = s9.schedule()
        saves = out.kv_connector_metadata.saves
        per_step.append([out.num_scheduled_tokens.get("chunked", 0),
                         sum(len(sv.keys) for sv in saves),
                         any(sv.handoff_follows for sv in saves),
                         any(sv.handoff is not None for sv in saves)])
        saved_keys += [bytes(k) for sv in saves for k in sv.keys]
        w9.bind_connector_metadata(out.kv_connector_metadata)
        for name in LAYERS:
            w9.save_kv_layer(name, caches9[name], None)
        w9.wait_for_save()
        committed(w9)       # (the ticket below is acknowledged once published)
        eng = s9.update_from_output(out, output([r9]))
        done = [o for outs in eng.values() for o in outs.outputs if o.finished]
        if done:
            params9 = done[0].kv_transfer_params
            break
    pk = prompt_keys(pool.info, tag, 16, chunked)
    obs["chunked_steps"] = per_step
    obs["chunked_saved_once_each"] = (len(saved_keys) == len(set(saved_keys)) and
                                      set(saved_keys) == {bytes(k) for k in pk.keys} |
                                      {bytes(pk.tail_key[0])})
    obs["chunked_ticket_blocks"] = (params9 or {}).get("tract_ticket", {}).get("blocks")
    if params9 and "tract_ticket" in params9:
        from tract_cli.core.handoff import Ticket
        pool.handoffs.ack(Ticket.from_dict(params9["tract_ticket"]))

    # 10. preempted after its load: the pages are freed, the request goes back to the
    #     queue, is looked up and loaded again (vLLM's own prefix cache off, so the
    #     pool is the only source), and nothing stays pinned
    s10 = scheduler(ckpt, pool_path, num_blocks=64, prefix_caching=False)
    c10 = s10.connector
    r10, out = add_hit(s10, pool, tag, "preempted", list(range(9500, 9500 + 100)))
    loads = []
    loads.append([len(ld.slots) for ld in out.kv_connector_metadata.loads])
    s10.update_from_output(out, output([], finished_recving={"preempted"}))
    out = s10.schedule()                                    # computes the 4 tokens past it
    s10.update_from_output(out, output([r10]))
    s10.running.remove(r10)
    s10._preempt_request(r10, time.monotonic())
    obs["preempt_status"] = r10.status.name
    out = s10.schedule()
    loads.append([len(ld.slots) for ld in out.kv_connector_metadata.loads])
    obs["preempt_pins_reloading"] = pins(pool, c10)
    s10.update_from_output(out, output([], finished_recving={"preempted"}))
    out = s10.schedule()
    obs["preempt_scheduled_after"] = out.num_scheduled_tokens.get("preempted")
    obs["preempt_loads"] = loads
    s10.finish_requests("preempted", RequestStatus.FINISHED_ABORTED)
    obs["preempt_pins_after"] = pins(pool, c10)

    # 11. a vLLM with two KV cache groups (a hybrid model) is refused at start
    config, kv = configs(ckpt, pool_path, 64)
    spec = kv.kv_cache_groups[0].kv_cache_spec
    two = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(LAYERS[:1], spec), KVCacheGroupSpec(LAYERS[1:], spec)])
    try:
        TractConnector(config, KVConnectorRole.SCHEDULER, two)
        obs["two_groups"] = None
    except Exception as exc:
        obs["two_groups"] = f"{type(exc).__name__}: {exc}"

    # 12. a stalled lock manager (every lock held by another node) delays the pool's
    #     hits by at most lookup_patience_s, never scheduling: a prompt the pool does
    #     not hold is answered by a look without a lock and scheduled at once, a hit's
    #     lookup runs off the scheduler loop, which answers vLLM "not yet" and
    #     schedules the rest; past the patience the hit is computed; once the locks
    #     are free, nothing stays pinned and hits load again
    patience = 0.5
    s12 = scheduler(ckpt, pool_path, num_blocks=64,
                    extra={"lookup_timeout_s": 60, "lookup_wait_s": 0.002,
                           "lookup_patience_s": patience})
    c12 = s12.connector
    stalled = list(range(9700, 9700 + 64))
    put_prompt(pool, tag, stalled)
    r12, miss = request("stalled-hit", stalled), request("stalled-miss", list(range(9800, 9864)))
    short = request("short", list(range(20, 30)))
    with every_lock_held(pool):
        for r in (r12, miss, short):
            s12.add_request(r)
        t0 = time.monotonic()
        out = s12.schedule()
        obs["stall_schedule_s"] = time.monotonic() - t0
        obs["stall_scheduled"] = sorted(out.num_scheduled_tokens)
        obs["stall_waiting"] = [r12.status.name, miss.status.name]
        late = {rid: time.monotonic() - t0 for rid in ("stalled-hit", "stalled-miss")
                if out.num_scheduled_tokens.get(rid)}
        s12.update_from_output(out, output([r for r in (short, r12, miss)
                                            if out.num_scheduled_tokens.get(r.request_id)]))
        deadline = time.monotonic() + 30
        while len(late) < 2:                    # bounded: each step's schedule is timed
            assert time.monotonic() < deadline, "the stalled requests were never scheduled"
            t1 = time.monotonic()
            out = s12.schedule()
            obs["stall_max_schedule_s"] = max(obs.get("stall_max_schedule_s", 0),
                                              time.monotonic() - t1)
            for rid in ("stalled-hit", "stalled-miss"):
                if out.num_scheduled_tokens.get(rid) and rid not in late:
                    late[rid] = time.monotonic() - t0
            obs.setdefault("stall_loads", []).extend(ld.req_id for ld in
                                                     out.kv_connector_metadata.loads)
            s12.update_from_output(out, output([r for r in (short, r12, miss)
                                                if out.num_scheduled_tokens.get(r.request_id)]))
            time.sleep(0.01)      # one engine step's pace, while the locks stay held
        obs["stall_scheduled_after_s"] = late
    s12.finish_requests(["stalled-hit", "stalled-miss", "short"], RequestStatus.FINISHED_ABORTED)
    wait_for(lambda: pins(pool, c12) == 0, "the stalled lookups' pins given back")
    side = c12.scheduler_side
    wait_for(lambda: time.monotonic() >= side._stalled_until, "the end of the stall window")
    again = request("after-stall", stalled)
    s12.add_request(again)
    deadline = time.monotonic() + 30
    while True:                 # its lookup may take more than one step (lookup_wait_s)
        out = s12.schedule()
        loads = [ld.req_id for ld in out.kv_connector_metadata.loads]
        if loads or out.num_scheduled_tokens.get("after-stall"):
            break
        assert time.monotonic() < deadline, "the request after the stall was never scheduled"
        s12.update_from_output(out, output([]))
        time.sleep(0.01)          # one engine step's pace
    obs["stall_loads_after"] = loads
    s12.update_from_output(out, output([], finished_recving={"after-stall"}))
    s12.finish_requests("after-stall", RequestStatus.FINISHED_ABORTED)
    obs["stall_pins_after"] = pins(pool, c12)

    # a paired decode that found its prefill's record RESERVED, which its prefill
    # then gave back and marked lost (Handoffs.publish_lost, queued after the
    # give-back): it looks for the pair by name again, reads that record of no
    # blocks, computes the prompt at once and gives the record back
    from tract_cli.core.handoff import pair_key
    sp = scheduler(ckpt, pool_path, 16, extra={"pair_wait_s": 60, "handoff_wait_s": 30,
                                               "pair_idle_s": 0})
    pair, ptoks = "5" * 32, list(range(9900, 9970))      # a prompt no phase stored
    pk = prompt_keys(pool.info, sp.connector.key_tag, 16, ptoks)
    name = pair_key(pair)
    record = pool.handoffs.peek_free()
    pool.handoffs.reserve_record(record, name, len(pk.keys) + 1, len(ptoks), ttl=30)
    rp = request("paired-lost", ptoks, params={"do_remote_prefill": True, "tract_pair": pair})
    sp.add_request(rp)
    out = sp.schedule()
    obs["paired_lost_first"] = [out.num_scheduled_tokens.get("paired-lost", 0),
                                sp.connector.scheduler_side._reqs["paired-lost"].pending
                                is not None]
    sp.update_from_output(out, output([]))
    obs["paired_lost_unreserved"] = pool.handoffs.unreserve(record, name)
    pool.handoffs.publish_lost(name, 30.0)
    t0 = time.monotonic()
    while True:                 # bounded: the pair's record read, then its lookup
        out = sp.schedule()
        if out.num_scheduled_tokens.get("paired-lost"):
            break
        assert time.monotonic() - t0 < 30, "the paired decode was never computed"
        sp.update_from_output(out, output([]))
        time.sleep(0.01)          # one engine step's pace
    obs["paired_lost_computed_after_s"] = time.monotonic() - t0
    obs["paired_lost_loads"] = [ld.req_id for ld in out.kv_connector_metadata.loads]
    sp.update_from_output(out, output([rp]))
    sp.finish_requests("paired-lost", RequestStatus.FINISHED_ABORTED)
    settle()
    obs["paired_lost_record_left"] = int(pool.handoffs.find(
        np.frombuffer(name, np.uint8).reshape(1, 16))[0])

    sched = conn.scheduler_side
    obs["state_left"] = [len(sched._reqs), len(sched._loading_done), len(sched._pending_loads)]
    for c in (conn, cs, other, consumer.connector, producer.connector, c8, w, s9.connector, w9,
              c10, c12, blind.connector, sp.connector,
              *([STEP["worker"]] if "worker" in STEP else [])):
        c.shutdown()
    pool.close()
    return obs


if __name__ == "__main__":
    print("OBSERVATIONS " + json.dumps(main(sys.argv[1], sys.argv[2])))
