"""The device-DAX path of `tract init`, against a recorded sysfs tree.

A real /dev/daxX.Y needs CXL hardware or QEMU (issue: emulated end to end).
Here a character device node with /dev/zero's numbers stands in for the
device (it can be mapped MAP_SHARED like device-DAX), and TRACT_SYSFS_ROOT
points at a sysfs tree laid out as the kernel lays out /sys/bus/dax.
"""
from __future__ import annotations

import os
import stat

import pytest

from tract_cli.core import medium
from tract_cli.core.errors import UsageError
from tract_cli.core.geometry import load_model
from tract_cli.core.region import FormatOptions, format_region

ZERO = os.stat("/dev/zero").st_rdev


@pytest.fixture
def fake_dax(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    sysfs = tmp_path / "sys"
    dev = sysfs / "bus" / "dax" / "devices" / "dax0.0"
    dev.mkdir(parents=True)
    (dev / "size").write_text(f"{64 << 20}\n")
    (dev / "align").write_text(f"{2 << 20}\n")
    (dev / "target_node").write_text("1\n")
    chardir = sysfs / "dev" / "char"
    chardir.mkdir(parents=True)
    (chardir / f"{os.major(ZERO)}:{os.minor(ZERO)}").symlink_to(dev)
    node = tmp_path / "dax0.0"
    os.mknod(node, stat.S_IFCHR | 0o600, ZERO)
    monkeypatch.setenv("TRACT_SYSFS_ROOT", str(sysfs))
    return str(node)


def test_a_dax_device_is_recognised_with_its_size_and_alignment(fake_dax):
    t = medium.inspect_target(fake_dax, for_write=True)
    assert (t.kind, t.size, t.alignment, t.dax_name) == ("devdax", 64 << 20, 2 << 20, "dax0.0")
    assert t.medium == "device-DAX dax0.0"


def test_init_formats_the_whole_device_with_clflush_by_default(fake_dax):
    info = format_region(fake_dax, None, FormatOptions(model=load_model("tiny")))
    assert info.region_size == 64 << 20
    assert info.flush_mode == "clflush"
    assert info.alignment == 2 << 20


def test_init_refuses_a_size_beyond_the_device(fake_dax):
    with pytest.raises(UsageError, match="exceeds dax0.0"):
        format_region(fake_dax, 128 << 20, FormatOptions(model=load_model("tiny")))


def test_init_refuses_a_size_off_the_device_alignment(fake_dax):
    with pytest.raises(UsageError, match="not a multiple of the alignment"):
        format_region(fake_dax, 33 << 20, FormatOptions(model=load_model("tiny")))


def test_a_character_device_that_is_not_dax_is_refused(tmp_path, monkeypatch):
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    monkeypatch.setenv("TRACT_SYSFS_ROOT", str(tmp_path / "empty-sys"))
    node = tmp_path / "notdax"
    os.mknod(node, stat.S_IFCHR | 0o600, ZERO)
    with pytest.raises(UsageError, match="not a device-DAX"):
        medium.inspect_target(str(node), for_write=True)
