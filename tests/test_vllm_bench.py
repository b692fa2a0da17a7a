"""`tract bench --engine vllm` with the real peers on the same real vLLM: each
configuration starts, hands the prompt over, answers as one vLLM, and leaves
no server, region or directory behind; a peer that is not installed is
skipped with the command that installs it.  The figures are a benchmark
(docs/VLLM.md), not a test: one small run per configuration here."""
from __future__ import annotations

import contextlib
import glob
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import typer

import background
from background import Check, uses
from tests.vllm_stack import (KV_CACHE_BYTES, VLLM_PY, background_checkpoint, kill_marked,
                              marked_processes)
from tract_cli.core.pids import pid_alive
from tract_cli.core.region import remove_region

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.path.join(ROOT, ".peers")
MARK = "TRACT_TEST_VLLM_BENCH"      # in the environment of everything a bench here starts

needs_vllm = pytest.mark.skipif(not os.path.exists(VLLM_PY),
                                reason=f"no vLLM environment at {VLLM_PY} (.ci/setup builds it)")


def _bench_command(args: list[str], peers_dir: str, tmpdir: str, mark: str) -> tuple:
    """(argv, environment) of `tract bench --engine vllm ARGS`: its temporary
    files (its logs' directory) in TMPDIR, MARK in the environment of
    everything it starts, each vLLM's KV cache as the real-vLLM tests size
    theirs (tests/vllm_stack.py)."""
    # the session start's environment: a background run starts while a foreground
    # test has set (monkeypatch) variables it must not inherit (a flush mode)
    env = background.environment() | {"TRACT_VLLM_PYTHON": VLLM_PY, "TRACT_PEERS_DIR": peers_dir,
                                      "HF_HUB_OFFLINE": "1", "COLUMNS": "200", "TMPDIR": tmpdir,
                                      MARK: mark}
    kv = ("--vllm-kv-cache-gib", f"{KV_CACHE_BYTES / (1 << 30):g}")
    return [sys.executable, "-m", "tract_cli.cli", "bench", "--engine", "vllm", *kv, *args], env


