"""Workload generators (static, synthetic, trace replay) and the offline
prefix-cache simulation."""
from __future__ import annotations

import json

import numpy as np
import pytest

from tract_cli.bench.workload import prefix_sim, workloads
from tract_cli.core.errors import UsageError
from tract_cli.core.hashing import block_hashes

TRACE = "tests/data/mooncake_trace_slice.jsonl"


def test_synthetic_is_seeded_with_shared_prefixes_and_poisson_arrivals():
    a = workloads.synthetic(200, isl_mean=800, osl_mean=50, prefix_ratio=0.5, num_prefix_prompts=4,
                            qps=10.0, seed=3)
    b = workloads.synthetic(200, isl_mean=800, osl_mean=50, prefix_ratio=0.5, num_prefix_prompts=4,
                            qps=10.0, seed=3)
    assert all((x.tokens == y.tokens).all() and x.arrival_s == y.arrival_s for x, y in zip(a, b))
    heads = {x.tokens[:400].tobytes() for x in a}
    assert len(heads) == 4                                  # four shared prefixes
    arrivals = np.array([x.arrival_s for x in a])
    assert (np.diff(arrivals) > 0).all()
    assert 14 < arrivals[-1] < 26                           # 200 requests at 10 QPS: ~20 s
    isl = np.array([len(x.tokens) for x in a])
    assert 700 < isl.mean() < 900 and (isl > 400).all()
    c = workloads.synthetic(200, isl_mean=800, osl_mean=50, seed=4)
    assert not all((x.tokens[:10] == y.tokens[:10]).all() for x, y in zip(a, c))


def test_presets_load_and_unknown_ones_are_named():
    p = workloads.load_preset("synthetic-b")
    assert p["isl_mean"] == 4449 and p["osl_mean"] == 215
    with pytest.raises(UsageError, match="synthetic-a"):
        workloads.load_preset("nope")


def test_trace_tokens_reproduce_the_prefix_structure():
    reqs = workloads.trace(TRACE)
    raw = [json.loads(line) for line in open(TRACE)]
    assert len(reqs) == len(raw) == 150
    assert reqs[0].arrival_s == 0.0
    assert reqs[-1].arrival_s == pytest.approx((raw[-1]["timestamp"] - raw[0]["timestamp"]) / 1000)
    # two requests sharing their first k hash ids share exactly their first k*512 tokens
    pairs = 0
    for i in range(len(raw)):
        for j in range(i + 1, len(raw)):
            a, b = raw[i]["hash_ids"], raw[j]["hash_ids"]
            k = 0
            while k < min(len(a), len(b)) and a[k] == b[k]:
                k += 1
            if k == 0:
                continue
            pairs += 1
            n = min(k * 512, len(reqs[i].tokens), len(reqs[j].tokens))
            assert (reqs[i].tokens[:n] == reqs[j].tokens[:n]).all()
            if k < min(len(a), len(b)):
                assert (reqs[i].tokens[k * 512:k * 512 + 16] != reqs[j].tokens[k * 512:k * 512 + 16]).any()
    assert pairs >= 8                                       # the slice shares some prefixes
    fast = workloads.trace(TRACE, limit=10, speedup=4.0)
    assert len(fast) == 10 and fast[9].arrival_s == pytest.approx(reqs[9].arrival_s / 4)
    short = workloads.trace(TRACE, max_input_len=2000)
    assert short and all(len(r.tokens) <= 2000 for r in short)


@pytest.mark.parametrize("line,needle", [
    ("not json", "not a Mooncake trace record"),
    ('{"timestamp": 0, "input_length": 10}', "not a Mooncake trace record"),
    ('{"timestamp": -1, "input_length": 10, "output_length": 1, "hash_ids": [1]}', "non-negative"),
    ('{"timestamp": 0, "input_length": "10", "output_length": 1, "hash_ids": [1]}', "non-negative"),
    ('{"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1]}', "do not cover"),
    ('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-3]}', "hash_ids"),
])
def test_bad_trace_lines_are_refused_with_their_line_number(tmp_path, line, needle):
    f = tmp_path / "t.jsonl"
    f.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n'
                 + line + "\n")
    with pytest.raises(UsageError, match=needle) as exc:
        workloads.trace(str(f))
    assert "t.jsonl:2" in str(exc.value)


def test_prefix_sim_counts_hits_and_evicts_tails_first():
    def keys(*ids):
        return np.array([[i] * 16 for i in ids], dtype=np.uint8)
    r = prefix_sim.simulate([keys(1, 2, 3), keys(1, 2, 4), keys(1, 5)], capacity_blocks=100)
    assert r.per_request == [0, 2, 1] and r.hit_blocks == 3 and r.evictions == 0
    # capacity 3: after [1,2,3] then [7,8], 3 and 2 (the tail) go first; the head 1 stays
    r = prefix_sim.simulate([keys(1, 2, 3), keys(7, 8), keys(1, 2, 3)], capacity_blocks=3)
    assert r.per_request == [0, 0, 1]
    r = prefix_sim.simulate([keys(1, 2, 3), keys(7), keys(1, 2, 3)], capacity_blocks=3)
    assert r.per_request == [0, 0, 2]                       # 3 was evicted, 1 and 2 kept


def test_trace_keys_match_what_the_pool_hashes():
    reqs = workloads.trace(TRACE, limit=5)
    k = block_hashes(reqs[0].tokens)
    assert len(k) == len(reqs[0].tokens) // 16
