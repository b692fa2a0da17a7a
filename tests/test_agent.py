"""`tract agent`: one per node, one manager per region, clean SIGTERM."""
from __future__ import annotations

import subprocess
import sys

import pytest

from agents import RunningAgent
from procs import wait_for
from tract_cli.core.nodes import NODE_ALIVE, NODE_LEFT, read_nodes
from tract_cli.core.pool import Pool


@pytest.fixture
def region(region_path):
    Pool.create(region_path, 16 << 20, "tiny", nodes=3).close()
    return region_path


def agent_cli(*args):
    return subprocess.run([sys.executable, "-m", "tract_cli.cli", "agent", *args],
                          capture_output=True, text=True, timeout=60)


def nodes(path):
    with Pool.attach(path, readonly=True, prefault=False) as p:
        return read_nodes(p)


def test_agent_heartbeats_and_leaves_cleanly_on_sigterm(region):
    agent = RunningAgent(region, 1, manager=False)
    rec = nodes(region)[1]
    assert rec.state == NODE_ALIVE and rec.agent_pid == agent.proc.pid and not rec.manager
    assert rec.epoch == 1
    assert agent.stop() == 0
    assert nodes(region)[1].state == NODE_LEFT
    again = RunningAgent(region, 1, manager=False)   # a restart gets a new epoch
    assert nodes(region)[1].epoch == 2
    again.stop()


def test_a_second_agent_for_the_same_node_refuses(region):
    with RunningAgent(region, 0, manager=True) as first:
        res = agent_cli("--pool", region, "--node", "0")
        assert res.returncode == 1
        assert f"an agent for node 0 already runs (pid {first.proc.pid})" in res.stderr
        assert "Traceback" not in res.stderr


def test_a_second_manager_refuses_while_the_first_heartbeats(region):
    with RunningAgent(region, 0, manager=True) as first:
        res = agent_cli("--pool", region, "--node", "1", "--manager")
        assert res.returncode == 1
        assert f"a lock manager already runs on node 0 (pid {first.proc.pid}" in res.stderr
    # once it has left, another node may run the manager (the agent is up
    # once its node entry is published; it starts the manager right after)
    with RunningAgent(region, 1, manager=True):
        wait_for("node 1's agent to run the lock manager", lambda: nodes(region)[1].manager)


def test_agent_rejects_a_node_out_of_range(region):
    res = agent_cli("--pool", region, "--node", "7")
    assert res.returncode == 2 and "node 7 is outside" in res.stderr


def test_an_agent_that_fails_to_start_gives_the_node_back(region, monkeypatch):
    """A start that fails after taking the node's agent mutex (here: the node
    table cannot be written, as in a corrupted region) releases the mutex even
    though marking the node as left fails too; a mutex left locked in a
    segment that is then unmapped made a later unlock crash the process (the
    fuzzer's seed 77031)."""
    from tract_cli.core.agent import Agent
    from tract_cli.core.errors import TractError

    def broken(self, arg):
        raise TractError("the node table cannot be written", "test")
    monkeypatch.setattr(Agent, "_rejoin", broken)      # the start's first publish
    monkeypatch.setattr(Agent, "_publish", broken)
    with pytest.raises(TractError, match="cannot be written"):
        Agent(region, 1).start()
    monkeypatch.undo()
    agent = Agent(region, 1).start()          # the node's mutex is free again
    agent.stop()


def test_a_stop_flag_is_set_by_a_handler_without_any_lock():
    """The agent's SIGTERM handler only sets a flag (core/stopflag.py): an Event
    set from the handler deadlocked when SIGTERM landed inside that Event's own
    wait (tests/test_dead_host.py saw the agent never stop)."""
    import inspect as pyinspect
    import time

    from tract_cli.core.stopflag import StopFlag
    flag = StopFlag()
    t0 = time.monotonic()
    assert flag.wait(0.12) is False and time.monotonic() - t0 >= 0.12
    assert "Lock" not in pyinspect.getsource(StopFlag.request)
    flag.request(15, None)
    assert flag.is_set() and flag.wait(10) is True
