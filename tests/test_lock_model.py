"""The lock protocol's Promela models, checked with spin: tests/model/lock.pml
(mutual exclusion and no starvation for 3 nodes x 2 processes under a
non-coherent memory model; a planted missing flush must fail the check) and
tests/model/takeover.pml (manager takeover with fencing tokens: exclusion
while a superseded manager keeps running, no starvation once the takeover is
over; each of the three planted protocol bugs must fail) and
tests/model/deadhost.pml (a dead host's slots: returned by its recovery's
sweep only, never twice, never once taken again; each of the three planted
bugs must fail).

Each verification is minutes of one CPU that shares nothing with any other
test: they run in the background while the suite goes on (tests/background.py)
and these tests, run last, assert on their reports."""
from __future__ import annotations

import pathlib
import shutil
import tempfile

import pytest

import background
from background import Check, uses, uses_param

MODELS = pathlib.Path(__file__).resolve().parent / "model"
pytestmark = pytest.mark.skipif(not shutil.which("spin") or not shutil.which("gcc"),
                                reason="spin (Debian package 'spin') is not installed")


def step(argv, cwd, timeout) -> str:
    res = background.run(argv, cwd=cwd, timeout=timeout)
    if res.returncode != 0 and argv[0] != "./pan":
        raise AssertionError(f"{' '.join(argv[:3])} failed:\n{res.stdout[-2000:]}{res.stderr[-2000:]}")
    return res.stdout


def check(*, liveness: bool, defines: tuple[str, ...] = (), model: str = "lock") -> str:
    """Generates, compiles and runs the verifier; returns its report."""
    with tempfile.TemporaryDirectory(prefix="tract-spin-") as d:
        shutil.copy(MODELS / f"{model}.pml", pathlib.Path(d) / f"{model}.pml")
        step(["spin", *defines, "-a", f"{model}.pml"], d, 120)
        flags = ["-DNFAIR=3"] if liveness else ["-DSAFETY"]
        step(["gcc", "-O2", "-DCOLLAPSE", *flags, "-o", "pan", "pan.c"], d, 300)
        return step(["./pan", "-m10000000"] + (["-a", "-f"] if liveness else []), d, 600)


# seconds each took on a 2-CPU machine (the order they run in: longest first)
EXCLUSION = Check("lock: mutual exclusion", check, liveness=False, cost=9)
NO_STARVATION = Check("lock: no starvation", check, liveness=True, cost=14)
GRANT_FLUSH_BUG = Check("lock: BUG_NO_GRANT_FLUSH", check, liveness=True,
                        defines=("-DBUG_NO_GRANT_FLUSH",), cost=3)
TAKEOVER_EXCLUSION = Check("takeover: mutual exclusion", check, liveness=False,
                           model="takeover", cost=34)
TAKEOVER_NO_STARVATION = Check("takeover: no starvation", check, liveness=True,
                               model="takeover", cost=72)
TAKEOVER_BUGS = {bug: Check(f"takeover: {bug}", check, liveness=False, defines=(f"-D{bug}",),
                            model="takeover", cost=cost)
                 for bug, cost in (("BUG_NO_RECHECK", 3), ("BUG_CHECK_BEFORE_LOCKED", 11),
                                   ("BUG_NO_ADOPT", 7))}
DEAD_HOST_SLOTS = Check("deadhost: a slot never given back twice", check, liveness=False,
                        model="deadhost", cost=1)
DEAD_HOST_BUGS = {bug: Check(f"deadhost: {bug}", check, liveness=False, defines=(f"-D{bug}",),
                             model="deadhost", cost=1)
                  for bug in ("BUG_NO_DEFER", "BUG_EPOCH_AT_FREE", "BUG_SWEEP_UNCHECKED")}


@uses(EXCLUSION)
def test_mutual_exclusion_holds():
    report = EXCLUSION.result()
    assert "errors: 0" in report, report
    assert "max search depth too small" not in report, report   # the search was complete


@uses(NO_STARVATION)
def test_no_node_starves():
    report = NO_STARVATION.result()
    assert "errors: 0" in report, report
    assert "max search depth too small" not in report, report


@uses(GRANT_FLUSH_BUG)
def test_a_missing_grant_flush_is_caught():
    report = GRANT_FLUSH_BUG.result()
    assert "acceptance cycle" in report and "errors: 1" in report, report


@uses(TAKEOVER_EXCLUSION)
def test_takeover_keeps_mutual_exclusion():
    report = TAKEOVER_EXCLUSION.result()
    assert "errors: 0" in report, report
    assert "max search depth too small" not in report, report


@uses(TAKEOVER_NO_STARVATION)
def test_no_node_starves_across_a_takeover():
    report = TAKEOVER_NO_STARVATION.result()
    assert "errors: 0" in report, report
    assert "max search depth too small" not in report, report


@uses_param("bug", TAKEOVER_BUGS)
@pytest.mark.parametrize("bug", list(TAKEOVER_BUGS))
def test_each_takeover_bug_breaks_exclusion(bug):
    report = TAKEOVER_BUGS[bug].result()
    assert "assertion violated (in_cs==1)" in report and "errors: 1" in report, report


@uses(DEAD_HOST_SLOTS)
def test_a_dead_hosts_slot_is_never_given_back_twice():
    report = DEAD_HOST_SLOTS.result()
    assert "errors: 0" in report, report
    assert "max search depth too small" not in report, report


@uses_param("bug", DEAD_HOST_BUGS)
@pytest.mark.parametrize("bug", list(DEAD_HOST_BUGS))
def test_each_dead_host_slot_bug_is_caught(bug):
    report = DEAD_HOST_BUGS[bug].result()
    assert "assertion violated" in report and "errors: 1" in report, report
