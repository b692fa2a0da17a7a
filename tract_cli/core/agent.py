"""The node agent: the duties of a node that outlive any worker.

One agent per node (held by the node's agent mutex in its local segment):
it heartbeats in the node table, runs the lock manager on the manager node
(exactly one per region: an agent refuses to start a manager while another
node's manager heartbeat is fresh), releases the lock grants and requests of
its node's dead processes, reclaims expired handoffs (on the manager node),
and is where the rest of recovery hangs (issue: faults).  Workers and benchmarks start one with `ensure_agent` when none runs.
"""
from __future__ import annotations

import os
import socket
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

from tract_cli.core.errors import TractError
from tract_cli.core.native import ffi, lib, raise_for
from tract_cli.core.pool import Pool

NODE_LINE = struct.Struct("<IIQQIIQ24s")   # line 0 of a node entry (FORMAT.md §4.2)
NODE_ALIVE, NODE_LEFT = 1, 2
FLAG_MANAGER = 1
HEARTBEAT_S = 0.1
RECLAIM_S = 0.5
STALE_S = 2.0


@dataclass(frozen=True)
class NodeRecord:
    """Line 0 of one node-table entry, decoded."""

    node: int
    state: int
    agent_pid: int
    epoch: int
    heartbeat_ns: int
    manager: bool
    manager_heartbeat_ns: int
    hostname: str

    def heartbeat_age(self, now_ns: int | None = None) -> float:
        """Seconds since the last heartbeat (inf if never)."""
        if not self.heartbeat_ns:
            return float("inf")
        return max(0, (now_ns or time.time_ns()) - self.heartbeat_ns) / 1e9

    def alive(self, stale_s: float = STALE_S) -> bool:
        return self.state == NODE_ALIVE and self.heartbeat_age() < stale_s


def read_nodes(pool: Pool) -> list[NodeRecord]:
    """The node table as this host observes it now."""
    sec = pool.info.section("nodes")
    raw = pool.observe(sec.offset, sec.length)
    out = []
    for n in range(sec.count):
        f = NODE_LINE.unpack_from(raw, n * sec.entry_size)
        out.append(NodeRecord(n, f[0], f[1], f[2], f[3], bool(f[4] & FLAG_MANAGER), f[6],
                              f[7].rstrip(b"\0").decode(errors="replace")))
    return out


@dataclass
class Recovered:
    """What one recovery pass gave back from the node's dead processes."""

    processes: int = 0
    pins: int = 0
    claims: int = 0
    slots: int = 0
    partial: int = 0      # journals that had overflowed: the rest needs `tract check --repair`

    def describe(self) -> str:
        text = (f"recovered {self.processes} dead process(es): {self.pins} pin(s) released, "
                f"{self.claims} unfinished write(s) dropped, {self.slots} slot(s) freed")
        if self.partial:
            text += (f"; {self.partial} journal(s) had overflowed: run `tract check --repair` "
                     "offline for the rest")
        return text


def recover_dead_processes(pool: Pool, timeout: float = 1.0) -> Recovered:
    """Gives back what this node's dead processes held in the index: their
    journaled pins and unfinished (PENDING) writes with their slots."""
    out = ffi.new("uint64_t[5]")
    rc = lib.tract_recover_dead(pool._r(), out, int(timeout * 1e9))
    if rc == lib.TRACT_E_TIMEOUT:
        return Recovered()           # a stripe lock was busy: the next heartbeat retries
    raise_for(rc, "recovery of dead processes")
    return Recovered(*(int(v) for v in out))


