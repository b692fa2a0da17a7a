"""The workers' HTTP side (serve/app.py) on its own: a FastAPI app over fake
routes, driven in process through httpx's ASGI transport (no sockets, no
pool).  The real workers' answers are tests/test_serve*.py's."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import pytest

from tract_cli.serve import app as http
from tract_cli.serve.api import ApiError
from tract_cli.serve.metrics import CONTENT_TYPE


def call(routes: dict, *requests):
    """The responses to REQUESTS ((method, path, kwargs) each), sent at once."""
    async def run():
        transport = httpx.ASGITransport(http.make_app(routes, "test"))
        async with httpx.AsyncClient(transport=transport, base_url="http://w") as client:
            return await asyncio.gather(*(client.request(m, p, **kw) for m, p, kw in requests))
    return asyncio.run(run())


def one(routes: dict, method: str, path: str, **kw) -> httpx.Response:
    return call(routes, (method, path, kw))[0]


def error_of(resp: httpx.Response, status: int) -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"] == "application/json"
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return err


def test_answers_json_text_and_post_bodies():
    routes = {("GET", "/health"): lambda: {"status": "ok"},
              ("GET", "/metrics"): lambda: (CONTENT_TYPE, "tract_x 1\n"),
              ("POST", "/echo"): lambda body: {"got": body}}
    assert one(routes, "GET", "/health").json() == {"status": "ok"}
    resp = one(routes, "GET", "/metrics?x=1")
    assert resp.headers["content-type"] == CONTENT_TYPE and resp.text == "tract_x 1\n"
    assert one(routes, "POST", "/echo", json={"a": [1, 2]}).json() == {"got": {"a": [1, 2]}}


def test_api_errors_keep_their_status_and_shape():
    def bad(body):
        raise ApiError(400, "field 'x' must be int", param="x")
    err = error_of(one({("POST", "/p"): bad}, "POST", "/p", json={"x": "1"}), 400)
    assert err["param"] == "x" and err["type"] == "invalid_request_error"


def test_a_bug_is_a_500_and_the_worker_keeps_serving():
    def broken():
        raise RuntimeError("oops")
    routes = {("GET", "/broken"): broken, ("GET", "/health"): lambda: {"status": "ok"}}
    err = error_of(one(routes, "GET", "/broken"), 500)
    assert err["type"] == "internal_error" and "RuntimeError: oops" in err["message"]
    assert one(routes, "GET", "/health").status_code == 200


def test_unknown_routes_and_methods():
    routes = {("POST", "/v1/completions"): lambda body: {}}
    err = error_of(one(routes, "GET", "/nope"), 404)
    assert err["type"] == "not_found_error" and "no route /nope" in err["message"]
    resp = one(routes, "GET", "/v1/completions")
    assert "is not served here" in error_of(resp, 405)["message"]
    assert resp.headers["allow"] == "POST"
    assert one(routes, "GET", "/openapi.json").status_code == 404       # no schema, no docs


@pytest.mark.parametrize("content,needle", [(b"", "no JSON body"), (b"{nope", "not valid JSON"),
                                            (b"[1]", "JSON object"), (b"\xff", "not valid JSON")])
def test_bodies_that_are_not_a_json_object_are_400(content, needle):
    resp = one({("POST", "/p"): lambda body: body}, "POST", "/p", content=content)
    assert needle in error_of(resp, 400)["message"]


def test_bodies_over_the_limit_are_413(monkeypatch):
    monkeypatch.setattr(http, "MAX_BODY", 1000)
    routes = {("POST", "/p"): lambda body: body}
    resp = one(routes, "POST", "/p", content=b"x" * 1001)              # told by Content-Length
    assert error_of(resp, 413)["type"] == "request_too_large"
    assert resp.headers["connection"] == "close"

    async def chunks():                                                # chunked: counted as read
        for _ in range(5):
            yield b" " * 300
    error_of(one(routes, "POST", "/p", content=chunks()), 413)
    assert one(routes, "POST", "/p", content=b'{"a": 1}' + b" " * 900).json() == {"a": 1}


def _events(resp: httpx.Response) -> list:
    assert resp.headers["content-type"] == "text/event-stream"
    frames = [f for f in resp.text.split("\n\n") if f]
    assert all(f.startswith("data: ") for f in frames), frames
    assert frames[-1] == "data: [DONE]"
    return [json.loads(f[len("data: "):]) for f in frames[:-1]]


def test_a_stream_is_server_sent_events_and_its_producer_is_closed():
    closed = threading.Event()

    def stream(body):
        def gen():
            try:
                for i in range(body["n"]):
                    yield {"i": i}
            finally:
                closed.set()
        return gen()
    assert _events(one({("POST", "/s"): stream}, "POST", "/s", json={"n": 3})) == \
        [{"i": 0}, {"i": 1}, {"i": 2}]
    assert closed.is_set()


def test_a_stream_that_fails_after_its_200_ends_with_the_error():
    def stream(body):
        yield {"i": 0}
        raise ApiError(500, "the pool went away", "pool_error")
    events = _events(one({("POST", "/s"): stream}, "POST", "/s", json={}))
    assert events[0] == {"i": 0}
    assert events[1]["error"]["type"] == "pool_error" and events[1]["error"]["code"] == 500


def test_blocking_handlers_run_off_the_event_loop():
    """One handler blocks until another has run: on the event loop the second
    could never start; on the thread pool both are served."""
    started, released = threading.Event(), threading.Event()

    def waits():
        started.set()
        return {"released": released.wait(30)}

    def releases():
        assert started.wait(30)
        released.set()
        return {}
    a, b = call({("GET", "/waits"): waits, ("GET", "/releases"): releases},
                ("GET", "/waits", {}), ("GET", "/releases", {}))
    assert a.json() == {"released": True} and b.status_code == 200


def test_log_levels_are_checked():
    with pytest.raises(ValueError, match="log level"):
        http.configure_logging("w", "loud")


def test_a_streamed_event_holding_a_unicode_line_separator_reads_whole():
    """JSON leaves U+2028, U+2029 and U+0085 unescaped inside a string; an event
    stream's lines end at LF, so an event that holds one is one event (httpx's
    iter_lines splits there and the client read half a JSON document), however
    the bytes arrive."""
    from tract_cli.serve.client import _event_lines
    text = "a\u2028b\u2029c\x85d"
    stream = ("data: " + json.dumps({"text": text}, ensure_ascii=False) + "\r\n\r\n"
              "data: [DONE]\n\n").encode()
    for cut in range(1, len(stream)):
        lines = list(_event_lines(iter([stream[:cut], stream[cut:]])))
        events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        assert events == [{"text": text}], cut
        assert "data: [DONE]" in lines
