"""The HTTP client of TraCT's own calls to an OpenAI-style server (its workers,
vLLM): JSON posts and gets, a streamed completion's events, a health probe and
the bounded wait for a child server to answer it.
One pooled, thread-safe httpx client per process.

Its connections are TCP_NODELAY: httpx writes a request's headers and its
body apart, and with Nagle the body would wait for the server's delayed ACK
of the headers (40 ms a call).
"""
from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator

import httpx

from tract_cli.core.errors import TractError

# below uvicorn's keep-alive timeout (5 s): the client drops an idle connection
# before the server may close it, so a request never goes out on one being closed
KEEPALIVE_EXPIRY_S = 2.0


class HttpError(Exception):
    """URL could not be reached (STATUS None) or answered STATUS; MESSAGE is
    the OpenAI error body's message, else the status's reason, else the cause;
    BODY the answer's JSON, if it was JSON."""

    def __init__(self, url: str, status: int | None, message: str, body: dict | None = None):
        super().__init__(f"{url} answered {status}: {message}" if status is not None else
                         f"{url} is unreachable ({message})")
        self.url, self.status, self.message, self.body = url, status, message, body


def new_client() -> httpx.Client:
    """A pooled httpx client whose connections are TCP_NODELAY (see above)."""
    transport = httpx.HTTPTransport(
        limits=httpx.Limits(keepalive_expiry=KEEPALIVE_EXPIRY_S),
        socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    return httpx.Client(transport=transport)


_client: httpx.Client | None = None
_lock = threading.Lock()


def client() -> httpx.Client:
    """This process's shared client (made on first use)."""
    global _client
    with _lock:
        if _client is None:
            _client = new_client()
        return _client


def _check(url: str, resp: httpx.Response) -> None:
    if resp.is_success:
        return
    try:
        detail = json.loads(resp.read())
    except ValueError:
        detail = None
    detail = detail if isinstance(detail, dict) else None
    err = (detail or {}).get("error")
    msg = err.get("message") if isinstance(err, dict) else None
    raise HttpError(url, resp.status_code, msg or resp.reason_phrase, detail)


def request_json(method: str, url: str, body: dict | None = None, timeout: float = 600) -> dict:
    """METHOD URL (with BODY as JSON), its JSON answer; HttpError when unreachable
    or not 2xx."""
    try:
        resp = client().request(method, url, json=body, timeout=timeout)
    except httpx.HTTPError as exc:
        raise HttpError(url, None, str(exc) or type(exc).__name__) from None
    _check(url, resp)
    try:
        return resp.json()
    except ValueError:
        raise HttpError(url, resp.status_code, "an answer that is not JSON") from None


def post_json(url: str, body: dict, timeout: float = 600) -> dict:
    return request_json("POST", url, body, timeout)


def get_json(url: str, timeout: float = 600) -> dict:
    return request_json("GET", url, None, timeout)


def stream_events(url: str, body: dict, timeout: float = 600) -> Iterator[dict]:
    """POSTs BODY (a streamed request) and yields each server-sent event's JSON
    (its `data:` lines) until `[DONE]`; HttpError as `request_json`."""
    try:
        with client().stream("POST", url, json=body, timeout=timeout) as resp:
            _check(url, resp)
            for line in _event_lines(resp.iter_bytes()):
                line = line.strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    yield json.loads(line[6:])
    except httpx.HTTPError as exc:
        raise HttpError(url, None, str(exc) or type(exc).__name__) from None


def _event_lines(chunks: Iterator[bytes]) -> Iterator[str]:
    """The lines of a server-sent event stream, split at LF only (a CR before it
    dropped).  Not httpx's `iter_lines`: it splits as `str.splitlines` does, also
    at U+0085, U+2028 and U+2029, which JSON leaves unescaped inside a string, so
    a completion whose text holds one arrived as two halves of a JSON document."""
    pending = b""
    for chunk in chunks:
        pending += chunk
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line.removesuffix(b"\r").decode()
    if pending:
        yield pending.removesuffix(b"\r").decode()


def is_up(url: str, timeout: float = 2) -> bool:
    """Whether URL answers 200 (a health probe: never raises)."""
    try:
        return client().get(url, timeout=timeout).status_code == 200
    except (httpx.HTTPError, OSError):
        return False


def wait_until_up(proc, url: str, timeout: float, name: str, log_path: str | None,
                  why=lambda: "", stop=lambda: None, gave_up=lambda: None) -> None:
    """Waits (bounded) until URL answers 200 while PROC, the child process that serves
    it, runs: one that exits is an error naming WHY(), one that overruns is stopped
    (STOP()) and an error, and so is one that GAVE_UP() says will never be ready
    (what it said, e.g. from its log) while it still runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            detail = why()
            raise TractError(f"{name} exited with code {proc.returncode} before it was ready"
                             + (f": {detail}" if detail else ""), f"see its log {log_path}")
        given_up = gave_up()
        if given_up:
            detail = why()
            stop()
            raise TractError(f"{name} {given_up}" + (f": {detail}" if detail else ""),
                             f"see its log {log_path}")
        if is_up(url, timeout=2):
            return
        time.sleep(0.5)     # polling another process's readiness, bounded
    stop()
    raise TractError(f"{name} did not become ready within {timeout:.0f} s",
                     f"check the machine's load; its log: {log_path}")
