"""A server the toolkit starts (a vLLM, LMCache's cache server) runs in a
process group of its own, which one killpg stops whole, grandchildren
included, and in its caller's session: a session of its own would be a
scheduling group of its own under Linux's autogroup, which starved the
bench's client behind the servers' pollers (core/spawn.py)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tract_cli.core.spawn import own_process_group


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.skipif(sys.version_info < (3, 11), reason="Python 3.10 has no process_group")
def test_a_server_has_its_own_process_group_in_its_callers_session(tmp_path):
    pidfile = tmp_path / "grandchild"
    # the child starts a grandchild, as vLLM starts its engine core and workers
    proc = subprocess.Popen(["sh", "-c", f"sleep 60 & echo $! > {pidfile}; wait"],
                            stdin=subprocess.DEVNULL, **own_process_group())
    try:
        deadline = time.monotonic() + 30
        while not (pidfile.exists() and pidfile.read_text().strip()):
            assert time.monotonic() < deadline, "the child did not start its grandchild"
            time.sleep(0.01)          # polling another process's file, bounded
        grandchild = int(pidfile.read_text())
        assert os.getpgid(proc.pid) == proc.pid != os.getpgid(0)
        assert os.getpgid(grandchild) == proc.pid
        assert os.getsid(proc.pid) == os.getsid(0) == os.getsid(grandchild)
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not _gone(grandchild):
            assert time.monotonic() < deadline, "the grandchild outlived its group's stop"
            time.sleep(0.01)          # polling the kernel's process table, bounded
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
