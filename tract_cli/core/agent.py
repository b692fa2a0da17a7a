"""The node agent: the duties of a node that outlive any worker.

One agent per node (held by the node's agent mutex in its local segment):
it heartbeats in the node table (`core/nodes.py`), runs the lock manager on
the manager node (an agent refuses to start a manager while another node's
manager heartbeat is fresh), stands by to take the manager over when that
heartbeat has been stale for `takeover_after` seconds (fenced by the claim
tokens of native/manager.c, docs/PROTOCOLS.md §4), runs its node's recovery
of dead processes every heartbeat (`core/recovery.py`), sweeps dead payloads,
and reclaims expired handoffs (on the manager node).  An agent started with
`idle_exit_s` (by a worker, `core/agent_launch.py`) stops by itself once its
node has had no attached process for that long (and, on the manager node, no
other node has a live agent), an agent started by hand runs until stopped;
every agent stops once its region file is gone and no process of its node
uses the region, and then removes its node's local segment
(docs/PROTOCOLS.md §7).

`run_foreground` runs one in this process until a signal: what `tract agent`
and `python -m tract_cli.core.agent_main` do.  The agent logs to the
`tract.agent` logger; `log_to_stderr` shows it as `tract agent: node N: ...`
lines, as the agent's own process does.
"""
from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, fields

from tract_cli.core.errors import LockTimeout, NodeAlive, Superseded, TractError, UsageError
from tract_cli.core.local import local_path, region_holds, sweep_segments
from tract_cli.core.medium import processes_mapping
from tract_cli.core.native import ffi, lib, raise_for
from tract_cli.core.nodes import (FLAG_AUTOSTOP, FLAG_MANAGER, FLAG_STANDBY, NODE_ALIVE,
                                  NODE_LEFT, VERDICT_CLAIMS, VERDICT_PINS, VERDICT_SLOTS,
                                  current_manager, encode_node_line, fencing_token, on_this_host,
                                  read_nodes, token_node, token_text)
from tract_cli.core.pids import pid_alive
from tract_cli.core.pool import Pool
from tract_cli.core.recovery import NodeRecovery, declare_dead, recover_host, recover_node, rejoin
from tract_cli.core.stopflag import StopFlag

HEARTBEAT_S = 0.1
RECLAIM_S = 0.5
# the payload sweep of every heartbeat (docs/PROTOCOLS.md §1.1): slots visited,
# bytes evicted at most (~40 ms of clflushopt at this machine's 25 GB/s: it
# keeps up with a node reading 10 GB/s of payloads new to it)
PAYLOAD_SWEEP_SLOTS = 4096
PAYLOAD_SWEEP_BYTES = 1 << 30
ORPHAN_SWEEP_S = 30.0        # a walk of the whole index: at start, then this seldom
DEAD_SLOT_SWEEP_S = 5.0      # a dead host's slots others evicted: a walk of index and owner map
TAKEOVER_AFTER_S = 2.0
TAKEOVER_STAGGER_S = 0.5     # per standby ranked before this one: one candidate at a time
# a node of another host whose heartbeat stood still this long is declared dead
# by the lock manager's agent (docs/PROTOCOLS.md §7, "A dead host"): long
# enough that no live host's pause (a VM migration, a swap storm) reaches it,
# short enough that the rack does not wait long on a lock a dead host held
HOST_DEAD_AFTER_S = 10.0
# once its region file is gone, how often an agent whose node's journal names
# no live process looks for one that maps the node's segment all the same (a
# walk of every process's maps)
GONE_MAPS_S = 1.0

# what the agent says (started, stopped, manager taken over or given up, what
# recovery gave back, failed steps); nothing is shown unless the process shows
# it (`log_to_stderr`): a library user of `Agent` sees only warnings and errors,
# through Python's last-resort handler, until it configures logging itself
log = logging.getLogger("tract.agent")
_STDERR_HANDLER = "tract-agent-stderr"


