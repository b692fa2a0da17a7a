"""The compiled module and native/tract.h agree; CPU detection is sane."""
from __future__ import annotations

import pathlib
import platform
import re

import pytest

from tract_cli.core.native import cpu_features, ffi, lib

HEADER = pathlib.Path(__file__).resolve().parents[1] / "native" / "tract.h"


def test_every_declared_function_is_exported():
    text = HEADER.read_text()
    block = text[text.index("/* CDEF-BEGIN */"):text.index("/* CDEF-END */")]
    names = re.findall(r"^\w[\w\s\*]*?\b(tract_\w+)\(", block, flags=re.M)
    assert len(names) > 20
    for name in names:
        assert hasattr(lib, name), name


def test_on_media_struct_sizes():
    assert ffi.sizeof("struct tract_header") == 4096
    assert ffi.sizeof("struct tract_section") == 32
    assert ffi.offsetof("struct tract_header", "sections") == 0x100
    assert ffi.offsetof("struct tract_header", "header_crc32") == 0xFF8
    assert ffi.offsetof("struct tract_header", "block_tokens") == 0x40
    assert ffi.offsetof("struct tract_header", "model_fingerprint") == 0x80


def test_crc32_matches_zlib():
    import zlib
    data = bytes(range(256)) * 17
    assert lib.tract_crc32(data, len(data)) == zlib.crc32(data)


@pytest.mark.skipif(platform.machine() != "x86_64", reason="an x86-64 check")
def test_cpu_features_on_x86():
    feats = cpu_features()
    assert "x86_64" in feats          # the core detected the machine it runs on
    assert "clflush" in feats         # every x86-64 CPU has clflush


def test_crc32c_is_the_castagnoli_check_value_with_and_without_the_instruction():
    """One CPU detection path (native/cpu.c): TRACT_NO_SSE42 turns the crc32
    instruction off like the other feature overrides, and both paths give
    CRC-32C's standard check value for "123456789"."""
    import os
    import subprocess
    import sys
    code = ("from tract_cli.core.native import lib, cpu_features; "
            "print(int('sse4_2' in cpu_features()), lib.tract_crc32c(b'123456789', 9))")
    for env, want_hw in (({}, None), ({"TRACT_NO_SSE42": "1"}, 0)):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env={**os.environ, **env}, timeout=60, check=True)
        hw, crc = map(int, out.stdout.split())
        assert crc == 0xE3069283
        if want_hw is not None:
            assert hw == want_hw
