"""Model and device profiles, sizes with units."""
from __future__ import annotations

import pytest

from tract_cli.core.errors import UsageError
from tract_cli.core.geometry import load_device, load_model, model_names
from tract_cli.core.units import format_duration, format_size, parse_size


@pytest.mark.parametrize("name,per_token,per_block", [
    ("llama-3-8b", 128 << 10, 2 << 20),
    ("deepseek-r1-distill-llama-8b", 128 << 10, 2 << 20),
    ("llama-3-70b", 320 << 10, 5 << 20),
    ("llama-3-405b", 504 << 10, 504 << 14),
])
def test_model_kv_geometry(name, per_token, per_block):
    g = load_model(name).geometry
    assert g.bytes_per_token == per_token
    assert g.block_bytes == per_block


def test_tiny_model_is_small_and_shipped():
    assert {"tiny", "llama-3-8b", "llama-3-70b", "llama-3-405b"} <= set(model_names())
    assert load_model("tiny").geometry.block_bytes == 8192


def test_models_have_distinct_fingerprints():
    prints = {load_model(n).fingerprint() for n in model_names()}
    assert len(prints) == len(model_names())


def test_unknown_model_lists_the_known_ones():
    with pytest.raises(UsageError, match="llama-3-8b"):
        load_model("gpt-5")


def test_device_profiles():
    assert load_device("niagara-2").latency_ns == 640
    assert load_device("niagara-2").bandwidth_gbps == 10.1
    assert load_device("emulated-shm").kind == "dram"
    assert load_device("nic-100g").bandwidth_gbps == 12.5


@pytest.mark.parametrize("text,value", [("4096", 4096), ("8G", 8 << 30), ("512MiB", 512 << 20),
                                        ("1GB", 10**9), ("1.5G", 3 << 29), ("2 mib", 2 << 20)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["", "G", "-1G", "1.3B", "12XB"])
def test_parse_size_rejects(text):
    with pytest.raises(UsageError):
        parse_size(text)


def test_format_size():
    assert format_size(2 << 20) == "2 MiB"
    assert format_size(504 << 14) == "7.88 MiB"
    assert format_size(10) == "10 B"


@pytest.mark.parametrize("seconds,text", [
    (0, "0 s"), (8.5e-7, "850 ns"), (7.1e-05, "71 µs"), (0.0012, "1.2 ms"),
    (0.00123456, "1.23 ms"), (0.99996, "1 s"), (3.4, "3.4 s"), (59.94, "59.9 s"),
    (59.96, "1 min"), (125, "2 min 5 s"), (3599.6, "1 h"), (3725, "1 h 2 min"),
    (2 * 86400 + 4 * 3600, "2 d 4 h"), (-2.5, "-2.5 s"), (float("inf"), "∞"),
])
def test_format_duration(seconds, text):
    """Three figures under a minute, never an exponent; whole units above."""
    assert format_duration(seconds) == text