def _clean_up_after(mark: str, paths) -> None:
    """What a bench (MARK) left: its processes killed, PATHS removed (a region
    with its local segments)."""
    kill_marked(MARK, mark)
    for path in paths:
        if path.endswith(".pool"):
            remove_region(path)
        elif os.path.isdir(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                os.unlink(path)


def _bench(args: list[str], peers_dir: str, tmpdir: str,
           timeout: float) -> subprocess.CompletedProcess:
    """`tract bench --engine vllm ARGS`; past TIMEOUT it is stopped as a user stops it
    (SIGTERM: it stops its servers), and whatever it left is removed after that."""
    mark = f"{os.getpid()}-{os.path.basename(tmpdir)}"
    argv, env = _bench_command(args, peers_dir, tmpdir, mark)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.communicate(timeout=120)
        finally:
            proc.kill()
            # its own files only: a background bench may run meanwhile
            _clean_up_after(mark, glob.glob(os.path.join(tmpdir, "tract-bench-vllm-*")) +
                            glob.glob(f"/dev/shm/tract-bench-vllm-{proc.pid}-*"))
        pytest.fail(f"tract bench {' '.join(args)} ran past {timeout:.0f} s")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


# The two runs of real vLLM configurations (minutes of vLLM starts each) run as
# background checks (tests/background.py), beside the rest of the suite: each
# is self-contained (its own checkpoint, temporary directory, regions and
# processes, told apart by MARK) and bounded only by vLLM's start and request
# timeouts, minutes past what a busy host takes.  What they left is read in the
# background too, right after each run, against names only a vLLM bench makes.
def _background_bench(name: str, args: list[str], timeout: float, plot: bool = False) -> dict:
    """`tract bench --engine vllm ARGS` (with --model, --json, and --plot if PLOT),
    as a background check: its CompletedProcess, its JSON (None if it wrote
    none), the files it left, its processes still running, its plot's path.
    Past TIMEOUT it is stopped as a user stops it (SIGTERM, 120 s to stop its
    servers); whatever ends it early, what it left is removed."""
    ckpt = background_checkpoint()
    work = background.session_dir(f"tract-vllm-bench-{name}-")
    mark = f"{os.getpid()}-{name}"
    out, png = os.path.join(work, "run.json"), os.path.join(work, "run.png")
    argv, env = _bench_command(["--model", ckpt, *args, "--json", out,
                                *(("--plot", png) if plot else ())], PEERS, work, mark)
    before = _debris(work)
    try:
        res = background.run(argv, timeout=timeout, term_grace=120, env=env)
    except subprocess.TimeoutExpired as exc:
        raise AssertionError(f"tract bench {' '.join(args)} ran past {timeout:.0f} s: "
                             f"{(exc.stderr or '')[-2000:]}") from None
    finally:     # what it left, however it ended, is the test's to see, not to keep
        left, debris = _our_processes(mark), _debris(work) - before
        _clean_up_after(mark, debris)
    try:
        run = json.loads(pathlib.Path(out).read_text()) if os.path.exists(out) else None
    except ValueError as exc:
        raise AssertionError(f"the bench's --json is not JSON ({exc}): "
                             f"{res.stdout[-2000:]}{res.stderr[-2000:]}") from None
    return {"res": res, "run": run, "left": left, "debris": debris, "png": png}


def _our_processes(mark: str) -> set[int]:
    """The live processes a bench started (they inherit MARK), whoever their
    parent is now."""
    return marked_processes(MARK, mark)


def _debris(tmpdir: str) -> set[str]:
    """What a vLLM bench whose temporary directory is TMPDIR could leave: its
    logs' directory there, its TraCT regions, ExampleConnector's store and
    LMCache's pool in /dev/shm (not the reference bench's regions, which the
    tests beside it make; nor the TraCT region of a vLLM bench still running,
    named by its live pid: another suite's on this host, which a clean-up of
    this one's must not pull from under it)."""
    return {p for pattern in ("tract-bench-vllm-*", "tract-bench-example-*",
                              "*tract-bench-lmcache*")
            for p in glob.glob(os.path.join("/dev/shm", pattern))
            if not _a_running_benchs_region(p)} | \
        set(glob.glob(os.path.join(tmpdir, "tract-bench-vllm-*")))


def _a_running_benchs_region(path: str) -> bool:
    """Whether PATH is a TraCT region a vLLM bench that still runs made
    (`/dev/shm/tract-bench-vllm-PID-CONFIG.pool`, PID alive)."""
    m = re.fullmatch(r"tract-bench-vllm-(\d+)-.*\.pool", os.path.basename(path))
    return m is not None and pid_alive(int(m.group(1)))


@pytest.mark.parametrize("config, tls", [("nixl", None), ("nixl-tcp", "tcp")])
def test_nixl_over_tcp_is_nixl_with_ucx_on_tcp(config, tls, monkeypatch, tmp_path):
    """What `--vllm-config nixl-tcp` starts: the NixlConnector pair of `nixl`
    (producer and consumer, their side channels), with UCX on TCP alone."""
    from tract_cli.bench.engine import configs, peer_envs
    from tract_cli.serve import vllm_engine
    started = []

    class Recorded:                 # the servers configs.start would launch, as it asks
        def __init__(self, model_dir, port, **kw):
            started.append(kw)

        def stop(self):
            pass

    monkeypatch.setattr(vllm_engine, "VllmServer", Recorded)
    monkeypatch.setattr(peer_envs, "python_of", lambda peer: tmp_path / "python")
    out = configs.start(config, "/models/x", str(tmp_path), (), 1.0, None)
    assert sorted(out) == ["decode", "prefill"] and len(started) == 2
    roles = [json.loads(kw["args"][kw["args"].index("--kv-transfer-config") + 1])["kv_role"]
             for kw in started]
    assert roles == ["kv_producer", "kv_consumer"]
    assert [kw["env"].get("UCX_TLS") for kw in started] == [tls, tls]
    assert all(kw["env"]["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1" for kw in started)
    assert all(kw["python"] == str(tmp_path / "python") for kw in started)


PEERS_RUN = Check("vllm bench: the peers beside one vLLM", _background_bench, "peers",
                  ["--input-len", "300", "--requests", "1", "--request-gap", "0",
                   *[a for c in ("nixl", "lmcache", "mono") for a in ("--vllm-config", c)]],
                  timeout=1500, cost=200)


@needs_vllm
@uses(PEERS_RUN)
def test_the_peers_run_beside_one_vllm_and_leave_nothing_behind():
    """NixlConnector and LMCache (its cache shared by two instances), one short
    prompt each, in one bench run beside one vLLM: each handed over and verified
    where it runs.  Nothing is left running.  (NixlConnector over TCP is the
    same connector with UCX_TLS=tcp in both engines' environment, checked
    without engines above; vLLM's MooncakeConnector, which vLLM 0.32's CPU
    build stops at start, is left out for CI's time: a configuration failing
    at start is the fake run's below; the peers share one run and one vLLM
    for the same reason.)  A peer not installed here is skipped by the bench
    itself (test_a_peer_not_installed_is_skipped_with_the_command_that_installs_it),
    and here."""
    got = PEERS_RUN.result()
    res, run = got["res"], got["run"]
    assert "Traceback" not in res.stdout + res.stderr
    assert got["left"] == set(), "a process the bench started outlived it"
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert run["kv_cache_gib"] == KV_CACHE_BYTES / (1 << 30)
    peers = [c for c in ("nixl", "lmcache") if c not in run["skipped"]]
    if not peers:
        pytest.skip("; ".join(run["skipped"].values()))
    rows = {s["config"]: s for s in run["summaries"]}
    expected = [c for c in peers if c != "lmcache"] + \
        (["lmcache-hit", "lmcache-miss"] if "lmcache" in peers else [])
    assert sorted(rows) == sorted(expected + ["mono"])
    for config in expected:
        assert rows[config]["verified"] is True, rows[config]    # the same answer as one vLLM
    for config in expected + ["mono"]:
        # the path as vLLM timed it: there, and inside what the client saw (vLLM's
        # front end stamps a request's arrival after the client sent it, and
        # records its times before it sends the answer; both clocks are steady here)
        assert 0 < rows[config]["engine_mean_s"] < rows[config]["ttft_mean_s"], rows[config]
    if "nixl" in rows:
        # a P/D request's parts, each inside the client's: the prefill instance's
        # whole request, the decode instance's time to first token
        r = rows["nixl"]
        assert 0 < r["engine_prefill_s"] < r["prefill_s"], r
        assert 0 < r["engine_decode_s"] < r["decode_s"], r
    for config in expected:
        if config in ("nixl", "lmcache-hit"):
            # handed over: the decode instance (for LMCache, the second instance)
            # took prompt tokens from its connector
            assert rows[config]["handed_over"] == rows[config]["requests"] == 1, rows[config]
            assert 0 < rows[config]["kv_tokens_mean"] <= 300, rows[config]
    if "lmcache" in peers:
        hit = next(r for r in run["records"] if r["config"] == "lmcache-hit")
        # LMCache stores whole chunks (vLLM's 128-token blocks): 2 of a 300-token prompt
        assert hit["hit_tokens"] == 256, hit
    for config in expected + ["mono"]:
        assert config in res.stdout
    assert "from KV path" in res.stdout          # the prompt tokens each took from its path
    if "lmcache" in peers:
        assert "256 tokens" in res.stdout
    assert got["debris"] == set(), "the bench left files behind"


@needs_vllm
def test_a_peer_not_installed_is_skipped_with_the_command_that_installs_it(tmp_path,
                                                                           vllm_checkpoint):
    res = _bench(["--model", vllm_checkpoint, "--input-len", "300", "--requests", "1",
                  "--vllm-config", "nixl"], str(tmp_path / "no-peers"), str(tmp_path),
                 timeout=300)
    assert res.returncode == 1
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    err = lines[-1]
    assert "Traceback" not in res.stderr
    assert "error: no configuration ran: nixl: vLLM with nixl is not installed" in err
    assert "tract bench --engine vllm --vllm-config nixl --install-peers" in err


def test_an_answer_unlike_one_vllms_is_not_verified():
    """The static bench's check can fail: a configuration's answer whose top
    logprobs moved past the tolerance, or that chose another token where one
    vLLM's preferred its own clearly, is reported unverified; one that parted
    from one vLLM's at a near-tie (every logprob within the tolerance: a prompt
    partly loaded rounds in another order) is verified, and counted."""
    from tract_cli.bench.engine.answers import TOLERANCE
    from tract_cli.bench.engine.calls import Answer
    from tract_cli.bench.engine.vllm_runs import summarize, verify

    def answer(tokens, logprob=-1.0):
        top = [{t: logprob, "token_id:9": -1.02} for t in tokens]
        return Answer(0.0, "".join(tokens), list(tokens), top)

    records = [{"config": c, "input_len": 10, "request": 0, "ttft_s": 0.1, "prefill_s": None,
                "decode_s": None} for c in ("mono", "nixl")]
    mono = answer(["token_id:1", "token_id:2", "token_id:3"])
    answers = {0: {"mono": mono, "nixl": answer(mono.tokens)}}
    verify(records, answers)
    assert all(r["verified"] for r in records)
    summary = {s["config"]: s for s in summarize(records)}
    assert summary["nixl"]["near_ties"] == 0 and summary["nixl"]["answer_gap"] == 0.0
    # logprobs moved past the tolerance, same tokens: not verified
    answers[0]["nixl"] = answer(mono.tokens, -1.0 - 2 * TOLERANCE)
    verify(records, answers)
    assert {s["config"]: s["verified"] for s in summarize(records)} == {"mono": True,
                                                                         "nixl": False}
    # another token where one vLLM preferred its own by far: not verified
    other = answer(["token_id:1", "token_id:7", "token_id:3"])
    other.top[1] = {"token_id:7": -0.5, "token_id:2": -3.0}
    answers[0]["nixl"] = other
    verify(records, answers)
    assert {s["config"]: s["verified"] for s in summarize(records)}["nixl"] is False
    # another token at a near-tie (token_id:9 within the tolerance of one vLLM's
    # choice): verified, and counted as a near-tie
    tie = answer(["token_id:1", "token_id:9", "token_id:5"])
    tie.top[1] = {"token_id:9": -1.0, "token_id:2": -1.02}
    mono.top[1] = {"token_id:2": -1.0, "token_id:9": -1.02}
    answers[0]["nixl"] = tie
    verify(records, answers)
    summary = {s["config"]: s for s in summarize(records)}
    assert summary["nixl"]["verified"] is True and summary["nixl"]["near_ties"] == 1


def test_a_path_that_loads_whole_blocks_is_held_to_one_vllms_answer_over_its_own_cache():
    """A row that took from its KV path the tokens one vLLM's own prefix cache
    gave its second answer is compared with that answer (the same split of the
    prompt, rounded alike), not with the prompt computed whole: it is verified
    where it equals that answer however far the whole prompt's lies, and not
    where one logprob moved past the tolerance from it, even onto the whole
    prompt's.  A row that took other tokens (P/D's all but the last) is held to
    the whole prompt's; and a prompt vLLM's cache gave nothing holds every row
    to it."""
    from tract_cli.bench.engine.answers import TOLERANCE
    from tract_cli.bench.engine.calls import Answer
    from tract_cli.bench.engine.vllm_runs import OVER_ITS_CACHE, verify

    def answer(logprob):
        return Answer(0.0, "ab", ["token_id:1", "token_id:2"],
                      [{"token_id:1": logprob, "token_id:9": -3.0}] * 2)

    whole, split = answer(-1.0), answer(-1.0 - 3 * TOLERANCE)
    records = [{"config": "mono", "request": 0},
               {"config": "prefix-hit", "request": 0, "kv_tokens": 256},
               {"config": "tract", "request": 0, "kv_tokens": 299}]
    answers = {0: {"mono": whole, OVER_ITS_CACHE: (256, split),
                   "prefix-hit": answer(split.top[0]["token_id:1"]), "tract": answer(-1.0)}}
    verify(records, answers)
    assert [r["verified"] for r in records] == [True, True, True]
    assert [r["answer"]["reference"] for r in records] == ["whole", "over its cache", "whole"]
    # the hit's answer one logprob off its split's, onto the whole prompt's: not verified
    answers[0]["prefix-hit"] = answer(-1.0)
    verify(records, answers)
    assert [r["verified"] for r in records] == [True, False, True]
    # P/D's answer held to the whole prompt's, not to the split's
    answers[0]["tract"] = answer(split.top[0]["token_id:1"])
    verify(records, answers)
    assert records[2]["verified"] is False
    # vLLM's cache gave nothing: every row is held to the whole prompt's
    answers[0][OVER_ITS_CACHE] = (0, split)
    answers[0]["prefix-hit"] = answer(-1.0)
    verify(records, answers)
    assert [r["verified"] for r in records] == [True, True, False]
    assert records[1]["answer"]["reference"] == "whole"


def test_a_configurations_crashed_process_is_named_from_its_logs(tmp_path):
    """A vLLM process killed by a signal writes Python's fault handler's line into
    its server's log; the bench's one-line failure names every instance whose log
    says so, and nothing where none does (another configuration's log is not
    read)."""
    from tract_cli.bench.engine.vllm_runs import crash_in_logs
    (tmp_path / "nixl-prefill.log").write_text("INFO started\nINFO answered\n")
    (tmp_path / "nixl-tcp-decode.log").write_text("Fatal Python error: Aborted\n")
    assert crash_in_logs(str(tmp_path), "nixl") is None
    (tmp_path / "nixl-decode.log").write_text(
        "INFO step\nFatal Python error: Illegal instruction\n\nThread 0x1 (most recent "
        "call first):\nFatal Python error: Illegal instruction\n")
    assert crash_in_logs(str(tmp_path), "nixl") == \
        "a process of its decode instance died: Illegal instruction"
    (tmp_path / "nixl-prefill.log").write_text("Fatal Python error: Aborted\n")
    assert crash_in_logs(str(tmp_path), "nixl") == (
        "a process of its prefill instance died: Aborted; "
        "a process of its decode instance died: Illegal instruction")


def test_a_vllm_whose_engine_core_failed_to_start_is_stopped_at_once(tmp_path):
    """vLLM's server may hang on its way out after its engine core failed to
    start (Mooncake's connector raised in its shutdown on the CPU build, and
    the peers run waited the whole 300 s for a server that would never be
    ready): once its log says so, the wait stops it at once and says why in
    one line, and nothing of it is left running. A log appended to is read
    only from this start on (an earlier failure there is not this one's)."""
    import stat
    import time
    from tract_cli.core.errors import TractError
    from tract_cli.serve.vllm_engine import VllmServer
    # stands in for vLLM's python: logs what vLLM logs, then hangs as its server did
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\n"
                    "echo '(EngineCore pid=1) ERROR [core.py:1510] EngineCore failed to start.'\n"
                    "echo \"(EngineCore pid=1) ERROR [core.py:1510] RuntimeError: Worker failed "
                    "with error 'Cannot access accelerator device when none is available.'\"\n"
                    "exec sleep 600\n")
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "mooncake-prefill.log"
    server = VllmServer(str(tmp_path), 1, python=str(fake), log_path=str(log))
    t0 = time.monotonic()
    try:
        with pytest.raises(TractError) as exc:
            server.wait_ready(timeout=120)
        # stopped by the wait itself, before anything here stops it
        assert server.proc.poll() is not None, "the hanging server was left running"
    finally:
        server.stop(timeout=10)
    assert time.monotonic() - t0 < 60, "it waited for the server instead of stopping it"
    line = str(exc.value)
    assert "its engine core failed to start" in line and "Cannot access accelerator" in line, line
    # the same log, appended to by a start that hangs without saying so: not stopped for
    # the earlier start's line (it overruns its short bound instead)
    quiet = tmp_path / "python-quiet"
    quiet.write_text("#!/bin/sh\nexec sleep 600\n")
    quiet.chmod(quiet.stat().st_mode | stat.S_IXUSR)
    server = VllmServer(str(tmp_path), 1, python=str(quiet), log_path=str(log))
    try:
        with pytest.raises(TractError, match="did not become ready within 2 s"):
            server.wait_ready(timeout=2)
    finally:
        server.stop(timeout=10)
    # and the cause it would name is this start's (none), not the earlier one's
    assert server.failure() == "no output", server.failure()


@pytest.mark.parametrize("gib,args,space,flag", [
    (2, (), "2", None),                     # whole GiB: the CPU platform's variable
    (0.125, (), "", str(128 << 20)),        # a fraction: vLLM's flag, the variable unset
    (2, ("--kv-cache-memory-bytes", "96M"), "", "96M"),     # the caller's flag wins
    (2, ("--kv-cache-memory-bytes=96M",), "", None),
    (2, ("--kv_cache_memory_bytes=96M",), "", None),       # vLLM's parser takes it too
    (1e6, (), "1000000", None),                            # a number vLLM's int() reads
])
def test_the_kv_cache_size_reaches_vllm_once_and_the_callers_flag_wins(tmp_path, monkeypatch,
                                                                        gib, args, space, flag):
    """VllmServer sizes vLLM's CPU KV cache with VLLM_CPU_KVCACHE_SPACE (whole
    GiB) or vLLM's --kv-cache-memory-bytes (a fraction); where the caller's
    arguments carry the flag, the variable, which vLLM's CPU platform puts
    over the flag, is not set, even where the caller's environment set it."""
    import stat
    from tract_cli.serve.vllm_engine import VllmServer
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "7")
    fake = tmp_path / "python"             # stands in for vLLM's python: says what it got
    fake.write_text('#!/bin/sh\necho "space=[${VLLM_CPU_KVCACHE_SPACE-unset}]"\n'
                    'for a in "$@"; do echo "arg=$a"; done\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    log = tmp_path / "vllm.log"
    server = VllmServer(str(tmp_path), 1, python=str(fake), log_path=str(log),
                        kv_cache_gib=gib, args=args)
    server.proc.wait(timeout=60)
    server.stop(timeout=10)
    lines = log.read_text().splitlines()
    assert f"space=[{space or 'unset'}]" in lines, lines
    argv = [line[4:] for line in lines if line.startswith("arg=")]
    flags = [a for a in argv if a.replace("_", "-").startswith("--kv-cache-memory-bytes")]
    assert len(flags) == (0 if space else 1), argv
    if flag is not None:
        assert argv[argv.index("--kv-cache-memory-bytes") + 1] == flag, argv


def test_a_kv_cache_too_small_or_not_a_number_is_refused_before_vllm_starts():
    from tract_cli.core.errors import UsageError
    from tract_cli.serve.vllm_engine import kv_cache_space
    for gib in (0, 1e-12, -1, float("nan"), float("inf")):
        with pytest.raises(UsageError, match="at least 1 MiB"):
            kv_cache_space((), gib)
    assert kv_cache_space((), 1 / 1024) is None          # 1 MiB: the flag


def test_a_workload_answer_unlike_one_vllms_is_not_verified():
    """Under load, an answer is verified when every token's top logprobs are one
    vLLM's (one request at a time) within the tolerance, up to a near-tie that
    parts them (batched arithmetic breaks such ties either way); one whose
    logprobs moved further, that parts where a run preferred its token clearly,
    that stops early, or whose text differs where no logprobs came, is not, and
    so its system at that rate is not."""
    from tract_cli.bench.engine.answers import TOLERANCE
    from tract_cli.bench.engine.calls import Answer
    from tract_cli.bench.engine.vllm_workloads import verify

    def answer(tokens, shift=0.0, at=None):
        top = [{t: -1.0 + (shift if i == at else 0.0), "token_id:9": -3.0}
               for i, t in enumerate(tokens)]
        return Answer(0.0, "", list(tokens), top)
    want = ["token_id:1", "token_id:2", "token_id:3"]
    records = [{"config": c, "point": 0, "request": r} for c in ("mono", "tract")
               for r in ("a", "b")]
    summaries = [{"config": c, "point": 0} for c in ("mono", "tract")]
    answers = {(c, 0, r): answer(want) for c in ("mono", "tract") for r in ("a", "b")}
    reference = {(0, "a"): answer(want), (0, "b"): answer(want)}

    def check(got):
        answers[("tract", 0, "b")] = got
        answers[("mono", 0, "b")] = reference[(0, "b")]        # one vLLM under load, alike
        verify(records, summaries, answers, reference)
        return {s["config"]: s["verified"] for s in summaries}
    assert check(answer(want)) == {"mono": True, "tract": True}
    # rounding: every logprob within the tolerance
    assert check(answer(want, TOLERANCE / 2, 1)) == {"mono": True, "tract": True}
    assert summaries[1]["answer_gap"] == pytest.approx(TOLERANCE / 2)
    # a wrong block moves a logprob beyond it, the same tokens chosen
    assert check(answer(want, 3 * TOLERANCE, 1)) == {"mono": True, "tract": False}
    assert "token 1" in records[-1]["answer"]["notes"][0]
    # a near-tie parts them at token 1: both runs rate the two alike
    tie = TOLERANCE / 4
    reference[(0, "b")] = Answer(0.0, "", want, [
        {"token_id:1": -1.0}, {"token_id:2": -1.0, "token_id:7": -1.0 - tie}, {"token_id:3": -1}])
    parted = Answer(0.0, "", ["token_id:1", "token_id:7", "token_id:4"], [
        {"token_id:1": -1.0}, {"token_id:7": -1.0, "token_id:2": -1.0 - tie}, {"token_id:4": -1}])
    assert check(parted) == {"mono": True, "tract": True}
    assert records[-1]["answer"]["parts_at"] == 1 and summaries[1]["near_ties"] == 1
    # the same parting where one vLLM preferred its token by a clear margin
    reference[(0, "b")].top[1]["token_id:7"] = -1.0 - 5 * TOLERANCE
    assert check(parted) == {"mono": True, "tract": False}
    # an answer that stops early
    reference[(0, "b")] = answer(want)
    assert check(answer(want[:2])) == {"mono": True, "tract": False}
    # no logprobs came: compared by text, which must then be equal and not empty
    reference[(0, "b")] = Answer(0.0, " x y")
    assert check(Answer(0.0, " x y")) == {"mono": True, "tract": True}
    assert check(Answer(0.0, " x z")) == {"mono": True, "tract": False}
    reference[(0, "b")] = Answer(0.0, "")
    assert check(Answer(0.0, ""))["tract"] is False       # nothing to compare
    verify(records, summaries, answers, {})            # no reference: not checked
    assert {s["verified"] for s in summaries} == {None}


def test_the_hit_rate_and_the_time_split_are_vllms_own_counts():
    """The hit rate is the share of the computing instances' prompt tokens vLLM
    counted as taken from the KV path or its own cache (P/D: the prefill
    instance's; the decode instance's handoff is not a hit); queue times add
    over the instances a request passes."""
    from tract_cli.bench.engine.vllm_workloads import TOKENS, summarize
    def scrape(compute, cached, external, queue, prefill, n=2):
        return {(TOKENS, "local_compute"): compute, (TOKENS, "local_cache_hit"): cached,
                (TOKENS, "external_kv_transfer"): external,
                ("vllm:request_queue_time_seconds_sum", None): queue,
                ("vllm:request_queue_time_seconds_count", None): n,
                ("vllm:request_prefill_time_seconds_sum", None): prefill,
                ("vllm:request_prefill_time_seconds_count", None): n}
    zero = scrape(0, 0, 0, 0, 0, 0)
    got = [{"ttft_s": 0.1, "e2e_s": 0.2, "output_tokens": 4, "decode_s": 0.05},
           {"ttft_s": 0.3, "e2e_s": 0.4, "output_tokens": 4, "decode_s": 0.07}]
    before = {"prefill": zero, "decode": zero}
    after = {"prefill": scrape(600, 0, 400, 0.2, 0.4),     # 400 of 1000 tokens from the pool
             "decode": scrape(2, 0, 998, 0.1, 0.02)}        # the handoff
    s = summarize("nixl", 0, 2.0, got, 1.0, before, after, None)
    assert s["hit_rate"] == pytest.approx(0.4) and s["handed_over"] == pytest.approx(0.998)
    assert s["throughput_rps"] == 2.0 and s["ttft_mean_s"] == pytest.approx(0.2)
    b = s["breakdown"]
    assert b["queue_s"] == pytest.approx(0.15) and b["compute_s"] == pytest.approx(0.2)
    # NixlConnector does not time its transfer apart: the decode leg, as the client saw it
    assert b["decode_leg_s"] == pytest.approx(0.06)
    assert b["kv_read_s"] is None and b["kv_write_s"] is None
    # TraCT's own load and save times, beside its decode leg
    s = summarize("tract", 0, 2.0, got, 1.0, before, after,
                  {"load_ms": 30.0, "save_ms": 10.0, "loads": 2, "saves": 2})
    assert s["breakdown"]["kv_read_s"] == pytest.approx(0.015)
    assert s["breakdown"]["kv_write_s"] == pytest.approx(0.005)
    # two instances sharing a cache: both compute, both count
    after = {"prefill": scrape(500, 0, 0, 0.2, 0.4), "decode": scrape(250, 0, 250, 0.2, 0.2)}
    s = summarize("prefix", 0, 2.0, got, 1.0, before, after, None)
    assert s["hit_rate"] == pytest.approx(0.25) and s["handed_over"] is None
    # a request passes one of the two: their requests' means, not a sum
    assert s["breakdown"]["queue_s"] == pytest.approx(0.1)
    assert s["breakdown"]["compute_s"] == pytest.approx(0.15)
    assert s["breakdown"]["decode_leg_s"] is None


def test_each_rate_is_its_own_draw_and_a_trace_is_rescaled_to_it():
    from tract_cli.cli.bench_vllm import workload_points
    trace = os.path.join(ROOT, "data", "mooncake_synthetic_trace.jsonl")
    points, described = workload_points("static", trace, 40, 1.0, None, 8, None, None, None,
                                        None, None, [1.0, 4.0], 0, 512, 8192)
    assert [q for q, _ in points] == [1.0, 4.0]
    (_, slow), (_, fast) = points
    assert len(slow) == len(fast) and all(len(r.tokens) <= 8192 - 8 - 32 for r in slow)
    for q, reqs in points:            # the trace's shape, at the rate asked
        assert (len(reqs) - 1) / reqs[-1].arrival_s == pytest.approx(q)
        assert all(r.output_len <= 8 for r in reqs)
    # a cold cache at each rate: other tokens, the same prefix structure
    assert not any((a.tokens[:16] == b.tokens[:16]).all() for a in slow for b in fast)
    assert any((a.tokens[:16] == b.tokens[:16]).all() for i, a in enumerate(slow)
               for b in slow[i + 1:])                 # the trace's shared first blocks
    assert "capped at 8 tokens" in described
    from tract_cli.core.errors import UsageError
    for bad, why in (
            (("static", trace, None, 1.0, None, 8, 6, None, None, None, None, [], 0), "--requests"),
            (("static", trace, None, 2.0, None, 8, None, None, None, None, None, [1.0], 0),
             "--speedup and --qps"),
            (("static", trace, 1, 1.0, None, 8, None, None, None, None, None, [1.0], 0),
             "no arrival rate"),
            (("synthetic", None, 5, 1.0, None, 8, None, None, None, None, None, [], 0), "--limit"),
            (("synthetic", None, None, 1.0, 100, 8, None, None, None, None, None, [], 0),
             "--max-input-len")):
        with pytest.raises(UsageError, match=why):
            workload_points(*bad, 512, 8192)
    points, _ = workload_points("synthetic", None, None, 1.0, None, 16, 6, 0.5, 2, 400, 100,
                                [2.0, 3.0], 0, 512, 8192)
    (_, a), (_, b) = points
    assert len(a) == len(b) == 6 and {r.rid for r in a}.isdisjoint(r.rid for r in b)
    assert all(r.output_len <= 16 for r in a + b)


# LMCache's configuration is the static run's (PEERS_RUN): CI's time budget
WORKLOAD_CONFIGS = ["tract", "prefix", "mono"]
WORKLOAD_RUN = Check("vllm bench: a synthetic workload under load", _background_bench, "workload",
                     ["--workload", "synthetic", "--requests", "6", "--isl-mean", "400",
                      "--prefix-ratio", "0.5", "--num-prefix-prompts", "2", "--output-len", "4",
                      "--qps", "2", "--qps", "8",
                      *[a for c in WORKLOAD_CONFIGS for a in ("--vllm-config", c)]],
                     timeout=1500, plot=True, cost=180)


@needs_vllm
@uses(WORKLOAD_RUN)
def test_a_workload_runs_under_load_at_each_rate_and_leaves_nothing_behind():
    """A synthetic workload with shared prefixes, two rates, requests in flight at
    once: TraCT's P/D pair and two vLLMs sharing a region beside one vLLM; each system at each rate is reported (its
    throughput, TTFT, hit rate and time split), every answer equals one vLLM's,
    and nothing outlives the bench."""
    configs = WORKLOAD_CONFIGS
    got = WORKLOAD_RUN.result()
    res, run = got["res"], got["run"]
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = {(s["config"], s["qps"]): s for s in run["summaries"]}
    assert sorted(rows) == sorted((c, q) for c in configs for q in (2.0, 8.0))
    for key, s in rows.items():
        assert s["verified"] is True, (key, s)        # every answer equals one vLLM's
        assert s["requests"] == 6 and s["throughput_rps"] > 0, (key, s)
        assert 0 < s["ttft_p50_s"] <= s["ttft_p99_s"], (key, s)
        assert 0 <= s["hit_rate"] <= 1, (key, s)
        b = s["breakdown"]
        assert b["queue_s"] is not None and b["compute_s"] > 0, (key, s)
    for q in (2.0, 8.0):
        # TraCT's pair: every prompt handed to the decode instance; its connector's
        # loads and saves timed apart
        t = rows[("tract", q)]
        assert t["handed_over"] > 0.9 and t["breakdown"]["kv_read_s"] > 0, t
        assert t["breakdown"]["kv_write_s"] > 0, t
        assert rows[("mono", q)]["hit_rate"] == 0       # vLLM's own cache is off
    assert len(run["records"]) == 6 * 2 * len(configs)
    assert all(r["verified"] is True for r in run["records"])
    for c in configs:
        assert c in res.stdout
    assert "hit rate" in res.stdout and "KV read" in res.stdout
    assert os.path.getsize(got["png"]) > 10_000
    assert got["left"] == set(), "a process the bench started outlived it"
    assert got["debris"] == set(), "the bench left files behind"


def test_each_measured_request_meets_quiet_instances(monkeypatch, tmp_path):
    """The static workload leaves REQUEST_GAP seconds of quiet before each
    measured request and before a prefix hit (vLLM's pollers: docs/VLLM.md,
    "Benchmark"), outside every timed window (the counters read before it, the
    wait for the miss's save before it), and none with a gap of 0.  The
    warm-ups of the measured lengths but the first of each, and only they, ask TraCT's connector for
    its memcpy reference (kvlog.REFERENCE_PARAM: no measured request pays its
    copies), and on TraCT's configurations they meet quiet instances too (the
    reference as paced as the copies it is set against); no other warm-up
    waits.  One vLLM is sent each measured prompt again right after it (its
    answer over its own prefix cache), outside the timed window.  The clock is
    the test's: the quiet moves it, so a quiet inside a timed window would show
    in the TTFT."""
    import types
    from tract_cli.bench.engine import calls, vllm_runs
    events, now = [], [0.0]
    ASK_S = 0.01                        # each request takes this long on the test's clock

    def sleep(s):
        events.append(("quiet", s))
        now[0] += s

    class Server:
        def __init__(self, name):
            self.name, self.log_path = name, str(tmp_path / f"{name}.log")
            self.store = str(tmp_path / "store")      # ExampleConnector's directory
            open(self.log_path, "w").close()

        def wait_ready(self):
            pass

    def asked(name):
        events.append(("ask", name))
        now[0] += ASK_S
        return calls.Answer(first=now[0], text="x")

    def metrics(server):
        events.append(("counters", server.name))
        return {}

    def saved(*a, **k):
        events.append(("saved",))
        return 0.0

    monkeypatch.setattr(vllm_runs.engine_configs, "start",
                        lambda config, *a, **k: {r: Server(r) for r in
                                                 (("mono",) if config == "mono"
                                                  else ("prefill", "decode"))})
    monkeypatch.setattr(vllm_runs.engine_configs, "stop_all", lambda servers: None)
    # the module's own clock only: nothing else in this process sleeps on it
    monkeypatch.setattr(vllm_runs, "time", types.SimpleNamespace(sleep=sleep,
                                                                 monotonic=lambda: now[0]))
    asks = []          # each request's logprobs: the answers are compared by them
    sent = []          # each request's (tokens, kv_transfer_params the bench added)

    def pd_request(config, p, d, tokens, *a, logprobs=0, params=None, **k):
        asks.append(logprobs)
        sent.append((len(tokens), params))
        return now[0], asked(f"P/D {len(tokens)}")

    def complete(server, tokens, n, logprobs=0, params=None, **k):
        asks.append(logprobs)
        sent.append((len(tokens), params))
        return asked(server.name)

    monkeypatch.setattr(calls, "pd_request", pd_request)
    monkeypatch.setattr(calls, "complete", complete)
    monkeypatch.setattr(calls, "metrics", metrics)
    monkeypatch.setattr(vllm_runs, "_wait_saved", saved)
    reqs = [(3, [1, 2, 3]), (4, [1, 2, 3, 4])]
    # a path's one-time costs, then a measured length's (TraCT's memcpy reference)
    warm = [([9] * 5, False), ([8] * 2, True)]
    from tract_cli.core.kvlog import REFERENCE_PARAM
    ref = {REFERENCE_PARAM: True}

    def pd(n):
        return [("counters", "prefill"), ("counters", "decode"), ("ask", f"P/D {n}"),
                ("counters", "prefill"), ("counters", "decode")]

    def one(name):
        return [("counters", name), ("ask", name), ("counters", name)]

    for gap in (1.25, 0.0):
        q = [("quiet", gap)] if gap else []
        for config, want, marked in (
                # the warm-ups (the reference's paced as a measured request is),
                # then each
                ("tract", pd(5) + q + pd(2) + q + pd(3) + q + pd(4),
                 [(5, None), (2, ref), (3, None), (4, None)]),
                ("prefix", one("prefill") + [("saved",)] + one("decode")
                 + 3 * (q + one("prefill") + [("saved",)] + q + one("decode")),
                 [(5, None), (5, None), (2, ref), (2, ref)] + [(3, None)] * 2 + [(4, None)] * 2),
                ("example", pd(5) + pd(2) + q + pd(3) + q + pd(4),
                 [(5, None), (2, None), (3, None), (4, None)]),
                # each measured prompt sent again once its request is timed
                # (one vLLM's answer over its own cache: verify's reference)
                ("mono", 2 * one("mono") + 2 * (q + one("mono") + one("mono")),
                 [(5, None), (2, None), (3, None), (3, None), (4, None), (4, None)])):
            events.clear()
            sent.clear()
            records = []
            vllm_runs._run_config(config, "model", str(tmp_path), (), 1, None, "sync", reqs, warm,
                                  1, 0, records, {}, request_gap=gap)
            assert events == want, (config, gap, events)
            assert sent == marked, (config, gap, sent)
            assert [r["ttft_s"] for r in records] == [pytest.approx(ASK_S)] * len(records), \
                (config, gap, records)
    from tract_cli.bench.engine.answers import TOP_LOGPROBS
    assert asks and set(asks) == {TOP_LOGPROBS}, asks     # every request, the warm-up's too


def test_one_vllm_answers_each_prompt_again_over_its_own_cache(monkeypatch, tmp_path):
    """One vLLM is started with its own prefix cache on (and only it: a TraCT
    configuration keeps it off) and sends each measured prompt again; what its
    cache gave is vLLM's `local_cache_hit` count, read around that second
    request.  A second request that fails leaves (0, None), said, and one vLLM's
    timed rows stand; a one vLLM that fails takes its second answers with its
    rows."""
    import io
    from tract_cli.bench.engine import calls, vllm_runs
    started = {}

    class Server:
        log_path = None

        def wait_ready(self):
            pass

    def start(config, model, work, args, *a, **k):
        started[config] = args
        return {r: Server() for r in (("mono",) if config == "mono" else ("prefill", "decode"))}

    counter = [0.0]                 # vLLM's local_cache_hit count
    asked = []

    def complete(server, tokens, *a, **k):
        asked.append(len(tokens))
        if len(asked) % 2 == 0:     # the second request: vLLM's cache gave the whole blocks
            if fail_second:
                raise OSError("connection refused")
            counter[0] += len(tokens) // 128 * 128
        return calls.Answer(first=0.0, text="x", tokens=["token_id:1"],
                            top=[{"token_id:1": -1.0}])

    monkeypatch.setattr(vllm_runs.engine_configs, "start", start)
    monkeypatch.setattr(vllm_runs.engine_configs, "stop_all", lambda servers: None)
    monkeypatch.setattr(calls, "complete", complete)
    monkeypatch.setattr(calls, "metrics", lambda server: {
        (calls.PROMPT_TOKENS, "local_cache_hit"): counter[0]})
    monkeypatch.setattr(vllm_runs, "_wait_saved", lambda *a, **k: 0.0)
    reqs = [(300, [1] * 300), (400, [2] * 400)]
    args = ("--no-enable-prefix-caching", "--block-size", "128")
    for fail_second in (False, True):
        records, answers = [], {}
        vllm_runs._run_config("mono", "model", str(tmp_path), args, 1, None, "sync", reqs, [],
                              1, 0, records, answers, request_gap=0.0)
        assert "--enable-prefix-caching" in started["mono"]
        assert "--no-enable-prefix-caching" not in started["mono"]
        assert [r["config"] for r in records] == ["mono", "mono"]
        got = [(answers[i][vllm_runs.OVER_ITS_CACHE][0],
                answers[i][vllm_runs.OVER_ITS_CACHE][1] is not None) for i in (0, 1)]
        assert got == ([(0, False)] * 2 if fail_second else [(256, True), (384, True)]), got
        asked.clear()
    vllm_runs._run_config("tract", "model", str(tmp_path), args, 1, None, "sync", [], [],
                          1, 0, [], {}, request_gap=0.0)
    assert "--no-enable-prefix-caching" in started["tract"]
    # said in one line where the second request failed
    log = io.StringIO()
    asked.append(10)            # the next request is a second one, and fails
    assert vllm_runs._over_its_cache(Server(), [1] * 10, 1, log) == (0, None)
    assert "second answer to a prompt failed" in log.getvalue()
    # one vLLM's rows dropped: its second answers with them
    records = [{"config": "mono", "request": 0}]
    answers = {0: {"mono": None, vllm_runs.OVER_ITS_CACHE: (256, None)}}
    vllm_runs._drop_rows("mono", records, answers)
    assert records == [] and answers == {0: {}}


def test_the_driver_sends_on_the_workloads_clock_and_stops_at_a_failure(monkeypatch):
    """The open-loop driver (its HTTP calls replaced, nothing else): throughput is
    measured from the first arrival, not the clock's start; a request that fails
    stops the sending, and its error is raised once the others in flight end."""
    import time

    from tract_cli.bench.engine import calls, vllm_workloads
    from tract_cli.bench.workload.workloads import Request
    sent = []

    def complete(server, tokens, output_len, logprobs=0):
        sent.append(tokens[0])
        if tokens[0] == 2:
            raise calls.TractError("the server died")
        return calls.Answer(time.monotonic(), "x", ["token_id:1"], [{"token_id:1": -1.0}])
    monkeypatch.setattr(calls, "complete", complete)
    servers = {"mono": object()}
    reqs = [Request(f"r{i}", 1.0 + 0.01 * i, np.array([i]), 1) for i in range(2)]
    out, wall = vllm_workloads._drive("mono", servers, reqs, None)
    assert sorted(r["request"] for r in out) == ["r0", "r1"]
    assert min(r["arrival_s"] for r in out) == pytest.approx(1.0, abs=0.05)
    assert wall < 0.9, wall               # from the first arrival, not from t0
    sent.clear()
    # the failing one first, the rest a second apart: none is due before it fails
    reqs = [Request(f"r{i}", float(i - 2), np.array([i]), 1) for i in range(2, 8)]
    with pytest.raises(calls.TractError, match="the server died"):
        vllm_workloads._drive("mono", servers, reqs, None)
    assert sent[0] == 2 and len(sent) < 6, sent      # the later ones were not sent


def test_mono_beside_sends_each_prompt_beside_every_configuration_and_is_stopped(
        monkeypatch, tmp_path):
    """`--mono-beside`: one vLLM, started and warmed up before the
    configurations, gets each measured prompt too, after the same quiet, before
    the configuration's request on odd requests and after it on even ones; each
    record carries its TTFT and each row its ratio to it (a prefix hit's
    included); it is stopped when the run ends, and when a configuration fails;
    a configuration whose vLLM stops at start is said in one line, the rest run,
    the logs are kept and the command exits 1."""
    import types
    from tract_cli.bench.engine import calls, vllm_runs
    events, now = [], [0.0]
    started, stopped, caching = [], [], {}
    # the logs' directories the runs that fail keep go where pytest removes them
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "hidden_size": 128, "head_dim": 32, "dtype": "bfloat16",
        "vocab_size": 450, "max_position_embeddings": 8192}))

    class Server:
        def __init__(self, name, work):
            self.name, self.log_path = name, os.path.join(work, f"{name}.log")
            self.store = None
            open(self.log_path, "w").close()

        def wait_ready(self):
            pass

    def start(config, model, work, args, *a, **k):
        started.append((config, os.path.basename(work)))
        caching[os.path.basename(work)] = "--enable-prefix-caching" in args
        roles = ("mono",) if config == "mono" else ("prefill", "decode")
        names = ["beside" if os.path.basename(work) == "beside" else r for r in roles]
        return {r: Server(n, work) for r, n in zip(roles, names)}

    def took(name):
        # the beside vLLM answers in 0.1 s, the configurations' servers in 0.2 s
        now[0] += 0.1 if name == "beside" else 0.2
        return calls.Answer(first=now[0], text="x")

    def complete(server, tokens, *a, **k):
        events.append(("ask", server.name, len(tokens)))
        if server.name in failing:
            raise vllm_runs.HttpError("connection refused")
        return took(server.name)

    failing: set = set()

    def pd_request(config, p, d, tokens, *a, **k):
        events.append(("ask", config, len(tokens)))
        return now[0], took(config)

    monkeypatch.setattr(vllm_runs.engine_configs, "start", start)
    monkeypatch.setattr(vllm_runs.engine_configs, "stop_all",
                        lambda servers: stopped.append(sorted(s.name for s in servers.values())))
    monkeypatch.setattr(vllm_runs.engine_configs, "unavailable_of", lambda configs, py: {})
    monkeypatch.setattr(vllm_runs, "_tract_region", lambda *a: str(tmp_path / "pool"))
    monkeypatch.setattr(vllm_runs, "_flush_mode", lambda pool: "none")
    monkeypatch.setattr(vllm_runs, "remove_pool", lambda pool: None)
    monkeypatch.setattr(vllm_runs, "_wait_saved", lambda *a, **k: 0.0)
    monkeypatch.setattr(vllm_runs, "_connector_figures", lambda *a: {})
    monkeypatch.setattr(vllm_runs, "time", types.SimpleNamespace(
        sleep=lambda s: events.append(("quiet", s)), monotonic=lambda: now[0]))
    monkeypatch.setattr(calls, "complete", complete)
    monkeypatch.setattr(calls, "pd_request", pd_request)
    monkeypatch.setattr(calls, "metrics", lambda server: {})
    res = vllm_runs.run(str(tmp_path), [300], 2, 1, ["tract", "prefix"], log=open(os.devnull, "w"),
                        request_gap=1.0, mono_beside=True, vllm_prefix_caching=True)
    # the configurations' own prefix caches as asked; the beside vLLM's off (every
    # configuration's prompts reach it)
    assert caching.pop("beside") is False and caching and all(caching.values()), caching
    assert started[0] == ("mono", "beside") and [c for c, _ in started[1:]] == ["tract", "prefix"]
    first = events.index(("ask", "tract", 300))
    # the beside vLLM was warmed up before any configuration started
    assert ("ask", "beside", 300) in events[:first]
    q, tract, beside = ("quiet", 1.0), ("ask", "tract", 300), ("ask", "beside", 300)
    start = events.index(("ask", "tract", 264))          # tract's first warm-up
    end = events.index(("ask", "prefill", 264))          # prefix's
    assert events[start:end] == [
        ("ask", "tract", 264), tract,                    # its warm-ups (the reference's
        *[q, tract] * vllm_runs.REFERENCE_WARMUPS,       # each after a quiet)
        q, tract, q, beside,                             # request 0: beside it after
        q, beside, q, tract], events                     # request 1: before
    rows = {s["config"]: s for s in res["summaries"]}
    assert rows["tract"]["beside_ttft_mean_s"] == pytest.approx(0.1)
    assert rows["tract"]["vs_beside"] == pytest.approx(2.0)
    assert rows["prefix-hit"]["vs_beside"] == pytest.approx(2.0)
    assert all(r["beside_ttft_s"] == pytest.approx(0.1) for r in res["records"])
    # every beside request met the same quiet as the configuration's
    for i, e in enumerate(events):
        if e[:2] == ("ask", "beside") and i > first:
            assert events[i - 1] == ("quiet", 1.0), events[i - 3:i + 1]
    assert stopped[-1] == ["beside"] and res["mono_beside"] is True
    # the beside vLLM failing a measured request stops the run, named as its own
    # failure (not the configuration's), and every server is stopped
    stopped.clear()
    n_asks = []
    real_complete = complete

    def failing_later(server, tokens, *a, **k):
        if server.name == "beside":
            n_asks.append(1)
            # past its warm-ups (a block's, and the length's: one and the references')
            if len(n_asks) > 2 + vllm_runs.REFERENCE_WARMUPS:
                failing.add("beside")
        return real_complete(server, tokens, *a, **k)

    monkeypatch.setattr(calls, "complete", failing_later)
    with pytest.raises(vllm_runs.TractError, match="--mono-beside.*failed a request"):
        vllm_runs.run(str(tmp_path), [300], 1, 1, ["tract"], log=open(os.devnull, "w"),
                      request_gap=0.0, mono_beside=True)
    assert sorted(stopped) == [["beside"], ["decode", "prefill"]], stopped
    # a configuration whose vLLM stops at start (as vLLM 0.32's CPU build stops
    # MooncakeConnector's): said in one line with its reason, its rows dropped,
    # the others run, the logs kept, and the command exits 1
    monkeypatch.setattr(calls, "complete", complete)
    failing.clear()

    fake_start = vllm_runs.engine_configs.start

    def start_or_fail(config, *a, **k):
        if config == "prefix":
            raise vllm_runs.TractError("vLLM exited (code 1) before it was ready: its engine "
                                       "core failed to start")
        return fake_start(config, *a, **k)

    monkeypatch.setattr(vllm_runs.engine_configs, "start", start_or_fail)
    said = tmp_path / "said.log"
    with open(said, "w") as log:
        res = vllm_runs.run(str(tmp_path), [300], 1, 1, ["prefix", "tract"], log=log,
                            request_gap=0.0)
    assert list(res["failed"]) == ["prefix"], res["failed"]
    assert "engine core failed" in res["failed"]["prefix"]
    assert "prefix failed: vLLM exited" in said.read_text()
    assert {s["config"] for s in res["summaries"]} == {"tract"}     # tract ran after it
    assert res["logs"] and os.path.isdir(res["logs"]), res["logs"]
    from tract_cli.cli.bench_vllm import _finish
    with pytest.raises(typer.Exit) as exit_:
        _finish(res, None, None)
    assert exit_.value.exit_code == 1


