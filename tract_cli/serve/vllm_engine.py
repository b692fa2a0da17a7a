"""vLLM as the serving engine of `tract serve-*` (and of tests and benchmarks).

`VllmServer` runs vLLM's OpenAI server as a child process with TraCT's KV
connector configured (`kv_transfer_config`), waits (bounded) until its
`/health` answers, and stops its whole process group (vLLM spawns an engine
core and workers) on `stop()`: nothing of it outlives the command.  Its ZMQ
IPC sockets (a handful a start, which vLLM leaves in /tmp when a process of
it is killed, and its own shutdown kills one) go to a directory of its own
(VLLM_RPC_BASE_PATH, unless the user set one), removed with it.  (Not all of
its TMPDIR: torch's compile cache lives there, and a fresh one costs each
start a compile of vLLM's sampler on its first request, ~20 s here.  So
torch.distributed's rendezvous file, `vllm_dist_*` of 2 KiB a start, which
vLLM names in the system's temporary directory with no setting, stays
behind where vLLM does not remove it.)

vLLM runs in its own environment when it is not importable here:
`TRACT_VLLM_PYTHON` names that environment's python, which must have TraCT
installed too (`pip install tract-cxl` beside vLLM), since vLLM imports the
connector.  The `vllm` console script of the CPU build fails to find its own
version, so the server is started as `python -m vllm.entrypoints.openai.api_server`.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from tract_cli.core.errors import TractError, UsageError
from tract_cli.core.spawn import own_process_group
from tract_cli.serve.client import wait_until_up

CONNECTOR = {"kv_connector": "TractConnector",
             "kv_connector_module_path": "tract_cli.connectors.vllm"}
READY_TIMEOUT_S = 300
# the least KV cache VllmServer asks vLLM for (a typo's 1e-12 GiB would be 0
# bytes, which vLLM's CPU worker takes as a cache of none and fails at start)
MIN_KV_CACHE_BYTES = 1 << 20
# how long a vLLM that never became ready gets to exit on SIGTERM before it is
# killed: it served nothing, and one whose engine core failed to start has its
# server hang on SIGTERM (vLLM 0.32), which a full stop's 60 s only waited out
UNREADY_STOP_S = 5
# what vLLM logs when its engine core will not start; its server may then hang
# on its way out instead of exiting (a peer connector's shutdown that raises:
# Mooncake's on the CPU build), so it is not waited for until the timeout
_START_FAILED = (b"EngineCore failed to start", b"Engine core initialization failed")
# a Python exception's last line, alone or after vLLM's log prefix ("... [file.py:N] ")
_EXCEPTION_LINE = re.compile(r"(?:^|\] )((?:[A-Za-z_][\w.]*\.)?[A-Z]\w*(?:Error|Exception): .*)$")


def vllm_python() -> str:
    """The python that runs vLLM: TRACT_VLLM_PYTHON, else this one; an absolute
    path (symbolic links kept: a virtual environment's python is one)."""
    given = os.environ.get("TRACT_VLLM_PYTHON") or sys.executable
    if os.sep not in given:                 # a command name, found on PATH
        return shutil.which(given) or given
    return os.path.abspath(given)


def kv_transfer_config(pool: str, node: int, role: str = "kv_both", **extra) -> dict:
    """vLLM's --kv-transfer-config for TraCT; a failed load recomputes, never fails a request."""
    return CONNECTOR | {"kv_role": role, "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"pool": pool, "node": node} | extra}


def kv_cache_space(args, gib: float) -> str | None:
    """VLLM_CPU_KVCACHE_SPACE for a KV cache of GIB: its whole GiB; "" (not
    set) where ARGS size the cache (vLLM's CPU platform reads the variable
    after the flag and puts it over it); None (not set) where GIB is no whole
    number, which the variable (whole GiB) cannot say: the caller passes the
    flag instead."""
    # vLLM's parser takes --kv_cache_memory_bytes for --kv-cache-memory-bytes too
    if any(str(a).split("=", 1)[0].replace("_", "-") == "--kv-cache-memory-bytes"
           for a in args):
        return ""
    if not (math.isfinite(gib) and gib * (1 << 30) >= MIN_KV_CACHE_BYTES):
        raise UsageError(f"a KV cache of {gib:g} GiB", "give each vLLM instance a KV cache "
                         f"of at least {MIN_KV_CACHE_BYTES >> 20} MiB")
    return str(int(gib)) if float(gib).is_integer() else None


class VllmServer:
    """vLLM's OpenAI server on HOST:PORT, with TraCT as its KV connector when POOL is given."""

    def __init__(self, model_dir: str, port: int, *, pool: str | None = None,
                 node: int | None = None, role: str = "kv_both", extra: dict | None = None,
                 host: str = "127.0.0.1", args: tuple[str, ...] = (), kv_cache_gib: float = 1,
                 log_path: str | None = None, env: dict | None = None,
                 python: str | None = None):
        """PYTHON: the interpreter that runs vLLM (default `vllm_python()`; the
        benchmarks pass a vLLM with a peer's connector installed).
        KV_CACHE_GIB: the CPU KV cache (a whole number of GiB: vLLM's
        VLLM_CPU_KVCACHE_SPACE, which only the CPU platform reads; a fraction:
        vLLM's --kv-cache-memory-bytes, which any platform reads).  A
        --kv-cache-memory-bytes in ARGS wins: VLLM_CPU_KVCACHE_SPACE, which
        vLLM's CPU platform would put over it, is then not set."""
        self.url = f"http://{host}:{port}"
        self.ready = False          # wait_ready saw it answer
        self.log_path = log_path
        cmd = [python or vllm_python(), "-m", "vllm.entrypoints.openai.api_server",
               "--model", model_dir, "--host", host, "--port", str(port), "--enforce-eager", *args]
        kv_space = kv_cache_space(args, kv_cache_gib)
        if kv_space is None:
            cmd += ["--kv-cache-memory-bytes", str(round(kv_cache_gib * (1 << 30)))]
        if pool is not None:
            cfg = kv_transfer_config(pool, node if node is not None else 0, role, **(extra or {}))
            cmd += ["--kv-transfer-config", json.dumps(cfg)]
        # PYTHONSAFEPATH: `python -m` would put the working directory first on
        # sys.path, and started from a clone's root the uninstalled source
        # (tract_cli/ without its compiled core) would shadow the installed package.
        # PYTHONFAULTHANDLER: a process of it killed by a signal (a native crash in
        # a kernel or a peer's library) writes what it ran and why into the log
        # ("Fatal Python error: ..."), which vLLM's own error does not say
        # THP_MEM_ALLOC_ENABLE: torch maps its large CPU tensors (vLLM's KV cache
        # among them) in 2 MiB pages, so a KV copy meets a page walk per 2 MiB,
        # not per 4 KiB (docs/VLLM.md "The data path"); the caller's own
        # setting wins
        # VLLM_CPU_KVCACHE_SPACE: the size, or not set at all where the flag
        # gives it (vLLM 0.32's envs.py reads an empty one with int() and fails
        # at start)
        child_env = {"THP_MEM_ALLOC_ENABLE": "1"} | os.environ | {
            "HF_HUB_OFFLINE": "1", "PYTHONSAFEPATH": "1", "PYTHONFAULTHANDLER": "1",
            "VLLM_CPU_KVCACHE_SPACE": kv_space}
        if not kv_space:
            del child_env["VLLM_CPU_KVCACHE_SPACE"]
        child_env |= env or {}
        self.rpc_dir = _rpc_dir() if "VLLM_RPC_BASE_PATH" not in child_env else None
        if self.rpc_dir:
            child_env["VLLM_RPC_BASE_PATH"] = self.rpc_dir
        try:
            self._log = open(log_path, "ab") if log_path else subprocess.DEVNULL
        except BaseException:
            self._remove_rpc_dir()
            raise
        # wait_ready reads only what this start writes (a log may be appended to)
        self._log_from = self._log_seen = self._log.tell() if log_path else 0
        try:
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=self._log,
                                         stderr=subprocess.STDOUT, env=child_env,
                                         **own_process_group())
        except BaseException as exc:
            self._remove_rpc_dir()
            if self._log is not subprocess.DEVNULL:
                self._log.close()
            if isinstance(exc, OSError):
                raise TractError(f"cannot start vLLM with {cmd[0]}: {exc.strerror}",
                                 "set TRACT_VLLM_PYTHON to the python of vLLM's "
                                 "environment") from None
            raise

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> "VllmServer":
        """Waits until /health answers 200; a vLLM that exits is an error naming why."""
        wait_until_up(self.proc, self.url + "/health", timeout, "vLLM", self.log_path,
                      self.failure, self.stop, self._start_failed)
        self.ready = True
        return self

    def _start_failed(self) -> str | None:
        """What vLLM's log says if its engine core gave up starting (None: not
        that), read from where the last look stopped."""
        if not self.log_path:
            return None
        # from a little before the last look's end: a marker it saw half of is whole now
        start = max(self._log_from, self._log_seen - max(len(m) for m in _START_FAILED))
        try:
            with open(self.log_path, "rb") as f:
                f.seek(start)
                new = f.read()
        except OSError:
            return None
        self._log_seen = start + len(new)
        if any(m in new for m in _START_FAILED):
            return "did not start: its engine core failed to start"
        return None

    def failure(self) -> str:
        """The line of vLLM's log that says why it stopped (TraCT's own, if any)."""
        if not self.log_path:
            return "no log kept"
        try:
            with open(self.log_path, "rb") as f:
                f.seek(self._log_from)         # this start's lines (a log may be appended to)
                lines = f.read().decode(errors="replace").splitlines()
        except OSError:
            return "its log is unreadable"
        for marker in ("ConnectorError: ", "TraCT connector:"):
            for line in reversed(lines):
                if marker in line:      # the connector's own sentence, without vLLM's wrapping
                    text = line[line.index(marker):].removeprefix("ConnectorError: ")
                    return text.split("', please check")[0].strip()
        # the root cause: the first exception a process of vLLM's logged (the engine
        # core and the server only wrap it: "Engine core initialization failed")
        for line in lines:
            found = _EXCEPTION_LINE.search(line)
            if found:
                return found.group(1).strip()
        errors = [ln for ln in lines if "Error" in ln]
        return (errors[-1] if errors else (lines[-1] if lines else "no output")).strip()

    def stop(self, timeout: float | None = None) -> int | None:
        """SIGTERM to vLLM's process group, then SIGKILL if it lingers past
        TIMEOUT (default: 60 s for a vLLM that was ready, UNREADY_STOP_S for one
        that never was)."""
        if timeout is None:
            timeout = 60 if self.ready else UNREADY_STOP_S
        try:
            return self._stop(timeout)
        finally:
            if self._log is not subprocess.DEVNULL:
                self._log.close()
                self._log = subprocess.DEVNULL
            self._remove_rpc_dir()       # no process of it is left to use it

    def _stop(self, timeout: float) -> int | None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                kill_vllm(self.proc.pid)
                self.proc.wait(timeout=30)
            except ProcessLookupError:
                pass
        # its engine core, workers and resource tracker share the group: let them
        # finish (the tracker removes vLLM's shared-memory files), then kill
        # stragglers but the tracker, give it its turn, and only then the group
        for spare_tracker in (True, False):
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and _group_alive(self.proc.pid):
                time.sleep(0.05)       # waiting for other processes to exit, bounded
            if spare_tracker:
                kill_vllm(self.proc.pid)
            else:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        return self.proc.returncode

    def _remove_rpc_dir(self) -> None:
        if self.rpc_dir:
            shutil.rmtree(self.rpc_dir, ignore_errors=True)


def _rpc_dir() -> str | None:
    """A new directory for a vLLM's IPC sockets; None where a socket's path in
    it (a 36-character uuid) would pass the 107 bytes a Unix socket's path may
    have (a long TMPDIR): vLLM then keeps its default."""
    path = tempfile.mkdtemp(prefix="tract-rpc-")
    if len(os.fsencode(path)) + 1 + 36 > 107:
        os.rmdir(path)
        return None
    return path


def kill_vllm(pgid: int) -> None:
    """SIGKILLs every process of vLLM's process group PGID but Python's resource
    tracker: once the others are gone, the tracker unlinks the shared memory they
    registered (vLLM's shm_broadcast rings, psm_* of 160 and 240 MiB, and a
    sem.mp-* lock) and exits. killpg would kill it too, and leave 400 MiB in
    /dev/shm that nobody removes."""
    import psutil
    for _ in range(3):      # again: a process forked while the scan ran
        killed = 0
        for proc in group_processes(pgid):
            try:
                if "multiprocessing.resource_tracker" not in " ".join(proc.cmdline()):
                    proc.kill()
                    killed += 1
            except psutil.Error:
                continue           # gone meanwhile, or not ours to kill
        if not killed:
            return


def group_processes(pgid: int) -> list:
    """The live processes (psutil) of process group PGID."""
    import psutil
    out = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid:
                out.append(proc)
        except OSError:
            continue               # gone meanwhile
    return out


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def check_model_dir(model_dir: str | None) -> str:
    """A vLLM engine needs a local checkpoint directory with a config.json."""
    if not model_dir:
        raise UsageError("--engine vllm needs --model DIR (a local Hugging Face checkpoint)",
                         "pass the checkpoint directory vLLM should serve")
    if not os.path.isfile(os.path.join(model_dir, "config.json")):
        raise UsageError(f"--model {model_dir} is not a checkpoint directory (no config.json)",
                         "pass a local Hugging Face checkpoint directory")
    return model_dir


def model_config(model_dir: str) -> dict:
    """The checkpoint's config.json (after `check_model_dir`): its vocabulary and
    positions, validated (a bench sizes prompts by them)."""
    path = os.path.join(model_dir, "config.json")
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{path} cannot be read as JSON ({exc})",
                         "pass a Hugging Face checkpoint directory") from None
    if not isinstance(cfg, dict):
        raise UsageError(f"{path} is not a JSON object", "pass a Hugging Face checkpoint directory")
    for key, default in (("vocab_size", 1000), ("max_position_embeddings", 1 << 30)):
        value = cfg.get(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < 4:
            raise UsageError(f"{path}: {key} is {value!r}, not a positive integer",
                             "pass a Hugging Face checkpoint directory")
        cfg[key] = value
    return cfg