def log_to_stderr() -> None:
    """Shows the agent's log on stderr from INFO up, one line a message, as
    `tract agent: node N: ...` (users and tests grep these lines); for a
    process that runs an agent (`run_foreground`).  Once per process: a
    second call changes nothing."""
    if any(h.get_name() == _STDERR_HANDLER for h in log.handlers):
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(_STDERR_HANDLER)
    handler.setFormatter(logging.Formatter("tract agent: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False      # the lines are this handler's: never twice through the root's


class Agent:
    """A running node agent (foreground: `tract agent`)."""

    def __init__(self, pool_path: str, node: int, manager: bool = False, *,
                 simulate: bool | None = None, flush_mode: str | None = None,
                 heartbeat_s: float = HEARTBEAT_S, idle_sleep_max_s: float = 0.001,
                 takeover_after_s: float | None = TAKEOVER_AFTER_S,
                 idle_exit_s: float | None = None,
                 host_dead_after_s: float | None = HOST_DEAD_AFTER_S):
        self.node = node
        self.idle_exit_s = idle_exit_s    # None: run until stopped (started by hand)
        self.manager = manager            # asked to start as the manager
        self.heartbeat_s = heartbeat_s
        self.takeover_after_s = takeover_after_s   # None: never take over
        self.host_dead_after_s = host_dead_after_s  # None: never declare a host dead
        self._host_watch: dict[int, tuple[tuple[int, int], float]] = {}  # node: (seen, since)
        self._host_sweeps: dict[tuple[int, int], float] = {}  # (node, dead epoch): last slot sweep
        self.declared_dead = 0
        self.pool = Pool.attach(pool_path, node=node, simulate=simulate, flush_mode=flush_mode,
                                prefault=False)
        self._manager = None
        self._stop = threading.Event()
        self._thread = None
        self._beat_thread = None
        self._publish_mu = threading.Lock()   # the two threads publish line 0
        self._locked = False
        self._joined = False               # published the node's entry as its agent
        self.reclaimed = 0
        self.recovered_locks = 0
        self.recovered_processes = 0
        self.epoch = 0
        self.manager_epoch = 0
        self._idle_sleep_max_ns = int(idle_sleep_max_s * 1e9)
        self._watch = None                 # (node, manager heartbeat seen, monotonic when it changed)
        self._said_alive = False
        self._path = pool_path
        # a region file's inode, held to see it unlinked (st_nlink 0); a
        # device is never gone
        self._file = self.pool.target.kind == "file"
        self._gone = False                 # the region file is gone (it never comes back)
        self._region_fd = None
        if self._file:
            try:
                self._region_fd = os.open(pool_path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                self._gone = True          # gone since it was attached
        self._maps_at = 0.0                # when the node segment's mappers were last looked for
        self._busy_at = time.monotonic()   # when the node was last seen with a process
        self._sweep_cursor = 0             # the payload sweep's next slot
        self.swept_slots = 0
        self.exit_reason: str | None = None
        self.exited = threading.Event()    # set when the agent decided to stop by itself

    @property
    def managing(self) -> bool:
        """Whether this agent runs the lock manager now."""
        return self._manager is not None

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
            nodes = read_nodes(self.pool)
            if self.manager:
                for rec in nodes:
                    if rec.node != self.node and rec.manager and rec.alive():
                        raise TractError(
                            f"a lock manager already runs on node {rec.node} (pid {rec.agent_pid}, "
                            f"heartbeat {rec.heartbeat_age():.1f} s ago)",
                            "run this agent without --manager; one manager serves the region")
            if nodes[self.node].epoch >= (1 << 64) - 1:
                raise TractError(f"node {self.node}'s agent epoch in the node table is at its "
                                 "maximum", "the region's node table is corrupt: run "
                                 "`tract check --repair`")
            prev = nodes[self.node]
            if prev.dead:
                self._refuse_while_fenced_processes_run(prev)
            self.epoch = prev.epoch + 1
            self.manager_epoch = prev.manager_epoch   # claims never go back
            self._rejoin(prev)
            self._joined = True
            if self.manager and not self._take_over("started with --manager"):
                # another node claimed it at the same moment: it manages, this one stands by
                self._log(logging.WARNING, "another node claimed the lock manager at the same "
                          "moment; standing by")
            # the heartbeat has a thread of its own, so that no duty that
            # waits (a recovery pass on busy locks, a dead host's sweep) can
            # make the node look dead to the lock manager, or the manager
            # look dead to its standbys
            self._beat_thread = threading.Thread(target=self._beat, name="tract-heartbeat",
                                                 daemon=True)
            self._beat_thread.start()
            self._thread = threading.Thread(target=self._duties, name="tract-duties",
                                            daemon=True)
            self._thread.start()
        except BaseException:
            self.stop()
            raise
        self._sweep("at start")
        return self

    def _sweep(self, when: str) -> None:
        """Removes the local segments regions that are gone left behind
        (`local.sweep_segments`), and says so."""
        removed = sweep_segments()
        if removed:
            self._log(logging.INFO, "%s: removed %d local segment(s) whose region is gone and "
                      "that no process uses: %s", when, len(removed), ", ".join(removed))

    def _refuse_while_fenced_processes_run(self, me) -> None:
        """The node's previous agent epoch was declared dead: its processes,
        if any still run, are fenced from the locks and what they held was
        given back; they must be gone before the node takes anything again."""
        alive = self.node_processes()
        if alive:
            raise TractError(
                f"node {self.node} was declared dead by the lock manager "
                f"({(time.time_ns() - me.declared_ns) / 1e9:.0f} s ago: its heartbeat had stood "
                f"still) and {len(alive)} of its processes still run (pid "
                f"{', '.join(map(str, alive[:8]))})",
                "stop them (they can take no lock), then start the agent again")

    def _rejoin(self, prev) -> None:
        """Publishes the node's entry with its new epoch, and forgets what a
        dead host's recovery gave back if a verdict declared the previous
        epoch dead -- read under the allocator lock after the publish, so a
        verdict that lands while this agent starts counts too (one C call,
        while no process of the node can allocate)."""
        named, pins, dropped = rejoin(self.pool, prev.epoch, self._node_line(NODE_ALIVE))
        if named:
            self._log(logging.WARNING, "the node's previous agent (epoch %d) was declared dead and "
                      "its recovery gave back what it held: %d journaled pin(s) forgotten, %d "
                      "free-list slot(s) dropped (back in the pool)", prev.epoch, pins, dropped)

    def _publish(self, state: int) -> None:
        sec = self.pool.info.section("nodes")
        with self._publish_mu:
            self.pool.publish(sec.offset + self.node * sec.entry_size, self._node_line(state))

    def _node_line(self, state: int) -> bytes:
        """Line 0 of this node's entry as this agent publishes it now."""
        now = time.time_ns()
        # who started the agent stays readable after it left (tract inspect)
        flags = FLAG_AUTOSTOP if self.idle_exit_s is not None else 0
        if state == NODE_ALIVE:
            flags |= FLAG_MANAGER if self.managing else 0
            flags |= FLAG_STANDBY if self.takeover_after_s is not None else 0
        return encode_node_line(state, os.getpid(), self.epoch, now, flags, self.manager_epoch,
                                now if self.managing else 0)

    def _take_over(self, why: str) -> bool:
        """Claims the next token, then starts the manager under it; False when a
        larger claim appeared meanwhile (that node manages: this one stands by)."""
        nodes = read_nodes(self.pool)
        top = max(nodes, key=lambda r: r.manager_epoch)
        if top.manager_epoch >= 0xFFFFFFFF:
            # a claim is a u32 that only grows: at its maximum the table is corrupt
            raise TractError(f"node {top.node}'s lock-manager claim in the node table is "
                             f"{top.manager_epoch}, the largest a claim can be",
                             "the region's node table is corrupt: run `tract check --repair`")
        self.manager_epoch = top.manager_epoch + 1
        self._publish(NODE_ALIVE)          # the claim, visible before the slots are read
        out = ffi.new("tract_manager **")
        rc = lib.tract_manager_start(self.pool._r(), self._idle_sleep_max_ns, out)
        if rc == lib.TRACT_E_SUPERSEDED:
            return False
        raise_for(rc, "lock manager")
        self._manager = out[0]
        self._publish(NODE_ALIVE)          # the manager flag and heartbeat
        self._log(logging.INFO, "lock manager running, token %s (%s)",
                  token_text(fencing_token(self.manager_epoch, self.node)), why)
        return True

    def _check_superseded(self) -> None:
        """Stops a manager that a later claim superseded; the agent stands by."""
        by = ffi.new("uint64_t *")
        if lib.tract_manager_superseded(self._manager, by) != 1:
            return
        lib.tract_manager_stop(self._manager)
        self._manager = None
        self._watch = None
        self._publish(NODE_ALIVE)
        self._log(logging.WARNING, "lock manager superseded by node %d (token %s); standing by",
                  token_node(int(by[0])), token_text(int(by[0])))

    def _maybe_take_over(self) -> None:
        """Takes the manager over once its heartbeat has not moved for
        takeover_after seconds (plus a stagger per standby node ranked before
        this one), unless the manager's process is seen alive on this host."""
        nodes = read_nodes(self.pool)
        cur = current_manager(nodes)
        if cur is None:
            return                        # no manager was ever started: nothing to resume
        if cur.node == self.node:
            # the claim is this node's and this agent holds the node: the agent
            # that claimed it is gone, so its duties are this one's now
            self._take_over(f"resuming node {self.node}'s manager after its agent died")
            return
        if cur.state != NODE_ALIVE:
            # it left cleanly: stopped on purpose, so the next manager is the
            # operator's (or a worker's ensure_agent) choice, not a takeover
            self._watch = None
            return
        # staleness is measured here, by how long the manager's heartbeat has
        # not changed on this host's clock: no comparison of two hosts' clocks
        now = time.monotonic()
        seen = (cur.node, cur.manager_heartbeat_ns if cur.manager else 0)
        if self._watch is None or self._watch[0] != seen:
            self._watch = (seen, now)
            self._said_alive = False
        still = now - self._watch[1]
        rank = sum(1 for r in nodes if r.standby and r.alive() and r.node < self.node
                   and r.node != cur.node)
        if still < self.takeover_after_s + rank * TAKEOVER_STAGGER_S:
            return
        if on_this_host(cur) and pid_alive(cur.agent_pid):
            if not self._said_alive:
                self._said_alive = True
                self._log(logging.WARNING, "the lock manager's heartbeat (node %d, pid %d) is "
                          "stale but the process is alive on this host: not taking over",
                          cur.node, cur.agent_pid)
            return
        why = f"node {cur.node}'s manager heartbeat stale for {still:.1f} s"
        self._take_over(why)

    def node_processes(self) -> list[int]:
        """Live processes attached to this node (its journal), the agent excluded."""
        cap = 64
        pids, n = ffi.new("uint32_t[]", cap), ffi.new("uint32_t *")
        if lib.tract_journal_pids(self.pool._r(), pids, cap, n) != 0:
            return []
        me = os.getpid()
        return [int(p) for p in pids[0:min(int(n[0]), cap)] if p != me and pid_alive(int(p))]

    def region_gone(self) -> bool:
        """Whether the region file is gone: unlinked (its inode has no name
        left), or its path holds anything but this region (removed,
        replaced, reformatted, moved away).  A device is never gone."""
        if self._gone or not self._file or self._region_fd is None:
            return self._gone
        try:
            gone = os.fstat(self._region_fd).st_nlink == 0 or \
                region_holds(self._path, self.pool.info.uuid) is False
        except OSError:
            return False
        if gone:
            self._gone = True
            self._log(logging.WARNING, "the region file %s is gone: nothing can attach to the "
                      "region again; stopping once no process uses node %d%s", self._path,
                      self.node, " and no other node's agent runs" if self.managing else "")
        return gone

    def _others_agent_alive(self) -> bool:
        """Whether another node's agent is alive (the lock manager serves
        every node: it stays while one is)."""
        return any(r.node != self.node and r.alive() and
                   not (on_this_host(r) and not pid_alive(r.agent_pid))
                   for r in read_nodes(self.pool))

    def _node_unused(self) -> bool:
        """Whether no process but this agent uses the node: none its journal
        names lives, and (looked at once a GONE_MAPS_S at most) none maps its
        local segment (a handle beyond the journal's entries)."""
        if self.node_processes():
            return False
        now = time.monotonic()
        if now - self._maps_at < GONE_MAPS_S:
            return False
        self._maps_at = now
        seg = local_path(self.pool.info.uuid, self.node)
        me = os.getpid()
        return not [p for p in processes_mapping([seg], writable=True)[seg] if p != me]

    def _why_exit(self) -> str | None:
        """Why this agent should stop by itself now, or None."""
        if self.region_gone():
            # nothing can attach again, but what runs still needs the node's
            # agent (and the manager) until it stops
            if not self._node_unused() or (self.managing and self._others_agent_alive()):
                return None
            return (f"the region file {self._path} is gone and no process uses node "
                    f"{self.node}" + (" and no other node's agent runs" if self.managing else ""))
        if self.idle_exit_s is None:
            return None
        now = time.monotonic()
        if self.node_processes():
            self._busy_at = now
            return None
        if self.managing and self._others_agent_alive():
            self._busy_at = now
            return None
        if now - self._busy_at >= self.idle_exit_s:
            return (f"no process on node {self.node} for {self.idle_exit_s:g} s"
                    + (" and no other node's agent alive" if self.managing else ""))
        return None

    def _beat(self) -> None:
        """The heartbeat: the node's entry published every heartbeat_s, until
        the agent stops or finds its node declared dead."""
        while not self._stop.wait(self.heartbeat_s) and not self.exited.is_set():
            if self._declared_dead():
                return
            self._publish(NODE_ALIVE)

    def _duties(self) -> None:
        """Everything else, every heartbeat_s: whether to stop, the manager's
        fencing and its watch over other hosts (or standing by), the node's
        recovery, the payload sweep, expired handoffs."""
        last_reclaim = 0.0
        last_sweep = -ORPHAN_SWEEP_S        # the first round sweeps: a restarted host
        while not self._stop.wait(self.heartbeat_s) and not self.exited.is_set():
            why = self._why_exit()
            if why is not None:
                self.exit_reason = why
                self.exited.set()
                return
            if self.managing:
                self._check_superseded()
                if self.managing:
                    self._watch_hosts()
            elif self.takeover_after_s is not None:
                try:
                    self._maybe_take_over()
                except TractError as err:
                    self._log(logging.ERROR, "takeover: %s", err)
            # what this node's dead processes left: locks, journals, orphaned
            # writes (a restarted host's; a walk of the whole index, so seldom),
            # half-done handoff releases -- one pass, one call (native/recover.c)
            orphans = time.monotonic() - last_sweep >= ORPHAN_SWEEP_S
            try:
                got = recover_node(self.pool, orphans)
            except TractError as err:
                self._log(logging.ERROR, "recovery: %s", err)
            else:
                self._report(got)
                if orphans and not got.orphans_pending:
                    last_sweep = time.monotonic()
            # slots whose payload died, evicted now so their next first read is free
            # (under the simulator this process's cache is its own: nothing to serve)
            if self.pool.accessors != "sim":
                try:
                    self._sweep_cursor, swept = self.pool.sweep_payload(
                        self._sweep_cursor, PAYLOAD_SWEEP_SLOTS, PAYLOAD_SWEEP_BYTES)
                except TractError as err:
                    self._log(logging.ERROR, "payload sweep: %s", err)
                else:
                    self.swept_slots += swept
            now = time.monotonic()
            if self.managing and now - last_reclaim >= RECLAIM_S:
                # expired handoffs (a decode side that died): pins and slots back
                last_reclaim = now
                try:
                    self.reclaimed += self.pool.handoffs.reclaim(timeout=RECLAIM_S)
                except LockTimeout:
                    pass        # a busy lock (a dead host's until its verdict): the next pass
                except TractError as err:
                    self._log(logging.ERROR, "reclaim: %s", err)

    def _declared_dead(self) -> bool:
        """Whether the lock manager declared this agent's node dead (it stood
        still too long: paused, or cut off); it then stops, for its processes
        are fenced from the locks and what they held was given back."""
        me = read_nodes(self.pool)[self.node]
        if not (me.dead_epoch and me.dead_epoch == self.epoch):
            return False
        self.exit_reason = (f"node {self.node} was declared dead by the lock manager (its heartbeat "
                            "stood still too long): its processes can take no lock; restart them "
                            "and this agent")
        self._log(logging.ERROR, "%s", self.exit_reason)
        self.exited.set()
        return True

    def _watch_hosts(self) -> None:
        """The lock manager's duty to the rack: a node of another host whose
        heartbeat has not moved for host_dead_after seconds (on this host's
        clock) is declared dead; a dead node's recovery runs every heartbeat
        until it is whole (docs/PROTOCOLS.md §7)."""
        now = time.monotonic()
        for rec in read_nodes(self.pool):
            if rec.node == self.node:
                continue
            if rec.dead:
                self._host_watch.pop(rec.node, None)
                self._recover_host(rec, now)
                continue
            # a node of this host is judged by its processes' pids (its own
            # agent's recovery), never by a heartbeat
            if self.host_dead_after_s is None or rec.state != NODE_ALIVE or on_this_host(rec):
                self._host_watch.pop(rec.node, None)
                continue
            seen = (rec.epoch, rec.heartbeat_ns)
            watch = self._host_watch.get(rec.node)
            if watch is None or watch[0] != seen:
                self._host_watch[rec.node] = (seen, now)
                continue
            still = now - watch[1]
            if still < self.host_dead_after_s:
                continue
            try:
                declare_dead(self.pool, rec.node, rec.epoch, rec.heartbeat_ns)
            except (NodeAlive, Superseded):
                continue                   # it heartbeat meanwhile / no longer the manager
            self.declared_dead += 1
            self._log(logging.WARNING, "node %d (host %s) declared dead: its heartbeat stood still "
                      "for %.1f s; the locks it held are taken back and repaired, its unfinished "
                      "writes dropped and its slots returned, its pins given back once its "
                      "handoffs end", rec.node, rec.hostname or "?", still)

    def _recover_host(self, rec, now: float) -> None:
        """One pass of dead node REC's recovery, its slots swept at the first
        and then every DEAD_SLOT_SWEEP_S while it stays dead; logs what it
        gave back."""
        key = (rec.node, rec.dead_epoch)
        last = self._host_sweeps.get(key)
        sweep = last is None or now - last >= DEAD_SLOT_SWEEP_S
        if not sweep and rec.recovered == VERDICT_CLAIMS | VERDICT_PINS | VERDICT_SLOTS:
            return                         # whole: only the next slot sweep is due
        try:
            got = recover_host(self.pool, rec.node, sweep)
        except (NodeAlive, Superseded):
            return                         # restarted meanwhile / no longer the manager
        except TractError as err:
            self._log(logging.ERROR, "recovery of dead node %d: %s", rec.node, err)
            return
        if sweep and not got.skipped:
            # none of its slots referenced any more, and all returned: no
            # later sweep can find one (a dead host takes no new slots)
            self._host_sweeps[key] = now if got.owned else float("inf")
        if got.handoffs or got.claims or got.pins or got.slots:
            self._log(logging.WARNING, "dead node %d: %d half-done handoff release(s) finished, "
                      "%d unfinished write(s) dropped, %d pin(s) given back, %d slot(s) returned "
                      "to the pool (%d still hold blocks or handoffs)", rec.node, got.handoffs,
                      got.claims, got.pins, got.slots, got.owned)

    def _report(self, got: NodeRecovery) -> None:
        """Logs what a recovery pass gave back (a warning: processes died)."""
        if got.locks:
            self.recovered_locks += got.locks
            self._log(logging.WARNING, "took back %d lock(s) of dead processes", got.locks)
        if got.dead.processes:
            self.recovered_processes += got.dead.processes
            self._log(logging.WARNING, "%s", got.dead.describe())
        if got.orphans:
            self._log(logging.WARNING, "dropped %d unfinished write(s) of processes no journal "
                      "remembers (their keys are writable again; `tract check --repair` returns "
                      "their slots)", got.orphans)
        if got.handoffs:
            self._log(logging.WARNING, "finished %d handoff release(s) of dead processes",
                      got.handoffs)
        for step, err in got.errors:
            self._log(logging.ERROR, "%s: %s", step, err)

    def _log(self, level: int, msg: str, *args) -> None:
        """One line of this agent's log: `node N: MSG % ARGS`."""
        log.log(level, "node %d: " + msg, self.node, *args)

    def manager_stats(self) -> dict:
        """Scans, grants, releases, idle sleeps of the manager thread."""
        if self._manager is None:
            return {}
        out = ffi.new("uint64_t[6]")
        lib.tract_manager_stats(self._manager, out)
        return dict(zip(("scans", "grants", "releases", "sleeps", "repairs", "revoked"), list(out)))

    def wait(self, stop: "StopFlag") -> None:
        """Blocks until STOP is set (SIGTERM / Ctrl-C in the CLI) or the agent
        decided to stop by itself (`exit_reason`)."""
        while not stop.wait(0.1) and not self.exited.is_set():
            pass

    def stop(self) -> None:
        """Stops the manager and heartbeat, marks the node as left, frees the node."""
        self._stop.set()
        for t in (self._thread, self._beat_thread):
            if t is not None:
                t.join(timeout=5)
        self._thread = self._beat_thread = None
        if self._manager is not None:
            lib.tract_manager_stop(self._manager)
            self._manager = None
        if self._locked:
            # the node mutex is given back even when the region no longer lets
            # the node be marked (a corrupted node table): a robust mutex left
            # locked in a segment that is then unmapped corrupts this thread's
            # robust list, and the next unlock of any robust mutex crashes
            try:
                if self._joined:     # (one refused before it published leaves the entry be)
                    self._publish(NODE_LEFT)
            finally:
                lib.tract_agent_unlock(self.pool._r())
                self._locked = False
        # the region gone and its node unused (stopped by a signal too): its
        # segment is garbage, and so are other nodes' that no agent removes
        gone = not self.pool.closed and self.region_gone()
        if not self.pool.closed:
            self.pool.close()
        if self._region_fd is not None:
            os.close(self._region_fd)
            self._region_fd = None
        if gone:
            self._sweep("stopping")


@dataclass(frozen=True)
class AgentOptions:
    """What a node agent runs with: `tract agent`'s options (the command line
    parses them, `cli/agent_cmd.py`) and what `ensure_agent` hands the agent
    process it starts (as JSON: `to_json`, `from_json`); the one definition of
    the agent's options and their defaults."""

    pool: str
    node: int
    manager: bool = False              # run the region's lock manager here
    simulate: bool = False             # the non-coherence simulator (tests)
    flush_mode: str | None = None      # None: the header's
    heartbeat_ms: int = round(HEARTBEAT_S * 1000)
    takeover_after: float | None = TAKEOVER_AFTER_S   # None: never take the manager over
    idle_exit: float | None = None     # seconds with no process on the node; None: never
    host_dead_after: float | None = HOST_DEAD_AFTER_S   # None: never declare a host dead

    def check(self) -> None:
        """Refuses options out of range (UsageError: one line, exit 2)."""
        if not 10 <= self.heartbeat_ms <= 10000:
            raise UsageError(f"--heartbeat-ms {self.heartbeat_ms} is outside 10..10000",
                             "give the heartbeat period in milliseconds, e.g. 100")
        takeover = self.takeover_after          # None: never taken over, nothing to check
        if takeover is not None and not 0.2 <= takeover <= 3600:
            raise UsageError(f"--takeover-after {takeover:g} is outside 0.2..3600 seconds",
                             "give the seconds a manager heartbeat may stand still, e.g. 2")
        if takeover is not None and takeover * 1000 < 3 * self.heartbeat_ms:
            raise UsageError(f"--takeover-after {takeover:g} s is under three heartbeats "
                             f"({self.heartbeat_ms} ms each)", "raise it, or lower --heartbeat-ms")
        dead_after = self.host_dead_after
        if dead_after is not None and not 0.5 <= dead_after <= 86400:
            raise UsageError(f"--host-dead-after {dead_after:g} is outside 0.5..86400 seconds",
                             "give the seconds another host's heartbeat may stand still, e.g. 10")
        if dead_after is not None and dead_after * 1000 < 5 * self.heartbeat_ms:
            raise UsageError(f"--host-dead-after {dead_after:g} s is under five heartbeats "
                             f"({self.heartbeat_ms} ms each)", "raise it, or lower --heartbeat-ms")
        if self.idle_exit is not None and not 0.1 <= self.idle_exit <= 86400:
            raise UsageError(f"--exit-when-idle {self.idle_exit:g} is outside 0.1..86400 seconds",
                             "give the seconds a node may have no process, e.g. 30")

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> "AgentOptions":
        """The options ensure_agent wrote; anything else is a UsageError."""
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise UsageError(f"agent options are not JSON ({exc})",
                             "start agents with `tract agent`") from None
        names = {f.name for f in fields(cls)}
        if not isinstance(raw, dict) or not {"pool", "node"} <= raw.keys() <= names:
            raise UsageError(f"agent options must be an object with pool, node and only "
                             f"{', '.join(sorted(names))}", "start agents with `tract agent`")
        try:
            return cls(**raw)
        except TypeError as exc:
            raise UsageError(f"bad agent options ({exc})", "start agents with `tract agent`") \
                from None


def run_foreground(opts: AgentOptions) -> None:
    """Runs a node agent in this process until SIGTERM/SIGINT, or until it stops
    by itself (OPTS.idle_exit seconds with no process on its node, or its region
    removed); logs to stderr (`log_to_stderr`).  `tract agent` and `python -m
    tract_cli.core.agent_main` (what `ensure_agent` starts) both run this."""
    log_to_stderr()
    opts.check()
    node, manager, idle_exit = opts.node, opts.manager, opts.idle_exit
    stop = StopFlag()               # (an Event set in the handler could deadlock)
    signal.signal(signal.SIGTERM, stop.request)
    signal.signal(signal.SIGINT, stop.request)
    a = Agent(opts.pool, node, manager, simulate=opts.simulate or None,
              flush_mode=opts.flush_mode, heartbeat_s=opts.heartbeat_ms / 1000,
              takeover_after_s=opts.takeover_after, idle_exit_s=idle_exit,
              host_dead_after_s=opts.host_dead_after).start()
    role = ", lock manager" if manager else (", standby manager"
                                             if opts.takeover_after is not None else "")
    life = (f", stops after {idle_exit:g} s with no process on the node" if idle_exit is not None
            else ", runs until stopped")
    log.info("node %d pid %d epoch %d%s%s: running", node, os.getpid(), a.epoch, role, life)
    try:
        a.wait(stop)
    finally:
        stats = a.manager_stats()
        a.stop()
        extra = f" ({stats['grants']} grants in {stats['scans']} scans)" if stats else ""
        why = f": {a.exit_reason}" if a.exit_reason else ""
        log.info("node %d: stopped%s%s", node, why, extra)


