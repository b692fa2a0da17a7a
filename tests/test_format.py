"""Format round trip, the independent reader, and 'formatting writes only metadata'."""
from __future__ import annotations

import os

import numpy as np
import pytest

from format_reader import CRC_OFFSET, read_header
from tract_cli.core.errors import (AlreadyFormattedError, FormatMismatchError,
                                   GeometryMismatchError, NotFormattedError, UsageError)
from tract_cli.core.geometry import Geometry, load_model
from tract_cli.core.locks import lock_count
from tract_cli.core.pool import Pool
from tract_cli.core.region import FormatOptions, format_region


def test_round_trip_header_fields(region_path):
    opts = FormatOptions(model=load_model("llama-3-8b"), max_nodes=3, flush_mode="clflush",
                         hash_scheme="vllm", index_stripes=16, transfer_entries=100)
    info = format_region(region_path, 64 << 20, opts)
    with Pool.attach(region_path, node=2) as pool:
        assert pool.info == info
        assert info.format_version == 9
        assert info.region_size == 64 << 20
        assert info.max_nodes == 3
        assert info.flush_mode == "clflush"
        assert info.hash_scheme == "vllm"
        assert info.index_stripes == 16
        assert info.lock_count == lock_count(16)
        assert info.section("transfer").count == 100
        assert info.model_name == "llama-3-8b"
        assert info.model_fingerprint == load_model("llama-3-8b").fingerprint().hex()
        assert info.geometry == Geometry(32, 8, 128, "bf16", 16)
        assert info.bytes_per_token == 128 << 10
        assert info.block_bytes == 2 << 20
        assert info.slot_stride == 2 << 20
        assert info.slot_count == 31     # 64 MiB less a 2 MiB-aligned metadata area


def test_independent_reader_agrees_with_the_core(region_path):
    info = format_region(region_path, 32 << 20, FormatOptions(model=load_model("tiny")))
    with open(region_path, "rb") as f:
        h = read_header(f.read(4096))
    assert h["uuid"].hex() == info.uuid.replace("-", "")
    assert h["region_size"] == info.region_size
    assert h["slot_count"] == info.slot_count
    assert h["block_bytes"] == info.block_bytes
    assert h["model_name"] == "tiny"
    for s in info.sections:
        assert h["sections"][s.name] == {"offset": s.offset, "length": s.length,
                                         "count": s.count, "entry_size": s.entry_size}


def test_two_formats_get_distinct_uuids_and_seeds(region_path, tmp_path):
    a = format_region(region_path, 16 << 20, FormatOptions(model=load_model("tiny")))
    b = format_region(region_path, 16 << 20, FormatOptions(model=load_model("tiny")), force=True)
    assert a.uuid != b.uuid and a.hash_seed != b.hash_seed


def test_format_writes_metadata_only_and_leaves_the_data_area(region_path):
    with Pool.create(region_path, 16 << 20, "tiny") as pool:
        data = pool.info.section("data")
        pattern = np.frombuffer(os.urandom(data.length), dtype=np.uint8)
        view = np.frombuffer(pool._mm, dtype=np.uint8, count=data.length, offset=data.offset)
        view[:] = pattern
        del view
    format_region(region_path, 16 << 20, FormatOptions(model=load_model("tiny")), force=True)
    with open(region_path, "rb") as f:
        f.seek(data.offset)
        assert f.read(data.length) == pattern.tobytes()


def test_format_resets_metadata_to_zero(region_path):
    with Pool.create(region_path, 16 << 20, "tiny") as pool:
        objdir = pool.info.section("objdir")
        pool.publish(objdir.offset, b"\xff" * 64)
    format_region(region_path, 16 << 20, FormatOptions(model=load_model("tiny")), force=True)
    with Pool.attach(region_path) as pool:
        assert pool.observe(objdir.offset, 64) == b"\0" * 64


def test_refuses_to_overwrite_a_region_without_force(region_path):
    format_region(region_path, 16 << 20, FormatOptions(model=load_model("tiny")))
    before = open(region_path, "rb").read(4096)
    with pytest.raises(AlreadyFormattedError, match="already holds a TraCT region .*--force"):
        format_region(region_path, 16 << 20, FormatOptions(model=load_model("tiny")))
    assert open(region_path, "rb").read(4096) == before


