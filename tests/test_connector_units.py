"""The vLLM connector's engine-free parts: its configuration and the page-layout map.

(The connector itself is tested against real vLLM in tests/test_vllm.py.)
"""
from __future__ import annotations

import subprocess
import time

import numpy as np
import pytest

from tract_cli.connectors.paged import probe_offsets
from tract_cli.core.kvpages import PageLayout, flash_offsets
from tract_cli.connectors.settings import ConnectorSettings
from tract_cli.core.errors import TractError, UsageError


def test_settings_defaults_follow_the_role():
    s = ConnectorSettings.parse({"pool": "/dev/shm/p", "node": 1}, "kv_both")
    assert (s.pool, s.node, s.save, s.prefix_cache, s.checksums) == ("/dev/shm/p", 1, True, True,
                                                                     True)
    assert ConnectorSettings.parse({"pool": "p", "node": 0}, "kv_consumer").save is False
    assert ConnectorSettings.parse({"pool": "p", "node": 0, "save": True}, "kv_consumer").save
    assert s.load_mode == "sync"
    assert s.handoff_publish == "after_step"
    assert ConnectorSettings.parse({"pool": "p", "node": 0, "handoff_publish": "in_step"},
                                   "kv_both").handoff_publish == "in_step"
    assert ConnectorSettings.parse({"pool": "p", "node": 0, "load_mode": "async"},
                                   "kv_both").load_mode == "async"
    assert (s.pair_wait_s, s.pair_idle_s, s.claim_wait_s) == (30.0, 0.005, 0.1)
    assert ConnectorSettings.parse({"pool": "p", "node": 0, "pair_idle_s": 0},
                                   "kv_both").pair_idle_s == 0      # off


@pytest.mark.parametrize("extra, role, words", [
    ({"node": 1}, "kv_both", "lacks 'pool'"),
    ({"pool": "p"}, "kv_both", "lacks 'node'"),
    ({"pool": "p", "node": -1}, "kv_both", "node must be an integer >= 0"),
    ({"pool": "p", "node": "1"}, "kv_both", "node must be an integer"),
    ({"pool": "p", "node": 1, "nod": 2}, "kv_both", "unknown key(s) nod"),
    ({"pool": "p", "node": 1, "checksums": "yes"}, "kv_both", "checksums must be true or false"),
    ({"pool": "p", "node": 1, "handoff_ttl_s": 0}, "kv_both", "handoff_ttl_s must be a positive"),
    ({"pool": "p", "node": 1, "flush_mode": "fast"}, "kv_both", "flush_mode 'fast' is unknown"),
    ({"pool": "", "node": 1}, "kv_both", "pool must be a path"),
    ({"pool": "p", "node": 1}, "kv_sideways", "kv_role 'kv_sideways'"),
    ({"pool": "p", "node": 1, "max_handoffs": -1}, "kv_both", "max_handoffs must be an integer"),
    ({"pool": "p", "node": 1, "model_id": ""}, "kv_both", "model_id must be a non-empty"),
    ({"pool": "p", "node": 1, "model_id": 7}, "kv_both", "model_id must be a non-empty"),
    ({"pool": "p", "node": 1, "weights_digest": "some"}, "kv_both", "weights_digest 'some'"),
    ({"pool": "p", "node": 1, "load_mode": "lazy"}, "kv_both", "load_mode 'lazy' is unknown"),
    ({"pool": "p", "node": 1, "gpu_copy": "fast"}, "kv_both", "gpu_copy 'fast' is unknown"),
    ({"pool": "p", "node": 1, "handoff_publish": "later"}, "kv_both",
     "handoff_publish 'later' is unknown"),
    ({"pool": "p", "node": 1, "kv_events": 1}, "kv_both", "kv_events must be true or false"),
    ({"pool": "p", "node": 1, "kv_events_medium": ""}, "kv_both", "kv_events_medium must be"),
    ({"pool": "p", "node": 1, "kv_events_ownership": 3}, "kv_both", "kv_events_ownership must"),
    ({"pool": "p", "node": 1, "kv_events_interval_s": -1}, "kv_both",
     "kv_events_interval_s must be a positive"),
    ({"pool": "p", "node": 1, "pair_wait_s": 0}, "kv_both", "pair_wait_s must be a positive"),
    ({"pool": "p", "node": 1, "claim_wait_s": "1"}, "kv_both", "claim_wait_s must be a positive"),
    ({"pool": "p", "node": 1, "pair_idle_s": 0.5}, "kv_both",
     "pair_idle_s must be between 0 (off) and 0.1 seconds"),
    ({"pool": "p", "node": 1, "pair_idle_s": True}, "kv_both", "pair_idle_s must be between"),
])
def test_bad_settings_are_one_line_saying_what_to_fix(extra, role, words):
    with pytest.raises(UsageError) as exc:
        ConnectorSettings.parse(extra, role)
    text = str(exc.value)
    assert words in text and "\n" not in text and "; " in text


def _cache_from_semantic(offsets, kv):
    """A flat page filled so that the element at offsets[c, t, h, d] is kv[c, t, h, d]."""
    flat = np.zeros(offsets.size, kv.dtype)
    flat[offsets.reshape(-1)] = kv.reshape(-1)
    return flat


