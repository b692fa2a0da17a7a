"""The lock protocol's Promela model, checked with spin (tests/model/lock.pml):
mutual exclusion and no starvation for 3 nodes x 2 processes under a
non-coherent memory model; a planted missing flush must fail the check."""
from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

MODEL = pathlib.Path(__file__).resolve().parent / "model" / "lock.pml"
pytestmark = pytest.mark.skipif(not shutil.which("spin") or not shutil.which("gcc"),
                                reason="spin (Debian package 'spin') is not installed")


def check(tmp_path, *, liveness: bool, defines: tuple[str, ...] = ()) -> str:
    """Generates, compiles and runs the verifier; returns its report."""
    shutil.copy(MODEL, tmp_path / "lock.pml")
    subprocess.run(["spin", *defines, "-a", "lock.pml"], cwd=tmp_path, check=True,
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
