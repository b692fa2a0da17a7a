"""The chaos test, bounded for CI (tests/chaos.py has the long version):
prefill and decode processes on three emulated nodes, one of them -- or a
node agent, the lock manager's included -- SIGKILLed at a random moment again
and again, and some of them killing themselves inside the allocator; in
one run a whole emulated host dies too, declared dead and recovered online.
Afterwards one manager runs, nothing is left over and nothing read
was wrong (see tests/chaos.py for the list)."""
from __future__ import annotations

import json

import pytest

from chaos import Chaos


# the host-kill run: one whole emulated host (its agent, its workers, its
# node-local segment) killed during the run, under the simulator, whose
# cache is the host's: its unflushed stores die with it (PROTOCOLS §7, "A
# dead host")
# The plain run's region is small for its chains (8 MiB, 96 chains), so it
# evicts (hundreds to thousands of blocks): killed evictors have their slots freed by
# their node's agent (PROTOCOLS §7, "Dead processes' pins")
EVICTING = {"region_size": 8 << 20, "chains": 96}


# (A host kill is run without evictions: a host that dies while it evicts
# another node's blocks leaks their slots, a documented limit, PROTOCOLS §7
# "What can still leak".)
@pytest.mark.parametrize("simulate,kills,host_kills,sizing", [(False, 40, 0, EVICTING),
                                                              (True, 15, 0, {}),
                                                              (False, 30, 1, {}),
                                                              (True, 30, 1, {})],
                         ids=["plain-evicting", "sim", "plain-host-kill", "sim-host-kill"])
def test_killed_workers_leave_nothing_behind_and_nothing_read_is_wrong(simulate, kills,
                                                                       host_kills, sizing):
    chaos = Chaos(seed=11, simulate=simulate, host_kills=host_kills, **sizing)
    try:
        r = chaos.run(kills)
    finally:
        chaos.close()
    # a string, not a dict: pytest prints a failed assertion's message in full,
    # and shortens a dict's repr to its first keys
    summary = json.dumps({k: r[k] for k in ("kills", "agent_kills", "allocator_deaths",
                                            "manager_kills", "managers", "events",
                                            "settled", "check_violations", "leaked_slots",
                                            "bad_blocks", "errors", "host_kills", "hosts",
                                            "index_counters", "logs")}, default=str)
    assert r["kills"] == kills
    # a whole host killed: declared dead, recovered online, back at the end
    assert r["host_kills"] == host_kills, summary
    assert len(r["hosts"]["declared_dead"]) == host_kills and not r["hosts"]["unswept"], r["hosts"]
    assert r["agent_kills"] > 0, summary
    assert r["allocator_deaths"] > 0, summary
    assert r["managers"]["running"] == [r["managers"]["current"]], summary
    assert r["errors"] == [], summary
    assert r["bad_blocks"] == 0, summary
    assert r["events"].get("received", 0) > 0 and r["events"].get("published", 0) > 0, summary
    assert r["settled"]["clean"], summary
    assert r["check_violations"] == [], summary
    assert r["leaked_slots"] == [], summary
    if sizing:
        assert r["index_counters"]["evictions"] > 0, r["index_counters"]
