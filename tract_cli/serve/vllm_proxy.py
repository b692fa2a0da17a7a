"""The OpenAI front door of a vLLM prefill/decode pair (`tract serve-decode --engine vllm`).

Over a real HTTP stack (FastAPI on uvicorn, httpx as the client: what vLLM
serves with), in one of two flows:

- vLLM's two-step flow (the default; vLLM's P/D proxy, Dynamo and llm-d
  send requests so): the request goes to a prefill instance with
  `max_tokens: 1`, no stream, and `kv_transfer_params: {"do_remote_decode":
  true}`; once it answers, the original request goes to the decode instance
  with the `kv_transfer_params` that answer carries (the TraCT ticket).
- Paired (`--paired`): both at once, named by a pair of this door's own
  (`tract_pair`, core/transfer_params.py): the prefill's handoff record
  in the pool is named by it, and the decode instance's connector answers
  vLLM "not yet" until it finds that record (a lock-free look each engine
  step), then loads it.  The decode request's way through its front end and
  scheduler then runs while the prefill computes, and the decode starts when
  the handoff is published, not when the prefill's reply has come back
  through its front end and this door.  If the prefill fails or answers
  without a handoff (no ticket in its reply), the decode request is dropped
  (its connection closed: vLLM aborts it; a request still waiting for its
  handoff holds no KV pages) and sent again without transfer parameters;
  if its ticket names the record otherwise than by the pair (its connector
  did not take the pair), it is dropped and sent again with the ticket.

A request the pool holds no KV of (a LoRA adapter's, multimodal input,
prompt embeddings: the connector's own rule, connectors/vllm_scheduler.py)
goes to the decode instance alone, in either flow: computed once there, not
by a prefill instance and then again by the decode instance.  The door knows
an adapter by the decode instance's `/v1/models` (an entry with a `parent`),
asked again for a model name it has not seen (vLLM loads adapters at run
time); one it cannot ask takes the usual flow, whose answer is the same.

Either way a prefill failure is not the user's error: the decode instance
then computes the prompt itself, and its answer is the same; a request the
prefill instance refuses (4xx) is answered with that refusal.  Answers (or
SSE streams) are relayed unchanged.  `/health` is ready only when both the
decode instance and a prefill instance answer theirs, and says which one it
waits for otherwise.  Prefill instances are used round-robin.  It is served
as the workers are (serve/app.py: `listen`, `serve`, their signal handling
and logging); its HTTP client is closed at the server's shutdown.
"""
# no `from __future__ import annotations`: FastAPI reads the handlers' annotations
# (Request) as objects
import asyncio
import itertools
import logging
import time
import uuid

from tract_cli.core import transfer_params
from tract_cli.core.handoff import pair_key

log = logging.getLogger("tract.proxy")

TIMEOUT_S = 600
MODELS_RECHECK_S = 30.0     # a model name the decode instance did not list: asked again after
MAX_UNLISTED = 1024         # such names remembered at most
# a chat content part of these types is text to vLLM (renderers/chat_utils.py's
# TEXT_PART_TYPES and tool references); any other carries media
TEXT_PARTS = frozenset({"text", "input_text", "output_text", "refusal", "thinking",
                        "tool_reference"})


