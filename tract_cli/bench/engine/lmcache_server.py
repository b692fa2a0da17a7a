"""LMCache's multiprocess cache server (`lmcache server`), the shared KV cache the
`lmcache` configuration's vLLM instances store into and load from.

On vLLM's CPU build LMCache runs only in its multiprocess mode (docs/VLLM.md,
"Benchmark"): a server process holds the cache in its own memory (an L1 pool
in shared memory, LRU), and each vLLM reaches it through LMCache's own
`LMCacheMPConnector` over ZMQ.  Flags, each needed here:

- `--eviction-policy LRU` with `--l1-size-gb`: the server refuses an L1 size
  alone;
- `--supported-transfer-mode auto`: on a CPU the connector moves KV
  "engine-driven" (vLLM's worker copies), which the server refuses by default;
- `--disable-observability`: its exporter needs an OpenTelemetry older than
  vLLM's, not installed beside it;
- `--shm-name`: the L1 pool in a named shared-memory segment, which the server
  removes when it stops.

Started as a child in its own process group, waited for (bounded) until its
HTTP `/healthcheck` answers, and stopped with its group: nothing of it
outlives the bench.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

from tract_cli.core.errors import TractError
from tract_cli.core.spawn import own_process_group
from tract_cli.serve.client import get_json, wait_until_up

READY_TIMEOUT_S = 300


class LmcacheServer:
    def __init__(self, python: str, port: int, http_port: int, chunk_tokens: int, l1_gib: int,
                 shm_name: str, log_path: str):
        self.port, self.log_path, self.shm_name = port, log_path, shm_name
        self.chunk_tokens = chunk_tokens
        self.url = f"http://127.0.0.1:{http_port}"
        exe = os.path.join(os.path.dirname(python), "lmcache")
        cmd = [exe, "server", "--host", "127.0.0.1", "--port", str(port),
               "--http-port", str(http_port), "--chunk-size", str(chunk_tokens),
               "--l1-size-gb", str(l1_gib), "--eviction-policy", "LRU",
               "--supported-transfer-mode", "auto", "--disable-observability",
               "--shm-name", shm_name]
        env = os.environ | {"LMCACHE_TRACK_USAGE": "false", "PYTHONHASHSEED": "0"}
        self._log = open(log_path, "ab")
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log,
                                         stderr=subprocess.STDOUT, env=env,
                                         **own_process_group())
        except OSError as exc:
            self._log.close()
            raise TractError(f"cannot start LMCache's server {exe}: {exc.strerror}",
                             "reinstall with `tract bench --engine vllm --vllm-config lmcache "
                             "--install-peers`") from None

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> "LmcacheServer":
        wait_until_up(self.proc, self.url + "/healthcheck", timeout, "LMCache's server",
                      self.log_path, stop=self.stop)
        return self

    def _l1(self) -> dict:
        """The server's L1 cache state (its `/status`: objects stored, staged, locked)."""
        got = get_json(self.url + "/status", timeout=30)
        l1 = (got.get("storage_manager") or {}).get("l1_manager") if isinstance(got, dict) else None
        if not isinstance(l1, dict) or not isinstance(l1.get("total_object_count"), int):
            raise TractError("LMCache's server /status has no L1 object count",
                             f"this LMCache is not the one the bench pins; its log: "
                             f"{self.log_path}")
        return l1

    def stored_chunks(self) -> int:
        """The chunks (objects) the cache holds now."""
        return self._l1()["total_object_count"]

    def wait_stored(self, chunks: int, timeout: float = 60) -> float:
        """Waits (bounded) until the cache holds CHUNKS objects with no store in
        flight; returns the seconds waited."""
        t0 = time.monotonic()
        while True:
            l1 = self._l1()
            if (l1["total_object_count"] >= chunks and not l1.get("staging_object_count")
                    and not l1.get("write_locked_count")):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout:
                raise TractError(f"LMCache's server held {l1['total_object_count']} chunks, "
                                 f"not {chunks}, {timeout:.0f} s after the miss",
                                 f"see its log {self.log_path}")
            time.sleep(0.002)   # polling another process's store, bounded

    def stop(self, timeout: float = 60) -> None:
        """SIGTERM to its group (the server removes its segment), then SIGKILL."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)       # anything of it still alive
        except (ProcessLookupError, PermissionError):
            pass
        # its pool's segment (LMCache names it lmcache_l1_pool_<name>), left behind
        # only if the server was killed; the name is this run's own (a uuid)
        try:
            os.unlink(f"/dev/shm/lmcache_l1_pool_{self.shm_name}")
        except OSError:
            pass
        if not self._log.closed:
            self._log.close()
