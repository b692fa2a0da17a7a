"""Workload generators for `tract bench` (seeded: the same seed, the same requests)."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from tract_cli.core.errors import UsageError


@dataclass(frozen=True)
class Request:
    rid: str
    arrival_s: float
    tokens: np.ndarray        # int32
    output_len: int


def arrivals(requests: list[Request], t0: float, stop: threading.Event):
    """Yields (seq, request, arrival time on the monotonic clock) in arrival order,
    each when its time comes (T0 + arrival_s): the drivers' workload clock.
    Ends early once STOP is set (a failure elsewhere)."""
    for seq, req in enumerate(sorted(requests, key=lambda r: r.arrival_s)):
        if stop.wait(max(t0 + req.arrival_s - time.monotonic(), 0.0)):
            return
        yield seq, req, t0 + req.arrival_s


def static(input_len: int, requests: int, output_len: int = 3, prefix_ratio: float = 0.0,
           seed: int = 0, vocab: int = 128000, qps: float = 0.0) -> list[Request]:
    """The paper's static workload: R prompts of INPUT_LEN tokens, back to back
    (or Poisson at QPS).  With PREFIX_RATIO > 0, the first PREFIX_RATIO of
    every prompt is shared.
    """
    if input_len < 1 or requests < 1 or output_len < 1:
        raise UsageError("--input-len, --requests and --output-len must be positive",
                         "e.g. --input-len 6000 --requests 8")
    if not 0.0 <= prefix_ratio <= 1.0:
        raise UsageError(f"--prefix-ratio {prefix_ratio} is not in 0..1", "e.g. 0.5")
    rng = np.random.default_rng(seed)
    shared = rng.integers(0, vocab, int(input_len * prefix_ratio)).astype(np.int32)
    out = []
    for i in range(requests):
        own = rng.integers(0, vocab, input_len - len(shared)).astype(np.int32)
        out.append(Request(f"req-{seed}-{i}", 0.0, np.concatenate([shared, own]), output_len))
    if qps:
        if qps < 0:
            raise UsageError("--qps must not be negative", "e.g. --qps 2")
        times = _poisson_arrivals(np.random.default_rng(seed), requests, qps)
        out = [Request(r.rid, float(a), r.tokens, r.output_len) for r, a in zip(out, times)]
    return out


def _poisson_arrivals(rng: np.random.Generator, n: int, qps: float) -> np.ndarray:
    """Arrival times (s) of N requests at QPS (Poisson); all at 0 when QPS is 0 (closed loop)."""
    if qps <= 0:
        return np.zeros(n)
    return np.cumsum(rng.exponential(1.0 / qps, n))


def synthetic(requests: int, isl_mean: int = 4449, osl_mean: int = 215, prefix_ratio: float = 0.5,
              num_prefix_prompts: int = 10, qps: float = 0.0, isl_std: float = 0.2,
              osl_std: float = 0.2, seed: int = 0, vocab: int = 128000) -> list[Request]:
    """Synthetic prefix-sharing workload (after Dynamo's prefix data generator).

    Each request takes one of NUM_PREFIX_PROMPTS shared prefixes (chosen
    uniformly) of PREFIX_RATIO * ISL_MEAN tokens, followed by its own tokens up
    to an input length drawn from a normal distribution around ISL_MEAN
    (relative spread ISL_STD, at least prefix + 1); output lengths likewise
    around OSL_MEAN.  Arrivals are Poisson at QPS (0: all at once).  Seeded.
    """
    if requests < 1 or isl_mean < 1 or osl_mean < 1 or num_prefix_prompts < 1:
        raise UsageError("--requests, --isl-mean, --osl-mean and --num-prefix-prompts must be "
                         "positive", "e.g. --isl-mean 4449 --osl-mean 215")
    if not 0.0 <= prefix_ratio < 1.0:
        raise UsageError(f"--prefix-ratio {prefix_ratio} is not in 0..1 (exclusive of 1)", "e.g. 0.5")
    if qps < 0 or isl_std < 0 or osl_std < 0:
        raise UsageError("--qps and the spreads must not be negative", "e.g. --qps 2")
    rng = np.random.default_rng(seed)
    plen = int(isl_mean * prefix_ratio)
    prefixes = rng.integers(0, vocab, (num_prefix_prompts, plen)).astype(np.int32)
    arrivals = _poisson_arrivals(rng, requests, qps)
    which = rng.integers(0, num_prefix_prompts, requests)
    isl = np.maximum(np.rint(rng.normal(isl_mean, isl_std * isl_mean, requests)), plen + 1).astype(int)
    osl = np.maximum(np.rint(rng.normal(osl_mean, osl_std * osl_mean, requests)), 1).astype(int)
    out = []
    for i in range(requests):
        own = rng.integers(0, vocab, isl[i] - plen).astype(np.int32)
        out.append(Request(f"syn-{seed}-{i}", float(arrivals[i]),
                           np.concatenate([prefixes[which[i]], own]), int(osl[i])))
    return out


TRACE_BLOCK_TOKENS = 512      # the Mooncake trace's hash_ids cover 512-token blocks


def _trace_tokens(hash_ids: np.ndarray, input_len: int, vocab: int, salt: int) -> np.ndarray:
    """Token ids of a trace request: block j's 512 tokens are a fixed function of
    hash_ids[j] (splitmix64 of id and position), so equal ids give equal tokens
    and the trace's prefix structure holds in any block size dividing 512."""
    pos = np.arange(TRACE_BLOCK_TOKENS, dtype=np.uint64)
    with np.errstate(over="ignore"):
        x = (hash_ids.astype(np.uint64)[:, None] << np.uint64(20)) + pos[None, :] \
            + np.uint64(salt) * np.uint64(0x9E3779B97F4A7C15)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(vocab)).astype(np.int32).reshape(-1)[:input_len]


