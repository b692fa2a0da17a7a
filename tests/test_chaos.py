"""The chaos test, bounded for CI (tests/chaos.py has the long version):
prefill and decode processes on three emulated nodes, one of them -- or a
node agent, the lock manager's included -- SIGKILLed at a random moment again
and again, and some of them killing themselves inside the allocator.
Afterwards one manager runs, nothing is left over and nothing read
was wrong (see tests/chaos.py for the list)."""
from __future__ import annotations

import pytest

from chaos import Chaos


@pytest.mark.parametrize("simulate,kills", [(False, 40), (True, 15)], ids=["plain", "sim"])
def test_killed_workers_leave_nothing_behind_and_nothing_read_is_wrong(simulate, kills):
    chaos = Chaos(seed=11, simulate=simulate)
    try:
        r = chaos.run(kills)
    finally:
        chaos.close()
    summary = {k: r[k] for k in ("kills", "agent_kills", "allocator_deaths", "manager_kills",
                                 "managers", "events",
                                 "settled", "check_violations", "leaked_slots", "bad_blocks",
                                 "errors")}
    assert r["kills"] == kills
    assert r["agent_kills"] > 0, summary
    assert r["allocator_deaths"] > 0, summary
    assert r["managers"]["running"] == [r["managers"]["current"]], summary
    assert r["errors"] == [], summary
    assert r["bad_blocks"] == 0, summary
    assert r["events"].get("received", 0) > 0 and r["events"].get("published", 0) > 0, summary
    assert r["settled"]["clean"], summary
    assert r["check_violations"] == [], summary
    assert r["leaked_slots"] == [], summary
