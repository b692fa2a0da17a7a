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

DOOR = ("import sys; from tract_cli.serve.vllm_proxy import serve; "
        "serve(sys.argv[1:-1], sys.argv[-1], '127.0.0.1', 0, lambda url: print(url, flush=True))")


def instance(role: str, seen: list):
    """A stand-in vLLM instance: prefill answers a ticket, decode echoes what it got."""
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
            self.answer(200, b'{"status": "ok"}')

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            seen.append((role, body))
            if role == "prefill":
                self.answer(200, json.dumps({"kv_transfer_params": {"ticket": "t-1"}}).encode())
            elif body.get("stream"):
                self.answer(200, b"data: " + json.dumps(body).encode() + b"\n\ndata: [DONE]\n\n",
                            "text/event-stream")
            else:
                self.answer(200, json.dumps({"got": body}).encode())

    srv = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"


@pytest.fixture
def door():
    """The door in front of a stand-in prefill and decode instance; its URL,
    what the instances received, and the process (stopped afterwards)."""
    seen: list = []
    (pre, pre_url), (dec, dec_url) = instance("prefill", seen), instance("decode", seen)
    proc = subprocess.Popen([sys.executable, "-c", DOOR, pre_url, dec_url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        box = {}
        reader = threading.Thread(target=lambda: box.update(url=proc.stdout.readline().strip()),
                                  daemon=True)
        reader.start()
        reader.join(60)                                  # the door's start, bounded
        assert box.get("url", "").startswith("http://127.0.0.1:"), proc.stderr.read() \
            if proc.poll() is not None else "the door did not say where it listens within 60 s"
        yield box["url"], seen, proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)
        pre.shutdown()
        dec.shutdown()


def test_the_door_runs_the_two_step_flow_and_stops_cleanly_on_sigterm(door):
    url, seen, proc = door
    assert request(url + "/health", timeout=30)[0] == 200
    status, body = request(url + "/v1/completions",
                           {"model": "m", "prompt": "hi", "max_tokens": 5,
                            "kv_transfer_params": {"ticket": "forged"}}, timeout=30)
    assert status == 200, body
    (r1, first), (r2, second) = seen
    assert (r1, r2) == ("prefill", "decode")
    assert first["max_tokens"] == 1 and first["kv_transfer_params"] == {"do_remote_decode": True}
    # the client's own transfer parameters never reach an instance
    assert second["kv_transfer_params"] == {"ticket": "t-1"} and second["max_tokens"] == 5
    assert body == {"got": second}
    status, text = request(url + "/v1/completions", {"prompt": "hi", "stream": True}, timeout=30)
    assert status == 200 and text.endswith("data: [DONE]\n\n")
    assert request(url + "/v1/completions", {"prompt": "hi", "n": 2}, timeout=30)[0] == 400
    # the workers' server: the first SIGTERM drains, the process exits 0
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0, proc.stderr.read()
