"""Real `tract serve-*` processes for tests: started on port 0, their address read
from their first log line (bounded), stopped with SIGTERM (bounded)."""
from __future__ import annotations

import json
import queue
import re
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

START_TIMEOUT_S = 120


class Server:
    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "tract_cli.cli", *args, "--port", "0",
                                      "--no-agent"], stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        self.lines: list[str] = []
        self._q: queue.Queue = queue.Queue()
        threading.Thread(target=self._drain, daemon=True).start()
        self.url = None
        while self.url is None:
            try:
                line = self._q.get(timeout=START_TIMEOUT_S)
            except queue.Empty:
                self.proc.kill()
                raise AssertionError(f"{args[0]} did not start within {START_TIMEOUT_S} s: "
                                     f"{self.lines}") from None
            if line is None:
                raise AssertionError(f"{args[0]} exited with {self.proc.wait()}: {self.lines}")
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
                raise AssertionError(f"the worker did not stop within {timeout} s of SIGTERM")
        return self.proc.returncode


def request(url: str, body=None, timeout: float = 120, raw: bytes | None = None):
    """(status, parsed JSON or text) of a GET (body None) or POST."""
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    req = urllib.request.Request(url, data=data, method="GET" if data is None else "POST",
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            status, text = resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        status, text = exc.code, exc.read().decode()
    try:
        return status, json.loads(text)
    except ValueError:
        return status, text


def metric(text: str, name: str) -> float:
    m = re.search(rf"^tract_{name} (\S+)$", text, re.M)
    assert m, f"metric {name} missing"
    return float(m.group(1))
