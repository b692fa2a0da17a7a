"""The vLLM front door (serve/vllm_proxy.py) without vLLM: stand-in prefill and
decode instances (http.server threads in this process) behind the door, run
as a real process on the workers' server (serve/app.py).  tests/test_vllm.py
runs it in front of real vLLM instances."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.servers import request
from tract_cli.core.handoff import pair_key

TICKET = {"tract_ticket": {"record": 1}, "do_remote_prefill": True}
# argv: "paired" or "two-step", the prefill URLs, the decode URL
DOOR = ("import sys; from tract_cli.serve.vllm_proxy import serve; "
        "serve(sys.argv[2:-1], sys.argv[-1], '127.0.0.1', 0, lambda url: print(url, flush=True), "
        "paired=sys.argv[1] == 'paired')")


def instance(role: str, seen: list, prefill_answer: dict, decode_arrived):
    """A stand-in vLLM instance: prefill answers as PREFILL_ANSWER["now"] says
    (a ticket; a reply without one; a status), decode echoes what it got;
    DECODE_ARRIVED(pair): the event a paired decode request sets on arrival."""
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def answer(self, status: int, body: bytes, ctype="application/json"):
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/v1/models":        # vLLM's list: a LoRA adapter has a parent
                seen.append((role, "models"))
                if prefill_answer.get("models") == "fail":
                    self.answer(500, b'{"error": "stand-in"}')
                    return
                self.answer(200, json.dumps({"data": [
                    {"id": "m", "parent": None}, {"id": "m-lora", "parent": "m"}]}).encode())
                return
            self.answer(200, b'{"status": "ok"}')

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((role, body))
            pair = (body.get("kv_transfer_params") or {}).get("tract_pair")
            if role == "decode" and pair:
                decode_arrived(pair).set()
            if role == "prefill":
                now = prefill_answer["now"]
                if now is TICKET and pair:
                    # a connector that took the pair names its record by it; the
                    # stand-in answers once the paired decode has arrived (bounded):
                    # the door sent both at once
                    now = {"tract_ticket": {"record": 1, "request_id": pair_key(pair).hex()},
                           "do_remote_prefill": True}
                    if not decode_arrived(pair).wait(10):
                        now = 500        # sent one after the other: the test fails
                if isinstance(now, int):
                    self.answer(now, b'{"error": "stand-in"}')
                else:
                    self.answer(200, json.dumps({"kv_transfer_params": now}).encode())
            elif body.get("stream"):
                self.answer(200, b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n",
                            "text/event-stream")
            else:
                self.answer(200, json.dumps({"got": body}).encode())

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.fixture(params=["paired"])
def door(request):
    """The door (its flow the parameter: "paired" unless a test says) in front
    of a stand-in prefill and decode instance; its URL, what the instances
    received, the process (stopped afterwards) and what the prefill answers."""
    seen: list = []
    prefill_answer = {"now": TICKET}
    events: dict = {}
    events_lock = threading.Lock()

    def arrived(pair: str) -> threading.Event:
        """The event of PAIR's decode request (one per pair, made on first ask)."""
        with events_lock:
            return events.setdefault(pair, threading.Event())

    (pre, pre_url), (dec, dec_url) = (instance("prefill", seen, prefill_answer, arrived),
                                      instance("decode", seen, prefill_answer, arrived))
    proc = subprocess.Popen([sys.executable, "-c", DOOR, request.param, pre_url, dec_url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        box = {}
        reader = threading.Thread(target=lambda: box.update(url=proc.stdout.readline().strip()),
                                  daemon=True)
        reader.start()
        reader.join(60)                                  # the door's start, bounded
        assert box.get("url", "").startswith("http://127.0.0.1:"), proc.stderr.read() \
            if proc.poll() is not None else "the door did not say where it listens within 60 s"
        yield box["url"], seen, proc, prefill_answer
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        pre.shutdown()
        dec.shutdown()


def _by_role(seen: list) -> dict:
    """What each stand-in was sent, in order: {"prefill": [...], "decode": [...]}
    (the requests' bodies; its model list asked for is not one)."""
    out: dict = {"prefill": [], "decode": []}
    for role, body in seen:
        if body != "models":
            out[role].append(body)
    return out


def _healthy_then_forged(url: str, key: str) -> dict:
    """The door is healthy, and answers a request whose client forged the
    transfer parameter KEY (which must never reach an instance): its body."""
    assert request(url + "/health", timeout=30)[0] == 200
    status, body = request(url + "/v1/completions",
                           {"model": "m", "prompt": "hi", "max_tokens": 5,
                            "kv_transfer_params": {key: "forged"}}, timeout=30)
    assert status == 200, body
    return body


def _streams_refuses_n_and_stops_on_sigterm(url: str, proc) -> None:
    """What either flow's door does alike: a streamed request streams to its end,
    a request for several choices is refused (400), and the first SIGTERM
    drains the workers' server, which exits 0."""
    status, text = request(url + "/v1/completions", {"prompt": "hi", "stream": True}, timeout=30)
    assert status == 200 and text.endswith("data: [DONE]\n\n")
    assert request(url + "/v1/completions", {"prompt": "hi", "n": 2}, timeout=30)[0] == 400
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, proc.stderr.read()


@pytest.mark.parametrize("door", ["two-step"], indirect=True)
def test_the_door_runs_the_two_step_flow_and_stops_cleanly_on_sigterm(door):
    url, seen, proc, _ = door
    body = _healthy_then_forged(url, "tract_ticket")
    (r1, first), (r2, second) = [(r, b) for r, b in seen if b != "models"]
    assert (r1, r2) == ("prefill", "decode")
    assert first["max_tokens"] == 1 and first["kv_transfer_params"] == {"do_remote_decode": True}
    # the client's own transfer parameters never reach an instance: the decode's
    # are what the prefill answered
    assert second["kv_transfer_params"] == TICKET and second["max_tokens"] == 5
    assert body == {"got": second}
    _streams_refuses_n_and_stops_on_sigterm(url, proc)


def test_the_door_pairs_prefill_and_decode_and_stops_cleanly_on_sigterm(door):
    url, seen, proc, _ = door
    body = _healthy_then_forged(url, "tract_pair")
    got = _by_role(seen)
    (first,), (second,) = got["prefill"], got["decode"]
    # both sent at once, named by one pair of the door's own (never the client's)
    pair = first["kv_transfer_params"]["tract_pair"]
    assert pair != "forged" and len(pair) == 32
    assert first["max_tokens"] == 1 and first["kv_transfer_params"] == {
        "do_remote_decode": True, "tract_pair": pair}
    assert second["kv_transfer_params"] == {"do_remote_prefill": True, "tract_pair": pair}
    assert second["max_tokens"] == 5 and body == {"got": second}
    _streams_refuses_n_and_stops_on_sigterm(url, proc)


@pytest.mark.parametrize("door", ["two-step", "paired"], indirect=True)
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("prefill_says", [503, {"no": "ticket"}], ids=["failed", "no-handoff"])
def test_a_decode_whose_prefill_made_no_handoff_is_sent_again_to_compute_it(door, stream,
                                                                           prefill_says):
    """A prefill that fails, or answers without a handoff, is not the user's
    error: the request goes to the decode instance without transfer
    parameters, whose answer the client gets (paired: the decode request sent
    with the prefill's, which would wait for a handoff that will not come, is
    dropped first)."""
    url, seen, _, prefill_answer = door
    prefill_answer["now"] = prefill_says
    status, body = request(url + "/v1/completions",
                           {"model": "m", "prompt": "hi", "max_tokens": 5, "stream": stream},
                           timeout=30)
    assert status == 200, body
    decodes = _by_role(seen)["decode"]
    plain = [d for d in decodes if d.get("kv_transfer_params") is None]
    # the paired one was sent first: cut off before it arrived, or answered, unused
    paired = [d for d in decodes if d.get("kv_transfer_params") is not None]
    assert len(plain) == 1 and plain[0]["max_tokens"] == 5, decodes
    assert len(paired) <= 1 and all(d["kv_transfer_params"]["do_remote_prefill"]
                                    for d in paired), decodes
    if stream:
        assert body.startswith("data: ") and '"kv_transfer_params"' not in body
    else:
        assert body == {"got": plain[0]}


def test_a_paired_decode_whose_prefill_named_its_record_otherwise_gets_the_ticket(door):
    """A prefill whose connector did not take the pair (its ticket names the
    record by the request id) answers a handoff the waiting decode would
    never find: the door drops it and sends the decode the ticket instead,
    as the two-step flow does."""
    url, seen, _, prefill_answer = door
    prefill_answer["now"] = {"tract_ticket": {"record": 2, "request_id": "ab" * 16}}
    status, body = request(url + "/v1/completions",
                           {"model": "m", "prompt": "hi", "max_tokens": 5}, timeout=30)
    assert status == 200, body
    assert body["got"]["kv_transfer_params"] == prefill_answer["now"]


@pytest.mark.parametrize("door", ["two-step", "paired"], indirect=True)
def test_a_request_the_prefill_refuses_is_answered_with_its_refusal(door):
    url, seen, _, prefill_answer = door
    prefill_answer["now"] = 400
    status, body = request(url + "/v1/completions", {"model": "m", "prompt": "hi"}, timeout=30)
    assert status == 400 and body == {"error": "stand-in"}
    assert all(b.get("kv_transfer_params") for b in _by_role(seen)["decode"])


@pytest.mark.parametrize("door", ["two-step", "paired"], indirect=True)
def test_a_request_the_pool_cannot_hold_is_computed_once_by_the_decode_instance(door):
    """A LoRA adapter's request, multimodal input or prompt embeddings (no KV
    of them in the pool): sent to the decode instance alone, as the client
    sent it, in either flow; a base model's text request still goes through
    the prefill.  A model name not seen before asks the decode instance's
    model list again (an adapter loaded at run time)."""
    url, seen, _, answer = door
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    for path, body in (
            ("/v1/completions", {"model": "m-lora", "prompt": "hi", "max_tokens": 2}),
            ("/v1/chat/completions", {"model": "m", "max_tokens": 2, "messages": [
                {"role": "user", "content": [{"type": "text", "text": "what is it"}, image]}]}),
            ("/v1/chat/completions", {"model": "m", "max_tokens": 2, "messages": [
                {"role": "user", "content": [{"image_url": {"url": "x"}}]}]}),   # untyped
            ("/v1/completions", {"model": "m", "prompt_embeds": "AAAA", "max_tokens": 2})):
        seen.clear()
        status, got = request(url + path, body, timeout=30)
        assert status == 200, got
        sent = _by_role(seen)
        assert sent["prefill"] == [] and sent["decode"] == [body], (body, seen)
    # text, of the base model, its content parts text too: the P/D flow as before
    seen.clear()
    text = {"model": "m", "max_tokens": 2, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]}]}
    assert request(url + "/v1/chat/completions", text, timeout=30)[0] == 200
    sent = _by_role(seen)
    assert len(sent["prefill"]) == 1 and sent["decode"][-1]["kv_transfer_params"], seen
    # the names the list had are not asked for again; a new one is, once: the
    # decode instance's list is asked again only after MODELS_RECHECK_S
    assert ("decode", "models") not in seen, seen
    for _ in range(2):
        seen.clear()
        assert request(url + "/v1/completions", {"model": "new-adapter", "prompt": "hi",
                                                 "max_tokens": 2}, timeout=30)[0] == 200
        assert len(_by_role(seen)["prefill"]) == 1, seen       # not an adapter it listed
        asked = [r for r, b in seen if b == "models"]
        assert asked == (["decode"] if _ == 0 else []), seen
    # a list that cannot be read: the name is taken for a base model's (the usual
    # flow), and the list is asked for again by the next request, not cached
    answer["models"] = "fail"
    for _ in range(2):
        seen.clear()
        assert request(url + "/v1/completions", {"model": "unread", "prompt": "hi",
                                                 "max_tokens": 2}, timeout=30)[0] == 200
        assert ("decode", "models") in seen and len(_by_role(seen)["prefill"]) == 1, seen
