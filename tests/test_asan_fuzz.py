"""Corrupted regions never crash the C core nor make it read or write out of
bounds: tests/asan_fuzz.py runs against a build of the core with
AddressSanitizer (built here, from this checkout, into a temporary copy)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

import sanitizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = 300


def libasan() -> str | None:
    return sanitizers.runtime("asan")


# a fixed seed (the same cases every run) and a fresh one (printed: a failure
# names the seed that reproduces it, `tests/asan_fuzz.py --cases N --seed S`)
FRESH_SEED = int.from_bytes(os.urandom(4), "little")


@pytest.fixture(scope="module")
def asan_build(tmp_path_factory):
    src = tmp_path_factory.mktemp("asan") / "src"
    shutil.copytree(os.path.join(ROOT, "native"), src / "native")
    shutil.copytree(os.path.join(ROOT, "tract_cli"), src / "tract_cli",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__", "_native.c"))
    for f in ("setup.py", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, f), src / f)
    env = {**os.environ, "TRACT_ASAN": "1", "TRACT_WERROR": "1"}
    build = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                           cwd=src, env=env, capture_output=True, text=True, timeout=900)
    assert build.returncode == 0, build.stderr[-3000:]
    return src


@pytest.mark.skipif(libasan() is None, reason="no gcc with libasan (package libasan8/gcc)")
@pytest.mark.parametrize("seed,cases", [(5, CASES), (FRESH_SEED, 2 * CASES)],
                         ids=["seed-5", f"fresh-seed-{FRESH_SEED}"])
def test_corrupted_regions_never_crash_the_core_under_asan(asan_build, seed, cases):
    src = asan_build
    print(f"asan fuzz: seed {seed}, {cases} cases")
    run_env = {**os.environ, "PYTHONPATH": str(src), "LD_PRELOAD": libasan(),
               "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1"}
    res = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "asan_fuzz.py"),
                          "--cases", str(cases), "--seed", str(seed)], env=run_env,
                         capture_output=True, text=True, timeout=1200)
    again = f"reproduce: tests/asan_fuzz.py --cases {cases} --seed {seed}"
    assert "AddressSanitizer" not in res.stderr, (again, res.stderr[-6000:])
    assert res.returncode == 0, (again, res.stdout[-3000:], res.stderr[-3000:])
    summary = json.loads(res.stdout)
    assert summary["core"].startswith(str(src)), summary["core"]   # the ASan build ran
    assert summary["cases"] == cases and summary["failures"] == [], (again, summary["failures"])
    assert summary["attached"] > 0 and summary["refused"] > 0
    assert len(summary["by_area"]) >= 10
