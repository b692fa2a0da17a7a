"""A harness for multi-process tests: real processes attached to a region as
emulated nodes, driven one command at a time over pipes.

Every wait is bounded: a reply that does not come within the timeout fails
the test with a message naming the command, never hangs CI.  No sleep
orders anything: ordering between processes comes from waiting for replies,
and `wait_for` polls state another process writes, within a bound.
"""
from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time

DEFAULT_TIMEOUT = 60.0


class WorkerError(AssertionError):
    pass


class Worker:
    """A child process attached to POOL as NODE; `call(op, **args)` runs one command."""

    def __init__(self, pool_path: str, node: int, simulate: bool = False,
                 flush_mode: str | None = None, sim_evict_prob: float = 0.0, sim_seed: int = 0,
                 env: dict | None = None):
        args = {"pool": pool_path, "node": node, "simulate": simulate, "flush_mode": flush_mode,
                "sim_evict_prob": sim_evict_prob, "sim_seed": sim_seed}
        env = {**os.environ, **(env or {})}
        env["PYTHONPATH"] = os.pathsep.join(
            [os.path.dirname(os.path.abspath(__file__))] + env.get("PYTHONPATH", "").split(os.pathsep))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "procs_child", json.dumps(args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, bufsize=1, env=env)
        self.name = f"node {node} ({'sim' if simulate else 'plain'})"
        self._sel = selectors.DefaultSelector()
        self._sel.register(self.proc.stdout, selectors.EVENT_READ)
        self.call("ready")

    def call(self, op: str, timeout: float = DEFAULT_TIMEOUT, **args):
        """Sends one command and waits (bounded) for its reply."""
        self.send(op, **args)
        return self.recv(op, timeout)

    def send(self, op: str, **args) -> None:
        """Sends one command without waiting (pair it with recv)."""
        self.proc.stdin.write(json.dumps({"op": op, **args}) + "\n")
        self.proc.stdin.flush()

    def ready(self) -> bool:
        """Whether a reply (to a command sent with `send`) is waiting to be read."""
        return bool(self._sel.select(timeout=0))

    def recv(self, op: str, timeout: float = DEFAULT_TIMEOUT):
        """Waits (bounded) for the reply to the command OP sent earlier."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise WorkerError(f"{self.name}: no reply to {op} within {timeout:.0f} s")
            if self._sel.select(timeout=left):
                line = self.proc.stdout.readline()
                if not line:
                    err = self.proc.stderr.read()
                    raise WorkerError(f"{self.name}: exited during {op}: {err.strip()[-2000:]}")
                reply = json.loads(line)
                if "error" in reply:
                    raise WorkerError(f"{self.name}: {op} failed: {reply['error']}")
                return reply.get("result")

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.write(json.dumps({"op": "exit"}) + "\n")
                self.proc.stdin.flush()
                self.proc.wait(timeout=DEFAULT_TIMEOUT)
            except (BrokenPipeError, subprocess.TimeoutExpired):
                self.kill()
        self._sel.close()
        for f in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            f.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=DEFAULT_TIMEOUT)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def wait_for(what: str, predicate, timeout: float = 60.0):
    """Polls PREDICATE (bounded) until it returns something true, and returns
    that; fails naming WHAT."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.02)      # polling what other processes write, bounded
    raise AssertionError(f"{what} did not happen within {timeout:.0f} s")
