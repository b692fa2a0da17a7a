"""The real peers the paper compares against, each in its own environment (adapter_*.py here).

A peer's dependencies must not change TraCT's, so each peer gets a virtual
environment of its own (`$TRACT_PEERS_DIR/<env>`, default
`~/.cache/tract/peers`), created by `tract bench --install-peers`, and its
adapter (a standalone script: the peer library and numpy, nothing of TraCT)
runs in it as a subprocess driven over JSON lines.  A peer that is not
installed is reported as skipped with the command that installs it.

Peers:
- `nixl`: NIXL with its UCX backend and UCX's same-host default transports;
- `nixl-tcp`: the same with `UCX_TLS=tcp`, the network path;
- `mooncake-tcp`: the Mooncake Transfer Engine (non-CUDA build), protocol
  `tcp`, metadata by `P2PHANDSHAKE` (needs libibverbs1 and librdmacm1);
- `lmcache-lm`: LMCache's `lm://` server path (its server process, its
  client connector and CPU memory objects);
- `lmcache-pd`: LMCache's PD disaggregation backend over NIXL/UCX with CPU
  buffers (a PD sender and a PD receiver).
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading

from tract_cli.core.errors import TractError

# transport -> (environment, adapter module file, extra environment variables,
#               whether the driver relays the sender's completions to the receiver)
PEERS = {
    "nixl": ("nixl", "adapter_nixl.py", {}, False),
    "nixl-tcp": ("nixl", "adapter_nixl.py", {"UCX_TLS": "tcp"}, False),
    "mooncake-tcp": ("mooncake", "adapter_mooncake.py", {}, True),
    # LMCache hashes with PYTHONHASHSEED-dependent builtins in places: fix it
    "lmcache-lm": ("lmcache", "adapter_lmcache.py",
                   {"PYTHONHASHSEED": "0", "LMCACHE_LOG_LEVEL": "ERROR"}, True),
    "lmcache-pd": ("lmcache", "adapter_lmcache.py",
                   {"PYTHONHASHSEED": "0", "LMCACHE_LOG_LEVEL": "ERROR",
                    "TRACT_LMCACHE_PATH": "pd", "NIXL_LOG_LEVEL": "WARN"}, True),
}
# environment -> pip install steps (torch first: the CPU build, never a CUDA one)
ENVS = {
    "nixl": [["torch==2.13.0"], ["nixl-cu12==1.5.1"], ["--no-deps", "nixl==1.5.1"]],
    "mooncake": [["numpy"], ["mooncake-transfer-engine-non-cuda==0.3.13.post1"]],
    # its own pins (numpy<=2.2.6, transformers, cupy...) stay in its environment
    # nixl-cu13: LMCache's cupy/cuda-python make NIXL look for its CUDA 13 build
    "lmcache": [["torch==2.13.0"], ["lmcache==0.5.6"], ["nixl-cu13==1.5.1"],
                ["--no-deps", "nixl==1.5.1"]],
}
CHECKS = {"nixl": "from nixl._api import nixl_agent",
          "mooncake": "from mooncake.engine import TransferEngine",
          "lmcache": "from lmcache.v1.storage_backend.connector.lm_connector import "
                     "LMCServerConnector; import lmcache.v1.storage_backend.pd_backend; "
                     "from nixl._api import nixl_agent"}
SYSTEM_HINTS = {"libibverbs": "apt-get install libibverbs1 librdmacm1 (Mooncake links them)"}
# peers whose store keeps every request's KV until the run ends (no eviction)
KEEPS_EVERYTHING = {"lmcache-lm"}
RECV_SLOTS = 4
PEER_TIMEOUT_S = 600


def peers_dir() -> pathlib.Path:
    return pathlib.Path(os.environ.get("TRACT_PEERS_DIR") or
                        pathlib.Path.home() / ".cache" / "tract" / "peers")


def python_of(env: str) -> pathlib.Path:
    return peers_dir() / env / "bin" / "python"


_checked: dict[str, str | None] = {}


def unavailable(transport: str) -> str | None:
    """None if TRANSPORT's peer can run here, else why and how to fix it."""
    env = PEERS[transport][0]
    if env not in _checked:
        py = python_of(env)
        if not py.exists():
            _checked[env] = f"{env} is not installed in {py.parent.parent}; run " \
                            f"`tract bench --transport {transport} --install-peers`"
        else:
            r = subprocess.run([str(py), "-c", CHECKS[env]], capture_output=True, text=True,
                               timeout=120)
            last = (r.stderr.strip().splitlines() or ["?"])[-1]
            hint = next((h for lib, h in SYSTEM_HINTS.items() if lib in last),
                        f"reinstall with `tract bench --transport {transport} --install-peers`")
            _checked[env] = None if r.returncode == 0 else \
                f"{env} does not import in {py.parent.parent} ({last}); {hint}"
    return _checked[env]