def test_refuses_to_overwrite_other_data_without_force(region_path):
    with open(region_path, "wb") as f:
        f.write(b"precious" * 1000)
    with pytest.raises(AlreadyFormattedError, match="other data"):
        format_region(region_path, 16 << 20, FormatOptions(model=load_model("tiny")))
    assert open(region_path, "rb").read() == b"precious" * 1000


def test_attach_rejects_a_file_that_is_not_a_region(region_path):
    with open(region_path, "wb") as f:
        f.write(b"\0" * (4 << 20))
    with pytest.raises(NotFormattedError, match="holds no TraCT region"):
        Pool.attach(region_path)


def _patch(path: str, offset: int, data: bytes, fix_crc: bool) -> None:
    import struct
    import zlib
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)
        if fix_crc:
            f.seek(0)
            page = f.read(4096)
            f.seek(CRC_OFFSET)
            f.write(struct.pack("<I", zlib.crc32(page[:CRC_OFFSET])))


def test_attach_rejects_an_unknown_version(region_path):
    format_region(region_path, 16 << 20, FormatOptions(model=load_model("tiny")))
    _patch(region_path, 8, (99).to_bytes(4, "little"), fix_crc=True)
    with pytest.raises(FormatMismatchError, match="unknown format version"):
        Pool.attach(region_path)


def test_attach_rejects_a_bad_checksum(region_path):
    format_region(region_path, 16 << 20, FormatOptions(model=load_model("tiny")))
    _patch(region_path, 0x44, (7).to_bytes(4, "little"), fix_crc=False)
    with pytest.raises(FormatMismatchError, match="checksum"):
        Pool.attach(region_path)


def test_attach_rejects_a_layout_table_that_disagrees(region_path):
    format_region(region_path, 16 << 20, FormatOptions(model=load_model("tiny")))
    _patch(region_path, 0x100 + 8, (0x2000).to_bytes(8, "little"), fix_crc=True)
    with pytest.raises(FormatMismatchError, match="layout table"):
        Pool.attach(region_path)


def test_attach_rejects_a_truncated_file(region_path):
    format_region(region_path, 16 << 20, FormatOptions(model=load_model("tiny")))
    os.truncate(region_path, 8 << 20)
    with pytest.raises(FormatMismatchError, match="smaller than the region size"):
        Pool.attach(region_path)


def test_attach_rejects_another_geometry(region_path):
    format_region(region_path, 16 << 20, FormatOptions(model=load_model("tiny")))
    with pytest.raises(GeometryMismatchError, match="tiny .* not 32 layers"):
        Pool.attach(region_path, expect=load_model("llama-3-8b"))
    with Pool.attach(region_path, expect=load_model("tiny")):
        pass


def test_attach_rejects_a_node_out_of_range(region_path):
    format_region(region_path, 16 << 20, FormatOptions(model=load_model("tiny"), max_nodes=2))
    with pytest.raises(UsageError, match="node 2 is outside"):
        Pool.attach(region_path, node=2)


def test_interrupted_format_never_looks_formatted(region_path):
    """The magic is written last: a header without it is 'not formatted'."""
    format_region(region_path, 16 << 20, FormatOptions(model=load_model("tiny")))
    _patch(region_path, 0, b"\0" * 8, fix_crc=False)
    with pytest.raises(NotFormattedError):
        Pool.attach(region_path)


def test_refuses_to_format_a_region_mapped_by_another_process(region_path):
    import subprocess
    import sys
    format_region(region_path, 16 << 20, FormatOptions(model=load_model("tiny")))
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys; from tract_cli.core.pool import Pool;"
         f"p = Pool.attach({region_path!r}, local=False); print('attached', flush=True);"
         "sys.stdin.readline()"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "attached"
        with pytest.raises(AlreadyFormattedError, match=rf"mapped by running processes \(pids {holder.pid}\)"):
            format_region(region_path, 16 << 20, FormatOptions(model=load_model("tiny")),
                          force=False)
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