def test_a_throttled_warning_is_due_once_a_period(monkeypatch):
    from tract_cli.connectors import throttle
    now = [1000.0]
    monkeypatch.setattr(throttle.time, "monotonic", lambda: now[0])
    every = throttle.Throttle(10.0)
    assert every.due()                       # the first time always
    now[0] += 9.9
    assert not every.due()                   # within the period
    now[0] += 0.1
    assert every.due() and not every.due()   # the period past: once, then not again
    quiet = throttle.Throttle(0.0)
    assert quiet.due() and quiet.due()       # no period: every time
    # a clock that starts near zero (a fresh boot) is no exception
    now[0] = 0.5
    assert throttle.Throttle(10.0).due()


def test_flash_attention_blocks_gather_in_the_canonical_order():
    pages, b, h, d, g = 3, 8, 2, 4, 4
    offsets, stride = flash_offsets(pages, b, h, d)
    pm = PageLayout(offsets, stride, g, 4)
    assert pm.digest is None and pm.run_count == 2 * pm.blocks_per_page   # K and V planes
    rng = np.random.default_rng(0)
    kv = rng.standard_normal((2, pages, b, h, d)).astype(np.float32)   # [K|V, page, token, h, d]
    layer = kv.reshape(-1)                     # FlashAttention's [2, pages, B, H, D], flattened
    idx = pm.gather_index(np.array([2, 0, 1]), np.array([1, 0, 1]))
    got = layer[idx].reshape(3, 2, g, h, d)
    for i, (p, sub) in enumerate([(2, 1), (0, 0), (1, 1)]):
        np.testing.assert_array_equal(got[i], kv[:, p, sub * g:(sub + 1) * g])


def test_page_map_refuses_a_page_that_is_not_whole_blocks():
    offsets, stride = flash_offsets(1, 12, 1, 2)
    with pytest.raises(TractError, match="not a multiple of the region's 8"):
        PageLayout(offsets, stride, 8, 4)