def has_media(body: dict) -> bool:
    """Whether a request BODY gives vLLM anything but text: prompt embeddings,
    or a chat message content part that is not text (an image, audio, video,
    their embeddings, a file); such a request's KV is not the pool's."""
    if body.get("prompt_embeds") is not None:
        return True
    messages = body.get("messages")
    for msg in messages if isinstance(messages, list) else ():
        content = msg.get("content") if isinstance(msg, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type", "text") not in TEXT_PARTS:
                return True
            # an untyped part is read by its key (vLLM's own rule): any but text's
            if isinstance(part, dict) and "type" not in part and set(part) - {"text", "uuid"}:
                return True
    return False


def make_app(prefill_urls: list[str], decode_url: str, paired: bool = False):
    """The FastAPI app of the front door: vLLM's two-step flow, or with PAIRED
    both requests at once."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI(title="TraCT vLLM front door")
    # no cap on connections: a paired decode holds its connection while it waits
    # for its prefill, and a capped pool could be filled by waiting decodes with
    # their prefills queued behind them (httpx's default is 100)
    client = httpx.AsyncClient(timeout=httpx.Timeout(TIMEOUT_S, connect=5),
                               limits=httpx.Limits(max_connections=None,
                                                   max_keepalive_connections=100))
    turn = itertools.cycle(prefill_urls)
    adapters: set[str] = set()      # the decode instance's LoRA adapters' names
    bases: set[str] = set()         # and its other models'
    unlisted: dict[str, float] = {}  # a name in neither, and when the list last said so
    reading: list = [None]          # the one read of the list in flight (shared)

    async def read_models() -> None:
        listed = (await client.get(decode_url + "/v1/models", timeout=10)).json()["data"]
        for m in listed:
            (adapters if m.get("parent") else bases).add(m["id"])

    async def is_adapter(name) -> bool:
        """Whether NAME is a LoRA adapter of the decode instance; a name not seen
        before asks its /v1/models again (an adapter may be loaded at run time;
        requests meanwhile wait for the same read), at most every
        MODELS_RECHECK_S for a name the list did not have; one it cannot ask
        is taken for a model's."""
        if not isinstance(name, str) or name in bases:
            return False
        if name in adapters:
            return True
        if time.monotonic() - unlisted.get(name, -MODELS_RECHECK_S) < MODELS_RECHECK_S:
            return False
        if reading[0] is None or reading[0].done():
            reading[0] = asyncio.ensure_future(read_models())
        try:
            await asyncio.shield(reading[0])
        except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError) as exc:
            log.warning("the decode instance's /v1/models could not be read (%s): "
                        "model %r is taken for a base model's", exc, name)
            return False
        if name in adapters:
            return True
        if name not in bases:
            if len(unlisted) >= MAX_UNLISTED:       # names from clients: bounded
                unlisted.clear()
            unlisted[name] = time.monotonic()
        return False

    async def healthy(url: str) -> bool:
        try:
            return (await client.get(url + "/health", timeout=2)).status_code == 200
        except httpx.HTTPError:
            return False

    @app.get("/health")
    async def health():
        waiting = [] if await healthy(decode_url) else [f"decode {decode_url}"]
        up = [u for u in prefill_urls if await healthy(u)]
        if not up:
            waiting.append("a prefill worker (" + ", ".join(prefill_urls) + ")")
        if waiting:
            return JSONResponse({"status": "waiting", "waiting_for": waiting}, status_code=503)
        return {"status": "ok", "decode": decode_url, "prefill": up}

    async def prefill(path: str, body: dict, pair: str | None):
        """The prefill request of BODY (paired by PAIR, if any): the transfer
        parameters its reply carries; None if it failed or made no handoff (the
        decode computes the prompt); {"_error": response} if the prefill
        instance refused the request (4xx)."""
        ask = {"do_remote_decode": True} | ({transfer_params.PAIR: pair} if pair else {})
        first = body | {"max_tokens": 1, "stream": False, "kv_transfer_params": ask}
        for key in ("stream_options", "max_completion_tokens", "min_tokens"):
            first.pop(key, None)
        url = next(turn)
        try:
            resp = await client.post(url + path, json=first)
        except httpx.HTTPError as exc:
            log.warning("prefill %s unreachable (%s): decode computes the prompt", url, exc)
            return None
        if resp.status_code != 200:
            if 400 <= resp.status_code < 500:
                return {"_error": resp}         # the request itself is bad: say so
            log.warning("prefill %s answered %d: decode computes the prompt", url,
                        resp.status_code)
            return None
        try:
            params = resp.json().get("kv_transfer_params")
        except (ValueError, AttributeError):
            params = None
        if not isinstance(params, dict) or transfer_params.TICKET not in params:
            log.warning("prefill %s answered without a handoff: decode computes the prompt", url)
            return None
        return params

    async def decode(path: str, body: dict, stream: bool):
        """BODY sent to the decode instance: its response (a stream's, open,
        once its headers are in)."""
        if stream:
            return await client.send(client.build_request("POST", decode_url + path, json=body),
                                     stream=True)
        return await client.post(decode_url + path, json=body)

    async def drop(task: asyncio.Task) -> None:
        """Stops a decode request that will not be used: its connection is
        closed (cancelled mid-request, or its open stream closed), so vLLM
        aborts it; shielded, so a handler cancelled meanwhile (its client
        gone) still closes it."""
        await asyncio.shield(close_decode(task))

    async def close_decode(task: asyncio.Task) -> None:
        task.cancel()
        await asyncio.wait({task})              # never raises
        if task.cancelled() or task.exception() is not None:
            return
        await task.result().aclose()

    def named_by(params: dict, pair: str) -> bool:
        """Whether the ticket in a prefill's reply names its record by PAIR."""
        ticket = params.get(transfer_params.TICKET)
        return isinstance(ticket, dict) and ticket.get("request_id") == pair_key(pair).hex()

    def relay(resp, stream: bool):
        if stream:
            async def chunks():
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                finally:
                    await resp.aclose()
            return StreamingResponse(chunks(), status_code=resp.status_code,
                                     media_type=resp.headers.get("content-type"))
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type"))

    async def two_step(path: str, request: Request):
        try:
            body = await request.json()
        except ValueError:
            body = None
        if not isinstance(body, dict):
            return JSONResponse({"error": {"message": "the request body must be a JSON object",
                                           "type": "BadRequestError", "code": 400}},
                                status_code=400)
        # transfer parameters are the front door's to set, never the client's: a client's
        # own ticket, pair or do_remote_decode would reach an instance unchecked
        body.pop("kv_transfer_params", None)
        if body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
            return JSONResponse({"error": {"message": "n and best_of other than 1 are not served "
                                           "by prefill/decode disaggregation",
                                           "type": "BadRequestError", "code": 400}},
                                status_code=400)
        stream = bool(body.get("stream"))
        if has_media(body) or await is_adapter(body.get("model")):
            # no KV of it in the pool (a handoff would be refused): computed once,
            # by the decode instance, not by a prefill and then again by it
            return relay(await decode(path, body, stream), stream)
        if not paired:
            params = await prefill(path, body, None)
            if params is not None and "_error" in params:
                return relay(params["_error"], False)      # the refusal, as it came
            second = body | ({"kv_transfer_params": params} if params else {})
            return relay(await decode(path, second, stream), stream)
        pair = uuid.uuid4().hex
        waiting = asyncio.create_task(decode(path, body | {"kv_transfer_params": {
            "do_remote_prefill": True, transfer_params.PAIR: pair}}, stream))
        try:
            params = await prefill(path, body, pair)
        except BaseException:
            await drop(waiting)
            raise
        if params is not None and "_error" not in params:
            if named_by(params, pair):
                return relay(await waiting, stream)
            # a prefill that named its record otherwise (its connector did not take
            # the pair): the waiting decode would not find it; the ticket works
            await drop(waiting)
            return relay(await decode(path, body | {"kv_transfer_params": params}, stream),
                         stream)
        await drop(waiting)
        if params is not None:
            return relay(params["_error"], False)          # the refusal, as it came
        return relay(await decode(path, body, stream), stream)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await two_step("/v1/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await two_step("/v1/chat/completions", request)

    @app.get("/v1/models")
    async def models():
        resp = await client.get(decode_url + "/v1/models")
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type"))

    @app.get("/metrics")
    async def metrics():
        """The decode instance's own metrics (vLLM's, with the pool's hits)."""
        resp = await client.get(decode_url + "/metrics")
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type"))

    @app.on_event("shutdown")
    async def close():
        await client.aclose()

    return app


def serve(prefill_urls: list[str], decode_url: str, host: str, port: int, announce=None,
          paired: bool = False) -> None:
    """Runs the front door on HOST:PORT (0: a free port) until SIGINT/SIGTERM, on
    the workers' server (serve/app.py: the first signal drains in-flight
    requests, a second stops without waiting).  ANNOUNCE(url) is called once
    it listens."""
    from tract_cli.core.errors import TractError
    from tract_cli.serve import app as http
    try:
        sock = http.listen(host, port)
    except OSError as exc:
        raise TractError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                         "pick another --port or stop what uses it") from None
    http.serve(make_app(prefill_urls, decode_url, paired), sock, cleanup=lambda: None,
               announce=announce and (lambda: announce(http.url_of(sock))), lifespan=True)
