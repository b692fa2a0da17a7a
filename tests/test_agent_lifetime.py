"""Who starts an agent decides when it stops, and a launched agent runs this
copy of TraCT: workers' agents stop once their node is idle (nothing of them
stays running or mapped), an agent started by hand runs until stopped, every
agent stops when its region file is removed, and a checkout in the working
directory is never what a child process imports."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from procs import wait_for
from servers import Server, request
from tract_cli.core import spawn
from tract_cli.core.agent_launch import ensure_agent
from tract_cli.core.local import local_path
from tract_cli.core.medium import processes_using
from tract_cli.core.nodes import read_nodes
from tract_cli.core.pids import pid_alive
from tract_cli.core.pool import Pool
from tract_cli.core.region import remove_region

WAIT_S = 90          # bound of every wait below (two busy cores)
TRACT = [sys.executable, "-m", "tract_cli.cli"]


def _wait(cond, what: str, timeout: float = WAIT_S):
    """Polls COND (bounded); fails with WHAT when it never holds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)       # polling state other processes change
    raise AssertionError(f"within {timeout} s: {what}")


def nodes(path):
    with Pool.attach(path, readonly=True, prefault=False) as p:
        return {r.node: r for r in read_nodes(p)}


@pytest.fixture
def decoy(tmp_path):
    """A directory holding a `tract_cli` package that refuses to be imported."""
    pkg = tmp_path / "tract_cli"
    (pkg / "core").mkdir(parents=True)
    for f in (pkg / "__init__.py", pkg / "core" / "__init__.py",
              pkg / "core" / "agent_main.py"):
        f.write_text("raise SystemExit('the decoy tract_cli was imported')\n")
    return tmp_path


def test_a_launched_agent_imports_the_running_copy_not_the_working_directorys(
        region_path, decoy, monkeypatch):
    Pool.create(region_path, 16 << 20, "tiny", nodes=3).close()
    monkeypatch.chdir(decoy)
    proc = ensure_agent(region_path, 0, manager=True)
    try:
        assert proc is not None and proc.poll() is None
        assert os.readlink(f"/proc/{proc.pid}/cwd") == str(decoy)
        # the compiled core it mapped is the one next to the package this test imported
        with open(f"/proc/{proc.pid}/maps") as f:
            natives = {line.split()[-1] for line in f if "_native" in line}
        assert natives and all(n.startswith(spawn.PACKAGE_ROOT + os.sep) for n in natives), natives
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