def test_probe_measures_a_packed_layout_from_the_engine_writer():
    torch = pytest.importorskip("torch")
    b, h, d = 8, 2, 4

    def write(key, value, page, slots):
        # a packed writer like vLLM's AMX path: per head, K as [d/2][token][2], V token-major
        view = page.view(h, 2, b * d)
        for t in slots.tolist():
            for hh in range(h):
                for dd in range(d):
                    view[hh, 0, (dd // 2) * b * 2 + t * 2 + dd % 2] = key[t, hh, dd]
                    view[hh, 1, t * d + dd] = value[t, hh, dd]

    offsets = probe_offsets(write, b, h, d, torch.bfloat16, (h, 2, b * d))
    kv = np.arange(2 * b * h * d, dtype=np.float32).reshape(2, b, h, d)
    page = np.zeros(offsets.size, np.float32)
    page[offsets.reshape(-1)] = kv.reshape(-1)
    # the measured offsets put K[t, h, d] where the writer does
    assert offsets[0, 3, 1, 2] == 1 * 2 * b * d + (2 // 2) * b * 2 + 3 * 2 + 0
    assert offsets[1, 5, 0, 3] == 0 * 2 * b * d + b * d + 5 * d + 3
    pm = PageLayout(offsets, offsets.size, 4, 2)
    assert pm.digest is not None                  # not the canonical order: it enters the keys
    # a region block holds its sub-block's elements in the page's own order
    got = page[pm.gather_index(np.array([0]), np.array([1]))].reshape(-1)
    want = kv[:, 4:8].reshape(-1)[np.argsort(offsets[:, 4:8].reshape(-1), kind="stable")]
    np.testing.assert_array_equal(got, want)
    tokens = np.broadcast_to(np.arange(4).reshape(1, 4, 1, 1), (2, 4, h, d)).reshape(-1)
    np.testing.assert_array_equal(pm.elem_token[1], tokens[np.argsort(
        offsets[:, 4:8].reshape(-1), kind="stable")])


def test_probe_refuses_a_writer_that_leaves_holes():
    torch = pytest.importorskip("torch")

    def write(key, value, page, slots):
        page.view(-1)[: key.numel()] = key.reshape(-1)     # V never written

    with pytest.raises(TractError, match="unwritten"):
        probe_offsets(write, 4, 1, 2, torch.bfloat16, (1, 4, 4))


@pytest.mark.parametrize("raw", [
    {"record": 2**70, "request_id": "00" * 16, "blocks": 1, "tokens": 1},
    {"record": 1.5, "request_id": "00" * 16, "blocks": 1, "tokens": 1},
    {"record": True, "request_id": "00" * 16, "blocks": 1, "tokens": 1},
    {"record": -1, "request_id": "00" * 16, "blocks": 1, "tokens": 1},
    {"record": 0, "request_id": "", "blocks": 1, "tokens": 1},
    {"record": 0, "request_id": "00" * 15, "blocks": 1, "tokens": 1},
    {"record": 0, "request_id": "zz" * 16, "blocks": 1, "tokens": 1},
    {"record": 0, "request_id": "00" * 16, "blocks": 2**40, "tokens": 1},
    {"record": 0, "request_id": "00" * 16, "blocks": 1, "tokens": -1},
    {"record": 0, "request_id": "00" * 16, "blocks": 1},
    "a string",
])
def test_a_hostile_ticket_is_a_usage_error(raw):
    from tract_cli.core.handoff import Ticket
    with pytest.raises(UsageError, match="malformed handoff ticket"):
        Ticket.from_dict(raw)


# ---- the served model's identity (connectors/model_identity.py) ----

def _checkpoint(path, seed: int, n: int = 4096):
    """A two-tensor safetensors checkpoint of random bf16-sized values."""
    import torch
    from safetensors.torch import save_file
    path.mkdir(exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    save_file({"a.weight": torch.randn(n, generator=g), "b.weight": torch.randn(64, generator=g)},
              str(path / "model.safetensors"))
    (path / "config.json").write_text("{}")
    return path


def test_two_checkpoints_of_one_shape_have_different_identities(tmp_path):
    from tract_cli.core.weights import weights_fingerprint
    a = weights_fingerprint(str(_checkpoint(tmp_path / "a", 0)))
    again = weights_fingerprint(str(_checkpoint(tmp_path / "a2", 0)))
    b = weights_fingerprint(str(_checkpoint(tmp_path / "b", 1)))
    assert a == again                         # the same weights: the same identity
    assert a[:2] == b[:2] == (1, 2)           # one file, two tensors
    assert a[2] != b[2]


def test_the_sampled_digest_misses_one_element_the_full_digest_sees(tmp_path):
    """The documented limit of sampling, and what closes it."""
    from tract_cli.core.weights import weights_fingerprint
    ckpt = _checkpoint(tmp_path / "a", 0)
    before = {m: weights_fingerprint(str(ckpt), m) for m in ("sampled", "full")}
    path = ckpt / "model.safetensors"
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 3] ^= 0x40               # one byte inside a.weight, between samples
    path.write_bytes(bytes(raw))
    assert weights_fingerprint(str(ckpt), "sampled") == before["sampled"]
    assert weights_fingerprint(str(ckpt), "full") != before["full"]


@pytest.mark.parametrize("damage, words", [
    (lambda raw: raw[:4], "shorter than a safetensors header"),
    (lambda raw: (2**40).to_bytes(8, "little") + raw[8:], "header length past its end"),
    (lambda raw: raw[:8] + b"[" + raw[9:], "does not parse"),
])
def test_a_damaged_checkpoint_is_one_line(tmp_path, damage, words):
    from tract_cli.core.weights import weights_fingerprint
    ckpt = _checkpoint(tmp_path / "a", 0)
    path = ckpt / "model.safetensors"
    path.write_bytes(damage(path.read_bytes()))
    with pytest.raises(TractError) as exc:
        weights_fingerprint(str(ckpt))
    assert words in str(exc.value)


def test_a_directory_without_weights_is_refused(tmp_path):
    from tract_cli.core.weights import weights_fingerprint
    with pytest.raises(TractError, match="has no weight files"):
        weights_fingerprint(str(tmp_path))


def test_a_model_tag_changes_every_key_of_both_schemes():
    from tract_cli.core.hashing import block_hashes, tag_keys, tract_root
    from tract_cli.core.index import as_keys
    tokens = np.arange(64, dtype=np.int32)
    plain = block_hashes(tokens, root=tract_root())
    a = block_hashes(tokens, root=tract_root(model_tag=b"a" * 16))
    b = block_hashes(tokens, root=tract_root(model_tag=b"b" * 16))
    assert not (plain == a).all(axis=1).any() and not (a == b).all(axis=1).any()
    # a salt cannot imitate a tag: the tag has a fixed width before it
    assert tract_root(model_tag=b"a" * 16) != tract_root(salt=b"a" * 16)
    keys = as_keys(block_hashes(tokens, "vllm", 16))
    ta, tb = tag_keys(keys, b"a" * 16), tag_keys(keys, b"b" * 16)
    assert not (ta == tb).all(axis=1).any() and not (ta == keys).all(axis=1).any()
    with pytest.raises(UsageError):
        tag_keys(keys, b"short")


# ---- releases retried off the request path (connectors/retry.py) ----

def test_a_release_that_times_out_is_retried_until_it_succeeds():
    from tract_cli.connectors.retry import Releases
    from tract_cli.core.errors import LockTimeout
    calls = []

    def flaky(timeout):
        calls.append(timeout)
        if len(calls) < 3:
            raise LockTimeout("lock 4: timed out", "retry")

    r = Releases(timeout=0.25)
    r.submit("unpin", flaky)
    assert r.drain(30), "the release was not done within 30 s"
    assert calls == [0.25] * 3 and r.retries == 2 and r.pending() == 0
    assert r.close(5)


def test_a_release_that_fails_for_good_is_dropped_not_retried():
    from tract_cli.connectors.retry import Releases
    from tract_cli.core.errors import HandoffError
    calls = []

    def gone(timeout):
        calls.append(timeout)
        raise HandoffError("record 3 is no longer published", "nothing")

    r = Releases(timeout=1.0)
    r.submit("ack", gone)
    r.submit("second", lambda timeout: calls.append("second"))
    assert r.drain(30)
    assert calls == [1.0, "second"] and r.retries == 0
    assert r.close(5)


def test_a_release_that_keeps_failing_does_not_hold_up_the_others():
    from tract_cli.connectors.retry import Releases
    from tract_cli.core.errors import LockTimeout
    stuck = {"free": False}
    done = []

    def blocked(timeout):
        if not stuck["free"]:
            raise LockTimeout("stripe 3: timed out", "retry")
        done.append("blocked")

    r = Releases(timeout=0.1)
    r.submit("blocked", blocked)
    for i in range(3):
        r.submit(f"r{i}", lambda timeout, i=i: done.append(i))
    deadline = time.monotonic() + 30
    while len(done) < 3:
        assert time.monotonic() < deadline, "the others waited behind the failing release"
        time.sleep(0.01)          # polling the release thread, bounded
    assert done == [0, 1, 2] and r.pending() == 1
    stuck["free"] = True
    assert r.drain(30) and done[-1] == "blocked"
    assert r.close(5)


def test_a_deferred_release_waits_its_defer_and_keeps_its_order():
    """A connector's releases wait past the step that asked for them (retry.py):
    none is tried before DEFER has passed since it was submitted, they run in
    submission order, and a drain (a shutdown's) waits for those not yet due."""
    from tract_cli.connectors.retry import Releases
    ran = []
    r = Releases(timeout=1.0, defer=0.2)
    asked = time.monotonic()
    for i in range(3):
        r.submit(f"r{i}", lambda timeout, i=i: ran.append((i, time.monotonic())))
    assert r.pending() == 3 and not ran
    assert r.drain(30), "the deferred releases were not done within 30 s"
    assert [i for i, _ in ran] == [0, 1, 2]
    assert all(at - asked >= 0.2 for _, at in ran), "a release was tried before its defer"
    assert r.close(5)


def test_the_vllm_plugin_that_asks_for_amx_is_declared_and_never_fails(monkeypatch, caplog):
    """vLLM calls every `vllm.general_plugins` entry point at start in each of its
    processes: TraCT's asks Linux for the AMX tile state (vllm_plugin.py).  It is
    declared and installed, asks only where the CPU has AMX, says when Linux
    refuses, and never fails vLLM's start."""
    import importlib
    import logging
    from importlib.metadata import entry_points
    from pathlib import Path
    try:
        import tomllib
    except ModuleNotFoundError:          # Python 3.10
        import tomli as tomllib
    import torch
    from tract_cli.connectors import vllm_plugin
    spec = tomllib.loads((Path(__file__).parent.parent / "pyproject.toml").read_text())
    declared = spec["project"]["entry-points"]["vllm.general_plugins"]
    assert declared == {"tract_amx": "tract_cli.connectors.vllm_plugin:request_amx_state"}
    # what vLLM reads: the installed metadata (an install older than the plugin lacks it)
    installed = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
    assert installed.get("tract_amx") == declared["tract_amx"], installed
    module, func = declared["tract_amx"].split(":")
    assert getattr(importlib.import_module(module), func) is vllm_plugin.request_amx_state
    asked = []
    monkeypatch.setattr(torch.cpu, "_init_amx", lambda: asked.append(1) or True, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert vllm_plugin.request_amx_state() is None and not asked     # no AMX: nothing asked
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    assert vllm_plugin.request_amx_state() is True and asked == [1]
    assert vllm_plugin.request_amx_state() is True                   # again: harmless
    with caplog.at_level(logging.WARNING, logger="vllm.tract"):
        monkeypatch.setattr(torch.cpu, "_init_amx", lambda: False, raising=False)
        assert vllm_plugin.request_amx_state() is False
        monkeypatch.setattr(torch.cpu, "_init_amx", lambda: 1 / 0, raising=False)
        assert vllm_plugin.request_amx_state() is False
    assert [r.getMessage().count("AMX tile state failed") for r in caplog.records] == [1, 1]
    monkeypatch.delattr(torch.cpu, "_init_amx", raising=False)
    assert vllm_plugin.request_amx_state() is None                   # a torch without it


def test_only_the_files_a_loader_reads_enter_the_weights_digest(tmp_path):
    """A host holding the whole repository (a training state, a second format) and
    one holding what the loader downloaded get one identity."""
    from tract_cli.core.weights import weight_files, weights_fingerprint
    ckpt = _checkpoint(tmp_path / "a", 0)
    bare = weights_fingerprint(str(ckpt))
    (ckpt / "training_args.bin").write_bytes(b"x" * 100)
    (ckpt / "optimizer.pt").write_bytes(b"y" * 100)
    assert weights_fingerprint(str(ckpt)) == bare
    assert weight_files(str(ckpt)) == ["model.safetensors"]
    (ckpt / "consolidated.safetensors").write_bytes((ckpt / "model.safetensors").read_bytes())
    (ckpt / "model.safetensors.index.json").write_text(
        '{"weight_map": {"a.weight": "model.safetensors", "b.weight": "model.safetensors"}}')
    assert weight_files(str(ckpt)) == ["model.safetensors"]
    (ckpt / "model.safetensors.index.json").write_text('{"weight_map": {"a": "gone.safetensors"}}')
    with pytest.raises(TractError, match="lacks gone.safetensors"):
        weight_files(str(ckpt))


def test_the_connector_timing_lines_parse_back_with_their_parts():
    from tract_cli.bench.engine.vllm_runs import _memcpy_figures
    from tract_cli.core import kvlog
    load = kvlog.parse("(Worker pid=1) INFO x " + kvlog.LOADED % (6, 49152, "cmpl-1", 2.5, 1.5, 1.0))
    assert load == ("load", {"blocks": 6, "bytes": 49152, "ms": 2.5, "copy_ms": 1.5,
                             "meta_ms": 1.0})
    save = kvlog.parse(kvlog.SAVED % (7, 57344, 3.0, 2.0, 1.0, 0.25, 0.75, kvlog.IN_STEP))
    assert save[0] == "save" and save[1]["copy_ms"] == 2.0 and save[1]["meta_ms"] == 1.0
    assert save[1]["claim_wait_ms"] == 0.25 and save[1]["commit_ms"] == 0.75
    assert save[1]["commit_in_step"]
    off = kvlog.parse(kvlog.SAVED % (7, 57344, 3.0, 2.0, 1.0, 0.25, 0.5, kvlog.OFF_STEP))
    assert off[1]["commit_ms"] == 0.5 and not off[1]["commit_in_step"]
    ref = kvlog.parse("INFO " + kvlog.REFERENCE % ("save", 6, 1.5, 1.0, 0.5, 1.2, 0.55))
    assert ref == ("save_memcpy", {"blocks": 6, "step_ms": 1.5, "ms": 1.0, "warm_ms": 0.5,
                                   "copy_cold_ms": 1.2, "copy_warm_ms": 0.55})
    assert kvlog.parse("INFO " + kvlog.PUBLISHED % ("cmpl-2", 13, 0.5)) == (
        "publish", {"blocks": 13, "ms": 0.5})
    assert kvlog.parse("INFO something else") is None
    # a save's reference covers its full blocks only: scaled to the blocks saved
    fig = _memcpy_figures({"saves": [save[1]], "saves_memcpy": [ref[1]]})["saves"]
    assert fig["memcpy_ms"] == pytest.approx(7 / 6)
    assert fig["copy_ratio"] == pytest.approx(2.0 / (7 / 6)) and fig["meta_ms"] == 1.0
    assert fig["cold_copy_ratio"] == pytest.approx(1.2) and fig["warm_copy_ratio"] == \
        pytest.approx(1.1)
    assert fig["memcpy_warm_ms"] == pytest.approx(0.5 * 7 / 6)
    # the memcpy in the step, where the copy runs: the reference the copy is held to
    assert fig["memcpy_step_ms"] == pytest.approx(1.5 * 7 / 6)
    assert fig["copy_vs_step_ratio"] == pytest.approx(2.0 / 1.75)
    assert (fig["claim_wait_ms"], fig["commit_ms"]) == (0.25, 0.75)
    # two saves: the figures are sums, the report tells the mean save beside the count
    from tract_cli.cli.bench_vllm import kv_path_line
    two = _memcpy_figures({"saves": [save[1], save[1]], "saves_memcpy": [ref[1], ref[1]]})
    fig = two["saves"]
    assert fig["count"] == 2 and fig["tract_ms"] == 6.0 and fig["commit_ms"] == 1.5
    assert _memcpy_figures({"saves": [save[1], off[1]]})["saves"]["commit_in_step_ms"] == 0.75
    assert fig["ratio"] == pytest.approx(3.0 / (7 / 6))
    line = kv_path_line("saves", fig)
    assert line.startswith("TraCT KV save: 2 saves of 112 KiB in all; the mean save, 56 KiB, "
                           "in 3 ms (copy 2 ms,"), line
    assert "commit 750 µs, 750 µs of it in the step" in line, line
    assert ("timed on warm-ups of the same lengths: 1.75 ms in the step where the copy runs "
            "(the median of up to 3 a length), 1.17 ms from cold caches, 583 µs warm. The copy "
            "1.14x the memcpy in the step (each save's: median 1.14x, max 1.14x), 1.71x the "
            "cold one (median 1.71x, max 1.71x), 3.43x the warm one; the save in all 1.71x the "
            "memcpy in the step, 2.57x the cold one") in line, line
    # each request's copy against the cold memcpy of its blocks: one slow copy
    # shows in the max, not in the median
    slow = dict(save[1], copy_ms=20.0)
    three = _memcpy_figures({"saves": [save[1], save[1], slow], "saves_memcpy": [ref[1]]})
    assert three["saves"]["copy_ratio_median"] == pytest.approx(2.0 / (7 / 6))
    assert three["saves"]["copy_ratio_max"] == pytest.approx(20.0 / (7 / 6))
    assert three["saves"]["step_ratio_median"] == pytest.approx(2.0 / 1.75)
    assert three["saves"]["step_ratio_max"] == pytest.approx(20.0 / 1.75)
    assert "1.20x both cold, 1.10x both warm" in line, line
    # a CPU that cannot evict times no cold memcpy (0): told as not timed, never a crash
    warm_only = kvlog.parse("INFO " + kvlog.REFERENCE % ("save", 6, 0.0, 0.0, 0.5, 0.0, 0.55))[1]
    fig = _memcpy_figures({"saves": [save[1]], "saves_memcpy": [warm_only]})["saves"]
    assert fig["memcpy_ms"] is None and fig["ratio"] is None and fig["cold_copy_ratio"] is None
    assert fig["copy_vs_warm_ratio"] == pytest.approx(2.0 / (0.5 * 7 / 6))
    line = kv_path_line("saves", fig)
    assert fig["memcpy_step_ms"] is None and fig["step_ratio_median"] is None
    assert ("lengths: — in the step where the copy runs (the median of up to 3 a length), "
            "— from cold caches, 583 µs warm. The copy — the memcpy in the step") in line, line
    assert "the save in all — the memcpy in the step, — the cold one" in line, line
    # each request against the reference lines of its own length (the nearest
    # size), their median: a short prompt's memcpy per block is not a long one's
    from tract_cli.bench.engine.vllm_runs import _row_references
    refs = [{"blocks": 11, "step_ms": 1.1}, {"blocks": 11, "step_ms": 2.2},
            {"blocks": 11, "step_ms": 99.0}, {"blocks": 47, "step_ms": 2.35},
            {"blocks": 47, "step_ms": 0.0}]          # one not timed
    assert _row_references([{"blocks": 12}, {"blocks": 47}, {"blocks": 30}], refs,
                           "step_ms") == pytest.approx([2.4, 2.35, 1.5])
    assert _row_references([{"blocks": 12}], [{"blocks": 11, "step_ms": 0.0}],
                           "step_ms") == [None]
    # a load that failed (0 blocks) has a memcpy of nothing: the others' figures stand
    assert _row_references([{"blocks": 0}, {"blocks": 12}], refs, "step_ms") == \
        pytest.approx([0.0, 2.4])
    failed = dict(save[1], blocks=0, copy_ms=0.0)
    fig = _memcpy_figures({"saves": [save[1], failed], "saves_memcpy": [ref[1]]})["saves"]
    assert fig["memcpy_step_ms"] == pytest.approx(1.75) and fig["count"] == 2
    assert fig["step_ratio_median"] == pytest.approx(2.0 / 1.75)


@pytest.mark.parametrize("scheme", ["tract", "vllm"])
def test_the_page_layout_enters_every_key(region_path, scheme):
    """An instance of another page layout computes other keys for the same prompt
    and model (so never finds, and never misreads, a block stored in this one);
    the canonical order keeps the model's own tag."""
    from tract_cli.connectors.keys import key_tag, prompt_keys
    from tract_cli.core.pool import Pool
    model = bytes(range(32))
    canonical, amx, other = key_tag(model, None), key_tag(model, b"a" * 32), key_tag(model, b"b" * 32)
    assert canonical == model[:16] and len({canonical, amx, other}) == 3
    with Pool.create(region_path, 16 << 20, "tiny", nodes=2, hash_scheme=scheme) as pool:
        one = prompt_keys(pool.info, amx, 16, list(range(40)))
        two = prompt_keys(pool.info, other, 16, list(range(40)))
    assert not (one.keys == two.keys).all(axis=1).any()
    assert not np.array_equal(one.tail_key, two.tail_key)


def test_the_bench_counts_only_what_the_connector_logged_after_the_warm_up(tmp_path):
    """`tract bench --engine vllm` reads the connector's timing lines from each log
    past its size once the warm-up requests were answered: the warm-up's lines and
    a line still being written are not counted; its memcpy reference, timed
    beside the warm-ups' copies only, is read from the whole log."""
    from tract_cli.bench.engine.vllm_runs import _connector_figures
    from tract_cli.core import kvlog
    prefill, decode = tmp_path / "tract-prefill.log", tmp_path / "tract-decode.log"
    warm_save = "INFO " + kvlog.SAVED % (2, 16384, 9.0, 8.0, 1.0, 0.5, 0.5, kvlog.OFF_STEP) + "\n"
    warm_load = "INFO " + kvlog.LOADED % (2, 16384, "warm", 9.0, 8.0, 1.0) + "\n"
    prefill.write_text(warm_save + "INFO "
                       + kvlog.REFERENCE % ("save", 11, 0.6, 0.45, 0.4, 0.5, 0.55)
                       + "\n"
                       + "INFO " + kvlog.PUBLISHED % ("warm", 2, 7.0) + "\n")
    decode.write_text(warm_load + "INFO " + kvlog.REFERENCE % ("load", 12, 0.5, 0.3, 0.2, 0.35, 0.4)
                      + "\n")
    marks = {str(prefill): prefill.stat().st_size, str(decode): decode.stat().st_size}
    with open(prefill, "a") as f:
        f.write("INFO " + kvlog.SAVED % (12, 98304, 3.0, 2.0, 1.0, 0.25, 0.75, kvlog.IN_STEP)
                + "\n")
        f.write("INFO " + kvlog.REFERENCE % ("save", 12, 0.7, 0.5, 0.45, 0.55, 0.6) + "\n")
        f.write("INFO " + kvlog.PUBLISHED % ("cmpl-1", 12, 0.4) + "\n")
        # a line still being written
        f.write("INFO " + kvlog.SAVED % (12, 98304, 3.0, 2.0, 1.0, 0.25, 0.75, kvlog.IN_STEP))
    with open(decode, "a") as f:
        f.write("INFO " + kvlog.LOADED % (12, 98304, "cmpl-1", 2.5, 1.5, 1.0) + "\n")
    got = _connector_figures(str(decode), str(prefill), marks)
    assert [r["ms"] for r in got["saves"]] == [3.0]
    assert [r["ms"] for r in got["loads"]] == [2.5]
    assert [r["ms"] for r in got["publishes"]] == [0.4]
    assert [r["ms"] for r in got["saves_memcpy"]] == [0.45, 0.5]
    assert [r["ms"] for r in got["loads_memcpy"]] == [0.3]
    # without the marks every line counts (the check can fail: warm-up lines are there)
    every = _connector_figures(str(decode), str(prefill), {})
    assert [r["ms"] for r in every["saves"]] == [9.0, 3.0]


def test_the_workload_bench_counts_a_save_in_the_step_and_not_its_commit_off_it(tmp_path):
    """`KV write` of the workload bench: what a save cost the engine's step; a
    commit the save thread ran off the step is not in it."""
    from tract_cli.bench.engine.vllm_workloads import _connector_times
    from tract_cli.core import kvlog
    log = tmp_path / "prefill.log"
    log.write_text("INFO " + kvlog.SAVED % (2, 16384, 3.0, 1.0, 2.0, 0.5, 1.5, kvlog.OFF_STEP)
                   + "\nINFO " + kvlog.SAVED % (2, 16384, 3.0, 1.0, 2.0, 0.5, 1.5, kvlog.IN_STEP)
                   + "\n")
    got = _connector_times({"prefill": str(log)}, {"prefill": 0})
    assert got["saves"] == 2 and got["save_ms"] == pytest.approx(1.5 + 3.0)


def test_the_prefix_bench_waits_for_the_misss_save_line_and_no_longer(tmp_path, capsys):
    """A prefix hit is asked once the prefill instance logged the miss's blocks
    saved (its commit is off the step); a save that logs nothing (pool full, a
    lock timeout) delays the hit by the bound only, and says so."""
    from tract_cli.bench.engine.vllm_runs import _wait_saved
    from tract_cli.core import kvlog
    log = tmp_path / "prefill.log"
    log.write_text("INFO warm-up\n")
    mark = log.stat().st_size
    line = "INFO " + kvlog.SAVED % (11, 90112, 3.0, 1.0, 2.0, 0.5, 1.5, kvlog.OFF_STEP)
    with open(log, "a") as f:
        f.write(line)                                   # still being written
    assert _wait_saved(str(log), mark, 11, timeout=0.05) is None
    assert "0 of 11 blocks saved" in capsys.readouterr().err
    with open(log, "a") as f:
        f.write("\n")
    assert _wait_saved(str(log), mark, 11, timeout=5) is not None


def test_the_worker_defers_its_commit_and_bounds_its_claim_wait(region_path):
    """The worker half's CPU path (tests/cpu_worker_driver.py, in vLLM's
    environment, against a real region): a step's commit, off the step, is
    deferred (COMMIT_DEFER_S, so it does not take the worker's bound core from
    the rest of the step and its output) until the next step's bind or
    shutdown, or its defer's end; its blocks are then READY with the pages'
    bytes, and a next step that saves claims after it.  Under a stalled lock
    manager a step waits claim_wait_s for its claim at most and goes on
    without saving, the steps after it queue no claim while that one is out,
    and once the locks are free its claims are given back.  A P/D prefill's
    step is bounded alike, for its claim and for its handoff's record: that
    handoff is not published (a paired decode finds a record of no blocks,
    a two-step ticket's record is gone), nothing stays pinned or reserved,
    and the next handoff is published; a step that waits for its commit waits
    claim_wait_s at most."""
    import os

    from tests.vllm_stack import VLLM_PY
    from tests.worker_stand import run_driver
    if not os.path.exists(VLLM_PY):
        pytest.skip(f"no vLLM environment at {VLLM_PY} (.ci/setup builds it)")
    seen = run_driver("cpu_worker_driver.py", region_path)
    assert seen == {"after_its_step": 0, "a_while_after": 0, "after_the_next_bind": True,
                    "bytes_equal": True, "a_commit_before_the_next_steps_claim": True,
                    "the_last_step_still_waits": 0, "a_short_defer_ends_by_itself": True,
                    "bytes_equal_3": True, "a_stalled_handoff_step_went_on": True,
                    "the_next_step_went_on": True, "the_next_step_queued_no_claim": True,
                    "a_handoff_step_behind_it_went_on": True, "its_handoff_said_lost": True,
                    "the_stalled_claim_given_back": True,
                    "the_paired_decodes_told": ["HandoffLost", "HandoffLost"],
                    "after_the_stall": {"pins": 0, "handoffs": 2, "pending": 0},
                    "saved_again_after_the_stall": True, "bytes_equal_6": True,
                    "a_step_whose_record_stalls_went_on": True, "its_records_said_late": True,
                    "its_claim_given_back": True,
                    "its_ticket": "HandoffGone", "its_blocks": 0,
                    "after_the_record_stall": {"pins": 0, "handoffs": 0, "pending": 0},
                    "published_without_the_stall": "1 blocks",
                    "after_its_ack": {"pins": 0, "handoffs": 0, "pending": 0},
                    "a_step_whose_commit_stalls_went_on": True, "its_commit_said_late": True,
                    "its_blocks_saved_after_the_stall": True,
                    "its_in_step_handoff": "HandoffGone",
                    "after_the_commit_stall": {"pins": 0, "handoffs": 0, "pending": 0},
                    "after_shutdown": 2, "bytes_equal_5": True}, seen


REFERENCE_DRIVER = """
import logging
import numpy as np
from tract_cli.connectors import vllm_worker
from tract_cli.core import kvlog
from tract_cli.core.errors import FlushModeError, TractError

class Paged:
    def __init__(self, fail_at=None, evicts=True):
        self.calls, self.fail_at, self.evicts = [], fail_at, evicts
    def evict(self, *_):
        self.calls.append("evict")
        if not self.evicts:
            raise FlushModeError("no flush instruction")
    def _copy(self, kind, checksum):
        self.calls.append(kind + ("+crc" if checksum else ""))
        if len(self.calls) == self.fail_at:
            raise TractError("the copy failed")
        return np.array([7, 8], np.uint32) if checksum else None
    def save(self, *_, checksum=True):
        return self._copy("save", checksum)
    def load(self, *_, checksum=True):
        return self._copy("load", checksum)

class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []
    def emit(self, record):
        if "memcpy of the same bytes" in record.getMessage():
            self.lines.append(record.getMessage())

lines = Lines()
logging.getLogger("vllm.tract").addHandler(lines)
logging.getLogger("vllm.tract").setLevel(logging.INFO)
vllm_worker.REFERENCE = True
worker = object.__new__(vllm_worker.WorkerSide)
args = (np.array([3, 4]), np.array([1, 2]), np.array([0, 0]))
worker._paged = Paged()
# the memcpy in the step: one plain copy where the real one runs, no eviction
took, in_step = worker._memcpy_in_step("save", *args)
assert took == in_step > 0 and worker._paged.calls == ["save"], worker._paged.calls
worker._paged = Paged()
assert worker._reference("save", *args, in_step_s=in_step) > 0
one = ["evict", "save", "save", "evict", "save+crc", "save+crc"]
assert worker._paged.calls == one * vllm_worker.REFERENCE_ROUNDS, worker._paged.calls
(line,) = lines.lines
kind, row = kvlog.parse(line)
assert kind == "save_memcpy" and row["blocks"] == 2, row
assert all(row[k] > 0 for k in ("step_ms", "ms", "warm_ms", "copy_cold_ms", "copy_warm_ms")), row
assert abs(row["step_ms"] - in_step * 1e3) < 1e-3, (row, in_step)
# a memcpy in the step that fails: said, not timed (its time still kept off
# the copy's), the copy goes on
worker._paged = Paged(fail_at=1)
took, in_step = worker._memcpy_in_step("load", *args)
assert in_step is None and took > 0
# no reference asked of this process: nothing copied
vllm_worker.REFERENCE = False
worker._paged = Paged()
assert worker._memcpy_in_step("save", *args) == (0.0, None) and worker._paged.calls == []
vllm_worker.REFERENCE = True

# a load that asks: acquire, the memcpy in the step, the real copy, then the
# rest of the reference; neither memcpy counts in the load's own times (a
# clock the stand-in's copies move: a memcpy 1 s, a checksummed copy 2**-10 s,
# sums a float holds exactly)
import types
from tract_cli.connectors.vllm_meta import LoadSpec
clock = [0.0]
class Timed(Paged):
    def _copy(self, kind, checksum):
        clock[0] += 2.0 ** -10 if checksum else 1.0
        return super()._copy(kind, checksum)
worker._paged = Timed()
worker.pool = types.SimpleNamespace(
    acquire_payload=lambda slots, tags: worker._paged.calls.append("acquire"),
    info=types.SimpleNamespace(block_bytes=4096))
worker.settings = types.SimpleNamespace(checksums=True)
worker._timings = logging.INFO
real_time = vllm_worker.time
vllm_worker.time = types.SimpleNamespace(perf_counter=lambda: clock[0])
class Loaded(logging.Handler):
    def __init__(self):
        super().__init__()
        self.rows = []
    def emit(self, record):
        got = kvlog.parse(record.getMessage())
        if got and got[0] == "load":
            self.rows.append(got[1])
loaded = Loaded()
logging.getLogger("vllm.tract").addHandler(loaded)
lines.lines.clear()
spec = LoadSpec("r1", np.array([3, 4]), np.array([7, 8], np.uint32), np.array([1, 2]),
                np.array([0, 0]), reference=True)
try:
    assert worker._load(spec) == set()
finally:
    vllm_worker.time = real_time
calls = worker._paged.calls
assert calls[:3] == ["acquire", "load", "load+crc"], calls     # the memcpy right before the copy
assert calls[3:9] == ["evict", "load", "load", "evict", "load+crc", "load+crc"], calls
(row,) = loaded.rows
assert row["copy_ms"] == row["ms"] == 0.977 and row["meta_ms"] == 0, row
(line,) = lines.lines
assert abs(kvlog.parse(line)[1]["step_ms"] - 1000.0) < 1e-6, line
# a failure after a memcpy's stores: the slots written back, nothing logged
lines.lines.clear()
worker._paged = Paged(fail_at=5)
worker._reference("save", *args)
assert worker._paged.calls == ["evict", "save", "save", "evict", "save+crc", "evict"], \
    worker._paged.calls
assert not lines.lines
# a CPU that cannot evict: warm only, the cold times logged as not timed (0)
worker._paged = Paged(evicts=False)
worker._reference("save", *args)
assert worker._paged.calls[:6] == ["evict", "save", "save", "save+crc", "save+crc", "save"], \
    worker._paged.calls
(line,) = lines.lines
row = kvlog.parse(line)[1]
assert row["ms"] == 0 and row["copy_cold_ms"] == 0 and row["warm_ms"] > 0, row
assert row["step_ms"] == 0, row          # none given: not timed
# a load whose checksummed copy read other bytes than the load's own
worker._paged = Paged()
try:
    worker._reference("load", *args, crcs=np.array([7, 9], np.uint32))
    raise AssertionError("a mismatch went unnoticed")
except vllm_worker.ReferenceMismatch:
    pass
worker._reference("load", *args, crcs=np.array([7, 8], np.uint32))
print("ok")
"""


def test_the_memcpy_reference_times_cold_and_warm_and_leaves_a_save_on_memory():
    """The connector's reference (TRACT_CONNECTOR_REFERENCE), in vLLM's
    environment with a stand-in for the copies: a memcpy in the step, one plain
    copy where the real one runs, logged beside the rest; each round a memcpy cold then
    warm, the checksummed copy cold then warm, each warm one right after its
    own kind; a save's last write a checksummed save, or its slots written
    back when a failure left a memcpy's stores last; warm only where the CPU
    cannot evict; a load whose copy reads other bytes fails."""
    import os

    from tests.vllm_stack import ROOT, VLLM_PY
    if not os.path.exists(VLLM_PY):
        pytest.skip(f"no vLLM environment at {VLLM_PY} (.ci/setup builds it)")
    out = subprocess.run([VLLM_PY, "-c", REFERENCE_DRIVER], capture_output=True, text=True,
                         timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-1:] == ["ok"], out.stdout[-2000:]
