"""Lock-manager takeover with fencing tokens (docs/PROTOCOLS.md §4): a standby
agent takes a dead manager over once its heartbeat has stood still, a paused
manager that wakes up finds itself superseded and its grants refused, two
managers started at once end as one, and the lock stays exclusive through all
of it (shared counters, real processes, plain and under the simulator).

The fencing itself is tested deterministically by forging the lines a stale
manager would leave: a grant under an older token is never entered, and a
new manager adopts the holder from the LOCKED slots."""
from __future__ import annotations

import os
import pathlib
import signal
import struct
import time

import pytest

from agents import RunningAgent
from counters import finish_counters, start_counters
from procs import wait_for
from tract_cli.core.errors import LockTimeout
from tract_cli.core.locks import LOCK_OBJDIR
from tract_cli.core.native import ffi, lib
from tract_cli.core.nodes import NODE_ALIVE, NODE_LINE, current_manager, current_token, read_nodes
from tract_cli.core.pool import Pool

NODES = 4
LOCK = LOCK_OBJDIR     # the lock these tests contend for: any one would do
MGR_LINE = struct.Struct("<IIQQQQ")
MGR_FIELDS = ("granted_node", "last_node", "grant_seq", "grant_ns", "granted_req", "token")
SLOT_LINE = struct.Struct("<IIQQQQ")
SLOT_FIELDS = ("state", "pid", "epoch", "request_seq", "since_ns", "grant_token")
IDLE, WAITING, LOCKED = 0, 1, 2


@pytest.fixture
def region(region_path):
    Pool.create(region_path, 16 << 20, "tiny", nodes=NODES, flush_mode="clflush").close()
    return region_path


def nodes(path):
    with Pool.attach(path, readonly=True, prefault=False) as p:
        return read_nodes(p)



def manager_node(path) -> int | None:
    """The node that claims the manager and runs it (flag set), or None."""
    table = nodes(path)
    cur = current_manager(table)
    return cur.node if cur is not None and cur.manager and cur.state == NODE_ALIVE else None


def log_text(path: pathlib.Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


@pytest.mark.parametrize("simulate,iterations", [(False, 600), (True, 150)], ids=["plain", "sim"])
def test_a_standby_takes_over_a_killed_manager(region, tmp_path, simulate, iterations):
    log = tmp_path / "standby.log"
    old = RunningAgent(region, 0, manager=True, simulate=simulate, takeover_after=0.5)
    old_token = nodes(region)[0].token
    with RunningAgent(region, 1, manager=False, simulate=simulate, takeover_after=0.5,
                      log_path=str(log)):
        workers = start_counters(region, simulate, iterations, (1, 2, 3))
        old.proc.send_signal(signal.SIGKILL)       # mid-run: grants and requests in flight
        old.proc.wait(timeout=30)
        assert finish_counters(region, workers, iterations) == 3 * iterations
        assert manager_node(region) == 1
        new = nodes(region)[1]
        assert new.token > old_token
        assert "lock manager running" in log_text(log) and "heartbeat stale" in log_text(log)


def test_a_paused_manager_wakes_up_superseded(region, tmp_path, monkeypatch):
    """Node 0's manager (on "host A") is stopped with SIGSTOP; node 1 (on
    "host B") takes over; when node 0 resumes it must find the later claim,
    stop managing, and no grant it may still write is entered."""
    log_a, log_b = tmp_path / "a.log", tmp_path / "b.log"
    monkeypatch.setenv("TRACT_HOSTNAME", "host-a")
    old = RunningAgent(region, 0, manager=True, takeover_after=0.5, log_path=str(log_a))
    monkeypatch.setenv("TRACT_HOSTNAME", "host-b")
    try:
        with RunningAgent(region, 1, manager=False, takeover_after=0.5, log_path=str(log_b)):
            monkeypatch.delenv("TRACT_HOSTNAME")
            workers = start_counters(region, False, 800, (1, 2, 3))
            old.proc.send_signal(signal.SIGSTOP)
            wait_for("node 1 taking the manager over", lambda: manager_node(region) == 1)
            old.proc.send_signal(signal.SIGCONT)
            wait_for("node 0 standing down", lambda: "superseded by node 1" in log_text(log_a))
            wait_for("node 0's manager flag clearing", lambda: not nodes(region)[0].manager)
            assert finish_counters(region, workers, 800) == 3 * 800
            assert manager_node(region) == 1
            assert old.proc.poll() is None         # it stands by, alive
    finally:
        old.proc.send_signal(signal.SIGCONT)
        old.stop()


def test_no_takeover_while_the_manager_process_lives_on_this_host(region, tmp_path):
    log = tmp_path / "standby.log"
    old = RunningAgent(region, 0, manager=True, takeover_after=0.5)
    try:
        with RunningAgent(region, 1, manager=False, takeover_after=0.5, log_path=str(log)):
            token = nodes(region)[0].token
            old.proc.send_signal(signal.SIGSTOP)
            wait_for("the standby noticing", lambda: "the process is alive" in log_text(log))
            assert nodes(region)[1].manager_epoch == 0 and current_manager(nodes(region)).token == token
            old.proc.send_signal(signal.SIGCONT)
    finally:
        old.proc.send_signal(signal.SIGCONT)
        old.stop()


def test_a_restarted_agent_resumes_its_nodes_manager(region, tmp_path):
    old = RunningAgent(region, 0, manager=True)
    old.proc.send_signal(signal.SIGKILL)
    old.proc.wait(timeout=30)
    # started without --manager: the claim is its node's, and it holds the node
    with RunningAgent(region, 0, manager=False):
        wait_for("node 0's new agent resuming the manager", lambda: manager_node(region) == 0)
        with Pool.attach(region, node=2) as p:
            p.locks.acquire(LOCK, timeout=30)
            p.locks.release(LOCK)


def test_two_managers_started_at_once_end_as_one(region, tmp_path):
    """Both may pass the "no live manager" check; the claims decide, and the
    lock stays exclusive while they do."""
    import subprocess
    import sys
    logs = [tmp_path / f"m{n}.log" for n in (0, 1)]
    procs = [subprocess.Popen([sys.executable, "-m", "tract_cli.cli", "agent", "--pool", region,
                               "--node", str(n), "--manager", "--takeover-after", "0.5"],
                              stdout=subprocess.DEVNULL, stderr=open(logs[n], "wb"))
             for n in (0, 1)]
    try:
        workers = start_counters(region, False, 400, (2, 3))
        wait_for("one manager running", lambda: manager_node(region) is not None)
        assert finish_counters(region, workers, 400) == 2 * 400
        table = nodes(region)
        running = [r.node for r in table if r.manager and r.state == NODE_ALIVE]
        assert running == [manager_node(region)], (running, [log_text(x) for x in logs])
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)


