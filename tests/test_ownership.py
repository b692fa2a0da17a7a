"""Who may use a region: region files and node-local segments are 0600 by
default, 0660 in a group with `tract init --group`, and another user's
region is refused unless it is shared with one of the caller's groups."""
from __future__ import annotations

import grp
import os
import stat
import subprocess
import sys
import uuid

import pytest

from conftest import remove_region
from tract_cli.core.errors import TractError, UsageError
from tract_cli.core.local import local_path
from tract_cli.core.pool import Pool

OTHER_UID = 4242


@pytest.fixture
def path():
    p = f"/dev/shm/tract-test-own-{uuid.uuid4().hex[:8]}.pool"
    yield p
    remove_region(p)


def mode_of(p: str) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


def a_group() -> grp.struct_group:
    """A group other than our own primary one (nogroup, daemon, ...)."""
    for g in grp.getgrall():
        if g.gr_gid != os.getegid():
            return g
    pytest.skip("no second group on this machine")


def test_a_region_and_its_local_segments_are_private_by_default(path):
    old = os.umask(0)                       # a permissive umask must not widen them
    try:
        with Pool.create(path, 4 << 20, "tiny", nodes=2) as p:
            seg = local_path(p.info.uuid, 0)
            assert mode_of(path) == 0o600
            assert mode_of(seg) == 0o600
    finally:
        os.umask(old)


def test_group_sharing_applies_to_the_region_and_its_segments(path):
    g = a_group()
    res = subprocess.run([sys.executable, "-m", "tract_cli.cli", "init", path, "--size", "4M",
                          "--model", "tiny", "--group", g.gr_name, "-q"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert mode_of(path) == 0o660 and os.stat(path).st_gid == g.gr_gid
    with Pool.attach(path, node=1) as p:
        seg = local_path(p.info.uuid, 1)
        assert mode_of(seg) == 0o660 and os.stat(seg).st_gid == g.gr_gid


def test_an_unknown_group_is_one_clear_line(path):
    res = subprocess.run([sys.executable, "-m", "tract_cli.cli", "init", path, "--size", "4M",
                          "--model", "tiny", "--group", "no-such-group-tract"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode != 0
    assert "unknown group 'no-such-group-tract'" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert not os.path.exists(path)


def as_user(monkeypatch, uid: int, gid: int, groups: list[int]) -> None:
    """The ownership rule as it applies to another (non-root) user."""
    monkeypatch.setattr(os, "geteuid", lambda: uid)
    monkeypatch.setattr(os, "getegid", lambda: gid)
    monkeypatch.setattr(os, "getgroups", lambda: groups)


def test_another_users_region_is_refused_even_if_the_mode_would_allow_it(path, monkeypatch):
    Pool.create(path, 4 << 20, "tiny", nodes=2).close()
    os.chown(path, OTHER_UID, -1)
    os.chmod(path, 0o666)                       # world-writable: the kernel would allow it
    as_user(monkeypatch, 5555, 5555, [5555])
    with pytest.raises(TractError, match="is not shared with your groups") as e:
        Pool.attach(path, readonly=True, local=False, prefault=False)
    assert "--group" in e.value.fix


def test_a_region_shared_with_one_of_my_groups_is_attached(path, monkeypatch):
    g = a_group()
    Pool.create(path, 4 << 20, "tiny", nodes=2, group=g.gr_name).close()
    os.chown(path, OTHER_UID, -1)
    as_user(monkeypatch, 5555, 5555, [5555, g.gr_gid])
    with Pool.attach(path, readonly=True, local=False, prefault=False) as p:
        assert p.info.max_nodes == 2


def test_group_sharing_of_a_device_is_refused_with_the_fix(monkeypatch):
    from tract_cli.core import region
    from tract_cli.core.geometry import load_model

    class Dev:
        kind, size, alignment, dax_name, path = "devdax", 64 << 20, 2 << 20, "dax9.9", "/dev/dax9.9"
    monkeypatch.setattr(region.medium, "inspect_target", lambda p, for_write=True: Dev())
    monkeypatch.setattr(region, "probe", lambda p, t: ("empty", None))
    monkeypatch.setattr(region.medium, "processes_using", lambda p: [])
    with pytest.raises(UsageError, match="udev"):
        region.format_region("/dev/dax9.9", None, region.FormatOptions(model=load_model("tiny")),
                             group="daemon")


@pytest.mark.parametrize("zero", [False, True], ids=["default", "zero-on-free"])
def test_freed_kv_is_cleared_only_with_zero_on_free(path, zero):
    """An evicted block's slot is handed to the next writer as it is, unless the
    region was formatted --zero-on-free: then nothing of it survives the free."""
    import numpy as np
    from agents import RunningAgent
    from tract_cli.core.hashing import block_hashes, pool_root
    from tract_cli.core.region import FormatOptions, format_region
    from tract_cli.core.geometry import load_model
    info = format_region(path, 4 << 20, FormatOptions(model=load_model("tiny"), max_nodes=2,
                                                      zero_on_free=zero))
    assert info.zero_on_free is zero
    agent = RunningAgent(path, 0)
    try:
        with Pool.attach(path, node=1) as p:
            keys = block_hashes(np.arange(64, dtype=np.int32), root=pool_root(p.info))
            kv = np.full((len(keys), p.info.block_bytes), 0xAB, np.uint8)
            p.index.put(keys, kv)
            hit = p.index.lookup(keys)
            slots = hit.slots.copy()
            p.index.unpin(hit)
            assert p.index.evict(len(keys)) == len(keys)
            left = np.stack([p.slot_bytes(int(s)).copy() for s in slots])
    finally:
        agent.stop()
    assert (left == 0).all() if zero else (left == 0xAB).all()
