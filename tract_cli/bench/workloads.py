"""Workload generators for `tract bench` (seeded: the same seed, the same requests)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tract_cli.core.errors import UsageError


@dataclass(frozen=True)
class Request:
    rid: str
    arrival_s: float
    tokens: np.ndarray        # int32
    output_len: int


def static(input_len: int, requests: int, output_len: int = 3, prefix_ratio: float = 0.0,
           seed: int = 0, vocab: int = 128000) -> list[Request]:
    """The paper's static workload: R prompts of INPUT_LEN tokens, back to back.

    With PREFIX_RATIO > 0, the first PREFIX_RATIO of every prompt is shared.
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
    return out
