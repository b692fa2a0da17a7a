"""What the workers' handlers share, whatever serves them over HTTP: errors in
OpenAI's shape, request-field validation, and calls to a peer worker.

A handler raises `ApiError` (a 4xx/5xx status and OpenAI's error body,
`{"error": {"message", "type", "param", "code"}}`); `serve/app.py` turns it
into the response.  `Peers` is the decode worker's HTTP client to its
prefill workers (httpx: pooled keep-alive connections, safe to share between
the threads that serve requests).
"""
from __future__ import annotations

import httpx

from tract_cli.serve.client import new_client


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param = status, message, kind, param

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                          "code": self.status}}


def field(body: dict, name: str, kind, default=None, required: bool = False):
    """One validated field of a JSON request (bool is not an int here)."""
    if name not in body or body[name] is None:
        if required:
            raise ApiError(400, f"missing field {name!r}", param=name)
        return default
    value = body[name]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
        names = "/".join(k.__name__ for k in kinds)
        raise ApiError(400, f"field {name!r} must be {names}, got {type(value).__name__}",
                       param=name)
    return value


class UpstreamError(Exception):
    """A peer worker could not be reached (status 503, no body) or answered
    with an error (its status and, if it was JSON, its body)."""

    def __init__(self, message: str, status: int = 503, body: dict | None = None):
        super().__init__(message)
        self.status, self.body = status, body


class Peers:
    """JSON calls to other workers, on one pooled, thread-safe httpx client
    (`serve.client.new_client`: TCP_NODELAY, keep-alive below uvicorn's)."""

    def __init__(self):
        self.client = new_client()

    def post_json(self, url: str, body: dict, timeout: float) -> dict:
        """POST BODY to URL, its JSON answer (UpstreamError when unreachable or not 2xx)."""
        return self._call("POST", url, timeout, body)

    def get_json(self, url: str, timeout: float) -> dict:
        """GET URL, its JSON answer (UpstreamError when unreachable or not 2xx)."""
        return self._call("GET", url, timeout)

    def _call(self, method: str, url: str, timeout: float, body: dict | None = None) -> dict:
        try:
            resp = self.client.request(method, url, json=body, timeout=timeout)
        except httpx.HTTPError as exc:
            raise UpstreamError(f"{url} is unreachable ({exc or type(exc).__name__})") from None
        if not resp.is_success:
            try:
                detail = resp.json()
            except ValueError:
                detail = None
            detail = detail if isinstance(detail, dict) else None
            err = (detail or {}).get("error")
            msg = err.get("message") if isinstance(err, dict) else None
            raise UpstreamError(f"{url} answered {resp.status_code}: {msg or resp.reason_phrase}",
                                resp.status_code, detail)
        try:
            return resp.json()
        except ValueError:
            raise UpstreamError(f"{url} answered with something that is not JSON") from None

    def close(self) -> None:
        self.client.close()
