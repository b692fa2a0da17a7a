"""pid_alive, the one Python answer to "is this process dead": a zombie is
dead, a process that exists is alive, a pid that cannot be one is dead."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from tract_cli.core.pids import pid_alive


def test_this_process_and_init_are_alive():
    assert pid_alive(os.getpid())
    assert pid_alive(1)


@pytest.mark.parametrize("pid", [0, -1, 2**31, 2**32 - 1])
def test_impossible_pids_are_dead(pid):
    """0 (the pid of a never-written line), and what a torn u32 can hold."""
    assert not pid_alive(pid)


def test_a_zombie_is_dead_and_so_is_a_reaped_child():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:      # exited, not yet reaped: a zombie
            if psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE:
                break
            time.sleep(0.01)     # waiting for another process to exit, bounded
        else:
            pytest.fail("the child did not exit")
        assert not pid_alive(child.pid)
    finally:
        child.wait(timeout=30)
    assert not pid_alive(child.pid)


def test_a_sleeping_child_is_alive():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert pid_alive(child.pid)
    finally:
        child.kill()
        child.wait(timeout=30)
