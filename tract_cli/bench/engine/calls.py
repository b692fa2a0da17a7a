"""The bench's calls to the vLLM servers it started: a streamed completion's
first token, a P/D request as a proxy makes it, the served model's name, the
Mooncake bootstrap's engine id, and vLLM's own counters (`/metrics`).

Thread-safe: the workload runs (`vllm_workloads.py`) make these calls from
many threads at once.
"""
from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field

from tract_cli.core.transfer_params import PAIR
from tract_cli.core.errors import TractError
from tract_cli.serve.client import get_json, post_json, stream_events


@dataclass
class Answer:
    """A streamed completion: when its first token came (monotonic), its text and,
    where logprobs were asked, its tokens ("token_id:N") and each one's top
    candidates {token: logprob}."""
    first: float
    text: str
    tokens: list = field(default_factory=list)
    top: list = field(default_factory=list)
    chunks: int = 0


def first_token(url: str, body: dict, timeout: float = 600) -> Answer:
    """Streams BODY; returns its Answer."""
    first, text, tokens, top, chunks = None, [], [], [], 0
    for chunk in stream_events(url, body | {"stream": True}, timeout):
        choices = chunk.get("choices") if isinstance(chunk, dict) else None
        if not choices:             # an error event, or something that is not a completion
            why = chunk.get("error", chunk) if isinstance(chunk, dict) else chunk
            raise TractError(f"a streamed completion failed: {str(why)[:200]}",
                             "see the server's log")
        if first is None:
            first = time.monotonic()
        chunks += 1
        text.append(choices[0].get("text") or "")
        lp = choices[0].get("logprobs")
        if isinstance(lp, dict):
            tokens += lp.get("tokens") or []
            top += [t or {} for t in lp.get("top_logprobs") or []]
    if first is None:
        raise TractError("a streamed completion returned no token", "see the server's log")
    return Answer(first, "".join(text), tokens, top, chunks)


_models: dict = {}
_models_lock = threading.Lock()


def model_id(server) -> str:
    """The model name SERVER serves (asked once)."""
    with _models_lock:
        if server.url not in _models:
            _models[server.url] = get_json(server.url + "/v1/models", timeout=30)["data"][0]["id"]
        return _models[server.url]


def _asks(logprobs: int) -> dict:
    """A request's fields for LOGPROBS top candidates a token, as token ids."""
    return {"logprobs": logprobs, "return_tokens_as_token_ids": True} if logprobs else {}


def complete(server, tokens: list, output_len: int, logprobs: int = 0,
             params: dict | None = None) -> Answer:
    """One completion of TOKENS on SERVER (greedy), streamed; PARAMS: its
    kv_transfer_params, if any."""
    return first_token(server.url + "/v1/completions",
                       {"model": model_id(server), "prompt": tokens, "max_tokens": output_len,
                        "temperature": 0} | _asks(logprobs)
                       | ({"kv_transfer_params": params} if params else {}))


# the configurations whose P/D requests are paired: both sent at once, as
# TraCT's front door sends them with --paired (serve/vllm_proxy.py); the
# others' prefill, then their decode, as vLLM's proxies send them
PAIRED = ("tract-paired",)


def pd_request(config: str, prefill, decode, tokens: list, output_len: int,
               mooncake_engine: str | None = None, logprobs: int = 0,
               params: dict | None = None) -> tuple[float, Answer]:
    """A P/D request as a proxy makes it: the prefill request (`max_tokens` 1,
    `do_remote_decode`, and PARAMS besides), then the decode request with the KV
    transfer parameters the prefill answered (Mooncake's: its proxy's pairing,
    MOONCAKE_ENGINE the prefill engine's id), streamed; a PAIRED
    configuration's two requests at once, named alike (`tract_pair`), the
    prefill's on a thread of its own.  Returns (monotonic time the prefill
    answered, the decode's Answer)."""
    model = model_id(prefill)
    base = {"model": model, "prompt": tokens, "max_tokens": output_len, "temperature": 0}
    ask, given = {"do_remote_decode": True} | (params or {}), None
    if config in PAIRED:
        return _paired(prefill, decode, base, ask, logprobs)
    if config == "mooncake":
        # vLLM's Mooncake proxy pairs the two requests: a transfer id of its own in
        # both, and the prefill engine's id from its bootstrap server for the decode
        transfer = f"tract-bench-{uuid.uuid4().hex}"
        ask = ask | {"do_remote_prefill": False, "transfer_id": transfer}
        given = {"do_remote_prefill": True, "do_remote_decode": False,
                 "remote_bootstrap_addr": prefill.bootstrap_url,
                 "remote_engine_id": mooncake_engine, "transfer_id": transfer}
    out = post_json(prefill.url + "/v1/completions",
                    base | {"max_tokens": 1, "kv_transfer_params": ask})
    answered = time.monotonic()
    handed = given or out.get("kv_transfer_params")
    answer = first_token(decode.url + "/v1/completions",
                         base | ({"kv_transfer_params": handed} if handed else {})
                         | _asks(logprobs))
    return answered, answer