def install(transport: str, log=sys.stderr) -> None:
    """Creates TRANSPORT's environment (a virtual environment with its peer)."""
    env = PEERS[transport][0]
    root = peers_dir() / env
    if unavailable(transport) is None:
        return
    _checked.pop(env, None)
    print(f"installing {env} into {root} ...", file=log, flush=True)
    try:
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(root)], check=True,
                       capture_output=True, timeout=600)
        for step in ENVS[env]:
            subprocess.run([str(root / "bin" / "python"), "-m", "pip", "install", "-q", *step],
                           check=True, capture_output=True, text=True, timeout=1800)
    except subprocess.CalledProcessError as exc:
        tail = ((exc.stderr or "") if isinstance(exc.stderr, str) else "").strip().splitlines()
        raise TractError(f"installing {env} failed: {tail[-1] if tail else exc}",
                         "check network access to the package index") from None
    except subprocess.TimeoutExpired:
        raise TractError(f"installing {env} took too long", "retry, or install it by hand") from None
    why = unavailable(transport)
    if why:
        raise TractError(f"{env} was installed but does not work: {why}", "see the message")


def run(transport: str, requests, geometry, compute, progress=None):
    """Runs the requests through TRANSPORT's peer: one sender (prefill) and one
    receiver (decode) process; returns a driver.TransportResult."""
    from tract_cli.bench.workload.driver import drive
    from tract_cli.core.hashing import block_hashes
    env_name, script, extra_env, relay = PEERS[transport]
    py = str(python_of(env_name))
    # -I: the adapter's directory (this package) must not shadow the peer's
    # imports (numpy imports `inspect`, and bench/ has an inspect.py)
    adapter = str(pathlib.Path(__file__).with_name(script))
    bb, bt, bpt = geometry.block_bytes, geometry.block_tokens, geometry.bytes_per_token
    longest = max(len(r.tokens) for r in requests)
    capacity = (longest // bt) * bb + bt * bpt
    if transport in KEEPS_EVERYTHING:
        _check_it_fits(transport, sum(len(r.tokens) for r in requests) * bpt)
    env = {**os.environ, **extra_env}
    procs = []
    metrics = None
    # the peers' own logging (NIXL, UCX, Mooncake's glog, LMCache) goes to a
    # file, not over the report: its path is in the report and in any error
    logged = log_path(transport)
    log = open(logged, "w")
    try:
        if env_name == "lmcache":
            # LMCache keeps its metrics' files in PROMETHEUS_MULTIPROC_DIR, else
            # creates /tmp/lmcache_prometheus and leaves it: one of this run's,
            # removed with it
            metrics = env["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(
                prefix="tract-bench-lmcache-metrics-")
        geo = ["--block-bytes", str(bb), "--block-tokens", str(bt)]
        recv = subprocess.Popen([py, "-I", adapter, "receiver", "--capacity", str(capacity),
                                 "--slots", str(RECV_SLOTS), *geo], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=log, text=True, env=env)
        procs.append(recv)
        hello = _read_line(recv, "receiver", logged)
        send = subprocess.Popen([py, "-I", adapter, "sender", "--capacity", str(capacity), *geo],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                                text=True, env=env)
        procs.append(send)
        send.stdin.write(json.dumps(hello) + "\n")
        send.stdin.flush()
        _read_line(send, "sender", logged)
        write_lock = threading.Lock()

        def to_receiver(obj):
            with write_lock:
                recv.stdin.write(json.dumps(obj) + "\n")
                recv.stdin.flush()

        if relay:                       # the sender's completions go to the receiver
            def relay_loop():
                for line in send.stdout:
                    try:
                        to_receiver(json.loads(line))
                    except (OSError, ValueError):
                        return
            threading.Thread(target=relay_loop, daemon=True).start()
        # a request waits for one of the receiver's slots to be free
        free = threading.Semaphore(RECV_SLOTS)
        slots_free = list(range(RECV_SLOTS))
        lock = threading.Lock()
        stop = threading.Event()

        def dispatch(seq, req, arrival):
            if not free.acquire(timeout=PEER_TIMEOUT_S) or stop.is_set():
                return False
            with lock:
                slot = slots_free.pop()
            keys = block_hashes(req.tokens, block_tokens=bt)
            n = len(keys)
            common = {"rid": req.rid, "keys": keys.tobytes().hex(), "blocks": n, "block_bytes": bb,
                      "tail_bytes": (len(req.tokens) - n * bt) * bpt, "slot": slot,
                      "block_tokens": bt,
                      "arrival": arrival, "tokens": len(req.tokens),
                      "output_len": req.output_len,
                      "compute_s": len(req.tokens) / compute.prefill_tokens_per_s}
            to_receiver({**common, "decode_s": compute.decode_s_per_token})
            send.stdin.write(json.dumps(common) + "\n")
            send.stdin.flush()

        def receive():
            line = recv.stdout.readline()         # bounded: the driver kills a silent peer
            if not line:
                raise TractError("the receiver peer process exited early" + _log_tail(logged),
                                 f"its log: {logged}; reinstall the peer with --install-peers")
            try:
                rec = json.loads(line)
            except ValueError:
                raise TractError("the receiver peer printed something that is not JSON",
                                 f"its log: {logged}") from None
            with lock:
                slots_free.append(rec.pop("slot"))
            free.release()
            return rec

        res = drive(transport, requests, dispatch, receive, progress, stop=stop,
                    join_timeout=PEER_TIMEOUT_S, why=lambda: _log_tail(logged),
                    hint=f"see the peers' log {logged}")
        res.log_path = logged
    finally:
        for p in procs:
            try:
                p.stdin.close()
            except OSError:
                pass
        for p in procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)
        log.close()
        if metrics is not None:
            shutil.rmtree(metrics, ignore_errors=True)
    return res


