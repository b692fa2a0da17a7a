"""TraCT inside real vLLM (its CPU build): P/D through the pool, the front door,
prefix sharing between instances, tenants, load failures, bad configuration.

The servers are real `vllm.entrypoints.openai.api_server` processes started
by the product's own launcher (`serve.vllm_engine.VllmServer`) in vLLM's
environment (`.ci/setup` builds it in `.peers/vllm`; TRACT_VLLM_PYTHON names
another), on a tiny random-weight checkpoint made locally.  They are shared
by the module: three engines start once (~1.5 min on two cores).  Every
answer is compared with a monolithic vLLM (no connector) at temperature 0.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.servers import request
from tract_cli.core.agent import read_nodes
from tract_cli.core.errors import TractError
from tract_cli.core.handoff import Ticket
from tract_cli.core.pool import Pool
from tract_cli.core.region import remove_region

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VLLM_PY = os.environ.get("TRACT_VLLM_PYTHON") or os.path.join(ROOT, ".peers", "vllm", "bin",
                                                              "python")
ARGS = ("--max-model-len", "2048", "--dtype", "bfloat16")
PROMPT = "Prefill computes the prompt's KV cache; decode reads it one token at a time. "

pytestmark = pytest.mark.skipif(not os.path.exists(VLLM_PY),
                                reason=f"no vLLM environment at {VLLM_PY} (.ci/setup builds it)")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """A region, a prefill and a decode instance on it (nodes 1, 2; kv_both),
    and a monolithic vLLM; stopped, with their node agents, afterwards."""
    from tract_cli.serve.vllm_engine import VllmServer
    os.environ["TRACT_VLLM_PYTHON"] = VLLM_PY
    tmp = tmp_path_factory.mktemp("vllm")
    ckpt = str(tmp / "ckpt")
    subprocess.run([VLLM_PY, os.path.join(ROOT, "tests", "vllm_model.py"), ckpt], check=True,
                   capture_output=True, timeout=300)
    pool = f"/dev/shm/tract-test-vllm-{os.getpid()}.pool"
    subprocess.run([sys.executable, "-m", "tract_cli.cli", "init", pool, "--size", "128M",
                    "--model", ckpt, "--nodes", "4", "--force", "-q"], check=True, timeout=120)
    servers = {}
    try:
        for name, node in (("prefill", 1), ("decode", 2), ("mono", None)):
            servers[name] = VllmServer(
                ckpt, _port(), pool=pool if node else None, node=node, args=ARGS,
                extra={"handoff_ttl_s": 60.0}, log_path=str(tmp / f"{name}.log"))
        for server in servers.values():
            server.wait_ready()
        yield {"pool": pool, "ckpt": ckpt, "tmp": tmp, **servers}
    finally:
        for server in servers.values():
            server.stop()
        _stop_agents(pool)
        remove_region(pool)


def _stop_agents(pool: str) -> None:
    """The node agents the connectors started for this region (bounded)."""
    try:
        with Pool.attach(pool, readonly=True, prefault=False) as p:
            pids = [n.agent_pid for n in read_nodes(p) if n.agent_pid]
    except TractError:
        return
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            continue
    deadline = time.monotonic() + 30
    for pid in pids:
        while time.monotonic() < deadline and os.path.exists(f"/proc/{pid}"):
            time.sleep(0.05)      # waiting for another process to exit, bounded


def complete(server, prompt: str, max_tokens: int = 12, **extra) -> dict:
    status, body = request(server.url + "/v1/completions",
                           {"model": server_model(server), "prompt": prompt,
                            "max_tokens": max_tokens, "temperature": 0} | extra)
    assert status == 200, body
    return body


def server_model(server) -> str:
    status, body = request(server.url + "/v1/models")
    assert status == 200, body
    return body["data"][0]["id"]


def tokens_by_source(server, source: str) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:prompt_tokens_by_source_total") and
               f'source="{source}"' in line)


def external_hits(server) -> float:
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    return sum(float(line.split()[-1]) for line in text.splitlines()
               if line.startswith("vllm:external_prefix_cache_hits_total"))


def prefill_params(stack, prompt: str, **extra) -> dict:
    body = complete(stack["prefill"], prompt, 1, kv_transfer_params={"do_remote_decode": True},
                    **extra)
    params = body.get("kv_transfer_params")
    assert params and params.get("do_remote_prefill") and "tract_ticket" in params, body
    return params


@pytest.mark.parametrize("repeat", [1, 3, 7, 20])
def test_decode_through_the_pool_answers_as_one_vllm(stack, repeat):
    # 1 repeat: 17 tokens (one block and a 1-token tail); 20: ~340 tokens over 3 vLLM pages
    prompt = PROMPT * repeat
    params = prefill_params(stack, prompt)
    ticket = params["tract_ticket"]
    external = tokens_by_source(stack["decode"], "external_kv_transfer")
    local = tokens_by_source(stack["decode"], "local_compute")
    out = complete(stack["decode"], prompt, kv_transfer_params=params)
    assert out["choices"][0]["text"] == complete(stack["mono"], prompt)["choices"][0]["text"]
    n = out["usage"]["prompt_tokens"]
    assert ticket["tokens"] == n and ticket["blocks"] == -(-n // 16)
    # every prompt token came from the pool, none was computed by the decode instance
    assert tokens_by_source(stack["decode"], "external_kv_transfer") - external == n
    assert tokens_by_source(stack["decode"], "local_compute") == local


def test_a_prefix_one_instance_computed_is_a_hit_for_another(stack):
    head = "CXL shared memory lets every host in a rack load and store the same bytes. " * 8
    complete(stack["prefill"], head, 1)
    hits = external_hits(stack["decode"])
    prompt = head + "A prefix cache reuses the blocks of prompts that start alike."
    out = complete(stack["decode"], prompt)
    assert out["choices"][0]["text"] == complete(stack["mono"], prompt)["choices"][0]["text"]
    n_head = complete(stack["mono"], head, 1)["usage"]["prompt_tokens"]
    assert external_hits(stack["decode"]) - hits >= n_head // 16 * 16 > 0


def test_cache_salt_keeps_tenants_apart(stack):
    prompt = "Tenant data that must never be shared across salts. " * 6
    complete(stack["prefill"], prompt, 1, cache_salt="tenant-a")
    hits = external_hits(stack["decode"])
    complete(stack["decode"], prompt, 1, cache_salt="tenant-b")
    assert external_hits(stack["decode"]) == hits
    complete(stack["decode"], prompt, 1, cache_salt="tenant-a")
    assert external_hits(stack["decode"]) > hits


def test_a_block_failing_its_checksum_is_recomputed(stack):
    prompt = "A corrupted block must never be served: vLLM recomputes it. " * 5
    params = prefill_params(stack, prompt)
    ticket = Ticket.from_dict(params["tract_ticket"])
    with Pool.attach(stack["pool"], node=3) as pool:
        rec = pool.handoffs.open(ticket)
        view = pool.slot_bytes(int(rec.slots[1]))
        view[:64] ^= 0xFF                   # one cache line of the second block
        del view
    external = tokens_by_source(stack["decode"], "external_kv_transfer")
    out = complete(stack["decode"], prompt, kv_transfer_params=params)
    assert out["choices"][0]["text"] == complete(stack["mono"], prompt)["choices"][0]["text"]
    # only the blocks before the bad one came from the pool (one 16-token block)
    assert tokens_by_source(stack["decode"], "external_kv_transfer") - external <= 16
    assert "fails its checksum" in open(stack["tmp"] / "decode.log").read()


def test_a_handoff_gone_before_decode_is_recomputed(stack):
    prompt = "This handoff expires before the decode instance reads it. " * 4
    params = prefill_params(stack, prompt)
    with Pool.attach(stack["pool"], node=3) as pool:    # as the agent's expiry would
        pool.handoffs.ack(Ticket.from_dict(params["tract_ticket"]))
    out = complete(stack["decode"], prompt, kv_transfer_params=params)
    assert out["choices"][0]["text"] == complete(stack["mono"], prompt)["choices"][0]["text"]


def test_front_door_runs_the_two_step_flow_over_http(stack):
    port = _port()
    door = subprocess.Popen(
        [VLLM_PY, "-c", "import sys; from tract_cli.serve.vllm_proxy import serve; "
                        "serve([sys.argv[1]], sys.argv[2], '127.0.0.1', int(sys.argv[3]))",
         stack["prefill"].url, stack["decode"].url, str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        status = None
        while time.monotonic() < deadline and status != 200:
            assert door.poll() is None, door.stderr.read()
            try:
                status, _ = request(url + "/health", timeout=5)
            except OSError:
                time.sleep(0.2)   # the front door starting up, bounded
        assert status == 200, "the front door did not become ready within 60 s"
        prompt = PROMPT * 4
        external = tokens_by_source(stack["decode"], "external_kv_transfer")
        status, body = request(url + "/v1/completions", {
            "model": server_model(stack["decode"]), "prompt": prompt, "max_tokens": 12,
            "temperature": 0})
        assert status == 200, body
        assert body["choices"][0]["text"] == complete(stack["mono"], prompt)["choices"][0]["text"]
        assert tokens_by_source(stack["decode"], "external_kv_transfer") - external == \
            body["usage"]["prompt_tokens"]
    finally:
        door.terminate()
        door.wait(timeout=30)


def test_pins_and_claims_are_given_back(stack):
    """After the requests above, nothing the instances took is left pinned or PENDING
    (acknowledged handoffs release their pins; lookups unpin after loading)."""
    deadline = time.monotonic() + 30
    while True:
        out = subprocess.run([sys.executable, "-m", "tract_cli.cli", "inspect", stack["pool"],
                              "--json"], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        data = json.loads(out.stdout)
        index, live = data["index"], data["handoffs"]["in_flight"]
        if index["states"]["PENDING"] == 0 and index["pins_total"] == 0 and not live:
            break
        # published-but-unread handoffs of the tests above hold pins until their ttl
        assert time.monotonic() < deadline, (index["pins_total"], index["states"], live)
        time.sleep(0.5)   # waiting for other processes' acknowledgements, bounded


def test_a_region_of_another_model_stops_vllm_at_start_with_one_line(stack, region_path):
    from tract_cli.serve.vllm_engine import VllmServer
    subprocess.run([sys.executable, "-m", "tract_cli.cli", "init", region_path, "--size", "32M",
                    "--model", "tiny", "--nodes", "4", "-q"], check=True, timeout=60)
    server = VllmServer(stack["ckpt"], _port(), pool=region_path, node=1, args=ARGS,
                        extra={"start_agent": False}, log_path=str(stack["tmp"] / "bad.log"))
    try:
        with pytest.raises(TractError) as exc:
            server.wait_ready(timeout=240)
    finally:
        server.stop()
    line = str(exc.value)
    assert "TraCT connector:" in line and "holds KV blocks of tiny" in line, line
    assert "tract init" in line
