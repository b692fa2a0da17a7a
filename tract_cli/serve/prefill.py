"""`tract serve-prefill`: prompt in, KV into the pool, handoff metadata out.

For each request: hash the prompt's full blocks, pin the longest cached
prefix, load it (copy mode) or attend over it in place (zero copy), compute
the rest one block at a time, publish the new full blocks, create the
handoff record (with the partial tail block), sample the first token and
answer with the ticket.  KV bytes never leave through HTTP.

At least the prompt's last token is always computed (its logits give the
first token), so a full hit reuses all blocks but the last one.
"""
from __future__ import annotations

import logging
import time
import uuid

import numpy as np

from tract_cli.core.errors import HandoffError, PoolFull, RequestTooLarge
from tract_cli.core.errors import TractError
from tract_cli.core.handoff import PENDING_WAIT_S
from tract_cli.core.index import PUT_CLAIMED, PUT_WAS_READY, PutResult
from tract_cli.serve.engine import Sampling
from tract_cli.serve.api import ApiError, field
from tract_cli.serve.kvcache import POOL, PRIVATE, as_bytes
from tract_cli.serve.worker import PoolWorker, cache_salt

MODES = ("copy", "zero-copy")

log = logging.getLogger("tract.serve.prefill")


class PrefillWorker(PoolWorker):
    role = "prefill"

    def __init__(self, *args, handoff_ttl_s: float = 30.0, **kw):
        super().__init__(*args, **kw)
        self.ttl = handoff_ttl_s
        m = self.metrics
        for name, text in (("prefill_requests_total", "Prefill requests served"),
                           ("prefill_failures_total", "Prefill requests that failed"),
                           ("prompt_tokens_total", "Prompt tokens received"),
                           ("prefix_hit_tokens_total", "Prompt tokens whose KV came from the pool"),
                           ("computed_tokens_total", "Prompt tokens computed"),
                           ("handoffs_published_total", "Handoff records published")):
            m.counter(name, text)
        for name, text in (("prefill_seconds", "Prefill time per request (hash to handoff)"),
                           ("kv_load_seconds", "Loading cached prefix KV from the pool"),
                           ("kv_write_seconds", "Writing new KV blocks to the pool"),
                           ("handoff_publish_seconds", "Publishing the handoff record")):
            m.histogram(name, text)

    def routes(self) -> dict:
        return {("POST", "/prefill"): self.handle, ("GET", "/health"): self.health,
                ("GET", "/metrics"): self.metrics_text}

    def handle(self, body: dict) -> dict:
        tokens = field(body, "tokens", list, required=True)
        mode = field(body, "mode", str, "copy")
        if mode not in MODES:
            raise ApiError(400, f"mode must be one of {', '.join(MODES)}", param="mode")
        rid = field(body, "request_id", str) or uuid.uuid4().hex
        salt = cache_salt(body)
        sampling = Sampling(max_tokens=field(body, "max_tokens", int, 1),
                            temperature=float(field(body, "temperature", (int, float), 0.0)),
                            seed=field(body, "seed", int, 0))
        try:
            self.engine.check_prompt(tokens, sampling.max_tokens, self.max_context)
        except TractError as exc:
            raise ApiError(400, exc.problem, param="tokens") from None
        try:
            out = self.prefill(rid, tokens, mode, sampling, salt)
        except ApiError:
            self.metrics.inc("prefill_failures_total")
            raise
        except RequestTooLarge as exc:
            # never satisfiable on this pool: not a retryable 503
            self.metrics.inc("prefill_failures_total")
            raise ApiError(413, f"the prompt does not fit the KV pool: {exc}",
                           "request_too_large", param="tokens") from None
        except PoolFull as exc:
            self.metrics.inc("prefill_failures_total")
            raise ApiError(503, f"the KV pool is full: {exc}", "pool_full") from None
        except HandoffError as exc:
            self.metrics.inc("prefill_failures_total")
            raise ApiError(503, str(exc), "handoff_error") from None
        except TractError as exc:
            self.metrics.inc("prefill_failures_total")
            raise ApiError(500, str(exc), "pool_error") from None
        return out

    def prefill(self, rid: str, tokens: list[int], mode: str, sampling: Sampling,
                salt: str | None = None) -> dict:
        eng, pool, m = self.engine, self.pool, self.metrics
        bt = eng.block_tokens
        t0 = time.perf_counter()
        t = {}
        arr = np.asarray(tokens, dtype=np.int32)
        keys, hashes = self.keys_and_hashes(arr, salt)
        full = len(keys)
        reusable = (len(tokens) - 1) // bt            # the last token is always computed
        t["hash"] = time.perf_counter() - t0
        table = eng.new_table(len(tokens), self.slots if mode == "zero-copy" else None)
        private = table.stores[PRIVATE]
        hit = None
        status = slots = put_pins = ready_pins = None
        h = 0
        try:
            c = time.perf_counter()
            hit = pool.index.lookup(keys[:reusable])
            h = hit.hits
            if mode == "copy":
                pool.index.read(hit, private[:h])
                pool.index.unpin(hit)
                hit = None
            else:
                pool.acquire_payload(hit.slots, hit.tags)
                status, slots = pool.index.reserve(keys[h:], pin=True)
                ready_pins = keys[h:][status == PUT_WAS_READY]
            t["lookup_load"] = time.perf_counter() - c
            m.observe("kv_load_seconds", t["lookup_load"])
            # the block table: hits, the new full blocks, the tail
            if mode == "copy":
                table.extend(PRIVATE, range(-(-len(tokens) // bt)))
            else:
                table.extend(POOL, hit.slots)
                # claimed blocks are computed into their pool slots; the few another
                # writer holds go to private scratch blocks
                claimed = status == PUT_CLAIMED
                table.extend(np.where(claimed, POOL, PRIVATE),
                             np.where(claimed, slots, np.arange(h, full)))
                if len(tokens) % bt:
                    table.append(PRIVATE, full)
            c = time.perf_counter()
            logits = eng.prefill(tokens, table, h)
            t["compute"] = time.perf_counter() - c
            c = time.perf_counter()
            # new blocks are published pinned: nothing evicts them before the handoff
            if mode == "copy":
                res = pool.index.put(keys[h:], as_bytes(private[h:full]).reshape(full - h, -1),
                                     pin=True, described=self.describe(arr, hashes, h, full, salt)
                                     ) if full > h else PutResult(np.zeros(0, np.uint8))
            else:
                res = pool.index.commit(keys[h:], status, slots, pin=True,
                                        described=self.describe(arr, hashes, h, full, salt))
                status = None
            put_pins = res.pinned(keys[h:])
            ready_pins = None
            if res.count("no_room"):
                raise PoolFull("no room for the new blocks", "free or enlarge the pool")
            t["kv_write"] = time.perf_counter() - c
            m.observe("kv_write_seconds", t["kv_write"])
            tail_tokens = len(tokens) - full * bt
            tail = as_bytes(private[table.ids[full]]) if tail_tokens else None
            c = time.perf_counter()
            ticket = self._publish(rid, keys, len(tokens), tail, tail_tokens,
                                   PENDING_WAIT_S if res.count("already_pending") else 0.0)
            t["handoff_publish"] = time.perf_counter() - c
            m.observe("handoff_publish_seconds", t["handoff_publish"])
        finally:
            if status is not None:           # reserved but never committed: abandon
                pool.index.commit(keys[h:], status, slots, publish=False)
            if ready_pins is not None and len(ready_pins):
                pool.index.unpin(ready_pins)
            if hit is not None:
                pool.index.unpin(hit)
            if put_pins is not None and len(put_pins):
                pool.index.unpin(put_pins)
            table.release()
        first = eng.sample(logits, sampling, 0)
        t["total"] = time.perf_counter() - t0
        for name, value in (("prefill_requests_total", 1), ("prompt_tokens_total", len(tokens)),
                            ("prefix_hit_tokens_total", h * bt),
                            ("computed_tokens_total", len(tokens) - h * bt),
                            ("handoffs_published_total", 1)):
            m.inc(name, value)
        m.observe("prefill_seconds", t["total"])
        log.info("prefill rid=%s: %d tok, %d hit blocks, %s, %.1f ms", rid[:12], len(tokens), h,
                 mode, 1e3 * t["total"])
        return {"request_id": rid, "ticket": ticket.to_dict(), "first_token": first,
                "model": eng.identity.hex(),
                "prompt_tokens": len(tokens), "hit_blocks": h, "computed_tokens": len(tokens) - h * bt,
                "mode": mode, "timings": t}

    def _publish(self, rid, keys, token_count, tail, tail_tokens, wait_s: float):
        """Publishes the handoff.  Blocks another request still holds PENDING
        (another worker's, or another thread's of this one) are waited for,
        bounded by WAIT_S, polling between attempts."""
        return self.pool.handoffs.publish(rid, keys, token_count, tail=tail,
                                          tail_tokens=tail_tokens, ttl=self.ttl, wait_s=wait_s)
