"""Long, self-contained checks that run beside the rest of the suite.

The model checker's runs (tests/test_lock_model.py), the sanitizer builds and
runs (tests/test_asan_fuzz.py, tests/test_tsan.py) and the emulated-CXL
guests (tests/test_cxl_vm.py) are minutes of CPU that share nothing with any
other test: no region of another test, no agent, no port, no timing bound of
another test.  So are the two runs of `tract bench --engine vllm` with real
vLLM configurations (tests/test_vllm_bench.py) and a vLLM that `tract
serve-prefill` starts on another model's region (tests/test_vllm.py): minutes
of vLLM starts, each with its own temporary directory, regions and processes,
told apart from every other test's (its ports are the kernel's free ones, as
every server's here).  The rest of the suite keeps about one of a machine's two CPUs
busy on average (its multi-process tests wait on one another), so these run
there, in one worker thread started once collection is done, while the suite
goes on; the tests that assert on them run last and collect what they
produced.  The assertions are the tests' own; only when a check runs moves.

At most one background check runs at a time, longest first.  Most are one
busy process (a model checker, a fuzzer, a compiler); the guests are two
emulated vCPUs each; a vLLM bench is a few vLLM instances, busy while they
start and while they serve (their workers poll a core for a second after a
step), idle between requests; none has a timing bound that load could trip
(vLLM's start and request bounds are minutes past a busy host's), so what
they add is load, which every test must stand anyway ("deterministic on two
busy cores").  A test that counts the suite's child processes leaves out the
checks' (`spawned`).  The mutation test is NOT one of them: its mutants are
multi-process protocol tests with lock bounds, whose outcome under extra
load could read as a catch.

Every subprocess a check starts goes through `run`, so the session's end,
however it ends (-x, ^C, a failure), stops it: SIGINT first (a pytest child
tears its agents down, cxlvm.py kills its guests, a bench stops its vLLMs),
then SIGKILL past a grace; one past its own timeout gets SIGTERM first where
the check asks (`run(term_grace=S)`).
Nothing outlives pytest.  A check whose test is skipped or deselected does
not run; with --collect-only none does.  When a test failed, the checks'
directories (guest consoles, sanitizer builds) are kept and named.

A module declares its checks as `Check`s and marks each test with the checks
it asserts on: `@uses(CHECK, ...)`, or `@uses_param("name", {value: CHECK})`
for a parametrized test (only the check of each selected parameter runs);
the test calls `CHECK.result()`.  A test run where the plugin did not start
the check (its module imported another way) runs it then, in the foreground.
"""
from __future__ import annotations

import concurrent.futures
import os
import shutil
import signal
import subprocess
import tempfile
import threading

GRACE_S = 60.0          # what a stopped check's process gets to tear down before SIGKILL

_lock = threading.Lock()
_running: set[subprocess.Popen] = set()
_stopping = threading.Event()
_pool: concurrent.futures.ThreadPoolExecutor | None = None
_futures: dict["Check", concurrent.futures.Future] = {}
_dirs: list[str] = []
_tmp_root: list[str] = []     # the temporary directory at the session's start (session_dir)
_env0: list[dict] = []        # the environment at the session's start (run's default)
# in the environment of every process a check starts (and theirs): a test that
# counts processes tells a check's apart by it, even one its parent left
MARK = "TRACT_TEST_BACKGROUND"


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


def uses_param(names: str | tuple[str, ...], checks: dict):
    """Marks a parametrized test as asserting on CHECKS[value of parameter(s) NAMES]
    (a tuple of names keys CHECKS by the tuple of their values)."""
    def mark(fn):
        fn.background_param_checks = (names, checks)
        return fn
    return mark


def checks_of(item) -> tuple[Check, ...]:
    """The checks the test ITEM asserts on (for a parametrized one, its parameter's)."""
    fn = getattr(item, "function", None)
    found = tuple(getattr(fn, "background_checks", ()))
    names, by = getattr(fn, "background_param_checks", (None, None))
    params = getattr(getattr(item, "callspec", None), "params", None)
    if by is not None and params is not None:
        key = (tuple(params[n] for n in names) if isinstance(names, tuple) else params[names])
        found += (by[key],)
    return found


