"""Starting and stopping real `tract agent` processes in tests."""
from __future__ import annotations

import signal
import subprocess

from tract_cli.core.agent_launch import ensure_agent


class RunningAgent:
    """`tract agent` for a node as a real process; stopped with SIGTERM (bounded)."""

    def __init__(self, pool_path: str, node: int = 0, manager: bool = True, simulate: bool = False,
                 **options):
        self.proc = ensure_agent(pool_path, node, manager=manager, simulate=simulate, **options)
        assert self.proc is not None, "an agent was already running"

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
                raise AssertionError("the agent did not stop within 30 s of SIGTERM")
        return self.proc.returncode

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()
