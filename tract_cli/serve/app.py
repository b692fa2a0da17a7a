"""The workers over HTTP: a FastAPI app served by uvicorn (what vLLM serves with).

A worker declares its routes as `{(method, path): handler}`.  A GET handler
takes nothing, a POST handler the request's JSON object; both return a dict
(a JSON answer), a `(content type, text)` pair (`/metrics`), or an iterator
of dicts, streamed as server-sent events (`data: <json>` each, `data: [DONE]`
last).  Handlers do blocking work (C core calls, model compute, calls to
other workers), so each runs on Starlette's thread pool, never on the event
loop; a stream is advanced there one event at a time, and closed there too
(when it ends, fails, or its client goes away) so that its producer's
cleanup (acknowledging a handoff) runs at once.

Errors are one JSON object in OpenAI's shape with the right status: the
handler's `ApiError`, 400 for a body that is not a JSON object, 413 for one
larger than MAX_BODY, 404/405 for an unknown route or method, 500 (and the
traceback in the log) for a bug.  A stream that fails after its 200 ends
with the error as its last event before `[DONE]`.

Logging is Python's: uvicorn's access log (one line per request) and the
workers' own lines (`tract.serve.*`), on stderr, time-stamped and named
after the worker.  The first SIGTERM or SIGINT stops accepting connections
and lets in-flight requests finish; a second one stops without waiting for
them: streams are cut where they are (a step already running on a thread
finishes, as a thread cannot be stopped).  Then, once no thread runs a
handler, the worker's cleanup runs (handoffs acknowledged, the region
unmapped) and `stopped` is logged.
"""
from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import sys
import threading

import anyio
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from tract_cli.serve.api import ApiError

MAX_BODY = 64 << 20
LOG_LEVELS = ("debug", "info", "warning", "error")

log = logging.getLogger("tract.serve.http")
_END = object()


# ---- the app ----

class Work:
    """The handlers' blocking calls on the thread pool, counted, and the
    streams not yet closed.  A stopped event loop does not stop a thread
    (one cancelled by a forced stop runs on), so the worker's cleanup first
    waits for them (`settle`): the region is never unmapped under one."""

    def __init__(self):
        self._cond = threading.Condition()
        self._running = 0
        self._streams: set = set()

    async def call(self, fn, *args):
        return await run_in_threadpool(self._run, fn, *args)

    def _run(self, fn, *args):
        with self._cond:
            self._running += 1
        try:
            return fn(*args)
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def opened(self, stream) -> None:
        with self._cond:
            self._streams.add(stream)

    def close(self, stream) -> None:
        """Closes STREAM (its producer's cleanup runs) unless a step of it is
        still running on another thread; `settle` closes it then."""
        try:
            getattr(stream, "close", lambda: None)()
        except ValueError:                  # "generator already executing"
            return
        with self._cond:
            self._streams.discard(stream)

    def settle(self) -> None:
        """Waits for the blocking calls still running, then closes the streams
        left open (a forced stop cancelled them mid-step)."""
        with self._cond:
            if self._running:
                log.info("waiting for %d blocking call(s) in flight", self._running)
            self._cond.wait_for(lambda: self._running == 0)
            left, self._streams = list(self._streams), set()
        for stream in left:
            try:
                getattr(stream, "close", lambda: None)()
            except Exception:
                log.exception("closing a stream failed")


def make_app(routes: dict, title: str) -> FastAPI:
    """The ASGI app of a worker's ROUTES; its `Work` is `app.state.work`."""
    app = FastAPI(title=title, openapi_url=None, docs_url=None, redoc_url=None)
    app.state.work = work = Work()
    app.add_exception_handler(ApiError, _api_error)
    app.add_exception_handler(HTTPException, _http_error)
    for (method, path), handler in routes.items():
        app.add_api_route(path, _endpoint(work, method, path, handler), methods=[method])
    return app


def _endpoint(work: Work, method: str, path: str, handler):
    async def endpoint(request: Request):
        args = (await _read_json(request),) if method == "POST" else ()
        try:
            result = await work.call(handler, *args)
        except ApiError:
            raise
        except Exception as exc:             # a bug: answer 500, log the traceback, keep serving
            log.exception("%s %s failed", method, path)
            raise ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                           "internal_error") from None
        if isinstance(result, dict):
            return JSONResponse(result)
        if isinstance(result, tuple):                # (content type, text)
            return Response(result[1], media_type=result[0])
        work.opened(result)
        return EventStream(_events(work, result, path))
    endpoint.__name__ = f"{method.lower()}_{path.strip('/').replace('/', '_') or 'root'}"
    return endpoint


