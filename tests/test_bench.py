"""`tract bench` end to end on a small model: every transport runs, every
request's KV is verified on the decode side, the JSON holds every record."""
from __future__ import annotations

import json
import subprocess
import sys

from tract_cli.bench.workloads import static


def test_static_workload_is_seeded_and_shares_its_prefix():
    a = static(100, 3, prefix_ratio=0.5, seed=4)
    b = static(100, 3, prefix_ratio=0.5, seed=4)
    assert all((x.tokens == y.tokens).all() for x, y in zip(a, b))
    assert (a[0].tokens[:50] == a[1].tokens[:50]).all() and (a[0].tokens[50:] != a[1].tokens[50:]).any()


def test_bench_runs_every_transport_and_verifies_the_kv(tmp_path):
    out = tmp_path / "bench.json"
    res = subprocess.run([sys.executable, "-m", "tract_cli.cli", "bench", "--model", "tiny",
                          "--input-len", "200", "--requests", "3", "--prefix-ratio", "0.5",
                          "--json", str(out)], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    by = {s["transport"]: s for s in data["summaries"]}
    assert set(by) == {"tract-copy", "tract-zero-copy", "tcp"}
    assert all(s["verified"] and s["requests"] == 3 for s in by.values())
    # the shared half of the prompt is found in the pool by the 2nd and 3rd requests
    assert by["tract-copy"]["hit_rate_blocks"] > 0.2 and by["tcp"]["hit_rate_blocks"] == 0
    assert data["compute"] == "modelled" and len(data["records"]["tcp"]) == 3
    assert "emulated /dev/shm region" in res.stdout


def test_bench_rejects_an_unknown_transport():
    res = subprocess.run([sys.executable, "-m", "tract_cli.cli", "bench", "--transport", "rdma"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "unknown transport" in res.stderr
