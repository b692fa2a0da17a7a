"""`tract inspect`: a region driven into a known state by processes on several
emulated nodes is inspected and every figure checked; the live view renders
and stops on interrupt; inspecting a busy region neither crashes nor
disturbs it."""
from __future__ import annotations

import json
import selectors
import signal
import subprocess
import sys

import pytest

from agents import RunningAgent
from procs import Worker
from tract_cli.core.locks import LOCK_OBJDIR
from tract_cli.core.pool import Pool
from tract_cli.inspect import snapshot

LOCK = LOCK_OBJDIR      # the lock the tests hold: the object directory's


def inspect_json(path: str, *views: str) -> dict:
    res = subprocess.run([sys.executable, "-m", "tract_cli.cli", "inspect", path, *views, "--json"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


@pytest.fixture
def region(region_path):
    Pool.create(region_path, 16 << 20, "tiny", nodes=4, index_stripes=8).close()
    return region_path


def test_a_known_state_is_reported_exactly(region):
    with RunningAgent(region, 0, manager=True) as agent, \
            Worker(region, 1) as prefill, Worker(region, 2) as holder, Worker(region, 3) as waiter:
        holder.call("lock_acquire", lock_id=LOCK)
        waiter.send("lock_acquire", lock_id=LOCK, wait=60)
        prefill.call("index_put_chains", chains=[[1, 0, 2, 10]])
        prefill.call("index_lookup_verify", chains=[[1, 0, 2, 10]], hold=True)   # 10 pins
        prefill.call("handoff_publish", chain=[3, 0, 4, 6], request="r1")     # 6 more
        snap = inspect_json(region)
        locks = {l["id"]: l for l in snap["locks"]["locks"]}
        assert locks[LOCK]["holder_node"] == 2 and locks[LOCK]["holder_pid"] == holder.proc.pid
        assert [w["node"] for w in locks[LOCK]["waiting"]] == [3]
        ix = snap["index"]
        assert ix["states"]["READY"] == 16 and ix["states"]["PENDING"] == 0
        assert ix["pinned_blocks"] == 16 and ix["pins_total"] == 16
        assert ix["pinned_by_node"] == {"1": 16}
        assert ix["counters"]["inserts"] == 16
        (h,) = snap["handoffs"]["in_flight"]
        assert (h["owner_node"], h["blocks"], h["state"]) == (1, 6, "PUBLISHED")
        assert h["owner_pid"] == prefill.proc.pid and 0 < h["expires_in_s"] <= 30
        al = snap["alloc"]
        assert al["in_use"] == 16 + 2 and al["consistent"]       # blocks + key list + tail
        assert al["by_node"]["1"]["in_use"] == 18
        (mgr,) = [n for n in snap["nodes"]["nodes"] if n["manager"]]
        assert mgr["node"] == 0 and mgr["agent_pid"] == agent.proc.pid and mgr["live"]
        holder.call("lock_release", lock_id=LOCK)
        assert waiter.recv("lock_acquire", timeout=60) is False
        waiter.call("lock_release", lock_id=LOCK)
        locks = {l["id"]: l for l in inspect_json(region, "--locks")["locks"]["locks"]}
        assert locks[LOCK]["holder_node"] is None and locks[LOCK]["grants"] == 2


def test_a_dead_holder_is_flagged(region):
    with RunningAgent(region, 0, manager=True):
        w = Worker(region, 2)
        w.call("lock_acquire", lock_id=LOCK)
        pid = w.proc.pid
        w.kill()
        w.close()
        (lock,) = [l for l in inspect_json(region, "--locks")["locks"]["locks"] if l["id"] == LOCK]
        assert f"holder pid {pid} is dead" in lock["flags"]


def test_json_follows_the_documented_schema(region):
    snap = inspect_json(region)
    assert snap["schema"] == 1
    assert set(snap) == {"schema", "region", "medium", "uuid", "model", "taken_ns", "nodes",
                         "locks", "index", "alloc", "handoffs", "snapshot_ms"}
    assert set(snap["index"]) == {"buckets", "stripes", "states", "load_factor",
                                  "probe_length_histogram", "max_probe_length", "pinned_blocks",
                                  "pins_total", "pinned_by_node", "counters", "lru",
                                  "occupancy_map", "events"}
    assert set(snap["index"]["events"]) == {"appended", "per_stripe_capacity", "kept",
                                            "busiest_stripe"}
    only = inspect_json(region, "--index", "--alloc")
    assert "index" in only and "alloc" in only and "locks" not in only


def test_durations_render_in_readable_units():
    """No '7.1e-05 s' in a table: every duration goes through format_duration."""
    from rich.console import Console
    from tract_cli.inspect import render
    lock = {"id": LOCK, "name": "object directory", "holder_node": 0, "holder_pid": 1,
            "held_s": 7.1e-05, "waiting": [{"node": 2, "waited_s": 125.0}], "grants": 3,
            "flags": []}
    console = Console(record=True, width=200)
    console.print(render.locks_table({"locks": [lock], "lock_count": 11}))
    text = console.export_text()
    assert "71 µs" in text and "2 min 5 s" in text and "e-05" not in text, text


def test_live_view_renders_and_stops_after_count(region):
    res = subprocess.run([sys.executable, "-m", "tract_cli.cli", "inspect", region, "--watch",
                          "--interval", "0.05", "--count", "3"], capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert "index" in res.stdout and "Traceback" not in res.stderr


def test_live_view_exits_cleanly_on_ctrl_c(region):
    p = subprocess.Popen([sys.executable, "-m", "tract_cli.cli", "inspect", region, "--watch",
                          "--interval", "0.05"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    sel = selectors.DefaultSelector()
    sel.register(p.stderr, selectors.EVENT_READ)
    assert sel.select(timeout=60), "the live view did not start within 60 s"
    assert "watching" in p.stderr.readline()
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "Traceback" not in err


def test_inspecting_a_busy_region_neither_crashes_nor_disturbs_it(region):
    chains = [[1, 4, 10 + i, 10] for i in range(8)]
    with RunningAgent(region, 0, manager=True):
        with Worker(region, 1) as a, Worker(region, 2) as b:
            a.send("index_put_chains", chains=chains)
            b.send("index_lookup_verify", chains=chains)
            with snapshot.open_pool(region) as pool:
                snaps = [snapshot.take(pool) for _ in range(40)]
            a.recv("index_put_chains", timeout=300)
            b.recv("index_lookup_verify", timeout=300)         # every byte verified
            assert b.call("index_lookup_verify", chains=chains) == [10] * 8
    assert all(s["index"]["states"]["READY"] <= 4 + 8 * 6 for s in snaps)
    assert snapshot.take(snapshot.open_pool(region))["index"]["states"]["READY"] == 4 + 8 * 6
