"""Real vLLM servers for tests: a region with a prefill and a decode instance on
it and a monolithic vLLM beside them, started with the product's launcher
(`serve.vllm_engine.VllmServer`) in vLLM's environment, and the requests and
metrics the tests read from them."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

from tests.servers import request
from tract_cli.bench.engine import answers
from tract_cli.core.nodes import read_nodes
from tract_cli.core.errors import TractError
from tract_cli.core.medium import processes_mapping
from tract_cli.core.pids import pid_alive
from tract_cli.core.pool import Pool
from tract_cli.core.region import remove_region

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PY = os.environ.get("TRACT_VLLM_PYTHON") or os.path.join(ROOT, ".peers", "vllm", "bin",
                                                              "python")
# a KV cache of 128 MiB (256K tokens of the test checkpoint), given as vLLM's own
# flag: the launcher's default GiB costs each start seconds of zeroed huge pages;
# that the flag wins over the launcher's VLLM_CPU_KVCACHE_SPACE is read in vLLM's
# log (tests/test_vllm.py)
KV_CACHE_BYTES = 128 << 20
ARGS = ("--max-model-len", "2048", "--dtype", "bfloat16",
        "--kv-cache-memory-bytes", str(KV_CACHE_BYTES))


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_background_ckpt: list[str] = []


def background_checkpoint() -> str:
    """The checkpoint the background checks of real vLLM share (tests/background.py;
    made once a session, the checks running one after the other on its one thread)."""
    import background
    if not (_background_ckpt and os.path.isdir(_background_ckpt[0])):
        ckpt = os.path.join(background.session_dir("tract-vllm-ckpt-"), "ckpt")
        made = background.run([VLLM_PY, os.path.join(ROOT, "tests", "vllm_model.py"), ckpt],
                              timeout=300)      # from the session start's environment
        assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
        _background_ckpt[:] = [ckpt]
    return _background_ckpt[0]


def marked_processes(var: str, value: str) -> set[int]:
    """The live processes whose environment has VAR=VALUE (what a test started
    carries it, whoever their parent is now)."""
    import psutil
    out = set()
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(var) == value:
                out.add(proc.pid)
        except psutil.Error:
            continue            # gone meanwhile, or not ours to read
    return out


def kill_marked(var: str, value: str) -> None:
    import psutil
    for pid in marked_processes(var, value):
        try:
            psutil.Process(pid).kill()
        except psutil.Error:
            pass


def make_checkpoint(out_dir: str) -> str:
    """The tiny random-weight checkpoint (tests/vllm_model.py, in vLLM's environment)."""
    subprocess.run([VLLM_PY, os.path.join(ROOT, "tests", "vllm_model.py"), out_dir], check=True,
                   capture_output=True, timeout=300)
    return out_dir


def _env(core: str) -> dict | None:
    """Pins a server's CPU threads to CORE where there are two cores."""
    return {"VLLM_CPU_OMP_THREADS_BIND": core} if (os.cpu_count() or 1) >= 2 else None


def start_mono(ckpt: str, log_path: str):
    """A monolithic vLLM (no connector), the reference every answer is compared with;
    started, not waited for (`start_stack` waits for it beside its own servers)."""
    from tract_cli.serve.vllm_engine import VllmServer
    os.environ["TRACT_VLLM_PYTHON"] = VLLM_PY
    return VllmServer(ckpt, port(), args=ARGS, log_path=log_path, env=_env("0"))


def start_stack(tmp, size: str, extra: dict, name: str = "vllm", *, ckpt: str,
                mono, decode_args: tuple = (), env: dict | None = None) -> dict:
    """A region (SIZE) of checkpoint CKPT, prefill (node 1) + decode (node 2) with
    connector options EXTRA, each on its own core where there are two, and MONO, a
    monolithic vLLM the caller owns (shared between stacks: `stop_stack` leaves it).
    DECODE_ARGS: more vLLM arguments of the decode instance; ENV: more of both
    instances' environment."""
    from tract_cli.serve.vllm_engine import VllmServer
    os.environ["TRACT_VLLM_PYTHON"] = VLLM_PY
    pool = f"/dev/shm/tract-test-{name}-{os.getpid()}.pool"
    subprocess.run([sys.executable, "-m", "tract_cli.cli", "init", pool, "--size", size,
                    "--model", ckpt, "--nodes", "4", "--force", "-q"], check=True, timeout=120)
    st = {"pool": pool, "ckpt": ckpt, "tmp": tmp, "mono": mono}
    # a step waits for its save's claim however busy these cores are: what is
    # checked here is every block saved and loaded, not the claim's bound
    # (claim_wait_s: tests/cpu_worker_driver.py checks that)
    extra = {"claim_wait_s": 60.0} | extra
    try:
        for role, node, core in (("prefill", 1, "0"), ("decode", 2, "1")):
            st[role] = VllmServer(ckpt, port(), pool=pool, node=node,
                                  args=ARGS + (decode_args if role == "decode" else ()),
                                  extra=extra, log_path=str(tmp / f"{role}.log"),
                                  env=(_env(core) or {}) | (env or {}))
        for role in ("prefill", "decode", "mono"):
            st[role].wait_ready()
    except BaseException:
        stop_stack(st)
        raise
    return st


def stop_stack(st: dict) -> None:
    """Stops the stack's servers (not the shared monolithic one), then the node agents
    their connectors started (bounded)."""
    for role in ("prefill", "decode"):
        if role in st:
            st[role].stop()
    pool = st["pool"]
    try:
        with Pool.attach(pool, readonly=True, prefault=False) as p:
            pids = [n.agent_pid for n in read_nodes(p) if n.agent_pid]
    except TractError:
        pids = []
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + 30
    for pid in pids:
        while time.monotonic() < deadline and pid_alive(pid):
            time.sleep(0.05)      # waiting for another process to exit, bounded
    remove_region(pool)


def server_model(server) -> str:
    status, body = request(server.url + "/v1/models")
    assert status == 200, body
    return body["data"][0]["id"]


# Answers are compared by their tokens' logprobs, not only their text: the top
# TOP_LOGPROBS of every generated token must agree with the monolithic vLLM's
# within LOGPROB_TOLERANCE nats (`answer_gap`; the measure, and what it was
# measured to tell apart, in tract_cli/bench/engine/answers.py, which the bench
# uses too).  tests/test_vllm_faults.py keeps the negative control.
TOP_LOGPROBS = answers.TOP_LOGPROBS
LOGPROB_TOLERANCE = answers.TOLERANCE
ANSWER_FIELDS = {"logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True}


def complete(server, prompt, max_tokens: int = 12, **extra) -> dict:
    status, body = request(server.url + "/v1/completions",
                           {"model": server_model(server), "prompt": prompt,
                            "max_tokens": max_tokens, "temperature": 0} | ANSWER_FIELDS | extra)
    assert status == 200, body
    return body


def _steps(body: dict) -> list[tuple[str, float, dict]]:
    lp = body["choices"][0].get("logprobs")
    assert lp and lp.get("top_logprobs"), f"an answer without logprobs: {body}"
    return list(zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]))


