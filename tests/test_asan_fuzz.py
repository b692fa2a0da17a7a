"""Corrupted regions never crash the C core nor make it read or write out of
bounds: tests/asan_fuzz.py runs against a build of the core with
AddressSanitizer (built here, from this checkout, into a temporary copy).

The build and the fuzz runs are minutes of one CPU that share nothing with
any other test (each case is a region file of its own): they run in the
background while the suite goes on (tests/background.py) and this test, run
last, asserts on what they printed."""
from __future__ import annotations

import functools
import json
import os
import pathlib
import shutil
import sys

import pytest

import background
from background import Check, uses_param
import sanitizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = 300


def libasan() -> str | None:
    return sanitizers.runtime("asan")


@functools.lru_cache(maxsize=1)
def asan_build() -> pathlib.Path:
    """A copy of the checkout with the core built under AddressSanitizer (once)."""
    src = pathlib.Path(background.session_dir("tract-asan-")) / "src"
    shutil.copytree(os.path.join(ROOT, "native"), src / "native")
    shutil.copytree(os.path.join(ROOT, "tract_cli"), src / "tract_cli",
                    ignore=shutil.ignore_patterns("*.so", "__pycache__", "_native.c"))
    for f in ("setup.py", "pyproject.toml"):
        shutil.copy(os.path.join(ROOT, f), src / f)
    env = {**os.environ, "TRACT_ASAN": "1", "TRACT_WERROR": "1"}
    build = background.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"],
                           cwd=src, env=env, timeout=900)
    assert build.returncode == 0, build.stderr[-3000:]
    return src


def fuzz(seed: int, cases: int):
    """The ASan build and one run of tests/asan_fuzz.py: (build dir, the run)."""
    src = asan_build()
    run_env = {**os.environ, "PYTHONPATH": str(src), "LD_PRELOAD": libasan(),
               "ASAN_OPTIONS": "detect_leaks=0:abort_on_error=1:halt_on_error=1"}
    return src, background.run([sys.executable, os.path.join(ROOT, "tests", "asan_fuzz.py"),
                                "--cases", str(cases), "--seed", str(seed)],
                               env=run_env, timeout=1200)


# a fixed seed (the same cases every run) and a fresh one (printed: a failure
# names the seed that reproduces it, `tests/asan_fuzz.py --cases N --seed S`)
FRESH_SEED = int.from_bytes(os.urandom(4), "little")
RUNS = {(5, CASES): Check("asan fuzz: seed 5", fuzz, 5, CASES, cost=36),
        (FRESH_SEED, 2 * CASES): Check(f"asan fuzz: seed {FRESH_SEED}", fuzz, FRESH_SEED,
                                       2 * CASES, cost=30)}


@pytest.mark.skipif(libasan() is None, reason="no gcc with libasan (package libasan8/gcc)")
@uses_param(("seed", "cases"), RUNS)
@pytest.mark.parametrize("seed,cases", list(RUNS), ids=["seed-5", f"fresh-seed-{FRESH_SEED}"])
def test_corrupted_regions_never_crash_the_core_under_asan(seed, cases):
    print(f"asan fuzz: seed {seed}, {cases} cases")
    src, res = RUNS[seed, cases].result()
    again = f"reproduce: tests/asan_fuzz.py --cases {cases} --seed {seed}"
    assert "AddressSanitizer" not in res.stderr, (again, res.stderr[-6000:])
    assert res.returncode == 0, (again, res.stdout[-3000:], res.stderr[-3000:])
    summary = json.loads(res.stdout)
    assert summary["core"].startswith(str(src)), summary["core"]   # the ASan build ran
    assert summary["cases"] == cases and summary["failures"] == [], (again, summary["failures"])
    assert summary["attached"] > 0 and summary["refused"] > 0
    assert len(summary["by_area"]) >= 10
