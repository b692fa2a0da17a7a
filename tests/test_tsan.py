"""The C core's threaded paths under ThreadSanitizer: tests/tsan_threads.c,
built here from this checkout with -fsanitize=thread, runs the lock
manager's thread, a watcher of its state and four worker threads sharing one
region handle; any data race on process memory fails the test (region memory
is the cross-host protocol's, checked by the simulator: tests/tsan.supp)."""
from __future__ import annotations

import glob
import os
import subprocess

import pytest

import sanitizers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = ["-std=gnu11", "-fsanitize=thread", "-O1", "-g", "-Wall", "-Wextra", "-Werror"]

pytestmark = pytest.mark.skipif(sanitizers.runtime("tsan") is None,
                                reason="no gcc with libtsan (package libtsan2/gcc)")


def _build(tmp_path, sources, name):
    exe = tmp_path / name
    res = subprocess.run(["gcc", *FLAGS, "-I", os.path.join(ROOT, "native"), *sources,
                          "-lpthread", "-o", str(exe)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return exe


def _run(exe):
    env = {**os.environ, "TSAN_OPTIONS": "halt_on_error=1 exitcode=66 suppressions="
           + os.path.join(ROOT, "tests", "tsan.supp")}
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=600, env=env)


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


def test_the_threaded_paths_of_the_core_have_no_data_race(tmp_path):
    sources = sorted(glob.glob(os.path.join(ROOT, "native", "*.c")))
    exe = _build(tmp_path, [*sources, os.path.join(ROOT, "tests", "tsan_threads.c")],
                 "tsan_threads")
    res = _run(exe)
    assert "ThreadSanitizer" not in res.stderr, res.stderr[-8000:]
    assert res.returncode == 0, res.stdout + res.stderr[-4000:]
    assert "every operation succeeded" in res.stdout
    handoffs = int(res.stdout.split("(")[1].split()[0])
    assert handoffs > 0, res.stdout      # the handoff paths ran too
