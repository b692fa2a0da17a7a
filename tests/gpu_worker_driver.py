"""Drives the vLLM connector's worker half on its GPU path, with the CPU
standing in for CUDA (tests/fake_cuda.py): the worker's logic around
`CudaPagedKV` -- saves layer by layer, a step whose forward handed over no
layer (a FULL CUDA graph's replay), a layer out of order, a load whose block
fails its checksum, the verdicts asked for before wait_for_save (speculative
decoding's order) -- against a real region, no model and no server.

Run in vLLM's environment: `python tests/gpu_worker_driver.py POOL`; prints one
JSON object of observations (tests/test_gpu.py checks them), one per way the
GPU path copies (direct, vLLM's batched copy stood in for by a memmove that
runs late on the side stream, until waited for; staging).
"""
from __future__ import annotations

import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import fake_cuda  # noqa: E402

fake_cuda.install()

from tract_cli.connectors.vllm_meta import LoadSpec, SaveSpec  # noqa: E402
from tract_cli.core.gpupages import CudaPagedKV  # noqa: E402
from tract_cli.core.hashing import block_hashes, pool_root  # noqa: E402
from tract_cli.core.index import PUT_CLAIMED  # noqa: E402
from worker_stand import expected_blocks, worker_on  # noqa: E402

PAGES = 32


def main(path: str) -> dict:
    # each way the GPU path copies: vLLM's batched copy stood in for, and staging
    return {"direct": scenarios(path, fake_cuda.batch_copy, 0),
            "staging": scenarios(path, None, 100_000)}


def scenarios(path: str, batch_copy, salt: int) -> dict:
    stand = worker_on(path, PAGES, seed=5)
    pool, ws, releases, tensors = stand
    g = pool.geometry
    B = g.block_tokens
    ws._gpu = CudaPagedKV(pool, ws.layout, tensors, capacity=3, batch_copy=batch_copy)
    assert ws._gpu.direct == (batch_copy is not None)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(g.num_layers)]
    ws._layers = {name: i for i, name in enumerate(names)}
    root = pool_root(pool.info)
    seen: dict = {}
    expected = lambda pages: expected_blocks(stand, pages)

    def saved(name, pages, layers) -> tuple[np.ndarray, dict]:
        keys = block_hashes(np.arange(len(pages) * B, dtype=np.int32) + 1000 * len(seen) + salt,
                            block_tokens=B, root=root)
        spec = SaveSpec(name, keys, np.full(len(pages), B, np.uint32),
                        np.asarray(pages, np.int64), np.zeros(len(pages), np.int64))
        ws.bind([spec])
        for layer in layers:
            ws.save_layer(names[layer], None)
        ws.wait_for_save()
        ws._saver.submit(lambda: None).result(10.0)    # its commit, off the step
        releases.drain(10.0)
        hit = pool.index.lookup(keys)
        out = {"hits": hit.hits}
        if hit.hits:
            got = np.stack([pool.slot_array(int(s)).reshape(-1).view(np.float32)
                            for s in hit.slots])
            out["bytes_equal"] = bool(np.array_equal(got, expected(pages)[:hit.hits]))
            out["checksums_equal"] = bool(np.array_equal(hit.checksums,
                                                         pool.checksum_slots(hit.slots)))
        return keys, hit, out

    pages = [3, 9, 4, 10]
    keys_a, hit_a, seen["in_order"] = saved("a", pages, range(g.num_layers))
    _, hit_b, seen["no_layer_handed_over"] = saved("b", [11, 12, 13], [])
    keys_c, hit_c, seen["out_of_order"] = saved("c", [14, 15], [1, 0])
    status, slots = pool.index.reserve(keys_c)          # its claims were given back
    seen["out_of_order"]["claimable_again"] = bool((status == PUT_CLAIMED).all())
    pool.index.commit(keys_c, status, slots, publish=False)

    # a load of a's blocks into other pages, block 2 changed in the pool since its save
    into = np.array([20, 21, 22, 23], np.int64)
    pool.slot_array(int(hit_a.slots[2])).reshape(-1).view(np.uint8)[40] ^= 0x04
    load = LoadSpec("d", hit_a.slots.copy(), hit_a.checksums.copy(), into,
                    np.zeros(4, np.int64), tags=hit_a.tags, sync=True)
    ws.start_loads([load])
    # speculative decoding's order: the step's verdicts before its wait_for_save
    errors = ws.load_errors()
    meta = ws.worker_meta()
    ws.wait_for_save()
    loaded = expected(list(into[:2]))
    seen["load"] = {"errors": sorted(errors), "reported": sorted(meta.loaded) if meta else [],
                    "good_blocks_equal": bool(np.array_equal(loaded, expected(pages[:2])))}
    for hit in (hit_a, hit_b, hit_c):
        if hit.hits:
            pool.index.unpin(hit)
    ws.shutdown()
    releases.close(10.0)
    pool.close()
    return seen


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1])))