def trace(path: str, limit: int | None = None, speedup: float = 1.0, vocab: int = 128000,
          salt: int = 0, max_input_len: int | None = None) -> list[Request]:
    """Requests of a Mooncake-format trace (JSONL: timestamp ms, input_length,
    output_length, hash_ids of 512-token blocks), arriving at timestamp / SPEEDUP;
    requests longer than MAX_INPUT_LEN are skipped (LIMIT counts those kept)."""
    import json
    if speedup <= 0:
        raise UsageError(f"--speedup {speedup} must be positive", "e.g. --speedup 10")
    if limit is not None and limit < 1:
        raise UsageError("--limit must be at least 1", "e.g. --limit 100")
    try:
        f = open(path)
    except OSError as exc:
        raise UsageError(f"cannot read trace {path}: {exc.strerror}", "check the path") from None
    out = []
    with f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                rec = json.loads(line)
                ts, isl, osl = rec["timestamp"], rec["input_length"], rec["output_length"]
                ids = rec["hash_ids"]
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise UsageError(f"{where} is not a Mooncake trace record ({exc})",
                                 "each line needs timestamp, input_length, output_length, hash_ids") \
                    from None
            ints = (ts, isl, osl)
            if not all(isinstance(v, int) and not isinstance(v, bool) for v in ints) or ts < 0 \
                    or isl < 1 or osl < 1:
                raise UsageError(f"{where}: timestamp, input_length and output_length must be "
                                 "non-negative integers (lengths at least 1)", "fix the trace")
            if not isinstance(ids, list) or not all(isinstance(h, int) and 0 <= h < 2**43
                                                    for h in ids):
                raise UsageError(f"{where}: hash_ids must be a list of non-negative integers",
                                 "fix the trace")
            if len(ids) != -(-isl // TRACE_BLOCK_TOKENS):
                raise UsageError(f"{where}: {len(ids)} hash_ids do not cover {isl} tokens in "
                                 f"{TRACE_BLOCK_TOKENS}-token blocks", "fix the trace")
            if max_input_len is not None and isl > max_input_len:
                continue
            tokens = _trace_tokens(np.asarray(ids, dtype=np.uint64), isl, vocab, salt)
            out.append(Request(f"trace-{lineno}", ts / 1000.0 / speedup, tokens, osl))
    if not out:
        raise UsageError(f"{path} holds no requests", "pass a Mooncake-format JSONL trace")
    t0 = out[0].arrival_s
    return [Request(r.rid, r.arrival_s - t0, r.tokens, r.output_len) for r in out]


def load_preset(name: str) -> dict:
    """A named synthetic workload from tract_cli/profiles/workloads/NAME.toml."""
    from tract_cli.core.geometry import named_profile
    data = named_profile("workloads", name, "workload preset")
    allowed = {"isl_mean", "osl_mean", "prefix_ratio", "num_prefix_prompts", "qps", "isl_std",
               "osl_std", "requests"}
    unknown = set(data) - allowed - {"description"}
    if unknown:
        raise UsageError(f"workload preset {name} has unknown fields {sorted(unknown)}",
                         f"use {', '.join(sorted(allowed))}")
    return data
