"""The chaos test: prefill and decode processes on several emulated nodes
share a region while a killer SIGKILLs one of them at a random moment, many
times, and starts a replacement each time. Node agents are killed too (about
one kill in six), the lock manager's among them: an agent comes back at once
or after a few more kills, so a standby on another node takes the manager
over, or the node's new agent resumes it. About a third of the workers are
started to kill themselves inside the allocator's critical sections (at a
random pass of a random TRACT_DIE_AT point), which a random moment almost
never hits. With --host-kills N, each node is an emulated host of its own
(TRACT_HOSTNAME) and N times a whole host dies: its agent and its workers
SIGKILLed at once and its node-local segment removed (its DRAM gone); the
lock manager's agent declares it dead once its heartbeat stood still and
recovers what it held online (docs/PROTOCOLS.md §7, "A dead host"); it comes
back when the run ends. Afterwards (every worker stopped, every agent back,
recovery and handoff expiry given a bounded time):

- exactly one lock manager runs;
- `tract check` finds no violation;
- no pin, no PENDING claim and no handoff record is left (reservations
  included: a quarter of the prefill rounds reserve their record and let
  the ticket out before they commit and publish, as the vLLM connector's
  P/D prefill does, so a killed one leaves a reservation for its agent);
- no slot leaked: every slot taken from the region is either READY data or
  on its node's free list;
- every block a decode worker read (handoffs and lookups) matched what was
  put, and every handoff was either received and acknowledged or expired
  and reclaimed.

    .venv/bin/python tests/chaos.py --kills 300 --seed 1 [--simulate] [--host-kills 2]

tests/test_chaos.py runs a bounded version; the long one is this command.
"""
from __future__ import annotations

import argparse
import json
import os
import selectors
import shutil
import subprocess
import sys
import tempfile
import time
import uuid

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from tract_cli.core.agent_launch import ensure_agent  # noqa: E402
from tract_cli.core.native import lib  # noqa: E402
from tract_cli.core.nodes import current_manager, read_nodes  # noqa: E402
from tract_cli.core.pool import Pool  # noqa: E402
from tract_cli.core.region import remove_region  # noqa: E402
from tract_cli.inspect import check, snapshot  # noqa: E402

NODES = 4                        # agents on 0 (manager at first) .. 3
LAYOUT = [("prefill", 1), ("prefill", 2), ("decode", 2), ("decode", 3)]
SETTLE_S = 30.0                  # bound on recovery and expiry after the workers stop
AGENT_KILL_P = 1 / 6             # share of the kills that hit a node agent
DIE_INSIDE_P = 1 / 3             # share of the workers started to die inside the allocator
# the death points an armed worker draws from: all but JOURNAL_MOVED, which
# also sits where a bare slot's key, or a publish's pins, were forgotten
# before the slot is given back or the record holds them (left there by
# design: the journal may say less, never more), while the run must end
# with nothing left (the PIN_* points, inside a pin move, are drawn: a move
# is told by the stripe's repair and set in the journal)
DIE_POINTS = [p for p in range(1, lib.TRACT_DIE_COUNT) if p != lib.TRACT_DIE_JOURNAL_MOVED]
TAKEOVER_AFTER_S = 0.5
# with host kills: how long a host's heartbeat may stand still before the
# manager declares it dead -- above the longest an agent killed alone takes to
# come back (a few kills, then an agent start on two busy cores)
HOST_DEAD_AFTER_S = 8.0


