"""Starting Python subprocesses of the toolkit that import this very copy of it.

`python -m tract_cli...` puts the working directory first on `sys.path`: run
from the root of a checkout after a non-editable install, the child would
import the source tree's `tract_cli` (no compiled `_native`) instead of the
installed one.  `module_command` closes that door: the child runs in safe-path
mode (`-P`, Python >= 3.11: neither the working directory nor a script's
directory goes on `sys.path`), so it finds the package where the running one
was imported from: the same interpreter's site-packages, or, when the running
copy lives outside them (a checkout on PYTHONPATH), that directory, put first
on the child's `PYTHONPATH`.
"""
from __future__ import annotations

import os
import site
import sys

import tract_cli

# where the running tract_cli was imported from (site-packages, or a checkout
# for an editable install): the child looks there first
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(tract_cli.__file__)))

# Python 3.10 has no -P: the bootstrap drops sys.path[0] when it is the
# working directory that -c puts there ('') before running the module (only
# then: where safe-path mode is honoured it is a PYTHONPATH entry)
_BOOTSTRAP = ("import runpy, sys; sys.path[:1] = [p for p in sys.path[:1] if p]; "
              "sys.argv = sys.argv[1:]; "
              "runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)")


def _site_dirs() -> set[str]:
    dirs = list(site.getsitepackages()) if hasattr(site, "getsitepackages") else []
    dirs.append(site.getusersitepackages())
    return {os.path.realpath(d) for d in dirs}


def module_command(module: str, *args: str) -> list[str]:
    """argv that runs `python -m MODULE ARGS` without the working directory on
    `sys.path` (pass `env=child_env()` to the process as well)."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", module, *args]
    return [sys.executable, "-c", _BOOTSTRAP, module, *args]


def child_env(extra: dict | None = None, base: dict | None = None) -> dict:
    """The environment of a toolkit subprocess: BASE (default os.environ) with
    safe-path mode on (so the child's own Python children keep it), this
    package's location first on PYTHONPATH unless it is a site directory of
    the interpreter (where the child looks anyway: put on PYTHONPATH it would
    go before the standard library), without a test's death point, and EXTRA."""
    env = dict(os.environ if base is None else base)
    if os.path.realpath(PACKAGE_ROOT) not in _site_dirs():
        rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep)
                if p and p != PACKAGE_ROOT]
        env["PYTHONPATH"] = os.pathsep.join([PACKAGE_ROOT, *rest])
    env["PYTHONSAFEPATH"] = "1"
    # a test's death point (TRACT_DIE_AT, native/tract.h) is for the process
    # it armed, never for the agents and workers that process starts
    env.pop("TRACT_DIE_AT", None)
    env.update(extra or {})
    return env


def own_process_group() -> dict:
    """Popen's keywords that start a server (and whatever it spawns) in a process
    group of its own, stopped as one with killpg, but in the caller's session.
    Not a session of its own (start_new_session): where Linux groups each session
    for scheduling (autogroup, `kernel.sched_autogroup_enabled`, on by default
    in most distributions) every session gets an equal share of the cores, and
    a caller's session then competes, as one group, with servers that spin:
    `tract bench --engine vllm`'s client, woken by a first token, waited up to
    40-50 ms for a core behind the pollers of the vLLM instances it had started
    (docs/VLLM.md, "Benchmark"), and a node agent started by a vLLM worker, in
    a session of its own, left its lock manager waiting 0.1-1.3 s for a core
    ("Lifecycle and faults").  Python 3.10 has no `process_group`: a session
    of its own there."""
    if sys.version_info >= (3, 11):
        return {"process_group": 0}
    return {"start_new_session": True}

