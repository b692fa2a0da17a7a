"""`tract bench --compute real`: the workload through the real serving path.

Prefill workers (`tract serve-prefill`, node 1) and decode workers
(`tract serve-decode`, node 2) run the reference engine; the driver sends
each request to a decode worker (round robin) at its arrival time, as an
OpenAI completion of token ids, greedy, `max_tokens` = the request's output
length, `kv_mode` copy or zero-copy per transport.  Each decode worker
spreads its requests over all prefill workers.  The records come from the
workers' own timings (the `tract` object of each answer).  A request is
verified when its tokens equal the single-process engine's for the same
prompt (computed after the transport's run, outside every timed stage).
"""
from __future__ import annotations

import queue
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from tract_cli.bench.workload.driver import TransportResult, drive
from tract_cli.core.errors import TractError
from tract_cli.serve.client import HttpError, post_json
from tract_cli.serve.launch import WorkerProcess

KV_MODES = {"tract-copy": "copy", "tract-zero-copy": "zero-copy"}
REQUEST_TIMEOUT_S = 600


def engine_tokens(tokens: np.ndarray, vocab: int) -> list[int]:
    """Workload token ids folded into the engine's byte vocabulary (0..255):
    equal ids stay equal, so shared prefixes stay shared."""
    return (np.asarray(tokens, dtype=np.int64) % min(vocab, 256)).tolist()


class RealCluster:
    """Prefill and decode serve workers on a region (agents started by the caller)."""

    def __init__(self, path: str, profile: str, prefill_workers: int, decode_workers: int):
        self.workers = []
        self.profile = profile
        self.reference: dict[str, list[int]] = {}     # rid -> the single-process engine's tokens
        self._engine = None
        try:
            self.prefills = [self._start("serve-prefill", "--pool", path, "--node", "1",
                                         "--model-profile", profile)
                             for _ in range(prefill_workers)]
            urls = [a for p in self.prefills for a in ("--prefill", p.url)]
            self.decodes = [self._start("serve-decode", "--pool", path, "--node", "2",
                                        "--model-profile", profile, *urls)
                            for _ in range(decode_workers)]
        except BaseException:
            self.stop()
            raise

    def _start(self, *args):
        w = WorkerProcess(*args)
        self.workers.append(w)
        return w

    def verify(self, res: TransportResult, requests, vocab: int) -> None:
        """Marks each record verified when its tokens equal those of the same
        engine in this process (greedy, the workers' weights seed 0)."""
        from tract_cli.serve.engine import Engine, Sampling
        by = {r.rid: r for r in requests}
        for rec in res.records:
            req = by[rec["rid"]]
            if req.rid not in self.reference:
                if self._engine is None:
                    self._engine = Engine.load(None, self.profile, 0)
                self.reference[req.rid] = self._engine.generate(
                    engine_tokens(req.tokens, vocab), Sampling(req.output_len, 0.0, 0))
            rec["ok"] = rec.pop("token_ids") == self.reference[req.rid]

    def stop(self) -> None:
        for w in reversed(self.workers):
            try:
                w.stop()
            except TractError:
                pass


def _post(url: str, body: dict) -> dict:
    try:
        return post_json(url, body, timeout=REQUEST_TIMEOUT_S)
    except HttpError as exc:
        if exc.status is None:
            raise TractError(f"the serving path is unreachable ({exc.message})",
                             "check the workers") from None
        raise TractError(f"the serving path answered {exc.status}: {exc.message}",
                         "see the worker's log line above") from None


def run_transport(cluster: RealCluster, transport: str, requests, vocab: int, block_tokens: int,
                  progress=None) -> TransportResult:
    mode = KV_MODES[transport]
    done = queue.Queue()                  # each request's record, or what it failed with

    def one(seq, req, arrival):
        try:
            body = {"prompt": engine_tokens(req.tokens, vocab), "max_tokens": req.output_len,
                    "temperature": 0, "kv_mode": mode}
            out = _post(cluster.decodes[seq % len(cluster.decodes)].url + "/v1/completions", body)
            finished = time.monotonic()
            tr, pt = out["tract"], out["tract"]["prefill_timings"]
            t = {"hash": pt.get("hash", 0.0), "lookup": pt.get("lookup_load", 0.0),
                 "compute": pt.get("compute", 0.0), "kv_write": pt.get("kv_write", 0.0),
                 "handoff_publish": pt.get("handoff_publish", 0.0), "kv_read": tr["handoff_s"],
                 "queue": max(tr["prefill_s"] - pt.get("total", 0.0), 0.0)}
            done.put({"rid": req.rid, "t": t, "ok": False, "token_ids": tr["token_ids"],
                      "hits": tr["hit_blocks"], "blocks": len(req.tokens) // block_tokens,
                      "tokens": len(req.tokens), "output_len": len(tr["token_ids"]),
                      "ttft": tr["ttft_s"], "e2e": finished - arrival, "prefill": 0})
        except BaseException as exc:          # reported by the driver, once
            done.put(exc)

    def receive():
        got = done.get()        # bounded: every request answers within REQUEST_TIMEOUT_S
        if isinstance(got, TractError):
            raise got
        if isinstance(got, BaseException):
            raise TractError(f"{transport}: {got}")
        return got

    # each request is an HTTP call on a thread of its own; leaving the pool
    # waits for those in flight, also after a failure
    with ThreadPoolExecutor(max_workers=64) as pool:
        def dispatch(seq, req, arrival):
            pool.submit(one, seq, req, arrival)
        res = drive(transport, requests, dispatch, receive, progress)
    cluster.verify(res, requests, vocab)          # after the clock: not timed
    return res
