"""Named roots across processes; bounds checks on what the directory says."""
from __future__ import annotations

import struct

import pytest

from agents import RunningAgent
from procs import Worker
from tract_cli.core.errors import TractError, UsageError
from tract_cli.core.objects import ObjectRef
from tract_cli.core.pool import Pool

OBJDIR_ENTRY = struct.Struct("<40sQQII")       # one object-directory entry (FORMAT.md §4.3)
OBJDIR_FIELDS = ("name", "offset", "size", "seq", "flags")


@pytest.fixture
def region(region_path):
    Pool.create(region_path, 16 << 20, "tiny", nodes=2).close()
    return region_path


@pytest.mark.parametrize("simulate", [False, True], ids=["plain", "sim"])
def test_put_on_one_node_get_on_another(region, simulate):
    with RunningAgent(region, 0, manager=True, simulate=simulate):
        with Worker(region, 0, simulate) as a, Worker(region, 1, simulate) as b:
            assert b.call("obj_get", name="index-root") is None
            a.call("obj_put", name="index-root", offset=8192, size=4096)
            assert b.call("obj_get", name="index-root") == [8192, 4096]
            b.call("obj_put", name="index-root", offset=12288, size=64)
            assert a.call("obj_get", name="index-root") == [12288, 64]


def test_names_and_ranges_are_validated(region):
    with RunningAgent(region, 0, manager=True):
        with Pool.attach(region, node=1) as p:
            with pytest.raises(UsageError):
                p.objects.put("x" * 40, 0, 1)
            with pytest.raises(TractError, match="outside the region"):
                p.objects.put("big", p.info.region_size - 8, 16)
            for i in range(64):
                p.objects.put(f"n{i}", 0, 1)
            with pytest.raises(TractError, match="full"):
                p.objects.put("one-too-many", 0, 1)
            assert p.objects.delete("n3")
            p.objects.put("one-too-many", 0, 1)
            assert p.objects.get("one-too-many") == ObjectRef(offset=0, size=1)


def test_a_corrupt_entry_is_reported_not_followed(region):
    with Pool.attach(region, node=1) as p:
        off = p.info.section("objdir").offset
        entry = OBJDIR_ENTRY.pack(b"evil", 1 << 60, 64, 1, 0)
        p.publish(off, entry)
        with pytest.raises(TractError, match="points outside the region"):
            p.objects.get("evil")
