"""The serving path's failure modes: bad requests get 4xx in OpenAI's shape, a
prefill worker that is down gives 503, a pool full of pinned blocks gives a
clear error (not a hang), SIGTERM drains in-flight requests and releases
everything."""
from __future__ import annotations

import http.client
import json
import re
import signal
import socket
import time
import urllib.request

import numpy as np
import pytest

from servers import Server, metric, request
from test_serve import MODEL, _cluster, _teardown, complete, prompt
from tract_cli.core.errors import PoolFull
from tract_cli.core.pool import Pool


@pytest.fixture(scope="module")
def small():
    """A cluster on an 8 MiB pool (384 slots of 16 KiB), plain mode."""
    c = _cluster(False, 8 << 20)
    yield c
    _teardown(c)


def _error(status, body, code, *needles):
    assert status == code, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code
    for n in needles:
        assert n in err["message"], err
    return err


@pytest.mark.parametrize("body,code,needles", [
    ({"prompt": "", "max_tokens": 2}, 400, ["empty"]),
    ({"prompt": [], "max_tokens": 2}, 400, ["empty"]),
    ({"max_tokens": 2}, 400, ["prompt"]),
    ({"prompt": "hi", "max_tokens": "x"}, 400, ["max_tokens", "int"]),
    ({"prompt": "hi", "max_tokens": 0}, 400, ["max_tokens"]),
    ({"prompt": "hi", "max_tokens": True}, 400, ["max_tokens"]),
    ({"prompt": "hi", "temperature": "hot"}, 400, ["temperature"]),
    ({"prompt": "hi", "temperature": -1}, 400, ["temperature"]),
    ({"prompt": "hi", "stream": "yes"}, 400, ["stream"]),
    ({"prompt": "hi", "seed": 1.5}, 400, ["seed"]),
    ({"prompt": ["a", "b"]}, 400, ["token ids"]),
    ({"prompt": [1, 2, 999]}, 400, ["token ids"]),
    ({"prompt": [1, -2]}, 400, ["token ids"]),
    ({"prompt": "hi", "n": 2}, 400, ["n=1"]),
    ({"prompt": "hi", "kv_mode": "rdma"}, 400, ["kv_mode"]),
    ({"prompt": "hi", "stop": [""]}, 400, ["stop"]),
    ({"prompt": "hi", "model": "gpt-4"}, 404, ["gpt-4", MODEL]),
    ({"prompt": [1] * 8190, "max_tokens": 8}, 400, ["exceeds the context"]),
])
def test_bad_requests_get_openai_shaped_4xx(small, body, code, needles):
    status, out = request(small.decode.url + "/v1/completions", body)
    err = _error(status, out, code, *needles)
    assert err["type"] in ("invalid_request_error", "not_found_error")


@pytest.mark.parametrize("raw,needle", [(b"{not json", "not valid JSON"), (b"[1, 2]", "JSON object"),
                                        (b"\xff\xfe", "not valid JSON")])
def test_invalid_json_is_400(small, raw, needle):
    status, out = request(small.decode.url + "/v1/completions", raw=raw)
    _error(status, out, 400, needle)


def test_unknown_route_and_method(small):
    status, out = request(small.decode.url + "/v1/chat/completions", {"x": 1})
    _error(status, out, 404, "no route")
    status, out = request(small.decode.url + "/v1/completions")
    _error(status, out, 405)


def test_unknown_fields_are_ignored(small):
    out = complete(small, prompt="hello", max_tokens=2, temperature=0, top_p=0.9, user="me")
    assert len(out["tract"]["token_ids"]) >= 1


def test_stream_is_server_sent_events(small):
    req = urllib.request.Request(small.decode.url + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": "stream me", "max_tokens": 5,
                                                  "temperature": 0, "stream": True}).encode())
    with urllib.request.urlopen(req, timeout=120) as resp:
        assert resp.headers["Content-Type"] == "text/event-stream"
        body = resp.read().decode()
    events = [e[len("data: "):] for e in body.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "stop")
    ids = chunks[-1]["tract"]["token_ids"]
    assert len(chunks) == len(ids) + 1
    assert all(c["object"] == "text_completion" for c in chunks)


def test_health_and_metrics(small):
    status, h = request(small.decode.url + "/health")
    assert status == 200 and h["role"] == "decode" and h["model"] == MODEL
    status, h = request(small.prefill.url + "/health")
    assert status == 200 and h["role"] == "prefill" and h["max_context"] == 8192
    complete(small, prompt="metrics", max_tokens=2, temperature=0)
    _, text = request(small.decode.url + "/metrics")
    # the request went through: counted, timed, its handoff timed, its blocks cached
    for name in ("requests_total", "ttft_seconds_count", "handoff_seconds_count",
                 "pool_slots_used"):
        assert metric(text, name) >= 1, name
    assert 0 <= metric(text, "prefix_hit_rate") <= 1
    assert metric(text, "lock_wait_seconds") >= 0          # present; may be 0 uncontended
    assert "# TYPE tract_ttft_seconds histogram" in text


