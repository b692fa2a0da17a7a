"""`tract bench` end to end on a small model: every transport runs, every
request's KV is verified on the decode side, the JSON holds every record."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tract_cli.bench import peers
from tract_cli.bench.workload.workloads import static

TRACE = "tests/data/mooncake_trace_slice.jsonl"


def tract(*args, timeout=900, env=None):
    return subprocess.run([sys.executable, "-m", "tract_cli.cli", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def in_tmp(tmp_path):
    """The environment of a run whose peers' logs (kept and named in the report:
    peers.log_path) go to TMP_PATH, not to the machine's temporary directory."""
    return {**os.environ, "TMPDIR": str(tmp_path)}


def test_static_workload_is_seeded_and_shares_its_prefix():
    a = static(100, 3, prefix_ratio=0.5, seed=4)
    b = static(100, 3, prefix_ratio=0.5, seed=4)
    assert all((x.tokens == y.tokens).all() for x, y in zip(a, b))
    assert (a[0].tokens[:50] == a[1].tokens[:50]).all() and (a[0].tokens[50:] != a[1].tokens[50:]).any()


def test_a_peer_checks_the_stand_in_the_runner_stamps(tmp_path):
    """One stand-in KV (bench/standin.py): what the runner's side stamps passes a
    peer's check, run as peers/ runs the adapters (python -I, adapter_common by
    path, nothing of TraCT), and a byte flipped in a middle block (neither the
    first nor the last) fails it."""
    import numpy as np

    from tract_cli.bench import standin
    bb, n, tb = 4096, 5, 1000
    keys = np.random.default_rng(1).integers(0, 256, (n, 16), dtype=np.uint8)
    buf = standin.stand_in(n * bb + tb)
    standin.stamp(buf, keys, bb, "req-1", tb)
    (tmp_path / "kv").write_bytes(buf.tobytes())
    exp = {"rid": "req-1", "keys": keys.tobytes().hex(), "blocks": n, "block_bytes": bb,
           "tail_bytes": tb, "slot": 0, "decode_s": 0.0, "arrival": 0.0, "tokens": 1,
           "output_len": 1, "compute_s": 0.0}
    adapters = os.path.join(os.path.dirname(standin.__file__), "peers")
    code = (f"import sys; sys.path.append({adapters!r})\n"
            "import json, numpy as np, adapter_common as p\n"
            f"buf = np.fromfile({str(tmp_path / 'kv')!r}, np.uint8)\n"
            "exp = json.loads(sys.argv[1])\n"
            "ok = p.record(buf, buf.size, exp, {})['ok']\n"
            f"buf[{2 * bb + 20}] ^= 1\n"
            "bad = p.record(buf, buf.size, exp, {})['ok']\n"
            "p.out([ok, bad, sorted(m for m in sys.modules if m.startswith('tract_cli'))])\n")
    res = subprocess.run([sys.executable, "-I", "-c", code, json.dumps(exp)],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout) == [True, False, []]


def test_block_crcs_are_the_crc32c_of_the_stand_in_blocks():
    """What zero-copy's check compares each slot's CRC-32C with (computed from
    the block's key and index alone) is the CRC-32C of the stamped stand-in
    block, for block sizes around the pattern's period; CRC-32C's check value."""
    import numpy as np

    from tract_cli.bench import standin

    def crc32c(data: bytes) -> int:                 # bit by bit, the definition
        c = 0xFFFFFFFF
        for x in data:
            c ^= x
            for _ in range(8):
                c = (c >> 1) ^ (0x82F63B78 if c & 1 else 0)
        return c ^ 0xFFFFFFFF
    assert crc32c(b"123456789") == 0xE3069283
    rng = np.random.default_rng(2)
    for bb in (16, 100, standin.PATTERN_BYTES + 5, 2 * standin.PATTERN_BYTES + 17):
        keys = rng.integers(0, 256, (3, 16), dtype=np.uint8)
        buf = standin.stand_in(3 * bb)
        standin.stamp(buf, keys, bb, "r", 0)
        want = [crc32c(buf[i * bb:(i + 1) * bb].tobytes()) for i in range(3)]
        assert standin.BlockCrcs(bb).of(keys).tolist() == want, bb