def test_interleave_keeps_every_configuration_up_and_sends_each_prompt_to_each_in_turn(
        monkeypatch, tmp_path):
    """`--interleave`: every configuration started and warmed up, one after the
    other, before any measured request, each TraCT one on its own region; then
    each measured prompt sent to each configuration after the same quiet, the
    order turned by one each request; all stopped at the end, regions removed.
    A configuration that fails a measured request is stopped, said, its rows
    (all of them, interleaved with the others') dropped and its region
    removed, and the rest go on; one that fails at start is said and the rest
    run.  An interrupt (^C) stops every configuration, each even where
    stopping one fails, and removes every region.  Configurations that would
    not all fit in memory at once are refused before any starts."""
    import types
    from tract_cli.bench.engine import calls, vllm_runs
    events, now, started, stopped, regions, removed = [], [0.0], [], [], [], []
    # the logs' directories the runs that fail keep go where pytest removes them
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "hidden_size": 128, "head_dim": 32, "dtype": "bfloat16",
        "vocab_size": 450, "max_position_embeddings": 8192}))

    class Server:
        def __init__(self, name, work, pool):
            self.name, self.pool = name, pool
            self.log_path, self.store = os.path.join(work, f"{name}.log"), None
            open(self.log_path, "w").close()

        def wait_ready(self):
            pass

    def start(config, model, work, args, gib, pool, *a, **k):
        started.append((config, pool))
        events.append(("start", config))
        roles = ("mono",) if config == "mono" else ("prefill", "decode")
        return {r: Server(config, work, pool) for r in roles}

    failing: dict = {}                 # a configuration -> measured requests it answers
    # the measured prompts (the warm-ups are other seeds' prompts, some as long)
    measured = {tuple(t) for _, t in vllm_runs.prompts([300], 3, 450, 0)}

    def took(config, tokens):
        events.append(("ask", config, len(tokens), tuple(tokens) in measured))
        if config in failing and tuple(tokens) in measured:
            if failing[config] == 0:
                raise vllm_runs.HttpError("http://127.0.0.1:1", None, "connection refused")
            failing[config] -= 1
        now[0] += 0.1
        return calls.Answer(first=now[0], text="x")

    def region(model, lengths, requests, config="tract"):
        regions.append(config)
        return str(tmp_path / f"{config}.pool")

    monkeypatch.setattr(vllm_runs.engine_configs, "start", start)
    stop_fails: set = set()

    def stop_all(servers):
        name = next(iter(servers.values())).name
        stopped.append(name)
        if name in stop_fails:
            raise RuntimeError(f"{name} would not stop")

    monkeypatch.setattr(vllm_runs.engine_configs, "stop_all", stop_all)
    monkeypatch.setattr(vllm_runs.engine_configs, "unavailable_of", lambda configs, py: {})
    monkeypatch.setattr(vllm_runs, "_tract_region", region)
    check_room = vllm_runs.check_room          # this host's memory: the last part's
    monkeypatch.setattr(vllm_runs, "check_room", lambda *a: None)
    monkeypatch.setattr(vllm_runs, "_flush_mode", lambda pool: "none")
    monkeypatch.setattr(vllm_runs, "remove_pool", removed.append)
    monkeypatch.setattr(vllm_runs, "_wait_saved", lambda *a, **k: 0.0)
    monkeypatch.setattr(vllm_runs, "_connector_figures", lambda *a: {})
    monkeypatch.setattr(vllm_runs, "time", types.SimpleNamespace(
        sleep=lambda s: events.append(("quiet", s)), monotonic=lambda: now[0]))
    monkeypatch.setattr(calls, "complete", lambda server, tokens, *a, **k: took(server.name,
                                                                                 tokens))
    monkeypatch.setattr(calls, "pd_request",
                        lambda config, p, d, tokens, *a, **k: (now[0], took(config, tokens)))
    monkeypatch.setattr(calls, "metrics", lambda server: {})
    configs = ["tract", "prefix", "mono"]
    res = vllm_runs.run(str(tmp_path), [300], 3, 1, configs, log=open(os.devnull, "w"),
                        request_gap=1.0, interleave=True)
    # started one after another, each warmed up before the next starts, all before
    # the first measured request; each TraCT configuration on its own region
    assert [c for c, _ in started] == configs
    assert regions == ["tract", "prefix"] and len({p for _, p in started[:2]}) == 2
    first = next(i for i, e in enumerate(events) if e[0] == "ask" and e[3])
    assert max(i for i, e in enumerate(events) if e[0] == "start") < first
    for a, b in zip(configs, configs[1:]):      # each warmed up in full before the next
        last_warm = max(i for i, e in enumerate(events) if e[0] == "ask" and e[1] == a
                        and not e[3])
        assert last_warm < events.index(("start", b)) < first
    # each measured prompt to each configuration in turn, the order turned by one,
    # every request after the same quiet ("prefix": its miss, then its hit; one
    # vLLM's answered, then sent again untimed at once: verify's reference)
    asks = [e[1] for e in events[first:] if e[0] == "ask"]
    turns = [["tract", "prefix", "prefix", "mono", "mono"],
             ["prefix", "prefix", "mono", "mono", "tract"],
             ["mono", "mono", "tract", "prefix", "prefix"]]
    assert asks == [c for turn in turns for c in turn], asks
    for i, e in enumerate(events[first:], first):     # a prefix hit after its own quiet too
        if e[0] == "ask":
            again = e[1] == "mono" and events[i - 1][:2] == ("ask", "mono")
            assert again or events[i - 1] == ("quiet", 1.0), events[i - 3:i + 1]
    assert sorted(stopped) == sorted(configs)
    assert sorted(removed) == sorted(str(tmp_path / f"{c}.pool") for c in regions)
    rows = {s["config"]: s["requests"] for s in res["summaries"]}
    assert rows == {"tract": 3, "prefix-miss": 3, "prefix-hit": 3, "mono": 3}, rows
    assert res["interleave"] is True and not res["failed"]
    # a configuration failing its second measured request: stopped at once, said,
    # every row of it dropped, its region removed; the others run on to the end
    events.clear(), stopped.clear(), removed.clear()
    failing["prefix"] = 2              # request 0's miss and hit, not request 1's miss
    said = tmp_path / "said.log"
    with open(said, "w") as log:
        res = vllm_runs.run(str(tmp_path), [300], 3, 1, configs, log=log, request_gap=0.0,
                            interleave=True)
    assert list(res["failed"]) == ["prefix"] and "connection refused" in res["failed"]["prefix"]
    assert "prefix failed: a request failed" in said.read_text()
    rows = {s["config"]: s["requests"] for s in res["summaries"]}
    assert rows == {"tract": 3, "mono": 3}, rows
    assert all(r["config"] in ("tract", "mono") for r in res["records"])
    assert stopped[0] == "prefix" and sorted(stopped) == sorted(configs), stopped
    asks = [e[1] for e in events if e[0] == "ask" and e[3]]
    assert asks.count("prefix") == 3 and asks.count("tract") == 3, asks
    assert asks.count("mono") == 6, asks        # each prompt, and again over its cache
    # the failed one's region removed when it failed, before the run's end
    assert removed[0] == str(tmp_path / "prefix.pool") and len(removed) == 2, removed
    # one that fails at start: said, the rest run
    failing.clear()
    fake_start = vllm_runs.engine_configs.start

    def start_or_fail(config, *a, **k):
        if config == "tract":
            raise vllm_runs.TractError("vLLM exited (code 1) before it was ready")
        return fake_start(config, *a, **k)

    monkeypatch.setattr(vllm_runs.engine_configs, "start", start_or_fail)
    removed.clear()
    with open(said, "w") as log:
        res = vllm_runs.run(str(tmp_path), [300], 2, 1, configs, log=log, request_gap=0.0,
                            interleave=True)
    assert list(res["failed"]) == ["tract"] and "tract failed: vLLM exited" in said.read_text()
    assert {s["config"] for s in res["summaries"]} == {"prefix-miss", "prefix-hit", "mono"}
    assert sorted(removed) == sorted(str(tmp_path / f"{c}.pool") for c in ("tract", "prefix"))
    # ^C during a measured request, and one configuration that will not stop:
    # every configuration is still stopped and every region removed
    monkeypatch.setattr(vllm_runs.engine_configs, "start", fake_start)
    events.clear(), stopped.clear(), removed.clear()
    stop_fails.add("tract")
    real_took = took

    def interrupted(config, tokens):
        if config == "mono" and tuple(tokens) in measured:
            raise KeyboardInterrupt
        return real_took(config, tokens)

    monkeypatch.setattr(calls, "complete", lambda server, tokens, *a, **k: interrupted(
        server.name, tokens))
    with pytest.raises(RuntimeError, match="tract would not stop") as exc:
        vllm_runs.run(str(tmp_path), [300], 2, 1, configs, log=open(os.devnull, "w"),
                      request_gap=0.0, interleave=True)
    assert isinstance(exc.value.__context__, KeyboardInterrupt)   # raised while stopping for it
    assert sorted(stopped) == sorted(configs), stopped
    assert sorted(removed) == sorted(str(tmp_path / f"{c}.pool") for c in ("tract", "prefix"))
    stop_fails.clear()
    # more instances than the memory available holds: refused before any starts;
    # what fits runs
    monkeypatch.setattr(calls, "complete", lambda server, tokens, *a, **k: took(server.name,
                                                                                 tokens))
    started.clear()
    monkeypatch.setattr(vllm_runs, "check_room", check_room)
    from tract_cli.core import medium
    monkeypatch.setattr(medium, "mem_available", lambda: 8 << 30)
    with pytest.raises(vllm_runs.UsageError, match="5 vLLM instances up at once"):
        vllm_runs.run(str(tmp_path), [300], 2, 1, configs, log=open(os.devnull, "w"),
                      request_gap=0.0, interleave=True)
    assert started == []
    monkeypatch.setattr(medium, "mem_available", lambda: 64 << 30)
    res = vllm_runs.run(str(tmp_path), [300], 2, 1, configs, log=open(os.devnull, "w"),
                        request_gap=0.0, interleave=True)
    assert [c for c, _ in started] == configs and not res["failed"]
    # counted: one instance for one vLLM, two a pair, LMCache's server, the regions
    n, need = vllm_runs.room_needed(str(tmp_path), ["lmcache", "mono"], [300], 2, 2)
    assert n == 3 and need > 3 * ((2 << 30) + vllm_runs.INSTANCE_BYTES) + (1 << 30), need
    n, need_tract = vllm_runs.room_needed(str(tmp_path), ["tract", "mono"], [300], 2, 2)
    assert n == 3 and need_tract > 3 * ((2 << 30) + vllm_runs.INSTANCE_BYTES), need_tract
    with pytest.raises(vllm_runs.UsageError, match="--mono-beside would add"):
        vllm_runs.run(str(tmp_path), [300], 2, 1, ["tract"], log=open(os.devnull, "w"),
                      interleave=True, mono_beside=True)
