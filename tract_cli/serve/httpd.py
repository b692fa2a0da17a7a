"""A small threaded JSON-over-HTTP server and client for the workers (stdlib only).

Errors have OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`)
and a 4xx/5xx status; a handler raises `ApiError`.  A handler that returns an
iterator streams it as server-sent events.  One log line per request.
Shutdown (SIGTERM) stops accepting, lets in-flight requests finish, then
runs the worker's cleanup.
"""
from __future__ import annotations

import json
import signal
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MAX_BODY = 64 << 20


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
    """A peer worker could not be reached or answered with an error."""

    def __init__(self, message: str, status: int = 503, body: dict | None = None):
        super().__init__(message)
        self.status, self.body = status, body


def post_json(url: str, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    return _call(url, req, timeout)


def get_json(url: str, timeout: float) -> dict:
    """GET URL, its JSON answer (UpstreamError when unreachable or not 2xx)."""
    return _call(url, urllib.request.Request(url, method="GET"), timeout)


def _call(url: str, req, timeout: float) -> dict:
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            return json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        try:
            detail = json.loads(exc.read())
        except (ValueError, OSError):
            detail = None
        msg = (detail or {}).get("error", {}).get("message", exc.reason)
        raise UpstreamError(f"{url} answered {exc.code}: {msg}", exc.code, detail) from None
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        reason = getattr(exc, "reason", exc)
        raise UpstreamError(f"{url} is unreachable ({reason})") from None
    except ValueError:
        raise UpstreamError(f"{url} answered with something that is not JSON") from None


class JsonServer(ThreadingHTTPServer):
    daemon_threads = False           # server_close() joins in-flight requests
    block_on_close = True
    allow_reuse_address = True

    def __init__(self, addr, routes: dict, name: str, log=sys.stderr):
        self.routes, self.name, self.log = routes, name, log
        self.stopping = threading.Event()
        super().__init__(addr, _Handler)

    def log_line(self, text: str) -> None:
        try:
            print(f"{time.strftime('%H:%M:%S')} {self.name} {text}", file=self.log, flush=True)
        except (OSError, ValueError):
            pass

    def serve_until_signal(self, cleanup) -> None:
        """Serves until SIGTERM/SIGINT, then drains in-flight requests and cleans up."""
        def stop(signum, _frame):
            self.log_line(f"{signal.Signals(signum).name}: draining in-flight requests")
            self.stopping.set()
            threading.Thread(target=self.shutdown, daemon=True).start()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, stop)
        try:
            self.serve_forever(poll_interval=0.2)
        finally:
            self.server_close()
            cleanup()
            self.log_line("stopped")


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: JsonServer

    def log_message(self, *args):     # one line per request is written by _dispatch
        pass

    def do_GET(self):
        self._dispatch("GET")

    def do_POST(self):
        self._dispatch("POST")

    def _send(self, status: int, body, ctype: str = "application/json") -> None:
        data = body if isinstance(body, bytes) else (
            body.encode() if isinstance(body, str) else json.dumps(body).encode())
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _read_json(self):
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            raise ApiError(400, "Content-Length is not a number") from None
        if length <= 0:
            raise ApiError(400, "the request has no JSON body")
        if length > MAX_BODY:
            raise ApiError(413, f"the body is larger than {MAX_BODY} bytes")
        raw = self.rfile.read(length)
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ApiError(400, f"the body is not valid JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the body must be a JSON object")
        return body

    def _dispatch(self, method: str) -> None:
        t0 = time.perf_counter()
        path = self.path.split("?", 1)[0]
        status, note = 500, ""
        try:
            route = self.server.routes.get((method, path))
            if route is None:
                known = any(p == path for _, p in self.server.routes)
                raise ApiError(405 if known else 404,
                               f"{method} {path} is not served here" if known else
                               f"no route {path}", "not_found_error" if not known else
                               "invalid_request_error")
            if self.server.stopping.is_set() and path not in ("/health", "/metrics"):
                raise ApiError(503, "the worker is shutting down", "service_unavailable")
            body = self._read_json() if method == "POST" else None
            result = route(body) if method == "POST" else route()
            if isinstance(result, tuple):             # (content type, text)
                status = 200
                self._send(200, result[1], result[0])
            elif isinstance(result, dict):
                status = 200
                note = result.pop("_log", "")
                self._send(200, result)
            else:
                status = 200
                note = self._stream(result)
        except ApiError as exc:
            status, note = exc.status, exc.message
            self._send(exc.status, exc.body())
        except (BrokenPipeError, ConnectionResetError):
            status, note = 499, "client went away"
        except Exception as exc:                     # a bug: answer 500, keep serving
            status, note = 500, f"{type(exc).__name__}: {exc}"
            try:
                self._send(500, ApiError(500, f"internal error: {exc}", "internal_error").body())
            except OSError:
                pass
        self.server.log_line(f"{method} {path} {status} {1e3 * (time.perf_counter() - t0):.1f} ms"
                             + (f" {note}" if note else ""))

    def _stream(self, events) -> str:
        """Server-sent events: one `data: <json>` per item, then `data: [DONE]`."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True
        note = ""
        try:
            for ev in events:
                if isinstance(ev, dict) and "_log" in ev:
                    note = ev.pop("_log")
                    continue
                self.wfile.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
                self.wfile.flush()
        except ApiError as exc:
            self.wfile.write(b"data: " + json.dumps(exc.body()).encode() + b"\n\n")
            note = exc.message
        finally:
            if hasattr(events, "close"):
                events.close()          # runs the producer's cleanup even if the client left
        self.wfile.write(b"data: [DONE]\n\n")
        self.wfile.flush()
        return note
