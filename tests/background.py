"""Long, self-contained checks that run beside the rest of the suite.

The model checker's runs (tests/test_lock_model.py) and the AddressSanitizer
fuzz (tests/test_asan_fuzz.py) are minutes of one CPU each that share nothing
with any other test: no region, no agent, no port, no timing bound.  The rest
of the suite keeps about one of a machine's two CPUs busy on average (its
multi-process tests wait on one another), so these run there, in one worker
thread started once collection is done, while the suite goes on; the tests
that assert on them run last and collect what they produced.  The assertions
are the tests' own, unchanged; only when a check runs moves.

At most one background check runs at a time (one extra busy CPU: what the
suite must stand anyway, "deterministic on two busy cores"), longest first.
Every subprocess a check starts goes through `run`, so the session's end,
however it ends (-x, ^C, a failure), stops it: nothing outlives pytest.

A module declares its checks as `Check`s and marks each test with the checks
it asserts on (`@uses(CHECK, ...)`); the test calls `CHECK.result()`.  A test
run where the plugin did not start the check (its module imported another
way) runs it then, in the foreground.
"""
from __future__ import annotations

import concurrent.futures
import shutil
import subprocess
import tempfile
import threading

_lock = threading.Lock()
_running: set[subprocess.Popen] = set()
_stopping = threading.Event()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_futures: dict["Check", concurrent.futures.Future] = {}
_dirs: list[str] = []


class Stopped(Exception):
    """The session ended before this check could finish."""


class Check:
    """FN(*ARGS) run once per session, in the background when a selected test uses it.

    COST is its rough duration in seconds on this kind of machine: the longest
    go first, so that the last to finish is a short one."""

    def __init__(self, name: str, fn, *args, cost: float = 1.0, **kwargs):
        self.name, self.fn, self.args, self.kwargs, self.cost = name, fn, args, kwargs, cost

    def __repr__(self) -> str:
        return f"Check({self.name})"

    def _call(self):
        if _stopping.is_set():
            raise Stopped(f"{self.name}: the session ended first")
        return self.fn(*self.args, **self.kwargs)

    def result(self, timeout: float = 3600.0):
        """What FN returned (or raised). Bounded by TIMEOUT, and in any case by
        the timeouts of the subprocesses FN runs."""
        with _lock:
            fut = _futures.get(self)
        if fut is None:                      # not started by the plugin: run it here
            return self._call()
        try:
            return fut.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            raise AssertionError(f"background check {self.name} gave no result within "
                                 f"{timeout:.0f} s") from None


def uses(*checks: Check):
    """Marks a test as asserting on CHECKS (started in the background, test moved last)."""
    def mark(fn):
        fn.background_checks = tuple(getattr(fn, "background_checks", ())) + checks
        return fn
    return mark


def checks_of(item) -> tuple[Check, ...]:
    return tuple(getattr(getattr(item, "function", None), "background_checks", ()))


def start(checks) -> None:
    """Queues CHECKS (each once), longest first, on the one background worker."""
    global _pool
    todo = sorted({c for c in checks if c not in _futures}, key=lambda c: -c.cost)
    if not todo:
        return
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                          thread_name_prefix="background-check")
        for c in todo:
            _futures[c] = _pool.submit(c._call)


def stop() -> None:
    """At the session's end: nothing queued starts, whatever runs is killed."""
    _stopping.set()
    with _lock:
        pool = _pool
        procs = list(_running)
    for p in procs:                 # asked first: a runner stops what it started
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            p.kill()
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)
    while _dirs:
        shutil.rmtree(_dirs.pop(), ignore_errors=True)


def session_dir(prefix: str) -> str:
    """A temporary directory that lives until the session's end (stop)."""
    d = tempfile.mkdtemp(prefix=prefix)
    with _lock:
        _dirs.append(d)
    return d


def run(argv, *, timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(ARGV, capture_output=True, text=True, ...) that the
    session's end can stop; raises subprocess.TimeoutExpired past TIMEOUT."""
    if _stopping.is_set():
        raise Stopped("the session ended first")
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          **kwargs) as p:
        with _lock:
            _running.add(p)
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.communicate()
            raise
        finally:
            with _lock:
                _running.discard(p)
    if _stopping.is_set() and p.returncode < 0:
        raise Stopped("the session ended first")
    return subprocess.CompletedProcess(argv, p.returncode, out, err)
