"""Drives vLLM's own Scheduler with TraCT's connector, no model and no server (as
vLLM's tests/v1/kv_connector/unit do): the scheduler-side lifecycle of pool
hits, handoffs, aborts and repeated matching against a real region.

Run in vLLM's environment: `python tests/vllm_scheduler_driver.py CKPT POOL`;
prints one JSON object of observations (tests/test_vllm_scheduler.py checks them).
"""
from __future__ import annotations

import json
import sys

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig,
                         SchedulerConfig, VllmConfig)
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from tract_cli.core.hashing import block_hashes, pool_root
from tract_cli.core.index import as_keys
from tract_cli.core.pool import Pool

PAGE = 32          # vLLM's block size here: two 16-token region blocks per page


def scheduler(ckpt: str, pool: str, num_blocks: int) -> Scheduler:
    model = ModelConfig(model=ckpt, dtype="bfloat16", seed=0)
    config = VllmConfig(
        model_config=model,
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=4096,
                                         max_model_len=2048, enable_chunked_prefill=True,
                                         is_encoder_decoder=False),
        cache_config=CacheConfig(block_size=PAGE, enable_prefix_caching=True),
        kv_transfer_config=KVTransferConfig(
            kv_connector="TractConnector", kv_connector_module_path="tract_cli.connectors.vllm",
            kv_role="kv_both", kv_load_failure_policy="recompute",
            kv_connector_extra_config={"pool": pool, "node": 1}),
        device_config=DeviceConfig("cpu"))
    config.cache_config.num_gpu_blocks = num_blocks
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"],
                         FullAttentionSpec(block_size=PAGE, num_kv_heads=2, head_size=32,
                                           dtype=torch.bfloat16))])
    return Scheduler(vllm_config=config, kv_cache_config=kv,
                     structured_output_manager=StructuredOutputManager(config), block_size=PAGE,
                     log_stats=True)


def request(rid: str, tokens: list[int], max_tokens: int = 4, params=None) -> Request:
    sp = SamplingParams(max_tokens=max_tokens)
    sp.update_from_generation_config({}, 1)
    req = Request(request_id=rid, prompt_token_ids=tokens, sampling_params=sp,
                  pooling_params=None, mm_features=None,
                  block_hasher=get_request_block_hasher(PAGE, sha256))
    req.kv_transfer_params = params
    return req


def output(reqs, finished_recving=None, invalid=None) -> ModelRunnerOutput:
    ids = [r.request_id for r in reqs]
    kvo = KVConnectorOutput(finished_recving=finished_recving, invalid_block_ids=invalid or set())
    return ModelRunnerOutput(req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)},
                             sampled_token_ids=[[5] for _ in ids], logprobs=None,
                             prompt_logprobs_dict={}, pooler_output=None, kv_connector_output=kvo)


def put_prompt(pool: Pool, tokens: list[int], with_tail: bool = False) -> None:
    """Stores the prompt's full blocks (and its tagged partial tail) as a prefill would."""
    from tract_cli.connectors.vllm import PARTIAL_TAG
    arr = np.asarray(tokens, np.int32)
    root = pool_root(pool.info)
    keys = as_keys(block_hashes(arr, pool.info.hash_scheme, 16, root=root))
    tok = [16] * len(keys)
    if with_tail and arr.size % 16:
        tail = arr.size % 16
        tk = as_keys(block_hashes(arr[-tail:], "tract", tail, root=bytes(keys[-1]),
                                  extra=PARTIAL_TAG))
        keys, tok = np.vstack([keys, tk]), tok + [tail]
    pool.index.put(keys, np.zeros((len(keys), pool.info.block_bytes), np.uint8), tokens=tok)


def pins(pool: Pool) -> int:
    from tract_cli.inspect.snapshot import take
    return take(pool)["index"]["pins_total"]


def main(ckpt: str, pool_path: str) -> dict:
    init_none_hash(sha256)
    obs = {}
    pool = Pool.attach(pool_path, node=3)
    s = scheduler(ckpt, pool_path, num_blocks=64)
    conn = s.connector

    # 1. a prefix hit: pinned once however often it is matched, loaded asynchronously,
    #    unpinned when the worker reports the load, then scheduled past the hit
    hit = list(range(10, 10 + 100))                  # 6 full region blocks + 4 tokens
    put_prompt(pool, hit)
    r1 = request("hit", hit)
    s.add_request(r1)
    out = s.schedule()
    obs["hit_status"] = r1.status.name
    obs["hit_loads"] = [len(l.slots) for l in out.kv_connector_metadata.loads]
    obs["hit_pins_while_loading"] = pins(pool)
    conn.get_num_new_matched_tokens(r1, 0)          # matching again takes no second pin
    obs["hit_pins_after_rematch"] = pins(pool)
    s.update_from_output(out, output([], finished_recving={"hit"}))
    obs["hit_pins_after_load"] = pins(pool)
    out = s.schedule()
    obs["hit_computed_then"] = r1.num_computed_tokens
    obs["hit_scheduled_tokens"] = out.num_scheduled_tokens.get("hit")
    s.finish_requests("hit", RequestStatus.FINISHED_ABORTED)
    s.update_from_output(out, output([r1]))

    # 2. aborted while its load runs: the pins wait for the worker, then go
    ab = list(range(300, 300 + 64))
    put_prompt(pool, ab)
    r2 = request("aborted", ab)
    s.add_request(r2)
    out = s.schedule()
    obs["abort_status"] = r2.status.name
    s.finish_requests("aborted", RequestStatus.FINISHED_ABORTED)
    obs["abort_pins_before_worker"] = pins(pool)
    s.update_from_output(out, output([], finished_recving={"aborted"}))
    obs["abort_pins_after_worker"] = pins(pool)

    # 3. a failed load: the request is recomputed and never offered the blocks again
    bad = list(range(600, 600 + 80))
    put_prompt(pool, bad)
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
    obs["bad_pins_after"] = pins(pool)

    # 4. a prefill for a remote decode: the handoff is published when it finishes and its
    #    kv_transfer_params carry the ticket; the blocks stay pinned for the decode side
    pd = list(range(900, 900 + 40))
    put_prompt(pool, pd, with_tail=True)
    r4 = request("pd", pd, max_tokens=1, params={"do_remote_decode": True})
    s.add_request(r4)
    out = s.schedule()                               # its full blocks are a pool hit
    s.update_from_output(out, output([], finished_recving={"pd"}))
    out = s.schedule()
    eng = s.update_from_output(out, output([r4]))
    params = [o.kv_transfer_params for outs in eng.values() for o in outs.outputs
              if o.request_id == "pd"]
    obs["pd_params"] = params[0] if params else None
    obs["pd_pins"] = pins(pool)
    obs["state_left"] = [len(conn._reqs), len(conn._loading_done), len(conn._pending_loads)]
    pool.close()
    return obs


if __name__ == "__main__":
    print("OBSERVATIONS " + json.dumps(main(sys.argv[1], sys.argv[2])))