def run_worker_loops(path: str, transport: str, requests) -> list[dict]:
    """The runner's own prefill and decode worker loops (one each), in threads
    of this process (so that a test can swap a transport's side), the requests
    handed to them as the driver does; their records."""
    import queue
    import threading
    import time
    from multiprocessing import Pipe

    from tract_cli.bench.workload import runner
    compute = runner.Compute(1e9, 0.0)
    longest = max(len(r.tokens) for r in requests)
    inbox, results, ready = queue.Queue(), queue.Queue(), queue.Queue()
    threading.Thread(target=runner._decode, args=(path, 2, 0, transport, inbox, results, ready, 1,
                                                  compute, longest), daemon=True).start()
    _, port = ready.get(timeout=60)
    ctl, child = Pipe()
    prefill = threading.Thread(target=runner._prefill, args=(path, 1, 0, transport, child, [inbox],
                                                             [port], compute, results, longest),
                               daemon=True)
    prefill.start()
    assert ctl.poll(60) and ctl.recv() == "ready"
    for r in requests:
        ctl.send({"rid": r.rid, "tokens": r.tokens.tobytes(), "arrival": time.monotonic(),
                  "output_len": 1, "prefill": 0, "decode": 0})
    records = [results.get(timeout=60) for _ in requests]
    ctl.send(None)
    prefill.join(60)
    inbox.put(None)
    return sorted(records, key=lambda rec: [r.rid for r in requests].index(rec["rid"]))