async def _read_json(request: Request) -> dict:
    """The request's JSON object, read up to MAX_BODY bytes."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY:
        raise ApiError(413, f"the body is larger than {MAX_BODY} bytes", "request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY:
            raise ApiError(413, f"the body is larger than {MAX_BODY} bytes", "request_too_large")
        chunks.append(chunk)
    raw = b"".join(chunks)
    if not raw:
        raise ApiError(400, "the request has no JSON body")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ApiError(400, f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    return body


async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    log.log(logging.WARNING if exc.status >= 500 else logging.INFO, "%s %s: %d %s",
            request.method, request.url.path, exc.status, exc.message)
    # a body too large is left unread: the connection cannot carry another request
    headers = {"Connection": "close"} if exc.status == 413 else None
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


async def _http_error(request: Request, exc: HTTPException) -> JSONResponse:
    """Starlette's own errors (no such route, method not allowed) in OpenAI's shape."""
    path = request.url.path
    if exc.status_code == 404:
        err = ApiError(404, f"no route {path}", "not_found_error")
    elif exc.status_code == 405:
        err = ApiError(405, f"{request.method} {path} is not served here")
    else:
        err = ApiError(exc.status_code, str(exc.detail))
    return JSONResponse(err.body(), status_code=err.status, headers=exc.headers)


# ---- server-sent events ----

def _event(data) -> bytes:
    return b"data: " + json.dumps(data).encode() + b"\n\n"


async def _events(work: Work, events, path: str):
    """EVENTS (a blocking iterator) as SSE frames, each step on the thread pool."""
    try:
        while True:
            try:
                ev = await work.call(next, events, _END)
            except ApiError as exc:
                log.warning("%s: the stream ended with %d %s", path, exc.status, exc.message)
                yield _event(exc.body())
                break
            except Exception as exc:
                log.exception("%s: the stream failed", path)
                yield _event(ApiError(500, f"internal error: {type(exc).__name__}: {exc}",
                                      "internal_error").body())
                break
            if ev is _END:
                break
            yield _event(ev)
        yield b"data: [DONE]\n\n"
    finally:
        # also when the client went away (this task is being cancelled): the
        # producer's cleanup (acknowledging a handoff) runs now, not when the
        # generator is collected
        with anyio.CancelScope(shield=True):
            try:
                await work.call(work.close, events)
            except Exception:
                log.exception("%s: closing the stream failed", path)


class EventStream(StreamingResponse):
    """`text/event-stream` (no charset parameter, as before), not cached; its
    body iterator is closed however the response ends."""

    def __init__(self, body):
        super().__init__(body, headers={"Content-Type": "text/event-stream",
                                        "Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self.body_iterator.aclose()


# ---- serving ----

def configure_logging(name: str, level: str = "info") -> None:
    """Lines on stderr as `HH:MM:SS NAME message`: the workers' (`tract.*`) and
    uvicorn's access log; uvicorn's own start/stop banners only from warnings
    up (the worker announces itself, and says when it drains and stops)."""
    if level not in LOG_LEVELS:
        raise ValueError(f"log level {level!r} is not one of {', '.join(LOG_LEVELS)}")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s {name} %(message)s", "%H:%M:%S"))
    for logger_name in ("tract", "uvicorn"):
        logger = logging.getLogger(logger_name)
        logger.handlers[:] = [handler]
        logger.setLevel(level.upper())
        logger.propagate = False
    logging.getLogger("uvicorn.error").setLevel(max(logging.WARNING,
                                                    logging.getLevelName(level.upper())))


def listen(host: str, port: int) -> socket.socket:
    """A listening TCP socket on HOST:PORT (port 0: a free one); OSError if not.

    Made with proto IPPROTO_TCP, as uvicorn's own are: asyncio sets
    TCP_NODELAY on the connections of such a socket only (with Nagle, a
    response's body waits for the ACK of its headers: 40 ms a request)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
    except BaseException:
        sock.close()
        raise
    return sock


def url_of(sock: socket.socket) -> str:
    host, port = sock.getsockname()[:2]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class _Server(uvicorn.Server):
    """uvicorn's server, its signals handled by `serve`: uvicorn's own handling
    re-raises the signal once it has stopped, which would end the process
    with the signal's status after the worker's cleanup, not exit 0."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


@contextlib.contextmanager
def _signals(server: uvicorn.Server):
    """The first SIGTERM or SIGINT drains SERVER, a second one stops it without
    waiting for in-flight requests (signals reach the main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, _frame):
        name = signal.Signals(signum).name
        if not server.should_exit:
            log.info("%s: draining in-flight requests", name)
            server.should_exit = True
        else:
            log.info("%s: stopping without waiting for in-flight requests", name)
            server.force_exit = True
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def serve(app, sock: socket.socket, cleanup, announce=None, lifespan: bool = False) -> None:
    """Serves APP on SOCK until SIGTERM/SIGINT, then runs CLEANUP.  ANNOUNCE
    (say where it listens) is called once a signal would stop it cleanly.
    LIFESPAN: run the app's startup and shutdown events (the vLLM front door
    closes its HTTP client there); the workers' apps have none."""
    config = uvicorn.Config(app, log_config=None, lifespan="on" if lifespan else "off",
                            ws="none", timeout_graceful_shutdown=None)
    server = _Server(config)
    with _signals(server):                  # kept through the cleanup: a signal cannot cut it
        try:
            if announce is not None:
                announce()
            server.run(sockets=[sock])
        finally:
            sock.close()
            work = getattr(getattr(app, "state", None), "work", None)
            if work is not None:
                work.settle()
            cleanup()
            log.info("stopped")
