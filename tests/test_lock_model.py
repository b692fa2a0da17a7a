"""The lock protocol's Promela models, checked with spin: tests/model/lock.pml
(mutual exclusion and no starvation for 3 nodes x 2 processes under a
non-coherent memory model; a planted missing flush must fail the check) and
tests/model/takeover.pml (manager takeover with fencing tokens: exclusion
while a superseded manager keeps running, no starvation once the takeover is
over; each of the three planted protocol bugs must fail)."""
from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

MODELS = pathlib.Path(__file__).resolve().parent / "model"
pytestmark = pytest.mark.skipif(not shutil.which("spin") or not shutil.which("gcc"),
                                reason="spin (Debian package 'spin') is not installed")


def check(tmp_path, *, liveness: bool, defines: tuple[str, ...] = (), model: str = "lock") -> str:
    """Generates, compiles and runs the verifier; returns its report."""
    shutil.copy(MODELS / f"{model}.pml", tmp_path / f"{model}.pml")
    subprocess.run(["spin", *defines, "-a", f"{model}.pml"], cwd=tmp_path, check=True,
                   capture_output=True, timeout=120)
    flags = ["-DNFAIR=3"] if liveness else ["-DSAFETY"]
    subprocess.run(["gcc", "-O2", "-DCOLLAPSE", *flags, "-o", "pan", "pan.c"], cwd=tmp_path,
                   check=True, capture_output=True, timeout=300)
    run = ["./pan", "-m10000000"] + (["-a", "-f"] if liveness else [])
    res = subprocess.run(run, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    return res.stdout


def test_mutual_exclusion_holds(tmp_path):
    report = check(tmp_path, liveness=False)
    assert "errors: 0" in report, report
    assert "max search depth too small" not in report, report   # the search was complete


def test_no_node_starves(tmp_path):
    report = check(tmp_path, liveness=True)
    assert "errors: 0" in report, report
    assert "max search depth too small" not in report, report


def test_a_missing_grant_flush_is_caught(tmp_path):
    report = check(tmp_path, liveness=True, defines=("-DBUG_NO_GRANT_FLUSH",))
    assert "acceptance cycle" in report and "errors: 1" in report, report


def test_takeover_keeps_mutual_exclusion(tmp_path):
    report = check(tmp_path, liveness=False, model="takeover")
    assert "errors: 0" in report, report
    assert "max search depth too small" not in report, report


def test_no_node_starves_across_a_takeover(tmp_path):
    report = check(tmp_path, liveness=True, model="takeover")
    assert "errors: 0" in report, report
    assert "max search depth too small" not in report, report


@pytest.mark.parametrize("bug", ["BUG_NO_RECHECK", "BUG_CHECK_BEFORE_LOCKED", "BUG_NO_ADOPT"])
def test_each_takeover_bug_breaks_exclusion(tmp_path, bug):
    report = check(tmp_path, liveness=False, defines=(f"-D{bug}",), model="takeover")
    assert "assertion violated (in_cs==1)" in report and "errors: 1" in report, report