def test_prefill_down_gives_503(small):
    with socket.socket() as s:                  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dec = Server("serve-decode", "--pool", small.path, "--node", "3",
                 "--prefill", f"http://127.0.0.1:{port}")
    try:
        status, out = request(dec.url + "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        _error(status, out, 503, "no prefill worker is reachable", str(port))
    finally:
        assert dec.stop() == 0


def test_pool_full_of_pinned_blocks_is_a_clear_error(small):
    """Fill and pin every slot from another process on the prefill worker's node
    (so its node's claimed slots are taken too): the request fails with 503 and
    a pool-full message; once unpinned, the same request succeeds."""
    pool = Pool.attach(small.path, node=1)
    pinned = []
    try:
        rng = np.random.default_rng(9)
        while True:
            keys = rng.integers(0, 256, (32, 16), dtype=np.uint8)
            try:
                pool.index.put(keys, np.zeros((32, pool.info.block_bytes), np.uint8))
            except PoolFull:
                break
            pinned.append(pool.index.lookup(keys))
            assert len(pinned) < 100, "the pool never filled"
        status, out = request(small.decode.url + "/v1/completions",
                              {"prompt": prompt(5, 100), "max_tokens": 2}, timeout=120)
        _error(status, out, 503, "pool is full")
    finally:
        for lk in pinned:
            pool.index.unpin(lk)
        pool.index.evict(1 << 20)
        pool.allocator.drain()
        pool.close()
    complete(small, prompt=prompt(5, 100), max_tokens=2)


def test_a_body_larger_than_the_limit_is_413_before_it_is_read(small):
    """Told by Content-Length, the worker answers at once (and closes the
    connection) instead of reading the body."""
    from tract_cli.serve.app import MAX_BODY
    host, port = small.decode.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: %d\r\n\r\n{" % (MAX_BODY + 1))
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413 "), head
    _error(413, json.loads(body), 413, "larger than")


def test_a_client_that_leaves_mid_stream_releases_its_handoff(small):
    """Zero copy pins the prompt's blocks until generation ends: a client that
    closes its connection after the first event ends generation there (it does
    not run to max_tokens) and the handoff is acknowledged at once."""
    req = urllib.request.Request(small.decode.url + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": prompt(12, 40), "max_tokens": 4000,
                                                  "temperature": 0, "stream": True,
                                                  "kv_mode": "zero-copy"}).encode())
    resp = urllib.request.urlopen(req, timeout=120)
    assert resp.readline().startswith(b"data: ")
    resp.close()
    deadline = time.monotonic() + 60
    while not any("stream cut after" in line for line in small.decode.lines):
        assert time.monotonic() < deadline, small.decode.lines[-5:]
        time.sleep(0.05)
    cut = next(line for line in small.decode.lines if "stream cut after" in line)
    assert int(re.search(r"cut after (\d+) tok", cut).group(1)) < 4000
    _, text = request(small.decode.url + "/metrics")
    assert metric(text, "requests_in_flight") == 0
    from tract_cli.inspect.snapshot import take
    with Pool.attach(small.path, node=3, readonly=True, prefault=False) as pool:
        snap = take(pool)
    assert snap["index"]["pinned_blocks"] == 0
    assert snap["handoffs"]["in_flight"] == []


def test_a_second_sigterm_stops_at_once_and_still_releases_everything(small):
    """The first signal drains, the second stops without waiting: the stream
    is cut, but its handoff is acknowledged and the region unmapped only once
    no thread runs a step of it (never under one: no crash), exit code 0."""
    dec = Server("serve-decode", "--pool", small.path, "--node", "3", "--prefill", small.prefill.url)
    try:
        req = urllib.request.Request(dec.url + "/v1/completions", method="POST",
                                     data=json.dumps({"prompt": prompt(13, 40), "max_tokens": 4000,
                                                      "temperature": 0, "stream": True,
                                                      "kv_mode": "zero-copy"}).encode())
        resp = urllib.request.urlopen(req, timeout=120)
        assert resp.readline().startswith(b"data: ")
        dec.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        dec.proc.send_signal(signal.SIGTERM)
        try:
            rest = resp.read()
        except http.client.IncompleteRead as exc:    # cut: the chunked body never ended
            rest = exc.partial
        resp.close()
        assert b"data: [DONE]" not in rest
        assert dec.proc.wait(timeout=60) == 0, dec.lines[-10:]
    finally:
        dec.stop()
    assert any("stopped" in line for line in dec.lines)
    from tract_cli.inspect.snapshot import take
    with Pool.attach(small.path, node=3, readonly=True, prefault=False) as pool:
        snap = take(pool)
    assert snap["index"]["pinned_blocks"] == 0
    assert snap["handoffs"]["in_flight"] == []


def test_sigterm_finishes_in_flight_stream_and_releases_everything(small):
    """Run last in this module: it stops the decode worker."""
    req = urllib.request.Request(small.decode.url + "/v1/completions", method="POST",
                                 data=json.dumps({"prompt": prompt(11, 40), "max_tokens": 150,
                                                  "temperature": 0, "stream": True,
                                                  "kv_mode": "zero-copy"}).encode())
    resp = urllib.request.urlopen(req, timeout=120)
    first = resp.readline()                 # the request is in flight (its KV pinned)
    assert first.startswith(b"data: ")
    small.decode.proc.send_signal(signal.SIGTERM)
    rest = resp.read().decode()
    resp.close()
    assert rest.rstrip().endswith("data: [DONE]")
    assert small.decode.proc.wait(timeout=60) == 0
    assert any("stopped" in line for line in small.decode.lines)
    from tract_cli.inspect.snapshot import take
    with Pool.attach(small.path, node=3, readonly=True, prefault=False) as pool:
        snap = take(pool)
    assert snap["index"]["pinned_blocks"] == 0
    assert snap["handoffs"]["in_flight"] == []
