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


# the writer thread writes x, says so, and stays alive until main has written
# x too; the flags are relaxed atomics (no happens-before for TSan); every
# wait is bounded (exit 3: the other thread never came)
RACE = r"""
#include <pthread.h>
#include <sched.h>
static int x, wrote, done;
static int wait_for(int *flag) {
    for (long i = 0; i < 100000000L; i++) {
        if (__atomic_load_n(flag, __ATOMIC_RELAXED)) return 1;
        sched_yield();
    }
    return 0;
}
static void *f(void *a) {
    (void)a;
    x++;
    __atomic_store_n(&wrote, 1, __ATOMIC_RELAXED);
    return (void *)(long)wait_for(&done);
}
int main(void) {
    pthread_t t;
    void *ok;
    pthread_create(&t, 0, f, 0);
    if (!wait_for(&wrote)) return 3;
    x++;
    __atomic_store_n(&done, 1, __ATOMIC_RELAXED);
    pthread_join(t, &ok);
    return ok ? 0 : 3;
}
"""


def test_tsan_catches_a_race_here(tmp_path):
    """The toolchain works on this machine: a deliberate race is reported
    (so a clean run of the core below means something).  Both writes happen
    while both threads live (relaxed flags order them in time, not for
    ThreadSanitizer): a race with a thread that already exited can go
    unreported when its history is recycled, which made this test flaky."""
    src = tmp_path / "race.c"
    src.write_text(RACE)
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
