"""The C core's threaded paths under ThreadSanitizer: tests/tsan_threads.c,
built here from this checkout with -fsanitize=thread, runs the lock
manager's thread, a watcher of its state and four worker threads sharing one
region handle; any data race on process memory fails the test (region memory
is the cross-host protocol's, checked by the simulator: tests/tsan.supp).
The core's build and run are a minute of CPU that shares nothing with any
other test: they run in the background while the suite goes on
(tests/background.py), and the test that asserts on them runs last."""
from __future__ import annotations

import glob
import os
import pathlib
import subprocess

import pytest

import background
from background import Check, uses
import sanitizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["-std=gnu11", "-fsanitize=thread", "-O1", "-g", "-Wall", "-Wextra", "-Werror"]

pytestmark = pytest.mark.skipif(sanitizers.runtime("tsan") is None,
                                reason="no gcc with libtsan (package libtsan2/gcc)")


def _build(tmp_path, sources, name):
    exe = tmp_path / name
    res = background.run(["gcc", *FLAGS, "-I", os.path.join(ROOT, "native"), *sources,
                          "-lpthread", "-o", str(exe)], timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return exe


def _run(exe):
    env = {**os.environ, "TSAN_OPTIONS": "halt_on_error=1 exitcode=66 suppressions="
           + os.path.join(ROOT, "tests", "tsan.supp")}
    return background.run([str(exe)], timeout=600, env=env)


def core_under_tsan() -> subprocess.CompletedProcess:
    """tests/tsan_threads.c with the whole core, built under ThreadSanitizer and run."""
    sources = sorted(glob.glob(os.path.join(ROOT, "native", "*.c")))
    exe = _build(pathlib.Path(background.session_dir("tract-tsan-")),
                 [*sources, os.path.join(ROOT, "tests", "tsan_threads.c")], "tsan_threads")
    return _run(exe)


CORE = Check("tsan: the core's threaded paths", core_under_tsan, cost=20)


def test_tsan_catches_a_race_here(tmp_path):
    """The toolchain works on this machine: a deliberate race is reported
    (so a clean run of the core below means something)."""
    src = tmp_path / "race.c"
    src.write_text("#include <pthread.h>\nstatic int x;\n"
                   "static void *f(void *a) { (void)a; x++; return 0; }\n"
                   "int main(void) { pthread_t t; pthread_create(&t, 0, f, 0); x++;\n"
                   "  pthread_join(t, 0); return 0; }\n")
    res = _run(_build(tmp_path, [str(src)], "race"))
    assert res.returncode == 66 and "data race" in res.stderr, res.stderr[-2000:]


@uses(CORE)
def test_the_threaded_paths_of_the_core_have_no_data_race():
    res = CORE.result()
    assert "ThreadSanitizer" not in res.stderr, res.stderr[-8000:]
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    assert "every operation succeeded" in res.stdout
    handoffs = int(res.stdout.split("(")[1].split()[0])
    assert handoffs > 0, res.stdout      # the handoff paths ran too
