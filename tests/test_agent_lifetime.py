"""Who starts an agent decides when it stops, and a launched agent runs this
copy of TraCT: workers' agents stop once their node is idle (nothing of them
stays running or mapped), an agent started by hand runs until stopped, every
agent stops once its region file is removed and no process of its node runs
(nothing of the region stays in /dev/shm), and a checkout in the working
directory is never what a child process imports."""
from __future__ import annotations

import glob
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from procs import Worker, wait_for
from servers import Server, request
from tract_cli.core import spawn
from tract_cli.core.agent_launch import ensure_agent
from tract_cli.core.local import local_dir, local_path
from tract_cli.core.locks import LOCK_OBJDIR
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


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 has no process_group")
def test_a_launched_agent_shares_its_starters_session_in_a_process_group_of_its_own(
        region_path):
    """The agent a worker starts is scheduled with it, not as a session (an
    autogroup) of its own, whose share of a busy host's cores left the lock
    manager runnable and waiting 0.1-1.3 s (docs/PROTOCOLS.md §7); its own
    process group keeps it out of its starter's group stop (killpg) and the
    terminal's Ctrl-C."""
    Pool.create(region_path, 16 << 20, "tiny", nodes=3).close()
    proc = ensure_agent(region_path, 0, manager=True)
    try:
        assert proc is not None and proc.poll() is None
        assert os.getsid(proc.pid) == os.getsid(0)
        assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)
        if os.path.exists("/proc/self/autogroup"):       # a kernel with autogroups
            # The kernel prints nothing for a task whose CPU cgroup is not the
            # root's (a container, a systemd slice): there the cgroup schedules
            # it, not a session's autogroup, and both files are empty alike.
            with open(f"/proc/{proc.pid}/autogroup") as f, open("/proc/self/autogroup") as me:
                theirs, mine = f.read(), me.read()
            assert theirs == mine, (theirs, mine)
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


def region_files(uuid: str) -> list[str]:
    """What the region UUID has in the local segments' directory (/dev/shm)."""
    return sorted(glob.glob(os.path.join(local_dir(), f"tract-{uuid}-*")))


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return ""


@pytest.mark.parametrize("started", ["by a worker", "by hand"])
def test_an_agent_stops_when_its_region_file_is_removed_and_its_node_is_unused(
        region_path, tmp_path, started):
    Pool.create(region_path, 16 << 20, "tiny", nodes=3).close()
    with Pool.attach(region_path, readonly=True, prefault=False) as p:
        uuid = p.info.uuid
    log = str(tmp_path / "agent.log")
    # (the lock manager: an agent's first recovery pass waits for locks none would grant)
    if started == "by hand":
        with open(log, "wb") as f:
            proc = subprocess.Popen([*TRACT, "agent", "--pool", region_path, "--node", "0",
                                     "--manager"], stderr=f)
        _wait(lambda: nodes(region_path)[0].agent_pid == proc.pid, "the agent did not start")
    else:
        proc = ensure_agent(region_path, 0, manager=True, idle_exit=3600, log_path=log)
    # a process of the node (this one): the agent stays while it runs
    worker = Pool.attach(region_path, node=0, prefault=False)
    os.unlink(region_path)
    try:
        _wait(lambda: "is gone" in _read(log), "the agent did not see its region file removed")
        assert proc.poll() is None and os.path.exists(local_path(uuid, 0)), _read(log)
    finally:
        worker.close()
    assert proc.wait(timeout=WAIT_S) == 0, _read(log)
    assert "stopped: the region file" in _read(log)
    assert not region_files(uuid)
    _wait(lambda: not processes_using(region_path), "processes still map the removed region")
    remove_region(region_path)


@pytest.mark.parametrize("removed", ["before the workers stop", "after the workers stop"])
def test_nothing_of_a_removed_region_stays_once_its_processes_are_stopped(
        region_path, tmp_path, removed):
    """Workers on nodes 1 and 2, each node with its agent (node 1's runs the
    lock manager); node 0 had a process once (the one that made the region)
    and never an agent.  One worker is killed (SIGKILL), the other stopped
    (SIGTERM); the region file is removed (rm) while they run or after.
    Once they are stopped the agents stop, and nothing of the region stays
    in /dev/shm: their own nodes' segments, node 0's too."""
    Pool.create(region_path, 16 << 20, "tiny", nodes=3).close()
    with Pool.attach(region_path, readonly=True, prefault=False) as p:
        uuid = p.info.uuid
    logs = {n: str(tmp_path / f"agent{n}.log") for n in (1, 2)}
    agents = {1: ensure_agent(region_path, 1, manager=True, idle_exit=3600, log_path=logs[1]),
              2: ensure_agent(region_path, 2, idle_exit=3600, log_path=logs[2])}
    workers = {}
    try:
        workers = {n: Worker(region_path, n) for n in (1, 2)}
        assert region_files(uuid) == sorted(local_path(uuid, n) for n in (0, 1, 2))
        if removed == "before the workers stop":
            os.unlink(region_path)
            for n in (1, 2):
                _wait(lambda: "is gone" in _read(logs[n]),
                      f"node {n}'s agent did not see the region file removed")
            # the agents stay for the workers, which go on: the manager grants
            for n, w in workers.items():
                w.call("lock_acquire", lock_id=LOCK_OBJDIR, wait=30)
                w.call("lock_release", lock_id=LOCK_OBJDIR)
                assert agents[n].poll() is None, _read(logs[n])
            # (node 0's, which no process uses, any sweep on this host may take)
            assert {local_path(uuid, 1), local_path(uuid, 2)} <= set(region_files(uuid))
        workers[1].proc.kill()
        workers[2].proc.send_signal(signal.SIGTERM)
        for w in workers.values():
            w.proc.wait(timeout=WAIT_S)
        if removed == "after the workers stop":
            os.unlink(region_path)
        for n, a in agents.items():
            _wait(lambda: a.poll() is not None, f"node {n}'s agent did not stop: {_read(logs[n])}")
            assert a.returncode == 0 and "stopped: the region file" in _read(logs[n]), \
                _read(logs[n])
        _wait(lambda: not region_files(uuid),
              "files of the removed region stay in /dev/shm: " + ", ".join(region_files(uuid)))
        _wait(lambda: not processes_using(region_path), "processes still map the removed region")
    finally:
        for w in workers.values():
            w.kill()
            w.close()
        for a in agents.values():
            if a.poll() is None:
                a.kill()
                a.wait(timeout=30)


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