def will_skip(item) -> bool:
    """Whether ITEM is skipped by a plain mark (skip, or skipif with a true
    boolean condition): its checks would run for nothing."""
    for m in item.iter_markers():
        if m.name == "skip":
            return True
        if m.name == "skipif" and any(isinstance(c, bool) and c for c in m.args):
            return True
    return False


def reset() -> None:
    """At a session's start: a fresh state (a second session in one process)."""
    global _pool
    _stopping.clear()
    with _lock:
        _futures.clear()
        _pool = None
        # a check's directory goes there even while a test points tempfile elsewhere,
        # and its processes start from this environment even while a test has set
        # (monkeypatch) variables they must not inherit
        _tmp_root[:] = [tempfile.gettempdir()]
        _env0[:] = [dict(os.environ)]


def start(checks) -> None:
    """Queues CHECKS (each once), longest first, on the one background worker."""
    global _pool
    with _lock:
        todo = sorted({c for c in checks if c not in _futures}, key=lambda c: -c.cost)
        if not todo or _stopping.is_set():
            return
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                          thread_name_prefix="background-check")
        for c in todo:
            _futures[c] = _pool.submit(c._call)


def stop(keep_dirs: bool = False) -> list[str]:
    """At the session's end: nothing queued starts, whatever runs is stopped
    (SIGINT, then SIGKILL after GRACE_S). The checks' directories are removed
    unless KEEP_DIRS; returns those kept."""
    with _lock:
        _stopping.set()              # under the lock: run() cannot register after this
        pool = _pool
        procs = list(_running)
    for p in procs:
        p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            p.kill()
    if pool is not None:
        pool.shutdown(wait=True, cancel_futures=True)
    with _lock:
        dirs, _dirs[:] = list(_dirs), []
    if keep_dirs:
        return dirs
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    return []


def session_dir(prefix: str) -> str:
    """A temporary directory that lives until the session's end (stop)."""
    with _lock:
        root = _tmp_root[0] if _tmp_root else None
    d = tempfile.mkdtemp(prefix=prefix, dir=root)
    with _lock:
        _dirs.append(d)
    return d


def stopping() -> bool:
    """Whether the session is ending: a check's bounded waits stop early."""
    return _stopping.is_set()


def environment() -> dict:
    """The environment a check's processes start from (the session's start's)."""
    with _lock:
        return dict(_env0[0] if _env0 else os.environ)


def spawned() -> set[int]:
    """The processes the checks run now, and theirs (psutil), whoever waits for them."""
    import psutil
    with _lock:
        pids = [p.pid for p in _running]
    out = set()
    for pid in pids:
        try:
            proc = psutil.Process(pid)
            out |= {pid} | {c.pid for c in proc.children(recursive=True)}
        except psutil.Error:
            continue                # gone meanwhile
    return out


def run(argv, *, timeout: float, term_grace: float = 0.0,
        **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run(ARGV, capture_output=True, text=True, ...) that the
    session's end can stop; raises subprocess.TimeoutExpired past TIMEOUT
    (the process SIGTERMed first and given TERM_GRACE seconds where that is
    not 0, then killed; the exception carries all it wrote, as text, what it
    wrote while it stopped too).  Without ENV, the session start's environment
    (`environment`); MARK is set in either."""
    kwargs["env"] = (kwargs.get("env") or environment()) | {MARK: "1"}
    with _lock:
        if _stopping.is_set():
            raise Stopped("the session ended first")
        # started and registered under the lock: stop() sees it or it never starts
        p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             **kwargs)
        _running.add(p)
    with p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            if term_grace:
                p.terminate()
                try:
                    exc.stdout, exc.stderr = p.communicate(timeout=term_grace)
                except subprocess.TimeoutExpired:
                    p.kill()
                    exc.stdout, exc.stderr = p.communicate()
            else:
                p.kill()
                exc.stdout, exc.stderr = p.communicate()
            raise
        finally:
            with _lock:
                _running.discard(p)
    if _stopping.is_set() and p.returncode != 0:
        raise Stopped("the session ended first")
    return subprocess.CompletedProcess(argv, p.returncode, out, err)