class Chaos:
    def __init__(self, seed: int, simulate: bool = False, region_size: int = 32 << 20,
                 host_kills: int = 0, chains: int = 24):
        self.rng = np.random.default_rng(seed)
        self.chains = chains                  # distinct chains the workers put and look up
        self.simulate = simulate
        self.host_kills_left = host_kills     # whole hosts to kill during the run
        self.hosts_apart = host_kills > 0     # each node an emulated host of its own
        self.dead_hosts: list[int] = []       # killed, to come back when the run ends
        self.host_kills = 0
        self.path = f"/dev/shm/tract-chaos-{uuid.uuid4().hex[:8]}.pool"
        # the agents' and workers' logs: removed with a run that passed, kept (and
        # named in its result) for one that did not or did not end
        self.dir = tempfile.mkdtemp(prefix="tract-chaos-")
        self.ok: bool | None = None
        Pool.create(self.path, region_size, "tiny", nodes=NODES, index_stripes=8).close()
        self.agents = [self.start_agent(n, manager=n == 0) for n in range(NODES)]
        self.agent_back_at: dict[int, int] = {}    # node -> the kill count that restarts it
        self.agent_kills = 0
        self.manager_kills = 0
        self.sel = selectors.DefaultSelector()
        self.workers: list[subprocess.Popen | None] = [None] * len(LAYOUT)
        self.events: dict[str, int] = {}
        self.blocks_verified = 0
        self.bad_blocks = 0
        self.errors: list[str] = []
        self.kills = 0
        self.started = 0
        self.armed: list[bool] = [False] * len(LAYOUT)   # started to die inside the allocator
        self.allocator_deaths = 0

    # ---- agents

    def start_agent(self, node: int, manager: bool = False) -> subprocess.Popen:
        old = os.environ.get("TRACT_HOSTNAME")
        if self.hosts_apart:
            os.environ["TRACT_HOSTNAME"] = f"chaos-host-{node}"
        try:
            return ensure_agent(self.path, node, manager=manager, simulate=self.simulate,
                                takeover_after=TAKEOVER_AFTER_S,
                                host_dead_after=HOST_DEAD_AFTER_S if self.hosts_apart else None,
                                log_path=os.path.join(self.dir, f"agent{node}.log"))
        finally:
            if self.hosts_apart:
                os.environ.pop("TRACT_HOSTNAME")
                if old is not None:
                    os.environ["TRACT_HOSTNAME"] = old

    def kill_host(self) -> None:
        """A whole emulated host dies: its agent and workers SIGKILLed at once,
        its node-local segment (its DRAM) removed.  It stays down until the
        run ends; at least one prefill and one decode worker stay up."""
        from tract_cli.core.local import local_path
        alive = [n for n in range(1, NODES) if n not in self.dead_hosts]
        ok = [n for n in alive
              if {r for r, node in LAYOUT if node not in self.dead_hosts + [n]} ==
              {"prefill", "decode"}]
        if not ok:
            return
        node = int(self.rng.choice(ok))
        self.agent_back_at.pop(node, None)
        victims = [self.agents[node]] + [p for i, p in enumerate(self.workers)
                                         if LAYOUT[i][1] == node]
        for p in victims:
            if p is not None and p.poll() is None:
                p.kill()
        for i, p in enumerate(self.workers):
            if LAYOUT[i][1] == node:
                p.wait(timeout=30)
                self.drain(0)
                self._forget(p)
                self.workers[i] = None
        if self.agents[node] is not None:
            self.agents[node].wait(timeout=30)
        with Pool.attach(self.path, readonly=True, prefault=False, local=False) as p:
            os.unlink(local_path(p.info.uuid, node))
        self.dead_hosts.append(node)
        self.host_kills += 1
        self.host_kills_left -= 1

    def _forget(self, p: subprocess.Popen) -> None:
        """Stops reading a dead worker's events."""
        try:
            self.sel.unregister(p.stdout)
        except (KeyError, ValueError):
            pass
        p.stdout.close()

    def bring_hosts_back(self) -> dict:
        """Once every dead host's recovery returned all of its slots nothing
        references (bounded), starts each one's agent again: it rejoins."""
        from tract_cli.core.nodes import VERDICT_CLAIMS, VERDICT_PINS, VERDICT_SLOTS
        whole = VERDICT_CLAIMS | VERDICT_PINS | VERDICT_SLOTS
        end = time.monotonic() + SETTLE_S + HOST_DEAD_AFTER_S
        waiting = list(self.dead_hosts)
        while waiting and time.monotonic() < end:
            with Pool.attach(self.path, readonly=True, prefault=False, local=False) as p:
                table = read_nodes(p)
            waiting = [n for n in waiting if not table[n].dead or table[n].recovered != whole
                       or self.unreferenced_slots_of(n)]
            if waiting:
                time.sleep(0.2)        # polling the region, bounded above
        with Pool.attach(self.path, readonly=True, prefault=False, local=False) as p:
            table = read_nodes(p)
        declared = [n for n in self.dead_hosts if table[n].dead]
        for node in self.dead_hosts:
            self.agents[node] = self.start_agent(node)
        back = {"declared_dead": declared, "unswept": waiting}
        self.dead_hosts = []
        return back

    def unreferenced_slots_of(self, node: int) -> list[int]:
        """Slots the owner map gives NODE that no READY bucket and no live
        handoff record names (what its recovery's sweep returns)."""
        from tract_cli.core.media import BUCKET_DTYPE, RECORD_DTYPE
        with Pool.attach(self.path, readonly=True, prefault=False, local=False) as p:
            info = p.info
            sec = info.section("owners")
            owners = np.frombuffer(p.observe(sec.offset, sec.length), np.uint8)[:info.slot_count]
            b = np.frombuffer(p.observe(info.section("buckets").offset,
                                        info.section("buckets").length), np.uint8).view(BUCKET_DTYPE)
            ts = info.section("transfer")
            rec = np.frombuffer(p.observe(ts.offset, ts.length), np.uint8).view(RECORD_DTYPE)
            data = info.section("data")
        used = set((b["slot"][b["state"] == 2].astype(np.int64) - 1).tolist())
        live = rec[(rec["state"] != 0) & (rec["owner_node"] == node + 1)]
        used |= set(((live["keys_offset"].astype(np.int64) - data.offset) //
                     data.entry_size).tolist())
        used |= set((live["tail_slot"][live["tail_slot"] > 0].astype(np.int64) - 1).tolist())
        return sorted(set(np.flatnonzero(owners == node + 1).tolist()) - used)

    def kill_agent(self) -> None:
        """SIGKILLs a random node's agent; it comes back now or a few kills later."""
        up = [n for n in range(NODES) if n not in self.dead_hosts]
        node = int(self.rng.choice(up))
        with Pool.attach(self.path, readonly=True, prefault=False, local=False) as p:
            cur = current_manager(read_nodes(p))
        if cur is not None and cur.node == node:
            self.manager_kills += 1
        a = self.agents[node]
        a.kill()
        a.wait(timeout=30)
        self.agent_kills += 1
        self.agent_back_at[node] = self.kills + int(self.rng.integers(0, 4))

    def restart_agents(self, everyone: bool = False) -> None:
        for node, at in list(self.agent_back_at.items()):
            if everyone or at <= self.kills:
                del self.agent_back_at[node]
                self.agents[node] = self.start_agent(node)

    def managers(self) -> dict:
        """Which nodes run a manager now, and how many takeovers the logs show."""
        with Pool.attach(self.path, readonly=True, prefault=False, local=False) as p:
            table = read_nodes(p)
        cur = current_manager(table)
        started = 0
        for n in range(NODES):
            path = os.path.join(self.dir, f"agent{n}.log")
            if os.path.exists(path):
                started += open(path, errors="replace").read().count("lock manager running")
        return {"running": [r.node for r in table if r.manager and r.state == 1],
                "current": cur.node if cur else None, "manager_starts": started}

    # ---- workers

    def start(self, i: int) -> None:
        role, node = LAYOUT[i]
        decoders = [k for k, (r, _) in enumerate(LAYOUT) if r == "decode"]
        args = {"pool": self.path, "node": node, "role": role, "simulate": self.simulate,
                "seed": int(self.rng.integers(1 << 31)), "chains": self.chains}
        if role == "prefill":
            args["tickets"] = os.path.join(self.dir, f"tickets-{i}-{self.started}.jsonl")
        else:
            args.update(tickets=os.path.join(self.dir, "tickets-*.jsonl"),
                        index=decoders.index(i), of=len(decoders))
        env = dict(os.environ)
        # some workers kill themselves at a random pass of a random point
        # inside the allocator's critical sections (TRACT_DIE_AT): the kills
        # a random moment almost never hits. The first prefill and the first
        # decode worker always do, early (a claim, a release of another
        # node's slots), so every run has some
        first = self.started < len(LAYOUT) and i in (0, 2)
        self.armed[i] = first or bool(self.rng.random() < DIE_INSIDE_P)
        if first:
            point = (lib.TRACT_DIE_CLAIM_HEADER if role == "prefill" else
                     lib.TRACT_DIE_RELEASE_HEADER)
            env["TRACT_DIE_AT"] = f"{point}:{int(self.rng.integers(0, 3))}"
        elif self.armed[i]:
            point = int(self.rng.choice(DIE_POINTS))
            env["TRACT_DIE_AT"] = f"{point}:{int(self.rng.integers(0, 30))}"
        p = subprocess.Popen([sys.executable, os.path.join(HERE, "chaos_worker.py"),
                              json.dumps(args)], stdout=subprocess.PIPE,
                             stderr=open(os.path.join(self.dir, f"worker{i}.err"), "wb"),
                             stdin=subprocess.DEVNULL, text=True, env=env)
        self.sel.register(p.stdout, selectors.EVENT_READ, i)
        self.workers[i] = p
        self.started += 1

    def drain(self, wait_s: float) -> None:
        """Reads every worker's event lines for up to WAIT_S seconds."""
        end = time.monotonic() + wait_s
        while True:
            left = end - time.monotonic()
            if left <= 0:
                return
            for key, _ in self.sel.select(timeout=left):
                line = key.fileobj.readline()
                if not line:
                    self.sel.unregister(key.fileobj)
                    continue
                self.count(key.data, line)

    def count(self, i: int, line: str) -> None:
        try:
            ev = json.loads(line)
        except ValueError:
            return                     # cut by SIGKILL mid-line
        name = ev["ev"]
        self.events[name] = self.events.get(name, 0) + 1
        if name in ("received", "lookup"):
            self.blocks_verified += ev["blocks"]
            self.bad_blocks += ev["bad"]
            if ev["bad"]:
                self.errors.append(f"worker {i} ({LAYOUT[i][0]}) read {ev['bad']} bad block(s)")

    def kill_one(self, left: int) -> None:
        self.restart_agents()
        # the host kills spread over the run (never two agents down at once)
        if (self.host_kills_left and not self.agent_back_at and
                self.rng.random() < self.host_kills_left / max(1, left)):
            self.kill_host()
            self.kills += 1
            return
        if not self.agent_back_at and self.rng.random() < AGENT_KILL_P:
            self.kill_agent()
            self.kills += 1
            return
        up = [i for i, p in enumerate(self.workers) if p is not None]
        i = int(self.rng.choice(up))
        p = self.workers[i]
        if p.poll() is not None and self.died_inside(i):
            self.allocator_deaths += 1
        elif p.poll() is not None:     # it died on its own: a bug, not chaos
            err = open(os.path.join(self.dir, f"worker{i}.err")).read()
            self.errors.append(f"worker {i} ({LAYOUT[i][0]}) exited by itself with "
                               f"{p.returncode}: {err.strip()[-600:]}")
        p.kill()
        p.wait(timeout=30)
        self.drain(0)                  # what it printed before dying
        self._forget(p)
        self.kills += 1
        self.start(i)

    def died_inside(self, i: int) -> bool:
        """Whether worker I killed itself at its death point, as armed to."""
        return self.armed[i] and self.workers[i].returncode == -9

    def stop_workers(self) -> None:
        for p in self.workers:
            if p is not None and p.poll() is None:
                p.terminate()
        end = time.monotonic() + 60
        for i, p in enumerate(self.workers):
            if p is None:
                continue               # its host died
            try:
                p.wait(timeout=max(1.0, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)
                self.errors.append(f"worker {i} did not stop within 60 s of SIGTERM")
        self.drain(0.2)
        for i, p in enumerate(self.workers):
            if p is None:
                continue
            if self.died_inside(i):
                self.allocator_deaths += 1
            elif p.returncode not in (0, -15):
                err = open(os.path.join(self.dir, f"worker{i}.err")).read()
                self.errors.append(f"a worker exited with {p.returncode}: {err.strip()[-600:]}")

    # ---- the run

    def run(self, kills: int, min_gap_s: float = 0.05, max_gap_s: float = 0.6) -> dict:
        t0 = time.monotonic()
        for i in range(len(LAYOUT)):
            self.start(i)
        for k in range(kills):
            # the kill points: a random moment of whatever the workers are doing
            self.drain(float(self.rng.uniform(min_gap_s, max_gap_s)))
            self.kill_one(kills - k)
        self.restart_agents(everyone=True)
        self.drain(1.0)
        self.stop_workers()
        hosts = self.bring_hosts_back()
        settled = self.settle()
        managers = self.wait_one_manager()
        violations, _ = self.verify()
        leaked = self.leaked_slots()
        with Pool.attach(self.path, readonly=True, prefault=False, local=False) as p:
            index_counters = snapshot.take(p, views=("index",))["index"]["counters"]
        self.ok = (not self.errors and not self.bad_blocks and settled["clean"] and
                   not violations and not leaked and not hosts["unswept"] and
                   managers["running"] == [managers["current"]])
        return {"kills": self.kills, "agent_kills": self.agent_kills,
                "host_kills": self.host_kills, "hosts": hosts,
                "allocator_deaths": self.allocator_deaths,
                "manager_kills": self.manager_kills, "managers": managers,
                "workers_started": self.started,
                "seconds": round(time.monotonic() - t0, 1), "events": self.events,
                "blocks_verified": self.blocks_verified, "bad_blocks": self.bad_blocks,
                "index_counters": index_counters,    # evictions: whether the run evicted
                "settled": settled, "check_violations": violations, "leaked_slots": leaked,
                "errors": self.errors, "logs": self.dir, "ok": self.ok}

    def wait_one_manager(self) -> dict:
        """Waits (bounded) until exactly the current manager runs one."""
        end = time.monotonic() + SETTLE_S
        while True:
            m = self.managers()
            if m["running"] == [m["current"]] or time.monotonic() > end:
                return m
            time.sleep(0.1)            # polling the node table, bounded by SETTLE_S

    def settle(self) -> dict:
        """Waits (bounded) until no pin, PENDING claim or handoff record is left."""
        end = time.monotonic() + SETTLE_S
        while True:
            with Pool.attach(self.path, readonly=True, prefault=False, local=False) as p:
                snap = snapshot.take(p, views=("index", "handoffs"))
            by_node = snap["index"]["pinned_by_node"]
            state = {"pins": snap["index"]["pins_total"],
                     "pending": snap["index"]["states"]["PENDING"],
                     "handoffs": len(snap["handoffs"]["in_flight"])}
            if not any(state.values()) or time.monotonic() > end:
                return {**state, "pinned_blocks_by_node": by_node,
                        "records": [{k: r[k] for k in ("record", "state", "owner_node",
                                                        "owner_pid", "expires_in_s")}
                                    for r in snap["handoffs"]["in_flight"]],
                        "clean": not any(state.values())}
            time.sleep(0.1)            # polling the region, bounded by SETTLE_S

    def verify(self) -> tuple[list[str], dict]:
        with Pool.attach(self.path, readonly=True, prefault=False, local=False) as p:
            violations, counts = check.verify(p, data=True)
        return [f"{v.check}: {v.detail}" for v in violations], counts

    def leaked_slots(self) -> list[int]:
        """Waits (bounded) until every slot taken from the region is READY data
        or on a free list, and returns those that are neither: a dead
        process's journaled slots (a killed evictor's) come back at its
        agent's next pass that gets lock 0, which may come after settle()."""
        end = time.monotonic() + SETTLE_S
        while True:
            leaked = self.leaked_now()
            if not leaked or time.monotonic() > end:
                return leaked
            time.sleep(0.1)            # polling the region, bounded by SETTLE_S

    def leaked_now(self) -> list[int]:
        """Slots taken from the region that are neither READY data nor on a free list."""
        from tract_cli.core.media import BUCKET_DTYPE
        with Pool.attach(self.path, readonly=True, prefault=False, local=False) as p:
            info = p.info
            bits = np.unpackbits(np.frombuffer(p.observe(info.section("bitmap").offset,
                                                         info.section("bitmap").length),
                                               np.uint8), bitorder="little")[:info.slot_count]
            b = np.frombuffer(p.observe(info.section("buckets").offset,
                                        info.section("buckets").length), np.uint8).view(BUCKET_DTYPE)
            in_use = set((b["slot"][b["state"] == 2].astype(np.int64) - 1).tolist())
        free = set()
        for n in range(NODES):
            with Pool.attach(self.path, node=n, prefault=False) as p:
                free |= set(p.allocator.local_free().tolist())
        taken = set(np.flatnonzero(bits).tolist())
        return sorted(taken - in_use - free)

    def close(self) -> None:
        for p in self.workers:
            if p is not None and p.poll() is None:
                p.kill()
                p.wait(timeout=30)
        for a in self.agents:
            if a is not None and a.poll() is None:
                a.terminate()
                try:
                    a.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    a.kill()
        self.sel.close()
        remove_region(self.path)
        if self.ok:
            shutil.rmtree(self.dir, ignore_errors=True)
        else:
            print(f"chaos: the agents' and workers' logs are kept in {self.dir}", file=sys.stderr)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kills", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--simulate", action="store_true", help="non-coherence simulator")
    ap.add_argument("--host-kills", type=int, default=0,
                    help="whole emulated hosts killed during the run (back when it ends)")
    ap.add_argument("--region-mib", type=int, default=32,
                    help="region size (small enough and the run evicts: 8 MiB is 768 slots; "
                         "with --host-kills, a killed host's evictions in flight can leak "
                         "another node's slots, PROTOCOLS.md §7 'What can still leak')")
    ap.add_argument("--chains", type=int, default=24,
                    help="distinct chains put and looked up (more than the region holds: "
                         "the run evicts)")
    a = ap.parse_args()
    chaos = Chaos(a.seed, a.simulate, region_size=a.region_mib << 20, host_kills=a.host_kills,
                  chains=a.chains)
    try:
        result = chaos.run(a.kills)
    finally:
        chaos.close()
    print(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