@pytest.mark.parametrize("transport", ["tract-copy", "tract-zero-copy", "tcp"])
def test_a_corrupt_middle_block_fails_verification(managed_region, monkeypatch, transport):
    """One byte of one middle block (neither the first nor the last) of one
    request flipped on the way -- in its pool slot before the decode side
    reads it (tract-copy) or attends over it (tract-zero-copy), in the
    received bytes (tcp): that request, and only it, is not verified, and the
    transport's summary says so ("verified" NO, `tract bench` exits 1).  The
    check used to look at the first and last block and the tail only."""
    from tract_cli.bench import stats
    from tract_cli.bench.workload import transports
    from tract_cli.bench.workload.driver import TransportResult
    reqs = static(200, 3, seed=7)                   # 12 blocks of 16 tokens and a tail each
    bad = reqs[1].rid
    decode = transports.SIDES[transport][1]

    class Corrupting(decode):
        def _open(self, msg, out, t):               # the pool's copy of the block
            rec, tail = super()._open(msg, out, t)
            if msg["rid"] == bad:
                self.pool.slot_bytes(int(rec.slots[len(rec.slots) // 2]))[100] ^= 1
            return rec, tail

        def read(self, msg, out, t):                # what arrived over the socket
            blocks, tail = super().read(msg, out, t)
            if transport == "tcp" and msg["rid"] == bad:
                blocks[len(blocks) // 2, 100] ^= 1
            return blocks, tail
    monkeypatch.setitem(transports.SIDES, transport, (transports.SIDES[transport][0], Corrupting))
    records = run_worker_loops(managed_region, transport, reqs)
    assert [r["blocks"] for r in records] == [12, 12, 12]
    assert [r["ok"] for r in records] == [True, False, True]
    assert all(r["verify_s"] > 0 for r in records)
    summary = stats.summarize(TransportResult(transport, records), 8192, 16, prefix_cache=False,
                              kv_bytes_moved=lambda rec, bb: 0)
    assert summary["verified"] is False and summary["verify_s"]["mean"] > 0


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
    assert by["tract-copy"]["hit_rate_blocks"] > 0.2 and by["tcp"]["hit_rate_blocks"] is None
    assert data["compute"] == "modelled" and len(data["records"]["tcp"]) == 3
    assert "emulated /dev/shm region" in res.stdout
    assert "flush mode none" in headline(res.stdout) and data["flush_mode"] == "none"


def test_bench_rejects_an_unknown_transport():
    res = subprocess.run([sys.executable, "-m", "tract_cli.cli", "bench", "--transport", "rdma"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "unknown transport" in res.stderr


def test_trace_replay_hit_rate_equals_the_offline_simulation(tmp_path):
    """The trace's prefix structure replayed through one prefill worker (requests
    in arrival order, one at a time) on a region that holds the whole workload:
    the pool's hit rate is exactly the offline simulation's."""
    out = tmp_path / "bench.json"
    res = tract("bench", "--model", "tiny-llama", "--trace", TRACE, "--limit", "40",
                "--speedup", "100", "--decode-workers", "2", "--transport", "tract-copy",
                "--json", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    s = data["summaries"][0]
    assert s["verified"] and s["requests"] == 40
    assert data["sim_hit_rate"] > 0
    assert s["hit_rate_blocks"] == pytest.approx(data["sim_hit_rate"])
    assert "trace" in data["workload"] and "offline LRU simulation" in res.stdout


def test_several_workers_under_eviction_pressure(tmp_path):
    """2 prefill and 2 decode workers on a region far smaller than the trace's
    blocks: requests overlap, blocks are evicted, every KV is still verified,
    and the offline simulation is reported next to the measured hit rate."""
    out = tmp_path / "bench.json"
    # 100 requests of at most 4096 tokens (258 slots each in flight): 2102 distinct
    # blocks on 1920 slots, so the cache must evict, while the most that requests
    # in flight can pin (2 prefill workers + a few unacknowledged handoffs, ~1750
    # slots) still fits: "pool full of pinned blocks" would be a correct answer
    # on a smaller region, not a pass
    res = tract("bench", "--model", "tiny-llama", "--trace", TRACE, "--limit", "100",
                "--max-input-len", "4096", "--speedup", "100", "--prefill-workers", "2",
                "--decode-workers", "2", "--pool-size", "32M", "--transport", "tract-copy",
                "--transport", "tract-zero-copy", "--transport", "tcp", "--json", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    by = {s["transport"]: s for s in data["summaries"]}
    assert all(s["verified"] and s["requests"] == 100 for s in by.values())
    assert data["unique_blocks"] > data["pool_slots"]               # eviction had to happen
    recs = data["records"]["tract-copy"]
    assert len({r["prefill"] for r in recs}) == 2                  # both prefill workers served
    for r in recs:
        assert r["ttft"] > 0 and r["e2e"] >= r["ttft"] and r["t"]["queue"] >= 0


def test_a_pool_too_small_for_one_request_is_a_one_line_error():
    """The right outcome on a region smaller than a single request's blocks:
    the run stops with one line naming both sizes and the fix, exit 1, no
    traceback (it used to be "invalid argument")."""
    res = tract("bench", "--model", "tiny-llama", "--input-len", "4096", "--requests", "1",
                "--pool-size", "4M", "--transport", "tract-copy")
    assert res.returncode == 1, res.stdout + res.stderr
    assert "Traceback" not in res.stderr
    line = res.stderr.strip().splitlines()[-1]
    assert "blocks cannot fit a pool of" in line and "use a larger region" in line, line


def test_synthetic_preset_runs_and_plots(tmp_path):
    png = tmp_path / "bench.png"
    res = tract("bench", "--model", "tiny-llama", "--workload", "synthetic-c", "--requests", "12",
                "--isl-mean", "600", "--osl-mean", "8", "--qps", "40", "--transport",
                "tract-zero-copy", "--plot", str(png))
    assert res.returncode == 0, res.stdout + res.stderr
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "synthetic-c" in res.stdout


def test_requests_larger_than_a_handoff_are_refused_up_front():
    res = tract("bench", "--model", "tiny", "--trace", TRACE)
    assert res.returncode == 2
    assert "holds at most 4096 tokens" in res.stderr and "--max-input-len" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_a_peer_that_is_not_installed_is_skipped_with_the_fix(tmp_path):
    env = {**os.environ, "TRACT_PEERS_DIR": str(tmp_path)}
    res = tract("bench", "--model", "tiny", "--input-len", "64", "--requests", "2",
                "--transport", "tract-copy", "--transport", "nixl", env=env)
    assert res.returncode == 0, res.stderr
    assert "skipped nixl" in res.stdout and "--install-peers" in res.stdout


@pytest.mark.skipif(peers.unavailable("nixl") is not None,
                    reason=f"the NIXL peer is not installed ({peers.unavailable('nixl')})")
def test_nixl_peers_move_and_verify_the_same_kv(tmp_path):
    out = tmp_path / "bench.json"
    res = tract("bench", "--model", "tiny", "--input-len", "1000", "--requests", "3",
                "--transport", "nixl", "--transport", "nixl-tcp", "--transport", "tract-copy",
                "--json", str(out), env=in_tmp(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    by = {s["transport"]: s for s in data["summaries"]}
    assert set(by) == {"nixl", "nixl-tcp", "tract-copy"}
    assert all(s["verified"] and s["requests"] == 3 for s in by.values())
    assert all(r["t"]["kv_read"] > 0 for r in data["records"]["nixl-tcp"])


@pytest.mark.skipif(peers.unavailable("mooncake-tcp") is not None,
                    reason=f"the Mooncake peer is not installed ({peers.unavailable('mooncake-tcp')})")
def test_mooncake_peer_moves_and_verifies_the_same_kv(tmp_path):
    out = tmp_path / "bench.json"
    res = tract("bench", "--model", "tiny", "--input-len", "1000", "--requests", "3",
                "--transport", "mooncake-tcp", "--json", str(out), env=in_tmp(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    s = json.loads(out.read_text())["summaries"][0]
    assert s["transport"] == "mooncake-tcp" and s["verified"] and s["requests"] == 3


@pytest.mark.skipif(peers.unavailable("lmcache-lm") is not None,
                    reason=f"the LMCache peer is not installed ({peers.unavailable('lmcache-lm')})")
def test_lmcache_peers_move_and_verify_the_same_kv(tmp_path):
    """Requests of several 256-token chunks and a tail through LMCache's lm://
    server and through its PD backend (NIXL, CPU buffers); every chunk's first
    block is checked on arrival."""
    out = tmp_path / "bench.json"
    res = tract("bench", "--model", "tiny", "--input-len", "1000", "--requests", "3",
                "--transport", "lmcache-lm", "--transport", "lmcache-pd", "--json", str(out),
                env=in_tmp(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    by = {s["transport"]: s for s in data["summaries"]}
    assert set(by) == {"lmcache-lm", "lmcache-pd"}
    assert all(s["verified"] and s["requests"] == 3 for s in by.values())
    assert all(r["t"]["kv_write"] > 0 and r["t"]["kv_read"] > 0
               for recs in data["records"].values() for r in recs)


def test_real_compute_runs_the_serving_path(tmp_path):
    """--compute real: the same workload through serve-prefill / serve-decode with
    the reference engine; the network transports are skipped with the reason."""
    out = tmp_path / "bench.json"
    res = tract("bench", "--compute", "real", "--input-len", "100", "--output-len", "4",
                "--requests", "3", "--prefix-ratio", "0.5", "--qps", "1", "--seed", "3",
                "--transport", "tract-copy", "--transport", "tract-zero-copy", "--transport", "tcp",
                "--json", str(out))
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    assert data["compute"] == "real"
    by = {s["transport"]: s for s in data["summaries"]}
    assert set(by) == {"tract-copy", "tract-zero-copy"} and "tcp" in data["skipped"]
    assert all(s["requests"] == 3 and s["verified"] for s in by.values())
    # the shared half is found in the pool by the later requests (real prefix reuse;
    # seed 3 at 1 QPS spaces the arrivals 0.39 s and 1.4 s apart, far more than a
    # 100-token prefill takes, so each request finds the previous one's blocks)
    assert by["tract-copy"]["hit_rate_blocks"] > 0
    assert all(r["t"]["compute"] > 0 for r in data["records"]["tract-copy"])
    assert "real" in res.stdout and "reference engine" in " ".join(res.stdout.split())


def test_ttft_is_made_of_its_timed_stages_and_compute_is_the_model():
    """With modelled compute, a request's TTFT holds each of its timed stages
    once, in order (queue, hash, lookup, compute, the KV write and handoff,
    the read, the first decode step: disjoint intervals between its arrival
    and its first token), compute never ends before the model's deadline, and
    stages a transport does not have are absent.  What it cannot see: time
    the harness adds between stages (the control message to the decode
    worker) -- bounding that is a wall-clock assertion, which on a busy 2-core
    machine is noise; the benchmark reports it (docs/BENCHMARKS.md)."""
    from tract_cli.bench.workload import runner, session
    from tract_cli.bench.stats import STAGES
    from tract_cli.bench.workload.workloads import Request
    from tract_cli.core.geometry import load_model
    profile = load_model("llama-3-8b")
    base = static(1500, 3, seed=5)
    compute = runner.Compute(9000.0, 0.022)
    reqs = [Request(r.rid, i * 1.5, r.tokens, r.output_len) for i, r in enumerate(base)]
    res = session.run(reqs, profile, ["tract-copy", "tcp"], compute)
    by = {s["transport"]: s for s in res.summaries}
    assert all(s["verified"] and s["requests"] == 3 for s in by.values())
    before_first_token = [k for k in STAGES if k != "ack"]     # ack comes after it
    for transport, recs in res.records.items():
        for r in recs:
            assert r["modelled_compute"] == pytest.approx(1500 / 9000)
            # sleep-until-deadline: compute is at least the model
            assert r["t"]["compute"] >= r["modelled_compute"], (transport, r["t"])
            timed = sum(r["t"].get(k, 0.0) for k in before_first_token)
            # 1 ms: the float sums of a dozen perf_counter differences
            assert timed <= r["ttft"] + 1e-3, (transport, r["ttft"], r["t"])
    assert set(res.records["tract-copy"][0]["t"]) >= {"lookup", "kv_write", "handoff_publish",
                                                     "handoff_open", "kv_read", "ack"}
    assert not set(res.records["tcp"][0]["t"]) & {"lookup", "handoff_publish", "handoff_open",
                                                  "ack"}
    assert by["tcp"]["stages_s"]["lookup"] is None and by["tcp"]["hit_rate_blocks"] is None


def headline(stdout: str) -> str:
    """The title of a command's output, before its table's header row (a title
    Rich wraps over lines is joined)."""
    text = " ".join(stdout.split())
    return text[:text.index("┏")] if "┏" in text else text


def test_zero_copy_moves_no_bytes_and_missing_stages_show_a_dash(tmp_path):
    out = tmp_path / "bench.json"
    res = tract("bench", "--model", "tiny", "--input-len", "300", "--requests", "2",
                "--transport", "tract-zero-copy", "--transport", "tcp", "--json", str(out),
                "--flush-mode", "clflush", env={**os.environ, "COLUMNS": "250"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert "flush mode clflush" in headline(res.stdout)
    assert json.loads(out.read_text())["flush_mode"] == "clflush"
    by = {s["transport"]: s for s in json.loads(out.read_text())["summaries"]}
    assert by["tract-zero-copy"]["kv_bytes_moved"] == 0 and by["tract-zero-copy"]["kv_gbps"] is None
    assert by["tcp"]["stages_s"]["handoff_open"] is None
    assert "bytes not moved" in res.stdout and "0 ns" not in res.stdout and "—" in res.stdout


def test_an_explicit_model_is_honoured_or_refused_for_real_compute(monkeypatch):
    """--compute real --model llama-3-8b runs that model or refuses in one line
    (here: its random weights do not fit), never silently tiny-llama."""
    from tract_cli.cli import main
    from tract_cli.core import medium
    monkeypatch.setattr(medium, "mem_available", lambda: 8 << 30)
    monkeypatch.setattr(sys, "argv", ["tract", "bench", "--compute", "real", "--model",
                                      "llama-3-8b", "--input-len", "64", "--requests", "1"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2


def test_the_default_static_run_sweeps_the_papers_input_lengths(tmp_path):
    """No --input-len: 1500, 3000, 4500 and 6000 tokens, each through every
    transport, summarized and plotted per length; --input-len given: only it."""
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    res = tract("bench", "--model", "tiny-llama", "--requests", "2", "--transport", "tract-copy",
                "--transport", "tcp", "--json", str(out), "--plot", str(png))
    assert res.returncode == 0, res.stdout + res.stderr
    data = json.loads(out.read_text())
    assert sorted((s["group"], s["transport"]) for s in data["summaries"]) == sorted(
        (n, t) for n in (1500, 3000, 4500, 6000) for t in ("tract-copy", "tcp"))
    assert all(s["verified"] and s["requests"] == 2 for s in data["summaries"])
    assert {r["tokens"] for r in data["records"]["tcp"]} == {1500, 3000, 4500, 6000}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "arrive at once" in res.stdout
    one = tract("bench", "--model", "tiny", "--input-len", "100", "--requests", "1",
                "--transport", "tcp", "--json", str(out))
    assert one.returncode == 0, one.stderr
    assert [s["group"] for s in json.loads(out.read_text())["summaries"]] == [None]


def test_a_trace_faster_than_the_modelled_capacity_says_so(tmp_path):
    res = tract("bench", "--model", "tiny-llama", "--trace", TRACE, "--limit", "30",
                "--speedup", "400", "--transport", "tract-copy", "--max-input-len", "8192")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "exceeds the modelled prefill capacity" in " ".join(res.stdout.split())


@pytest.mark.parametrize("command", [["copy", "--model", "tiny", "--size", "64M", "--rounds", "1"],
                                     ["attach", "--size", "64M"], ["format", "--size", "64M"]],
                         ids=["copy", "attach", "format"])
def test_microbench_headlines_name_the_flush_mode_they_ran_with(command):
    """The mode the pool really ran with: the header's, or TRACT_FLUSH_MODE's
    override (format writes clflush into the header whatever the override)."""
    env = {**os.environ, "COLUMNS": "250"}
    env.pop("TRACT_FLUSH_MODE", None)
    plain = tract("microbench", *command, timeout=300, env=env)
    assert plain.returncode == 0, plain.stdout + plain.stderr
    expect = "clflush" if command[0] == "format" else "none"
    assert f"flush mode {expect}" in headline(plain.stdout), plain.stdout
    over = tract("microbench", *command, timeout=300, env={**env, "TRACT_FLUSH_MODE": "clflush"})
    assert over.returncode == 0, over.stdout + over.stderr
    assert "flush mode clflush" in headline(over.stdout), over.stdout
