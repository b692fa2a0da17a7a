"""Real `tract serve-*` processes for tests: started on port 0, their address read
from their first log line (bounded), stopped with SIGTERM (bounded)."""
from __future__ import annotations

import json
import re
import urllib.error
import urllib.request

from tract_cli.core.errors import TractError
from tract_cli.serve.launch import WorkerProcess


class Server(WorkerProcess):
    """A worker process; a start or stop failure fails the test."""

    def __init__(self, *args: str, **kw):
        try:
            super().__init__(*args, **kw)
        except TractError as exc:
            raise AssertionError(str(exc)) from None

    def stop(self, timeout: float = 60) -> int:
        try:
            return super().stop(timeout)
        except TractError as exc:
            raise AssertionError(str(exc)) from None


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