def _paired(prefill, decode, base: dict, ask: dict, logprobs: int) -> tuple[float, Answer]:
    """pd_request's two requests at once, as TraCT's front door sends them.
    A prefill that fails raises here once the decode has answered (which,
    finding no handoff within pair_wait_s, computes the prompt)."""
    pair = uuid.uuid4().hex
    # the decode's reference ask (kvlog.REFERENCE_PARAM) travels with it, as a
    # prefill's reply would carry it
    told = {k: v for k, v in ask.items() if k != "do_remote_decode"}
    box: dict = {}

    def send_prefill():
        try:
            post_json(prefill.url + "/v1/completions",
                      base | {"max_tokens": 1, "kv_transfer_params": ask | {PAIR: pair}})
            box["answered"] = time.monotonic()
        except BaseException as exc:        # raised in the caller's thread, below
            box["error"] = exc

    sender = threading.Thread(target=send_prefill, name="tract-bench-prefill", daemon=True)
    sender.start()
    try:
        answer = first_token(decode.url + "/v1/completions",
                             base | {"kv_transfer_params": told | {"do_remote_prefill": True,
                                                                   PAIR: pair}}
                             | _asks(logprobs))
    finally:
        sender.join(600)                    # bounded as the prefill request itself is
    if "error" in box:
        raise box["error"]
    if "answered" not in box:
        raise TractError("the prefill request did not answer within 600 s",
                         "see the prefill server's log")
    return box["answered"], answer


def mooncake_engine(prefill) -> str:
    """The prefill engine's id, from its Mooncake bootstrap server ({dp rank: {engine_id,
    ...}}); its worker registers there once started, so a missing entry is waited
    for (bounded)."""
    deadline = time.monotonic() + 60
    while True:
        got = get_json(prefill.bootstrap_url + "/query", timeout=30)
        engine = (got.get("0") or {}).get("engine_id") if isinstance(got, dict) else None
        if isinstance(engine, str) and engine:
            return engine
        if time.monotonic() > deadline:
            raise TractError(f"Mooncake's bootstrap server names no prefill engine ({got!r:.200})",
                             "see the prefill server's log")
        time.sleep(0.2)         # polling another process's registration, bounded


# vLLM's counter of prompt tokens by where they came from (source: local_compute,
# local_cache_hit, external_kv_transfer)
PROMPT_TOKENS = "vllm:prompt_tokens_by_source_total"
# vLLM's own request times (histogram sums, seconds): from the request's arrival
# at the engine's front end to its end, and to its first token
E2E = "vllm:e2e_request_latency_seconds_sum"
TTFT = "vllm:time_to_first_token_seconds_sum"


def metrics(server) -> dict:
    """SERVER's vLLM counters now: {(sample name, source label or None): value},
    summed over the other labels (vLLM labels each by model and engine)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as resp:
        text = resp.read().decode()
    out: dict = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm:"):
                key = (s.name, s.labels.get("source"))
                out[key] = out.get(key, 0.0) + s.value
    return out


def grew(before: dict, after: dict, name: str, source: str | None = None) -> float | None:
    """How much vLLM's counter or histogram sum NAME (with label SOURCE) grew
    between two `metrics` scrapes; None if vLLM does not report it (e.g. started
    with --disable-log-stats)."""
    if (name, source) not in after:
        return None
    return after[(name, source)] - before.get((name, source), 0.0)


def reset_prefix_cache(server) -> None:
    """Empties SERVER's own prefix cache (vLLM's development endpoint, served with
    VLLM_SERVER_DEV_MODE=1); it refuses while blocks are held, so it is asked
    again a few times (bounded)."""
    for _ in range(20):
        if post_json(server.url + "/reset_prefix_cache", {}, timeout=60).get("success"):
            return
        time.sleep(0.5)         # blocks still held by requests finishing: asked again
    raise TractError("vLLM would not empty its prefix cache before the reference answers",
                     "run without --vllm-prefix-caching")
