"""`tract bench --engine vllm` with the real peers on the same real vLLM: each
configuration starts, hands the prompt over, answers as one vLLM, and leaves
no server, region or directory behind; a peer that is not installed is
skipped with the command that installs it.  The figures are a benchmark
(docs/VLLM.md), not a test: one small run per configuration here."""
from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import tempfile

import psutil
import pytest

from tests.vllm_stack import VLLM_PY

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PEERS = os.path.join(ROOT, ".peers")
MARK = "TRACT_TEST_VLLM_BENCH"      # in the environment of everything a bench here starts

needs_vllm = pytest.mark.skipif(not os.path.exists(VLLM_PY),
                                reason=f"no vLLM environment at {VLLM_PY} (.ci/setup builds it)")


def _bench(args: list[str], peers_dir: str, timeout: float) -> subprocess.CompletedProcess:
    """`tract bench --engine vllm ARGS`; past TIMEOUT it is stopped as a user stops it
    (SIGTERM: it stops its servers), and whatever it started is killed after that."""
    env = os.environ | {"TRACT_VLLM_PYTHON": VLLM_PY, "TRACT_PEERS_DIR": peers_dir,
                        "HF_HUB_OFFLINE": "1", "COLUMNS": "200", MARK: str(os.getpid())}
    proc = subprocess.Popen([sys.executable, "-m", "tract_cli.cli", "bench", "--engine", "vllm",
                             *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            proc.communicate(timeout=120)
        finally:
            proc.kill()
            for pid in _our_processes():
                try:
                    psutil.Process(pid).kill()
                except psutil.Error:
                    pass
        pytest.fail(f"tract bench {' '.join(args)} ran past {timeout:.0f} s")
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def _our_processes() -> set[int]:
    """The live processes this test's benches started (they inherit MARK), whoever
    their parent is now."""
    out = set()
    for proc in psutil.process_iter():
        try:
            if proc.environ().get(MARK) == str(os.getpid()):
                out.add(proc.pid)
        except psutil.Error:
            continue            # gone meanwhile, or not ours to read
    return out


def _debris() -> set[str]:
    return (set(glob.glob("/dev/shm/tract-bench-*")) |
            set(glob.glob(os.path.join(tempfile.gettempdir(), "tract-bench-vllm-*"))))


def _missing(config: str, monkeypatch) -> str | None:
    from tract_cli.bench.engine import configs
    monkeypatch.setenv("TRACT_PEERS_DIR", PEERS)
    return configs.unavailable(config, VLLM_PY)


@needs_vllm
def test_the_peers_run_beside_one_vllm_and_leave_nothing_behind(vllm_checkpoint, tmp_path,
                                                                 monkeypatch):
    """NixlConnector (both transports) and LMCache (its cache shared by two
    instances), one short prompt each, in one bench run beside one vLLM."""
    peers = [c for c in ("nixl", "nixl-tcp", "lmcache") if _missing(c, monkeypatch) is None]
    if not peers:
        pytest.skip("; ".join(_missing(c, monkeypatch) for c in ("nixl", "lmcache")))
    before_files = _debris()
    out = tmp_path / "run.json"
    res = _bench(["--model", vllm_checkpoint, "--input-len", "300", "--requests", "1",
                  *[a for c in peers + ["mono"] for a in ("--vllm-config", c)],
                  "--json", str(out)], PEERS, timeout=1200)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    run = json.loads(out.read_text())
    rows = {s["config"]: s for s in run["summaries"]}
    expected = [c for c in peers if c != "lmcache"] + (
        ["lmcache-hit", "lmcache-miss"] if "lmcache" in peers else [])
    assert sorted(rows) == sorted(expected + ["mono"])
    for config in expected:
        # the same answer as one vLLM
        assert rows[config]["verified"] is True, rows[config]
    for config in expected:
        if config in ("nixl", "nixl-tcp", "lmcache-hit"):
            # handed over: the decode instance (for LMCache, the second instance)
            # took prompt tokens from its connector
            assert rows[config]["handed_over"] == rows[config]["requests"] == 1, rows[config]
            assert 0 < rows[config]["kv_tokens_mean"] <= 300, rows[config]
    for config in ("nixl", "nixl-tcp"):
        if config in rows:
            assert rows[config]["prefill_s"] > 0 and rows[config]["decode_s"] > 0
    if "lmcache" in peers:
        hit = next(r for r in run["records"] if r["config"] == "lmcache-hit")
        # LMCache stores whole chunks (vLLM's 128-token blocks): 2 of a 300-token prompt
        assert hit["hit_tokens"] == 256, hit
    assert run["skipped"] == {}
    for config in expected + ["mono"]:
        assert config in res.stdout
    assert "from KV path" in res.stdout          # the prompt tokens each took from its path
    if "lmcache" in peers:
        assert "256 tokens" in res.stdout
    assert _our_processes() == set(), "a process the bench started outlived it"
    assert _debris() - before_files == set(), "the bench left files behind"
    assert not glob.glob("/dev/shm/*tract-bench-lmcache*"), "LMCache's pool outlived the bench"


@needs_vllm
def test_a_peer_not_installed_is_skipped_with_the_command_that_installs_it(tmp_path,
                                                                           vllm_checkpoint):
    res = _bench(["--model", vllm_checkpoint, "--input-len", "300", "--requests", "1",
                  "--vllm-config", "nixl"], str(tmp_path / "no-peers"), timeout=300)
    assert res.returncode == 1
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    err = lines[-1]
    assert "Traceback" not in res.stderr
    assert "error: no configuration ran: nixl: vLLM with nixl is not installed" in err
    assert "tract bench --engine vllm --vllm-config nixl --install-peers" in err


def test_an_answer_unlike_one_vllms_is_not_verified():
    """The bench's check can fail: a configuration's answer that differs from one
    vLLM's in one token is reported unverified."""
    from tract_cli.bench.engine.vllm_runs import summarize, verify
    records = [{"config": c, "input_len": 10, "request": 0, "ttft_s": 0.1, "prefill_s": None,
                "decode_s": None} for c in ("mono", "nixl")]
    texts = {0: {"mono": " a b c", "nixl": " a b c"}}
    verify(records, texts)
    assert all(r["verified"] for r in records)
    texts[0]["nixl"] = " a b d"
    verify(records, texts)
    assert {s["config"]: s["verified"] for s in summarize(records)} == {"mono": True,
                                                                         "nixl": False}


@needs_vllm
def test_mooncake_runs_or_its_failure_is_reported_and_the_rest_run(vllm_checkpoint, tmp_path,
                                                                   monkeypatch):
    """vLLM's MooncakeConnector: handed over and verified where it runs; where it
    cannot (vLLM 0.32's CPU build stops it at start), the bench says why in one
    line, still runs the other configuration, exits non-zero, keeps the logs it
    names and leaves nothing running."""
    why = _missing("mooncake", monkeypatch)
    if why:
        pytest.skip(why)
    before_files = _debris()
    out = tmp_path / "run.json"
    res = _bench(["--model", vllm_checkpoint, "--input-len", "300", "--requests", "1",
                  "--vllm-config", "mooncake", "--vllm-config", "mono", "--json", str(out)],
                 PEERS, timeout=1200)
    assert "Traceback" not in res.stdout + res.stderr
    assert _our_processes() == set(), "a process the bench started outlived it"
    if res.returncode == 0:
        run = json.loads(out.read_text())
        row = next(s for s in run["summaries"] if s["config"] == "mooncake")
        assert row["handed_over"] == 1 and row["verified"] is True, row
        assert _debris() - before_files == set(), "the bench left files behind"
        return
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    failure = [ln for ln in res.stdout.splitlines() if ln.startswith("mooncake failed: ")]
    assert len(failure) == 1 and "vLLM exited" in failure[0], res.stdout
    logs = next(ln for ln in res.stdout.splitlines() if ln.startswith("the vLLM servers' logs: "))
    kept = logs.split(": ", 1)[1].strip()
    assert os.path.isfile(os.path.join(kept, "mooncake-prefill.log"))
    assert "mono" in res.stdout            # the rest ran and is reported
    import shutil
    shutil.rmtree(kept)
    assert _debris() - before_files == set(), "the bench left files behind"