def answer_gap(out: dict, ref: dict) -> tuple[float, list[str]]:
    """How far OUT's answer is from REF's (`answers.gap`)."""
    steps = lambda body: [(tok, top) for tok, _, top in _steps(body)]
    return answers.gap(steps(out), steps(ref))


def answer_differences(out: dict, ref: dict) -> list[str]:
    """What in OUT's answer differs from REF's beyond LOGPROB_TOLERANCE ([]: none)."""
    return answer_gap(out, ref)[1]


def assert_answers_as_mono(st: dict, prompt, out: dict, **extra) -> None:
    """OUT, an answer to PROMPT (12 tokens), is the monolithic vLLM's within the
    tolerance (EXTRA: request fields that do not change the answer, e.g. cache_salt)."""
    diffs = answer_differences(out, complete(st["mono"], prompt, **extra))
    assert not diffs, "the answer differs from one vLLM's: " + "; ".join(diffs[:5])


def _metrics(server) -> list[str]:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        return resp.read().decode().splitlines()


def tokens_by_source(server, source: str) -> float:
    return sum(float(line.split()[-1]) for line in _metrics(server)
               if line.startswith("vllm:prompt_tokens_by_source_total") and
               f'source="{source}"' in line)


def external_hits(server) -> float:
    return sum(float(line.split()[-1]) for line in _metrics(server)
               if line.startswith("vllm:external_prefix_cache_hits_total"))


