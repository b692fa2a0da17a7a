"""Starting `tract serve-*` workers as processes (benchmarks, tests): each
listens on a free port and announces its address in its first log line,
which is read with a bounded wait; stopped with SIGTERM, bounded."""
from __future__ import annotations

import queue
import re
import signal
import subprocess
import threading

from tract_cli.core.errors import TractError
from tract_cli.core.spawn import child_env, module_command

START_TIMEOUT_S = 120


class WorkerProcess:
    def __init__(self, *args: str, start_timeout: float = START_TIMEOUT_S,
                 start_agent: bool = False, env: dict | None = None, port: int = 0):
        self.args = args
        agent = [] if start_agent else ["--no-agent"]
        # this copy of the package, whatever the working directory holds (core/spawn.py)
        self.proc = subprocess.Popen(module_command("tract_cli.cli", *args, "--port", str(port),
                                                    *agent),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True, env=child_env(env))
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()
        self.url = None
        while self.url is None:
            try:
                line = self._q.get(timeout=start_timeout)
            except queue.Empty:
                self.proc.kill()
                raise TractError(f"{args[0]} did not start within {start_timeout:.0f} s",
                                 "check the machine's load; its log: " + " | ".join(self.lines[-3:])) \
                    from None
            if line is None:
                raise TractError(f"{args[0]} exited with code {self.proc.wait()}",
                                 "its log: " + " | ".join(self.lines[-3:]))
            m = re.search(r"listening on (http://\S+)", line)
            if m:
                self.url = m.group(1)

    def _drain(self):
        for line in self.proc.stderr:
            self.lines.append(line.rstrip("\n"))
            self._q.put(line)
        self._q.put(None)

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)
                raise TractError(f"{self.args[0]} did not stop within {timeout:.0f} s of SIGTERM",
                                 "it was killed")
        return self.proc.returncode
