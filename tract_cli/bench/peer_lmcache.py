"""The LMCache peer adapter, its `lm://` server path (LMCache 0.5.6): run by
the peer's own Python as `receiver` (decode side) or `sender` (prefill side),
driven by `tract bench` over JSON lines on stdin/stdout (as peer_nixl.py).

The receiver starts LMCache's own server (`python -m lmcache.v1.server HOST
PORT cpu`, the process behind `remote_url: lm://HOST:PORT`) and prints its
address. Both sides talk to it through LMCache's client, `LMCServerConnector`,
with memory objects from LMCache's `LocalCPUBackend`, as an LMCache engine
configured with that `remote_url` does:

- sender, per request: waits out its modelled compute, writes the stand-in KV
  (the same bytes as the tract transports) into its private buffer, then per
  LMCache chunk (256 tokens = 16 TraCT blocks, plus the tail in the last one)
  allocates a memory object, copies the chunk into it (the copy LMCache makes
  from the engine's KV when it stores) and `put`s it; an `exists` of the last
  chunk on the same connection returns once the server has stored them all;
  then it prints the request's timings, which the driver relays;
- receiver: `get`s every chunk (the server streams it into a fresh memory
  object) and copies it into the request's receive slot (LMCache's retrieve
  copy into the engine's KV), then verifies and prints the record
  (peer_common.py).

The server keeps every object (0.5.6 has no eviction and no delete): the
driver refuses workloads whose KV would not fit in memory.

Standalone on purpose: it must import nothing from TraCT.
"""
import asyncio
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # after the stdlib: see peers.py
from peer_common import fill_and_compute, main, np, out, record  # noqa: E402  (takes stdout)
import torch  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402

CHUNK_TOKENS = 256              # LMCache's default chunk_size
MODEL = "tract-bench"
SERVER_START_S = 120.0


class Client:
    """An LMCServerConnector with its LocalCPUBackend and event loop."""

    def __init__(self, host: str, port: int, chunk_bytes: int):
        cfg = LMCacheEngineConfig.from_defaults(
            chunk_size=CHUNK_TOKENS, local_cpu=False, remote_url=f"lm://{host}:{port}",
            # room for two chunks in flight, in GB as LMCache counts them
            max_local_cpu_size=max(2 * chunk_bytes / 1e9, 0.05))
        meta = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.uint8,
                               kv_shape=(1, 2, CHUNK_TOKENS, 1, 1))
        self.backend = LocalCPUBackend(cfg, meta, dst_device="cpu")
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.conn = LMCServerConnector(host, port, self.loop, self.backend)

    def call(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def put(self, key, data: np.ndarray) -> None:
        obj = self.backend.allocate(torch.Size([1, 1, 1, data.size]), torch.uint8,
                                    MemoryFormat.KV_2LTD)
        if obj is None:
            raise SystemExit("lmcache: no memory object for a chunk (LocalCPUBackend full)")
        obj.tensor.view(-1).numpy()[:] = data
        self.call(self.conn.put(key, obj))
        obj.ref_count_down()

    def get_into(self, key, dst: np.ndarray) -> None:
        obj = self.call(self.conn.get(key))
        if obj is None:
            raise SystemExit(f"lmcache: the server has no chunk {key.chunk_hash:x}")
        dst[:] = obj.tensor.view(-1).numpy()[:dst.size]
        obj.ref_count_down()


def chunk_keys(rid: str, n: int) -> list:
    """LMCache keys of request RID's N chunks (no prefix sharing across requests)."""
    return [CacheEngineKey(MODEL, 1, 0, int.from_bytes(
        hashlib.blake2b(f"{rid}/{i}".encode(), digest_size=8).digest(), "little"), torch.uint8)
        for i in range(n)]


def spans(req: dict) -> list[tuple[int, int]]:
    """(start, end) bytes of each chunk: 256 tokens of blocks each, the tail in the last."""
    n, bb = req["blocks"], req["block_bytes"]
    per = max(CHUNK_TOKENS // req["block_tokens"], 1) * bb
    total = n * bb + req["tail_bytes"]
    starts = list(range(0, n * bb, per)) or [0]
    return [(s, total if i == len(starts) - 1 else s + per) for i, s in enumerate(starts)]


def client_for(req: dict, host: str, port: int) -> Client:
    """A client whose memory objects hold the largest chunk: 256 tokens and a tail."""
    return Client(host, port, max(CHUNK_TOKENS // req["block_tokens"], 1) * req["block_bytes"] +
                  req["block_bytes"])


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def start_server() -> tuple[subprocess.Popen, int]:
    """LMCache's server on a free loopback port; waits (bounded) until it accepts."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "lmcache.v1.server", "127.0.0.1", str(port),
                             "cpu"], stdin=subprocess.DEVNULL, stdout=sys.stderr,
                            stderr=sys.stderr)
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"lmcache: the server exited with code {proc.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, port
        except OSError:
            time.sleep(0.05)    # the server is importing torch: poll, bounded
    proc.kill()
    raise SystemExit(f"lmcache: the server did not listen within {SERVER_START_S:.0f} s")


def receiver(capacity: int, slots: int) -> None:
    server, port = start_server()
    try:
        buf = np.zeros(capacity * slots, np.uint8)
        client = None
        out({"host": "127.0.0.1", "port": port})
        expected, done = {}, {}
        for line in sys.stdin:
            msg = json.loads(line)
            if "done" in msg:
                done[msg["done"]] = msg["t"]
            else:
                expected[msg["rid"]] = msg
            for rid in [r for r in done if r in expected]:
                exp, t = expected.pop(rid), done.pop(rid)
                client = client or client_for(exp, "127.0.0.1", port)
                c = time.perf_counter()
                base = exp["slot"] * capacity
                parts = spans(exp)
                for key, (s, e) in zip(chunk_keys(rid, len(parts)), parts):
                    client.get_into(key, buf[base + s:base + e])
                t["kv_read"] = time.perf_counter() - c
                out(record(buf, capacity, exp, t))
    finally:
        server.kill()
        server.wait()


def sender(capacity: int) -> None:
    hello = json.loads(sys.stdin.readline())
    buf = np.zeros(capacity, np.uint8)
    client = None
    out({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        client = client or client_for(req, hello["host"], hello["port"])
        t, _ = fill_and_compute(buf, req)
        c = time.perf_counter()
        parts = spans(req)
        keys = chunk_keys(req["rid"], len(parts))
        for key, (s, e) in zip(keys, parts):
            client.put(key, buf[s:e])
        if not client.call(client.conn.exists(keys[-1])):     # ordered after the puts
            raise SystemExit(f"lmcache: the server does not hold {req['rid']} after put")
        t["kv_write"] = time.perf_counter() - c
        out({"done": req["rid"], "t": t})


if __name__ == "__main__":
    main(receiver, sender)
