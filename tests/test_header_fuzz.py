"""Fuzzing the header parser: any corruption is an error code, never a crash."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from format_reader import CRC_OFFSET
from tract_cli.core.geometry import load_model
from tract_cli.core.native import ffi, lib
from tract_cli.core.region import FormatOptions, format_region

ERRORS = {lib.TRACT_E_NOT_FORMATTED, lib.TRACT_E_VERSION, lib.TRACT_E_CHECKSUM, lib.TRACT_E_SIZE,
          lib.TRACT_E_LAYOUT}


@pytest.fixture(scope="module")
def good_header(tmp_path_factory):
    path = tmp_path_factory.mktemp("fuzz") / "r.pool"
    format_region(str(path), 16 << 20, FormatOptions(model=load_model("tiny")))
    return bytearray(open(path, "rb").read(4096))


def verify(page: bytes, mapped: int = 16 << 20) -> int:
    buf = ffi.new("char[]", bytes(page))
    return lib.tract_verify_header(buf, mapped, ffi.NULL)


def with_crc(page: bytearray) -> bytearray:
    import struct
    import zlib
    page = bytearray(page)
    struct.pack_into("<I", page, CRC_OFFSET, zlib.crc32(bytes(page[:CRC_OFFSET])))
    return page


def test_the_unmodified_header_verifies(good_header):
    assert verify(good_header) == 0


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 4095), st.integers(0, 255)), min_size=1, max_size=8))
def test_random_byte_flips_are_rejected(good_header, flips):
    page = bytearray(good_header)
    for off, val in flips:
        page[off] = val
    rc = verify(page)
    if page[:0xFFC] == good_header[:0xFFC]:
        assert rc == 0          # only the 4 bytes after the checksum are outside it
    else:
        assert rc in ERRORS


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.integers(0x08, 0x2FF), st.binary(min_size=1, max_size=8))
def test_field_corruption_with_a_valid_checksum_is_caught_by_the_layout_check(good_header, off, data):
    """A header that lies consistently (checksum recomputed) still cannot point outside."""
    page = bytearray(good_header)
    page[off:off + len(data)] = data
    page = with_crc(page)
    rc = verify(page)
    if rc == 0:
        # accepted only if every layout-bearing field still agrees with itself
        hdr = ffi.new("struct tract_header *")
        assert lib.tract_verify_header(ffi.new("char[]", bytes(page)), 16 << 20, hdr) == 0
        for i in range(hdr.section_count):
            s = hdr.sections[i]
            assert s.offset + s.length <= hdr.region_size <= 16 << 20
    else:
        assert rc in ERRORS


def test_short_mappings_are_not_formatted():
    assert lib.tract_verify_header(ffi.new("char[]", 100), 100, ffi.NULL) == lib.TRACT_E_NOT_FORMATTED