class Agent:
    """A running node agent (foreground: `tract agent`)."""

    def __init__(self, pool_path: str, node: int, manager: bool = False, *,
                 simulate: bool | None = None, flush_mode: str | None = None,
                 heartbeat_s: float = HEARTBEAT_S, idle_sleep_max_s: float = 0.001):
        self.node = node
        self.manager = manager
        self.heartbeat_s = heartbeat_s
        self.pool = Pool.attach(pool_path, node=node, simulate=simulate, flush_mode=flush_mode,
                                prefault=False)
        self._manager = None
        self._stop = threading.Event()
        self._thread = None
        self._locked = False
        self.reclaimed = 0
        self.recovered_locks = 0
        self.recovered_processes = 0
        self.epoch = 0
        self._idle_sleep_max_ns = int(idle_sleep_max_s * 1e9)

    def start(self) -> "Agent":
        """Takes the node, checks manager uniqueness, starts heartbeat and manager."""
        try:
            rc = lib.tract_agent_lock(self.pool._r())
            if rc == lib.TRACT_E_TIMEOUT:
                me = read_nodes(self.pool)[self.node]
                raise TractError(f"an agent for node {self.node} already runs (pid {me.agent_pid})",
                                 "stop it first, or use it")
            raise_for(rc, "agent lock")
            self._locked = True
            if self.manager:
                for rec in read_nodes(self.pool):
                    if rec.node != self.node and rec.manager and rec.alive():
                        raise TractError(
                            f"a lock manager already runs on node {rec.node} (pid {rec.agent_pid}, "
                            f"heartbeat {rec.heartbeat_age():.1f} s ago)",
                            "run this agent without --manager; one manager serves the region")
            self.epoch = read_nodes(self.pool)[self.node].epoch + 1
            self._publish(NODE_ALIVE)
            if self.manager:
                out = ffi.new("tract_manager **")
                raise_for(lib.tract_manager_start(self.pool._r(), self._idle_sleep_max_ns, out),
                          "lock manager")
                self._manager = out[0]
            self._thread = threading.Thread(target=self._heartbeat, name="tract-heartbeat",
                                            daemon=True)
            self._thread.start()
        except BaseException:
            self.stop()
            raise
        return self

    def _publish(self, state: int) -> None:
        sec = self.pool.info.section("nodes")
        now = time.time_ns()
        line = NODE_LINE.pack(state, os.getpid(), self.epoch, now,
                              FLAG_MANAGER if self.manager and state == NODE_ALIVE else 0, 0,
                              now if self.manager else 0,
                              socket.gethostname().encode()[:23])
        self.pool.publish(sec.offset + self.node * sec.entry_size, line)

    def _heartbeat(self) -> None:
        last_reclaim = 0.0
        while not self._stop.wait(self.heartbeat_s):
            self._publish(NODE_ALIVE)
            # locks held or requested by this node's dead processes: released
            count = ffi.new("uint32_t *")
            if lib.tract_lock_recover(self.pool._r(), count) == 0 and count[0]:
                self.recovered_locks += count[0]
                print(f"tract agent: node {self.node}: released {count[0]} lock(s) of dead "
                      "processes", file=sys.stderr, flush=True)
            # then what they held in the index (their stripe locks are free now)
            try:
                got = recover_dead_processes(self.pool)
            except TractError as err:
                print(f"tract agent: node {self.node}: recovery: {err}", file=sys.stderr,
                      flush=True)
            else:
                if got.processes:
                    self.recovered_processes += got.processes
                    print(f"tract agent: node {self.node}: {got.describe()}", file=sys.stderr,
                          flush=True)
            # handoffs whose acknowledgement or reclaim a dead process left half done
            try:
                finished = self.pool.handoffs.recover()
            except TractError as err:
                print(f"tract agent: node {self.node}: handoff recovery: {err}",
                      file=sys.stderr, flush=True)
            else:
                if finished:
                    print(f"tract agent: node {self.node}: finished {finished} handoff "
                          "release(s) of dead processes", file=sys.stderr, flush=True)
            now = time.monotonic()
            if self.manager and now - last_reclaim >= RECLAIM_S:
                # expired handoffs (a decode side that died): pins and slots back
                last_reclaim = now
                try:
                    self.reclaimed += self.pool.handoffs.reclaim(timeout=RECLAIM_S)
                except TractError as err:
                    print(f"tract agent: node {self.node}: reclaim: {err}", file=sys.stderr,
                          flush=True)

    def manager_stats(self) -> dict:
        """Scans, grants, releases, idle sleeps of the manager thread."""
        if self._manager is None:
            return {}
        out = ffi.new("uint64_t[4]")
        lib.tract_manager_stats(self._manager, out)
        return dict(zip(("scans", "grants", "releases", "sleeps"), list(out)))

    def wait(self, stop: threading.Event) -> None:
        """Blocks until STOP is set (SIGTERM / Ctrl-C in the CLI)."""
        while not stop.wait(0.5):
            pass

    def stop(self) -> None:
        """Stops the manager and heartbeat, marks the node as left, frees the node."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None
        if self._manager is not None:
            lib.tract_manager_stop(self._manager)
            self._manager = None
        if self._locked:
            self._publish(NODE_LEFT)
            lib.tract_agent_unlock(self.pool._r())
            self._locked = False
        if not self.pool.closed:
            self.pool.close()


def ensure_agent(pool_path: str, node: int, manager: bool = False, timeout: float = 15.0,
                 log_path: str | None = None, **attach) -> subprocess.Popen | None:
    """Starts `tract agent` for NODE unless one is alive; returns the process started.

    Waits (bounded) until the new agent's heartbeat shows in the node table.
    """
    with Pool.attach(pool_path, node=node, readonly=True, prefault=False) as pool:
        if read_nodes(pool)[node].alive():
            return None
    cmd = [sys.executable, "-m", "tract_cli.cli", "agent", "--pool", pool_path, "--node", str(node)]
    if manager:
        cmd.append("--manager")
    if attach.get("simulate"):
        cmd.append("--simulate")
    if attach.get("flush_mode"):
        cmd += ["--flush-mode", attach["flush_mode"]]
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                            start_new_session=True)
    deadline = time.monotonic() + timeout
    with Pool.attach(pool_path, node=node, readonly=True, prefault=False) as pool:
        while time.monotonic() < deadline:
            rec = read_nodes(pool)[node]
            if rec.agent_pid == proc.pid and rec.alive():
                return proc
            if proc.poll() is not None:
                raise TractError(f"the agent for node {node} exited with code {proc.returncode}",
                                 f"run `tract agent --pool {pool_path} --node {node}` to see why")
            time.sleep(0.02)   # polling a heartbeat another process writes
    proc.kill()
    raise TractError(f"the agent for node {node} did not heartbeat within {timeout:.0f} s",
                     "check the machine's load and the agent's log")