# ---- the fencing, deterministically: the lines a stale manager leaves ----

def lock_line(pool: Pool, lock_id: int, line: int) -> int:
    sec = pool.info.section("locks")
    return sec.offset + lock_id * sec.entry_size + line * 64


def claim(pool: Pool, node: int, manager_epoch: int) -> int:
    """Publishes NODE's manager claim as its agent would; returns the token."""
    sec = pool.info.section("nodes")
    line = NODE_LINE.pack(NODE_ALIVE, os.getpid(), 1, time.time_ns(), 0, manager_epoch, 0,
                          b"test")
    pool.publish(sec.offset + node * sec.entry_size, line)
    return (manager_epoch << 32) | node


def test_the_cores_current_manager_and_the_agents_agree(region):
    """current_manager (the agent's rule, over a table it read) and the C core's
    tract_manager_current (current_token) name the same claim: none, then the
    largest epoch, then the larger node of two equal epochs."""
    with Pool.attach(region) as p:
        assert current_token(p) == 0 and current_manager(read_nodes(p)) is None
        # (node, its claim, the current token after it is published)
        for node, epoch, expected in ((2, 3, 3 << 32 | 2), (1, 5, 5 << 32 | 1),
                                      (3, 5, 5 << 32 | 3), (0, 4, 5 << 32 | 3)):
            claim(p, node, epoch)
            cur = current_manager(read_nodes(p))
            assert current_token(p) == cur.token == expected
        assert cur.node == 3


def forge_grant(pool: Pool, lock_id: int, node: int, req: int, token: int) -> None:
    pool.publish(lock_line(pool, lock_id, 0),
                 MGR_LINE.pack(node + 1, node + 1, 1, time.time_ns(), req, token).ljust(64, b"\0"))


def read_line(pool: Pool, lock_id: int, line: int):
    raw = pool.observe(lock_line(pool, lock_id, line), 64)
    return MGR_LINE.unpack_from(raw) if line == 0 else SLOT_LINE.unpack_from(raw)


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
def test_a_grant_of_a_superseded_manager_is_never_entered(region, simulate):
    with Pool.attach(region, node=0, simulate=simulate) as admin, \
            Pool.attach(region, node=2, simulate=simulate) as p:
        old = claim(admin, 0, 1)
        new = claim(admin, 1, 2)
        forge_grant(admin, LOCK, 2, 1, old)        # node 2's next request, old token
        with pytest.raises(LockTimeout):
            p.locks.acquire(LOCK, timeout=0.3)
        state, _, _, req, _, _ = read_line(admin, LOCK, 3)
        assert state == IDLE and req == 1           # it withdrew; it never entered
        forge_grant(admin, LOCK, 2, 2, new)         # the current manager's grant of request 2
        p.locks.acquire(LOCK, timeout=5)
        state, _, _, req, _, token = read_line(admin, LOCK, 3)
        assert (state, req, token) == (LOCKED, 2, new)
        p.locks.release(LOCK)