@pytest.mark.parametrize("how", ["module_command", "python 3.10 bootstrap"])
def test_module_command_ignores_a_package_in_the_working_directory(decoy, how):
    if how == "module_command":
        argv = spawn.module_command("tract_cli.core.agent_main", "--help")
    else:
        argv = [sys.executable, "-c", spawn._BOOTSTRAP, "tract_cli.core.agent_main", "--help"]
    res = subprocess.run(argv, cwd=decoy, env=spawn.child_env(), capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0 and "AgentOptions" in res.stdout, res.stderr
    # and without it, the decoy is what Python imports: the test can fail
    res = subprocess.run([sys.executable, "-m", "tract_cli.core.agent_main", "--help"], cwd=decoy,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "decoy" in res.stderr


def _free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def test_workers_agents_stop_after_the_workers_and_nothing_stays_mapped(region_path):
    """serve-prefill and serve-decode each start their node's agent; once both
    workers stop, the agents stop by themselves (the manager last) and no
    process maps the region; `tract inspect` shows who started them."""
    Pool.create(region_path, 64 << 20, "tiny-llama", nodes=4).close()
    env = {"TRACT_AGENT_IDLE_EXIT_S": "1"}
    prefill = Server("serve-prefill", "--pool", region_path, "--node", "1", start_agent=True,
                     env=env)
    decode = None
    try:
        decode = Server("serve-decode", "--pool", region_path, "--node", "2", "--prefill",
                        prefill.url, start_agent=True, env=env)
        table = nodes(region_path)
        agents = {n: table[n].agent_pid for n in (1, 2)}
        assert all(table[n].alive() and table[n].autostop for n in (1, 2))
        # an agent is up once its entry is published; it starts the manager next
        assert wait_for("node 1's agent to run the lock manager",
                        lambda: nodes(region_path)[1].manager)
        assert not table[2].manager
        res = subprocess.run([*TRACT, "inspect", region_path, "--nodes", "--json"],
                             capture_output=True, text=True, timeout=120)
        rows = {r["node"]: r for r in json.loads(res.stdout)["nodes"]["nodes"]}
        assert rows[1]["started_by"] == rows[2]["started_by"] == "worker"
        status, out = request(decode.url + "/v1/completions",
                              {"prompt": [1, 2, 3, 4, 5], "max_tokens": 2, "temperature": 0})
        assert status == 200, out
    finally:
        if decode is not None:
            decode.stop()
        prefill.stop()
    _wait(lambda: not any(pid_alive(p) for p in agents.values()),
          f"the workers' agents {agents} did not stop")
    _wait(lambda: not processes_using(region_path), "processes still map the region")
    table = nodes(region_path)
    assert table[1].state == table[2].state == 2          # left, not stale


def test_a_hand_started_agent_runs_on_while_a_workers_agent_stops(region_path):
    Pool.create(region_path, 16 << 20, "tiny", nodes=3).close()
    hand = subprocess.Popen([*TRACT, "agent", "--pool", region_path, "--node", "0", "--manager"],
                            stderr=subprocess.PIPE, text=True)
    try:
        _wait(lambda: nodes(region_path)[0].agent_pid == hand.pid and nodes(region_path)[0].alive(),
              "the hand-started agent did not heartbeat")
        auto = ensure_agent(region_path, 1, idle_exit=0.5)
        res = subprocess.run([*TRACT, "inspect", region_path, "--nodes", "--json"],
                             capture_output=True, text=True, timeout=120)
        rows = {r["node"]: r for r in json.loads(res.stdout)["nodes"]["nodes"]}
        assert rows[0]["started_by"] == "hand" and rows[1]["started_by"] == "worker"
        text = subprocess.run([*TRACT, "inspect", region_path, "--nodes"], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "COLUMNS": "250"}).stdout
        assert "hand (runs until stopped)" in text and "stops when the node is idle" in text
        # no process on either node: the worker's agent stops by itself, the other does not
        assert auto.wait(timeout=WAIT_S) == 0
        assert hand.poll() is None and nodes(region_path)[0].alive()
        assert nodes(region_path)[1].state == 2
    finally:
        hand.send_signal(signal.SIGTERM)
        hand.wait(timeout=30)
    assert "stopped" in hand.stderr.read()


@pytest.mark.parametrize("started", ["by a worker", "by hand"])
def test_an_agent_stops_when_its_region_file_is_removed(region_path, started):
    Pool.create(region_path, 16 << 20, "tiny", nodes=3).close()
    with Pool.attach(region_path, readonly=True, prefault=False) as p:
        uuid = p.info.uuid
    if started == "by hand":
        proc = subprocess.Popen([*TRACT, "agent", "--pool", region_path, "--node", "0"],
                                stderr=subprocess.PIPE, text=True)
        _wait(lambda: nodes(region_path)[0].agent_pid == proc.pid, "the agent did not start")
    else:
        # a worker attached to the node: idleness alone would not stop it
        worker = Pool.attach(region_path, node=0, prefault=False)
        proc = ensure_agent(region_path, 0, idle_exit=3600)
    os.unlink(region_path)
    try:
        assert proc.wait(timeout=WAIT_S) == 0
    finally:
        if started == "by a worker":
            worker.close()
    if started == "by hand":
        assert "was removed" in proc.stderr.read()
    assert not os.path.exists(local_path(uuid, 0))
    _wait(lambda: not processes_using(region_path), "processes still map the removed region")
    remove_region(region_path)


def test_decode_health_waits_for_a_prefill_worker_then_the_first_request_succeeds(region_path):
    from tract_cli.serve.engine import Engine, Sampling
    Pool.create(region_path, 64 << 20, "tiny-llama", nodes=4).close()
    agents = [ensure_agent(region_path, 0, manager=True), ensure_agent(region_path, 1),
              ensure_agent(region_path, 2)]
    port = _free_port()
    servers = []
    try:
        decode = Server("serve-decode", "--pool", region_path, "--node", "2", "--prefill",
                        f"http://127.0.0.1:{port}")
        servers.append(decode)
        status, body = request(decode.url + "/health")
        assert status == 503, body
        assert "waiting for a prefill worker" in body["error"]["message"]
        assert f"127.0.0.1:{port}" in body["error"]["message"]
        servers.append(Server("serve-prefill", "--pool", region_path, "--node", "1", port=port))
        _wait(lambda: request(decode.url + "/health")[0] == 200, "decode never became ready")
        p = [3, 1, 4, 1, 5, 9, 2, 6]
        status, out = request(decode.url + "/v1/completions",
                              {"prompt": p, "max_tokens": 3, "temperature": 0})
        assert status == 200, out
        engine = Engine.load(None, "tiny-llama", 0)
        assert out["tract"]["token_ids"] == engine.generate(p, Sampling(3, 0.0, 0))
    finally:
        for s in reversed(servers):
            s.stop()
        for a in agents:
            a.terminate()
            a.wait(timeout=30)