def prefill_params(st: dict, prompt, **extra) -> dict:
    """The kv_transfer_params a prefill instance answers (a TraCT handoff)."""
    body = complete(st["prefill"], prompt, 1, kv_transfer_params={"do_remote_decode": True},
                    **extra)
    params = body.get("kv_transfer_params")
    assert params and params.get("do_remote_prefill") and "tract_ticket" in params, body
    return params


def open_published(pool: Pool, ticket, timeout: float = 30):
    """POOL's record of TICKET once published (Handoffs.open), or the error that
    says it never will be: a prefill's reply may leave while its record is
    still reserved (its commit and publish run off its step), so a test that
    reads the record right after the reply waits (bounded) for the publish."""
    from tract_cli.core.errors import HandoffPending
    deadline = time.monotonic() + timeout
    while True:
        try:
            return pool.handoffs.open(ticket)
        except HandoffPending:
            assert time.monotonic() < deadline, \
                f"handoff record {ticket.record} still reserved after {timeout:.0f} s"
            time.sleep(0.002)   # waiting for another process's publish, bounded


def pool_state(pool: str) -> dict:
    """`tract inspect --json` of POOL (a live region, read-only)."""
    out = subprocess.run([sys.executable, "-m", "tract_cli.cli", "inspect", pool, "--json"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def wait_until_saved(pool: str, timeout: float = 60) -> None:
    """Waits (bounded) until POOL has no PENDING entry: a save an instance's step
    claimed is committed (off the step, so perhaps after its reply went out)."""
    deadline = time.monotonic() + timeout
    while (pending := pool_state(pool)["index"]["states"]["PENDING"]):
        assert time.monotonic() < deadline, f"{pending} blocks still PENDING after {timeout:.0f} s"
        time.sleep(0.05)  # waiting for another process's commit, bounded


def wait_until_released(pool: str, timeout: float = 60) -> dict:
    """Waits (bounded) until POOL has no pins, no PENDING entry and no handoff in flight."""
    deadline = time.monotonic() + timeout
    while True:
        data = pool_state(pool)
        index, live = data["index"], data["handoffs"]["in_flight"]
        if index["states"]["PENDING"] == 0 and index["pins_total"] == 0 and not live:
            return data
        assert time.monotonic() < deadline, \
            f"still held after {timeout:.0f} s: pins {index['pins_total']}, " \
            f"states {index['states']}, handoffs {live}"
        time.sleep(0.5)   # waiting for other processes' acknowledgements or expiry, bounded


def shm_names() -> set[str]:
    return set(os.listdir("/dev/shm"))


def vllm_shm(server) -> set[str]:
    """The psm_* files (vLLM's shm_broadcast rings) that the processes of SERVER's
    vLLM map."""
    import psutil
    from tract_cli.serve.vllm_engine import group_processes
    names = set()
    for proc in group_processes(server.proc.pid):
        try:
            names |= {os.path.basename(m.path) for m in proc.memory_maps()
                      if os.path.basename(m.path).startswith("psm_")}
        except psutil.Error:
            continue
    return names


def remove_vllm_debris(before: set[str]) -> None:
    """vLLM's own shared memory (psm_*, sem.mp-*) that a vLLM which crashed or was
    killed left since BEFORE and that no live process maps: its resource tracker
    died with it, so nobody else will remove it."""
    for name in shm_names() - before:
        path = os.path.join("/dev/shm", name)
        # this process's own maps count too: a spawn context's semaphore lives
        # here until the children it was made for open it
        if name.startswith(("psm_", "sem.mp-")) and not processes_mapping([path])[path]:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