def test_a_new_manager_adopts_the_holder_from_the_locked_slots(region):
    with Pool.attach(region, node=1) as admin:
        t_old, t_older = claim(admin, 0, 2), (1 << 32) | 3
        # node 2 entered under the last manager; node 3 is a leftover of an older
        # one that will withdraw; line 0 was overwritten by a stale grant to 3
        for node, token in ((2, t_old), (3, t_older)):
            admin.publish(lock_line(admin, LOCK, 1 + node),
                          SLOT_LINE.pack(LOCKED, os.getpid(), 1, 5, time.time_ns(), token)
                          .ljust(64, b"\0"))
        forge_grant(admin, LOCK, 3, 5, t_older)
        mine = claim(admin, 1, 3)
        out = ffi.new("tract_manager **")
        assert lib.tract_manager_start(admin._r(), 1000000, out) == 0
        try:
            line = wait_for("the adopted grant", lambda: (lambda l: l if l[5] == mine else None)(
                read_line(admin, LOCK, 0)))
            assert line[0] == 2 + 1 and line[4] == 5      # node 2 keeps the lock
            # a stale write to line 0 is repaired by the next scan
            forge_grant(admin, LOCK, 3, 5, t_older)
            wait_for("line 0 repaired", lambda: read_line(admin, LOCK, 0)[5] == mine)
            # a later claim supersedes this manager at its next scan
            claim(admin, 0, 4)
            by = ffi.new("uint64_t *")
            wait_for("the manager stopping", lambda: lib.tract_manager_superseded(out[0], by) == 1)
            assert by[0] == (4 << 32) | 0
        finally:
            lib.tract_manager_stop(out[0])


def test_inspect_shows_the_claims_and_roles(region):
    import json
    import subprocess
    import sys
    with RunningAgent(region, 0, manager=True), RunningAgent(region, 2, manager=False):
        res = subprocess.run([sys.executable, "-m", "tract_cli.cli", "inspect", region, "--nodes",
                              "--json"], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        v = json.loads(res.stdout)["nodes"]
        rows = {r["node"]: r for r in v["nodes"]}
        assert v["current_claim"] == "1.0" and v["manager_node"] == 0
        assert rows[0]["manager"] and rows[0]["claim"] == "1.0"
        assert rows[2]["standby"] and not rows[2]["manager"] and rows[2]["claim"] is None


def test_under_the_simulator_every_party_sees_the_new_claim(region):
    """Each party has the claims and the lock table in a private cache from
    before the takeover (the non-coherence simulator): the old manager must
    still notice the later claim and stop, a requester must still refuse a
    grant of the old token, and the new manager must still adopt the holder.
    (Each of these fails if its invalidate is removed: tests/mutation.py.)"""
    out_old, out_new = ffi.new("tract_manager **"), ffi.new("tract_manager **")
    with Pool.attach(region, node=0, simulate=True) as old_host, \
            Pool.attach(region, node=1, simulate=True) as new_host, \
            Pool.attach(region, node=2, simulate=True) as p, \
            Pool.attach(region, node=3, simulate=True) as holder:
        sec = new_host.info.section("locks")
        new_host.observe(sec.offset, sec.length)        # its cache: the table as it is now
        old_token = claim(old_host, 0, 1)
        assert lib.tract_manager_start(old_host._r(), 1000000, out_old) == 0
        try:
            p.locks.acquire(LOCK, timeout=10)            # p caches the claims
            p.locks.release(LOCK)
            holder.locks.acquire(LOCK, timeout=10)       # node 3 holds LOCK under 1.0
            new_token = claim(new_host, 1, 2)
            by = ffi.new("uint64_t *")
            wait_for("the old manager stopping",
                     lambda: lib.tract_manager_superseded(out_old[0], by) == 1, timeout=10)
        finally:
            lib.tract_manager_stop(out_old[0])
        # a grant of node 2's next request under the old token: never entered
        req = read_line(old_host, LOCK, 3)[3] + 1
        forge_grant(old_host, LOCK, 2, req, old_token)
        with pytest.raises(LockTimeout):
            p.locks.acquire(LOCK, timeout=0.3)
        assert lib.tract_manager_start(new_host._r(), 1000000, out_new) == 0
        try:
            line = wait_for("the adopted grant", lambda: (lambda l: l if l[5] == new_token
                                                          else None)(read_line(old_host, LOCK, 0)),
                            timeout=10)
            assert line[0] == 3 + 1, "the new manager did not adopt node 3's hold"
            holder.locks.release(LOCK)
            p.locks.acquire(LOCK, timeout=10)            # under the new token
            assert read_line(old_host, LOCK, 3)[5] == new_token
            p.locks.release(LOCK)
        finally:
            lib.tract_manager_stop(out_new[0])
