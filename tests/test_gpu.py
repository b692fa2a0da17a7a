"""The GPU path: registration, DMA in and out of slots, a put from GPU memory
read back on the CPU.  Skipped without CUDA (run on a GPU host; docs/SERVING.md)."""
from __future__ import annotations

import numpy as np
import pytest

from tract_cli.core.hashing import block_hashes, pool_root
from tract_cli.core.pool import Pool
from tract_cli.core.gpu import _runs, cuda_available


def test_runs_of_consecutive_slots():
    assert _runs(np.array([4, 5, 6, 9, 10, 2], np.uint32)) == [(0, 4, 3), (3, 9, 2), (5, 2, 1)]
    assert _runs(np.array([], np.uint32)) == []


@pytest.mark.skipif(not cuda_available(), reason="needs a CUDA GPU (the GPU path of docs/ARCHITECTURE.md §12)")
def test_gpu_put_and_load_through_registered_mapping(region_path):
    import torch

    from tract_cli.core.gpu import CudaPool
    with Pool.create(region_path, 64 << 20, "tiny-llama") as pool:
        g = pool.geometry
        cp = CudaPool(pool)
        try:
            kv = torch.randn((40, *g.block_shape), device="cuda")
            keys = block_hashes(np.arange(40 * 16, dtype=np.int32), root=pool_root(pool.info))
            status = cp.put(keys, kv)
            assert (status == 0).all()
            hit = pool.index.lookup(keys)
            assert hit.hits == 40
            cpu = np.empty((40, pool.info.block_bytes), np.uint8)
            pool.index.read(hit, cpu)                        # CPU read of what the GPU wrote
            assert np.array_equal(cpu.view(np.float32).reshape(kv.shape), kv.cpu().numpy())
            back = torch.empty_like(kv)
            cp.load(hit.slots, back)
            cp.stream.synchronize()
            assert torch.equal(back, kv)
            pool.index.unpin(hit)
        finally:
            cp.close()
