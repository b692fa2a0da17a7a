"""The OpenAI front door of a vLLM prefill/decode pair (`tract serve-decode --engine vllm`).

The two-step flow of vLLM's P/D proxy (and Dynamo's, llm-d's), over a real
HTTP stack (FastAPI on uvicorn, httpx as the client: what vLLM serves with):

1. the request goes to a prefill instance with `max_tokens: 1`, no stream,
   and `kv_transfer_params: {"do_remote_decode": true}`; its answer carries
   `kv_transfer_params` naming the TraCT handoff;
2. the original request goes to the decode instance with those parameters,
   and its answer (or SSE stream) is relayed unchanged.

A prefill failure is not the user's error: the decode instance then computes
the prompt itself (its answer is the same).  `/health` is ready only when
both the decode instance and a prefill instance answer theirs, and says
which one it waits for otherwise.  Prefill instances are used round-robin.
It is served as the workers are (serve/app.py: `listen`, `serve`, their
signal handling and logging); its HTTP client is closed at the server's
shutdown.
"""
# no `from __future__ import annotations`: FastAPI reads the handlers' annotations
# (Request) as objects
import itertools
import logging

log = logging.getLogger("tract.proxy")

TIMEOUT_S = 600


def make_app(prefill_urls: list[str], decode_url: str):
    """The FastAPI app of the front door."""
    import httpx
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, Response, StreamingResponse

    app = FastAPI(title="TraCT vLLM front door")
    client = httpx.AsyncClient(timeout=httpx.Timeout(TIMEOUT_S, connect=5))
    turn = itertools.cycle(prefill_urls)

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

    async def prefill(path: str, body: dict):
        first = body | {"max_tokens": 1, "stream": False,
                        "kv_transfer_params": {"do_remote_decode": True}}
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
        return resp.json().get("kv_transfer_params")

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
        # own ticket or do_remote_decode would reach the decode instance unchecked
        body.pop("kv_transfer_params", None)
        if body.get("n", 1) != 1 or body.get("best_of", 1) != 1:
            return JSONResponse({"error": {"message": "n and best_of other than 1 are not served "
                                           "by prefill/decode disaggregation",
                                           "type": "BadRequestError", "code": 400}},
                                status_code=400)
        params = await prefill(path, body)
        if isinstance(params, dict) and "_error" in params:
            bad = params["_error"]
            return Response(bad.content, status_code=bad.status_code,
                            media_type=bad.headers.get("content-type"))
        second = body | ({"kv_transfer_params": params} if params else {})
        if body.get("stream"):
            req = client.build_request("POST", decode_url + path, json=second)
            resp = await client.send(req, stream=True)

            async def relay():
                try:
                    async for chunk in resp.aiter_raw():
                        yield chunk
                finally:
                    await resp.aclose()
            return StreamingResponse(relay(), status_code=resp.status_code,
                                     media_type=resp.headers.get("content-type"))
        resp = await client.post(decode_url + path, json=second)
        return Response(resp.content, status_code=resp.status_code,
                        media_type=resp.headers.get("content-type"))

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


def serve(prefill_urls: list[str], decode_url: str, host: str, port: int, announce=None) -> None:
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
    http.serve(make_app(prefill_urls, decode_url), sock, cleanup=lambda: None,
               announce=announce and (lambda: announce(http.url_of(sock))), lifespan=True)
