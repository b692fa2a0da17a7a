"""The stand the worker-half drivers (tests/cpu_worker_driver.py,
tests/gpu_worker_driver.py) put the vLLM connector's worker half on: a real
region, FlashAttention-shaped layer tensors of random values, no model and
no server; and the test side that runs a driver in vLLM's environment.

A driver imports this after anything it must install first (the GPU
driver's CUDA stand-in), since it imports the connector.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import subprocess
from types import SimpleNamespace
from typing import NamedTuple

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Stand(NamedTuple):
    pool: object          # the region, attached as node 1
    ws: object            # the worker half (connectors.vllm_worker.WorkerSide)
    releases: object      # its releases (connectors.retry.Releases)
    tensors: list         # vLLM's layer tensors it moves KV to and from


def worker_on(path: str, pages: int, seed: int, **extra) -> Stand:
    """The worker half on region PATH (node 1), over PAGES pages a layer of random
    values (SEED) in FlashAttention's layout, with connector settings EXTRA; the
    caller gives it its data path."""
    import torch

    from tract_cli.connectors.retry import Releases
    from tract_cli.connectors.settings import ConnectorSettings
    from tract_cli.connectors.vllm_worker import WorkerSide
    from tract_cli.core.kvpages import PageLayout, flash_offsets
    from tract_cli.core.pool import Pool
    pool = Pool.attach(path, node=1)
    g = pool.geometry
    B, H, D = g.block_tokens, g.num_kv_heads, g.head_dim
    settings = ConnectorSettings.parse({"pool": path, "node": 1} | extra, "kv_both")
    releases = Releases(5.0)
    config = SimpleNamespace(cache_config=SimpleNamespace(block_size=B))
    ws = WorkerSide(pool, settings, config, releases, logging.INFO)
    torch.manual_seed(seed)
    tensors = [torch.randn((2, pages, B, H, D)) for _ in range(g.num_layers)]
    offsets, stride = flash_offsets(pages, B, H, D)
    ws.layout = PageLayout(offsets, stride, B, tensors[0].element_size())
    return Stand(pool, ws, releases, tensors)


@contextlib.contextmanager
def every_lock_held(pool):
    """Holds every lock of the region from POOL's node (another than the one
    under test): each pool call of the connector's waits meanwhile, as under a
    stalled lock manager."""
    with contextlib.ExitStack() as stack:
        for lock_id in range(pool.locks.count):
            stack.enter_context(pool.locks.hold(lock_id, timeout=30))
        yield


def find_record(pool, name: bytes) -> int:
    """The record a paired decode finds under NAME (-1: none)."""
    return int(pool.handoffs.find(np.frombuffer(name, np.uint8).reshape(1, 16))[0])


def told(pool, record: int, name: bytes, blocks: int, tokens: int) -> str:
    """What a decode that opens RECORD for NAME's handoff of BLOCKS blocks and
    TOKENS tokens is told: "N blocks", the error's name, or "no record"."""
    from tract_cli.core.errors import TractError
    from tract_cli.core.handoff import Ticket
    if record < 0:
        return "no record"
    try:
        got = pool.handoffs.open(Ticket(record, name.hex(), blocks, tokens))
    except TractError as exc:
        return type(exc).__name__
    return f"{len(got.keys)} blocks"


def acked(pool, record: int, name: bytes) -> None:
    """The decode's acknowledgement of RECORD (NAME's), if it is published
    (what `told` said says whether it was)."""
    from tract_cli.core.errors import TractError
    from tract_cli.core.handoff import Ticket
    if record >= 0:
        with contextlib.suppress(TractError):
            pool.handoffs.ack(Ticket(record, name.hex(), 0, 0))


def expected_blocks(stand: Stand, pages) -> np.ndarray:
    """The region blocks (one row each, every layer) that vLLM's PAGES hold."""
    index = stand.ws.layout.gather_index(np.asarray(pages), np.zeros(len(pages), np.int64))
    flat = [t.numpy().reshape(-1) for t in stand.tensors]
    return np.stack([np.concatenate([f[index[i]] for f in flat]) for i in range(len(pages))])


def run_driver(name: str, region_path: str) -> dict:
    """Runs tests/NAME on a fresh region at REGION_PATH, in vLLM's environment,
    beside the region's lock manager; its observations (one JSON object).  The
    caller skips where there is no vLLM environment."""
    from agents import RunningAgent
    from tests.vllm_stack import VLLM_PY
    from tract_cli.core.pool import Pool
    Pool.create(region_path, 64 << 20, "tiny-llama").close()
    with RunningAgent(region_path, 0, manager=True):
        out = subprocess.run([VLLM_PY, os.path.join(ROOT, "tests", name), region_path],
                             capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, f"the driver failed: {out.stderr[-3000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])