def log_path(transport: str) -> str:
    """Where TRANSPORT's peer processes log in this run (the temporary directory)."""
    return os.path.join(tempfile.gettempdir(), f"tract-bench-{transport}-{os.getpid()}.log")


def _log_tail(path: str) -> str:
    """The last line of a peer's log, as ` (last log line: ...)`, or ''."""
    try:
        with open(path, errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
    except OSError:
        return ""
    return f" (last log line: {lines[-1][:200]})" if lines else ""


def _check_it_fits(transport: str, kv_bytes: int) -> None:
    """Refuses a workload whose KV the peer's store would hold in memory all at once."""
    from tract_cli.core.medium import mem_available
    from tract_cli.core.units import format_size
    avail = mem_available()
    if avail is not None and kv_bytes > avail // 2:
        raise TractError(f"{transport} keeps every request's KV in its server ({format_size(kv_bytes)} "
                         f"for this workload, {format_size(avail)} of memory available)",
                         "run fewer requests (--requests/--limit) for this transport")


def _read_line(proc, who: str, log: str) -> dict:
    """One JSON line from a peer process (bounded by the peer timeout)."""
    box = {}

    def read():
        box["line"] = proc.stdout.readline()
    th = threading.Thread(target=read, daemon=True)
    th.start()
    th.join(PEER_TIMEOUT_S)
    line = box.get("line")
    if not line:
        code = proc.poll()
        state = f"exited with code {code}" if code is not None else "is silent"
        raise TractError(f"the {who} peer process {state}{_log_tail(log)}",
                         f"its log: {log}; reinstall the peer with --install-peers")
    return json.loads(line)


__all__ = ["PEERS", "install", "run", "unavailable"]
