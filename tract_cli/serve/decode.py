"""`tract serve-decode`: the front door (OpenAI-compatible `/v1/completions`).

For each request: tokenize, send the prompt to a prefill worker (round
robin over the ones given, skipping unreachable ones), open the handoff it
returns, take the KV out of the pool — copied into private blocks (the copy
path, acknowledged at once) or attended in place over the pinned slots (zero
copy, acknowledged when generation ends) — and generate.  Every exit path
acknowledges the handoff, so no pin outlives a request.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
import uuid

from tract_cli.core.errors import TractError
from tract_cli.core.errors import HandoffError
from tract_cli.core.handoff import Ticket
from tract_cli.serve.engine import Sampling
from tract_cli.serve.api import ApiError, Peers, UpstreamError, field
from tract_cli.serve.kvcache import POOL, PRIVATE, as_bytes
from tract_cli.serve.prefill import MODES
from tract_cli.serve.worker import PoolWorker, cache_salt

PREFILL_TIMEOUT_S = 300.0
HEALTH_PROBE_S = 2.0          # a prefill worker that does not answer /health in this is down
MAX_TOKENS_DEFAULT = 16

log = logging.getLogger("tract.serve.decode")


class DecodeWorker(PoolWorker):
    role = "decode"

    def __init__(self, pool_path: str, node: int, engine, prefill_urls: list[str], *,
                 kv_mode: str = "copy", **kw):
        super().__init__(pool_path, node, engine, **kw)
        if kv_mode not in MODES:
            raise TractError(f"unknown KV mode {kv_mode!r}", f"use one of {', '.join(MODES)}")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.kv_mode = kv_mode
        self.peers = Peers()
        self._rr = itertools.count()
        self._inflight = 0
        self._inflight_lock = threading.Lock()
        m = self.metrics
        for name, text in (("requests_total", "Completion requests answered"),
                           ("request_failures_total", "Completion requests that failed"),
                           ("prompt_tokens_total", "Prompt tokens"),
                           ("prefix_hit_tokens_total", "Prompt tokens served from the pool's prefix cache"),
                           ("generated_tokens_total", "Tokens generated"),
                           ("handoffs_acked_total", "Handoffs acknowledged")):
            m.counter(name, text)
        for name, text in (("ttft_seconds", "Time to first token (request in to first token out)"),
                           ("handoff_seconds", "Taking a handoff: open, KV read, acknowledge"),
                           ("prefill_call_seconds", "Round trip to the prefill worker"),
                           ("request_seconds", "Whole request")):
            m.histogram(name, text)
        m.gauge("prefix_hit_rate", "Share of prompt tokens served from the pool", self._hit_rate)
        m.gauge("requests_in_flight", "Requests being served", lambda: self._inflight)

    def _hit_rate(self) -> float:
        total = self.metrics.value("prompt_tokens_total")
        return self.metrics.value("prefix_hit_tokens_total") / total if total else 0.0

    def routes(self) -> dict:
        return {("POST", "/v1/completions"): self.completions, ("GET", "/health"): self.health,
                ("GET", "/metrics"): self.metrics_text, ("GET", "/v1/models"): self.models}

    def health(self) -> dict:
        """Ready (200) only when at least one prefill worker answers its /health;
        else 503 saying what it waits for: a request now would fail."""
        reachable, down = [], []
        for url in self.prefill_urls:
            try:
                got = self.peers.get_json(url + "/health", HEALTH_PROBE_S)
            except UpstreamError as exc:
                down.append(str(exc))
                continue
            (reachable if got.get("role") == "prefill" else down).append(
                url if got.get("role") == "prefill" else f"{url} is not a prefill worker")
        if not reachable:
            raise ApiError(503, "waiting for a prefill worker: " + "; ".join(down),
                           "service_unavailable")
        out = super().health()
        out["prefill"] = self.prefill_urls
        out["prefill_reachable"] = reachable
        return out

    def close(self) -> None:
        self.peers.close()
        super().close()

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.engine.profile.name, "object": "model",
                                            "owned_by": "tract"}]}

    # ---- request parsing ----

    def _parse(self, body: dict):
        model = field(body, "model", str)
        if model is not None and model != self.engine.profile.name:
            raise ApiError(404, f"model {model!r} is not served here (this worker serves "
                                f"{self.engine.profile.name!r})", "not_found_error", "model")
        prompt = field(body, "prompt", (str, list), required=True)
        if isinstance(prompt, list):
            if not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
                raise ApiError(400, "prompt must be a string or a list of token ids "
                                    "(one prompt per request)", param="prompt")
            tokens = list(prompt)
        else:
            tokens = self.engine.tokenizer.encode(prompt) if prompt else []
        max_tokens = field(body, "max_tokens", int, MAX_TOKENS_DEFAULT)
        if max_tokens < 1:
            raise ApiError(400, "max_tokens must be at least 1", param="max_tokens")
        temperature = float(field(body, "temperature", (int, float), 1.0))
        if not 0.0 <= temperature <= 100.0:
            raise ApiError(400, "temperature must be between 0 and 100", param="temperature")
        seed = field(body, "seed", int, 0)
        stream = field(body, "stream", bool, False)
        n = field(body, "n", int, 1)
        if n != 1:
            raise ApiError(400, "only n=1 is supported", param="n")
        if field(body, "echo", bool, False):
            raise ApiError(400, "echo is not supported", param="echo")
        stop = field(body, "stop", (str, list), None)
        stop = [stop] if isinstance(stop, str) else (stop or [])
        if not all(isinstance(s, str) and s for s in stop):
            raise ApiError(400, "stop must be a non-empty string or a list of them", param="stop")
        mode = field(body, "kv_mode", str, self.kv_mode)
        if mode not in MODES:
            raise ApiError(400, f"kv_mode must be one of {', '.join(MODES)}", param="kv_mode")
        if not tokens:
            raise ApiError(400, "the prompt is empty", param="prompt")
        try:
            self.engine.check_prompt(tokens, max_tokens, self.max_context)
        except TractError as exc:
            raise ApiError(400, exc.problem, param="prompt") from None
        return tokens, Sampling(max_tokens, temperature, seed), stream, stop, mode, cache_salt(body)

    # ---- serving ----

    def completions(self, body: dict):
        tokens, sampling, stream, stop, mode, salt = self._parse(body)
        cid = "cmpl-" + uuid.uuid4().hex
        gen = self._generate(cid, tokens, sampling, mode, salt)
        # prefill and handoff happen before the first yield: their errors get
        # an HTTP status, not an event in a stream that already said 200
        _, meta = next(gen)
        if stream:
            return self._sse(cid, meta, gen, stop)
        return self._collect(cid, tokens, meta, gen, stop)

    def _prefill(self, rid: str, tokens, sampling: Sampling, mode: str,
                 salt: str | None = None) -> dict:
        body = {"request_id": rid, "tokens": tokens, "mode": mode, "max_tokens": sampling.max_tokens,
                "temperature": sampling.temperature, "seed": sampling.seed}
        if salt is not None:
            body["cache_salt"] = salt
        errors = []
        start = next(self._rr)
        for i in range(len(self.prefill_urls)):
            url = self.prefill_urls[(start + i) % len(self.prefill_urls)]
            try:
                return self.peers.post_json(url + "/prefill", body, PREFILL_TIMEOUT_S)
            except UpstreamError as exc:
                if exc.status != 503 or exc.body is not None:   # the worker answered: relay
                    err = (exc.body or {}).get("error")
                    err = err if isinstance(err, dict) else {}
                    raise ApiError(exc.status if 400 <= exc.status < 600 else 502,
                                   f"prefill worker: {err.get('message', str(exc))}",
                                   err.get("type", "upstream_error")) from None
                errors.append(str(exc))
        raise ApiError(503, "no prefill worker is reachable: " + "; ".join(errors),
                       "service_unavailable")

    def _generate(self, cid: str, tokens, sampling: Sampling, mode: str, salt: str | None = None):
        """Yields ("meta", dict) once the KV is in place, then ("token", id)..."""
        eng, pool, m = self.engine, self.pool, self.metrics
        t0 = time.perf_counter()
        with self._inflight_lock:
            self._inflight += 1
        ticket = rec = None
        acked = False
        table = None
        ok = False
        count = 0
        try:
            c = time.perf_counter()
            resp = self._prefill(cid, tokens, sampling, mode, salt)
            prefill_s = time.perf_counter() - c
            m.observe("prefill_call_seconds", prefill_s)
            try:
                ticket = Ticket.from_dict(resp["ticket"])
                first = int(resp["first_token"])
            except (KeyError, TypeError, ValueError, TractError):
                raise ApiError(502, "the prefill worker's answer lacks a valid ticket",
                               "upstream_error") from None
            if resp.get("model") != eng.identity.hex():
                # its KV was computed by other weights: loading it would answer wrongly
                raise ApiError(502, "the prefill worker serves another model (other weights "
                                    "or --weights-seed); serve the same model on both",
                               "upstream_error")
            c = time.perf_counter()
            bt = eng.block_tokens
            table = eng.new_table(0, self.slots if mode == "zero-copy" else None,
                                  private=-(-(len(tokens) + sampling.max_tokens) // bt) + 1)
            private = table.stores[PRIVATE]
            rec = pool.handoffs.open(ticket)
            if rec.token_count != len(tokens):
                raise ApiError(502, f"the handoff holds {rec.token_count} tokens, the prompt "
                                    f"has {len(tokens)}", "upstream_error")
            n = len(rec.slots)
            if mode == "copy":
                pool.handoffs.copy_blocks(rec, private[:n])
                table.extend(PRIVATE, range(n))
                nxt = n
            else:
                pool.acquire_payload(rec.slots, rec.tags)
                table.extend(POOL, rec.slots)
                nxt = 0
            if rec.tail_slot is not None:
                pool.handoffs.copy_tail(rec, as_bytes(private[nxt]))
                table.append(PRIVATE, nxt)
                nxt += 1
            if mode == "copy":
                pool.handoffs.ack(ticket, read=pool.handoffs.read_slots(rec))
                acked = True
            handoff_s = time.perf_counter() - c
            m.observe("handoff_seconds", handoff_s)
            ttft = time.perf_counter() - t0
            m.observe("ttft_seconds", ttft)
            yield "meta", {"ttft_s": ttft, "handoff_s": handoff_s, "prefill_s": prefill_s,
                           "hit_blocks": resp.get("hit_blocks", 0),
                           "computed_tokens": resp.get("computed_tokens"),
                           "prefill_timings": resp.get("timings", {}), "kv_mode": mode}
            try:
                for tok in eng.decode(first, len(tokens), table, sampling, [nxt]):
                    count += 1
                    yield "token", tok
            except GeneratorExit:         # a stop string, or the client went away
                pass
            m.inc("requests_total")
            m.inc("prompt_tokens_total", len(tokens))
            m.inc("prefix_hit_tokens_total", resp.get("hit_blocks", 0) * bt)
            m.inc("generated_tokens_total", count)
            ok = True
        except HandoffError as exc:
            raise ApiError(503, str(exc), "handoff_error") from None
        except TractError as exc:
            raise ApiError(500, str(exc), "pool_error") from None
        finally:
            if table is not None:
                table.release()
            if ticket is not None and not acked:
                try:
                    pool.handoffs.ack(ticket, read=None if rec is None
                                      else pool.handoffs.read_slots(rec))
                except TractError:
                    pass              # expired and reclaimed already: nothing left pinned
            if ticket is not None:
                m.inc("handoffs_acked_total")
            if not ok:
                m.inc("request_failures_total")
            m.observe("request_seconds", time.perf_counter() - t0)
            with self._inflight_lock:
                self._inflight -= 1

    def _texts(self, gen, stop):
        """(token, text delta, finish) per token; cuts at a stop string."""
        tok_ids, text = [], ""
        for _, value in gen:
            tok_ids.append(value)
            full = self.engine.tokenizer.decode(tok_ids)
            if full.endswith("\ufffd"):          # an incomplete UTF-8 sequence: wait for more
                yield value, "", None
                continue
            for s in stop:
                at = full.find(s)
                if at >= 0:
                    yield value, full[len(text):at] if at > len(text) else "", "stop"
                    gen.close()
                    return
            delta, text = full[len(text):], full
            finish = "stop" if value == self.engine.tokenizer.eos_id else None
            yield value, delta, finish

    def _collect(self, cid, tokens, meta, gen, stop) -> dict:
        ids, text, finish = [], "", "length"
        for tok, delta, fin in self._texts(gen, stop):
            ids.append(tok)
            text += delta
            finish = fin or finish
        log.info("%s: %d+%d tok, %d hit blocks, ttft %.1f ms, %s", cid[:17], len(tokens), len(ids),
                 meta["hit_blocks"], 1e3 * meta["ttft_s"], meta["kv_mode"])
        return {"id": cid, "object": "text_completion", "created": int(time.time()),
                "model": self.engine.profile.name,
                "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}],
                "usage": {"prompt_tokens": len(tokens), "completion_tokens": len(ids),
                          "total_tokens": len(tokens) + len(ids)},
                "tract": {**meta, "token_ids": ids}}

    def _sse(self, cid, meta, gen, stop):
        created, model = int(time.time()), self.engine.profile.name
        ids, finish = [], "length"
        try:
            for tok, delta, fin in self._texts(gen, stop):
                ids.append(tok)
                finish = fin or finish
                yield {"id": cid, "object": "text_completion", "created": created, "model": model,
                       "choices": [{"index": 0, "text": delta, "logprobs": None,
                                    "finish_reason": None}]}
        except GeneratorExit:
            log.info("%s: stream cut after %d tok (the client went away)", cid[:17], len(ids))
            raise
        finally:
            gen.close()              # a client that went away: the handoff is acknowledged now
        log.info("%s: stream %d tok, %d hit blocks, ttft %.1f ms, %s", cid[:17], len(ids),
                 meta["hit_blocks"], 1e3 * meta["ttft_s"], meta["kv_mode"])
        yield {"id": cid, "object": "text_completion", "created": created, "model": model,
               "choices": [{"index": 0, "text": "", "logprobs": None, "finish_reason": finish}],
               "tract": {**meta, "token_ids": ids}}
