"""The LMCache peer adapter (LMCache 0.5.6), two paths: run by the peer's own
Python as `receiver` (decode side) or `sender` (prefill side), driven by
`tract bench` over JSON lines on stdin/stdout (as adapter_nixl.py). The path is
`TRACT_LMCACHE_PATH`: `lm` (default) or `pd`.

**`pd`: LMCache's PD disaggregation backend (`PDBackend`) over NIXL/UCX with
CPU buffers**, as between a prefill and a decode engine: the receiver is a
PD receiver (its memory-allocation side channel and NIXL listener on free
loopback ports); the sender a PD sender (`pd_skip_proxy_notification`: the
driver relays the completion, as LMCache's proxy would). Per request the
sender allocates memory objects from its PD buffer, copies each 256-token
chunk into one (the copy LMCache's GPU connector makes from the engine's KV),
and `batched_submit_put_task`s them: the receiver allocates their twins in
its buffer over the side channel, NIXL writes them, the future resolves. The
receiver then copies each chunk out of its buffer into the request's receive
slot (LMCache's retrieve copy) and frees it.

**`lm`: the `lm://` server path.**
The receiver starts LMCache's own server (`python -m lmcache.v1.server HOST
PORT cpu`, the process behind `remote_url: lm://HOST:PORT`) and prints its
address. Both sides talk to it through LMCache's client, `LMCServerConnector`,
with memory objects from LMCache's `LocalCPUBackend`, as an LMCache engine
configured with that `remote_url` does:

- sender, per request: stamps the stand-in KV in its private buffer (made at
  start, before the clock: the same bytes as the tract transports), waits out
  its modelled compute, then per
  LMCache chunk (256 tokens = 16 TraCT blocks, plus the tail in the last one)
  allocates a memory object, copies the chunk into it (the copy LMCache makes
  from the engine's KV when it stores) and `put`s it; an `exists` of the last
  chunk on the same connection returns once the server has stored them all;
  then it prints the request's timings, which the driver relays;
- receiver: `get`s every chunk (the server streams it into a fresh memory
  object) and copies it into the request's receive slot (LMCache's retrieve
  copy into the engine's KV), then verifies and prints the record
  (adapter_common.py).

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

sys.path.append(os.path.dirname(os.path.abspath(__file__)))   # after the stdlib: see peers/__init__.py
from adapter_common import (GEOMETRY, fill_and_compute, main, np, out, receiver_buffer, record,  # noqa: E402
                         relayed, sender_buffer)  # (importing it takes stdout: first)
import torch  # noqa: E402
from lmcache.utils import CacheEngineKey  # noqa: E402
from lmcache.v1.config import LMCacheEngineConfig  # noqa: E402
from lmcache.v1.memory_management import MemoryFormat  # noqa: E402
from lmcache.v1.metadata import LMCacheMetadata  # noqa: E402
from lmcache.v1.storage_backend.connector.lm_connector import LMCServerConnector  # noqa: E402
from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend  # noqa: E402

PATH = os.environ.get("TRACT_LMCACHE_PATH", "lm")

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


def lm_receiver(capacity: int, slots: int) -> None:
    server, port = start_server()
    try:
        buf = receiver_buffer(capacity, slots)
        client = None
        out({"host": "127.0.0.1", "port": port})
        for exp, t in relayed(sys.stdin):
            client = client or client_for(exp, "127.0.0.1", port)
            c = time.perf_counter()
            base = exp["slot"] * capacity
            parts = spans(exp)
            for key, (s, e) in zip(chunk_keys(exp["rid"], len(parts)), parts):
                client.get_into(key, buf[base + s:base + e])
            t["kv_read"] = time.perf_counter() - c
            out(record(buf, capacity, exp, t))
    finally:
        server.kill()
        server.wait()


def lm_sender(capacity: int) -> None:
    hello = json.loads(sys.stdin.readline())
    buf = sender_buffer(capacity)          # the stand-in KV, before the clock
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


# ---------------------------------------------------------------- the PD path

def pd_backend(role: str, buffer_bytes: int, ports: tuple[int, int] | None = None):
    """A PDBackend with a CPU buffer of BUFFER_BYTES whose chunk is 256 tokens."""
    from lmcache.v1.storage_backend.pd_backend import PDBackend
    bpt = GEOMETRY["block_bytes"] // GEOMETRY["block_tokens"]
    meta = LMCacheMetadata(model_name=MODEL, world_size=1, local_world_size=1, worker_id=0,
                           local_worker_id=0, kv_dtype=torch.uint8,
                           kv_shape=(1, 2, CHUNK_TOKENS, 1, bpt // 2))
    chunk = CHUNK_TOKENS * bpt
    kw = dict(chunk_size=CHUNK_TOKENS, local_cpu=False, pd_role=role, pd_backend_mode="sync",
              pd_buffer_size=(buffer_bytes // chunk + 2) * chunk, pd_buffer_device="cpu",
              transfer_channel="nixl", nixl_backends=["UCX"])
    if role == "receiver":
        kw.update(pd_peer_host="127.0.0.1", pd_peer_init_port=[ports[0]],
                  pd_peer_alloc_port=[ports[1]])
    else:
        kw.update(pd_skip_proxy_notification=True)
    return PDBackend(LMCacheEngineConfig.from_defaults(**kw), meta)


def pd_shapes(req: dict) -> list:
    """The KV_2LTD shape of each chunk: [K|V, layer, tokens, bytes per token / 2]."""
    bpt = req["block_bytes"] // req["block_tokens"]
    return [torch.Size([2, 1, (e - s) // bpt, bpt // 2]) for s, e in spans(req)]


def pd_receiver(capacity: int, slots: int) -> None:
    ports = (free_port(), free_port())
    backend = pd_backend("receiver", capacity * slots, ports)
    buf = receiver_buffer(capacity, slots)
    out({"host": "127.0.0.1", "init_port": ports[0], "alloc_port": ports[1]})
    for exp, t in relayed(sys.stdin):
        c = time.perf_counter()
        base = exp["slot"] * capacity
        parts = spans(exp)
        for key, (s, e) in zip(chunk_keys(exp["rid"], len(parts)), parts):
            obj = backend.get_blocking(key)        # written by NIXL before "done"
            buf[base + s:base + e] = obj.tensor.view(-1).numpy()[:e - s]
            backend.remove(key)
            obj.ref_count_down()
        t["kv_read"] = time.perf_counter() - c
        out(record(buf, capacity, exp, t))
    exit_without_close()


def pd_sender(capacity: int) -> None:
    import types
    hello = json.loads(sys.stdin.readline())
    backend = pd_backend("sender", capacity)
    spec = types.SimpleNamespace(receiver_host=hello["host"],
                                 receiver_init_port=[hello["init_port"]],
                                 receiver_alloc_port=[hello["alloc_port"]],
                                 is_last_prefill=False, req_id="")
    buf = sender_buffer(capacity)          # the stand-in KV, before the clock
    out({"ready": True})
    for line in sys.stdin:
        req = json.loads(line)
        t, _ = fill_and_compute(buf, req)
        c = time.perf_counter()
        parts = spans(req)
        objs = []
        for shape, (s, e) in zip(pd_shapes(req), parts):
            obj = backend.allocate(shape, torch.uint8)
            if obj is None:
                raise SystemExit("lmcache: the PD buffer has no room for a chunk")
            obj.tensor.view(-1).numpy()[:] = buf[s:e]
            objs.append(obj)
        spec.req_id = req["rid"]
        futures = backend.batched_submit_put_task(chunk_keys(req["rid"], len(parts)), objs, spec)
        futures[0].result(timeout=600)
        for obj in objs:
            obj.ref_count_down()
        t["kv_write"] = time.perf_counter() - c
        out({"done": req["rid"], "t": t})
    exit_without_close()


def exit_without_close() -> None:
    """Ends a PD peer without `PDBackend.close()`: LMCache's NixlChannel.close
    joins its initialization thread, which sits in a receive on a REP socket
    that has no timeout and that nothing sends to after the handshake, then
    terminates a zmq context whose sockets linger: it does not return, and the
    driver killed each side after its 30 s grace (a minute of every run).
    What the backend holds (its CPU buffer, NIXL's registration, the sockets)
    is this process's and goes with it; everything it reported is flushed first."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    if PATH == "pd":
        main(pd_receiver, pd_sender)
    else:
        main(lm_receiver, lm_sender)
