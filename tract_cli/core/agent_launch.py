"""Starting a node's agent from a worker or a benchmark, when none runs.

`ensure_agent` starts `python -m tract_cli.core.agent_main` (`core/spawn.py`:
with this very copy of the package, never a checkout that happens to be the
working directory) as a process group of its own in the caller's session
(not a session of its own: see `ensure_agent`) unless the node's entry
in the node table shows a live agent, and waits (bounded) for its first
heartbeat; `start_node_agent` is what workers call: the agent it starts runs
the lock manager when no node has a live one, and stops by itself once the
node has been idle for `IDLE_EXIT_S` (docs/PROTOCOLS.md §7); `AgentWatch`
keeps it running while the worker lives.
"""
from __future__ import annotations

import logging
import os
import subprocess
import threading
import time

from tract_cli.core.agent import HOST_DEAD_AFTER_S, TAKEOVER_AFTER_S, AgentOptions
from tract_cli.core.errors import TractError, UsageError
from tract_cli.core.nodes import on_this_host, read_nodes
from tract_cli.core.pids import pid_alive
from tract_cli.core.pool import Pool
from tract_cli.core.spawn import child_env, module_command, own_process_group

# how long an agent that a worker started waits with no process on its node
# before it stops (TRACT_AGENT_IDLE_EXIT_S overrides it, e.g. in tests)
IDLE_EXIT_S = float(os.environ.get("TRACT_AGENT_IDLE_EXIT_S") or 30.0)


def ensure_agent(pool_path: str, node: int, manager: bool = False, timeout: float = 15.0,
                 log_path: str | None = None, takeover_after: float | None = TAKEOVER_AFTER_S,
                 idle_exit: float | None = None,
                 host_dead_after: float | None = HOST_DEAD_AFTER_S,
                 **attach) -> subprocess.Popen | None:
    """Starts an agent process for NODE unless one is alive; returns the process started.

    IDLE_EXIT (seconds): the agent stops by itself once the node has had no
    attached process for that long (what workers pass: `IDLE_EXIT_S`); None:
    it runs until stopped.  The process is `python -m tract_cli.core.agent_main`
    with this copy of the package (`spawn`): never a checkout's that happens to
    be the working directory.  Waits (bounded) until the new agent's
    heartbeat shows in the node table.
    """
    with Pool.attach(pool_path, node=node, readonly=True, prefault=False) as pool:
        rec = read_nodes(pool)[node]
        # a fresh heartbeat of an agent seen dead on this host does not count
        if rec.alive() and not (on_this_host(rec) and not pid_alive(rec.agent_pid)):
            return None
    opts = AgentOptions(pool_path, node, manager, simulate=bool(attach.get("simulate")),
                        flush_mode=attach.get("flush_mode") or None,
                        takeover_after=takeover_after, idle_exit=idle_exit,
                        host_dead_after=host_dead_after)
    opts.check()                  # here, not as the child's exit code
    cmd = module_command("tract_cli.core.agent_main", opts.to_json())
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        # in this session, a process group of its own (spawn.own_process_group):
        # a session of its own is an autogroup of its own where Linux has them,
        # and on a host whose cores the engine keeps busy that group's share
        # left the lock manager runnable and waiting 0.1-1.3 s for a core (lock
        # round trips timed out; its threads' schedstat showed the wait)
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                env=child_env(), **own_process_group())
    finally:
        if log is not subprocess.DEVNULL:
            log.close()
    deadline = time.monotonic() + timeout
    with Pool.attach(pool_path, node=node, readonly=True, prefault=False) as pool:
        while time.monotonic() < deadline:
            rec = read_nodes(pool)[node]
            if rec.agent_pid == proc.pid and rec.alive():
                return proc
            if proc.poll() is not None:
                raise TractError(f"the agent for node {node} exited with code {proc.returncode}",
                                 f"run `tract agent --pool {pool_path} --node {node}` to see why"
                                 + (f" (its log: {log_path})" if log_path else ""))
            time.sleep(0.02)   # polling a heartbeat another process writes
    proc.kill()
    raise TractError(f"the agent for node {node} did not heartbeat within {timeout:.0f} s",
                     "check the machine's load and the agent's log")


def start_node_agent(pool_path: str, node: int, **attach):
    """Starts this node's agent if none runs; it runs the lock manager when no
    node has a live one.  The agent is its own process (its own process group): it
    outlives the worker for IDLE_EXIT_S, then stops by itself once no process
    is attached to its node (a manager: and no other node's agent is alive)."""
    with Pool.attach(pool_path, node=node, readonly=True, prefault=False) as pool:
        nodes = read_nodes(pool)
    if not 0 <= node < len(nodes):
        raise UsageError(f"node {node} is outside this region's nodes 0..{len(nodes) - 1}",
                         "pick a node in range")
    manager = not any(n.manager and n.alive() for n in nodes)
    try:
        return ensure_agent(pool_path, node, manager=manager, idle_exit=IDLE_EXIT_S, **attach)
    except TractError as exc:
        if not manager:
            raise TractError(f"cannot start the node agent: {exc.problem}", exc.fix) from None
    # another node's worker started the manager meanwhile (the agent refused
    # to start a second one): be a plain agent.  Two agents starting in the
    # same instant can both pass that check; then both claim a fencing token
    # (core/agent.py, native/manager.c), the later claim supersedes the
    # earlier, whose agent stops its manager and stands by, and requesters
    # enter only under the current token: one manager serves the region.
    try:
        return ensure_agent(pool_path, node, manager=False, idle_exit=IDLE_EXIT_S, **attach)
    except TractError as exc:
        raise TractError(f"cannot start the node agent: {exc.problem}", exc.fix) from None


class AgentWatch:
    """Keeps a node's agent running while a worker of the node lives: a daemon
    thread checks every PERIOD_S seconds that the node's entry shows a live
    agent and starts one (`start_node_agent`) when it does not.

    Why a worker must: the lock manager's agent declares a node of another
    host dead once its agent's heartbeat has stood still for --host-dead-after
    (10 s by default), and then gives back what the node held -- its readers'
    pins among it -- while its workers may still be running.  An agent that
    crashes alone must therefore come back well within that time, and the
    workers are what is left on the node to notice (docs/PROTOCOLS.md §7).
    A node declared dead is not restarted here: its workers are fenced, and a
    new agent refuses to start while they run."""

    PERIOD_S = 1.0

    def __init__(self, pool_path: str, node: int, **attach):
        self.pool_path, self.node, self.attach = pool_path, node, attach
        self.restarts = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tract-agent-watch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.PERIOD_S):
            try:
                with Pool.attach(self.pool_path, node=self.node, readonly=True,
                                 prefault=False) as pool:
                    rec = read_nodes(pool)[self.node]
                if rec.dead or (rec.alive() and not (on_this_host(rec)
                                                     and not pid_alive(rec.agent_pid))):
                    continue
                if start_node_agent(self.pool_path, self.node, **self.attach) is not None:
                    self.restarts += 1
            except TractError as err:     # the next period tries again
                if not os.path.exists(self.pool_path):
                    return                # the region is gone: no agent can start for it
                logging.getLogger("tract.worker").warning(
                    "node %d's agent is not running and could not be started: %s", self.node, err)
            except OSError:               # the region is gone: nothing to keep
                return

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
