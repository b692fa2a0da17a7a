"""A node-local segment whose region file is gone and that no live process
uses (its agent was gone before the region: nothing stopped for it) is
removed by what a user runs anyway -- an agent's start, `tract init`, the
removal of a region -- while one whose region still exists, one a live
process maps, and one of another layout version stay.

Each test keeps its segments in a directory of its own (TRACT_LOCAL_DIR, in
/dev/shm), so that no other sweep on this host takes them first."""
from __future__ import annotations

import os
import shutil
import struct
import subprocess
import sys
import uuid as uuidlib

import pytest

from agents import RunningAgent
from procs import Worker, wait_for
from tract_cli.core.local import local_path, sweep_segments
from tract_cli.core.pool import Pool
from tract_cli.core.region import remove_region

SHM = "/dev/shm"
WAIT_S = 90          # bound of every wait below (two busy cores)
TRACT = [sys.executable, "-m", "tract_cli.cli"]


@pytest.fixture
def segment_dir(monkeypatch):
    """A directory of local segments for this test alone (inherited by the
    processes it starts)."""
    path = os.path.join(SHM, f"tract-test-{uuidlib.uuid4().hex[:12]}-local")
    os.mkdir(path, 0o700)
    monkeypatch.setenv("TRACT_LOCAL_DIR", path)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def regions():
    """Makes regions in /dev/shm (16 MiB, tiny model); removes what is left."""
    made = []

    def make(nodes: int = 3) -> tuple[str, str]:
        path = os.path.join(SHM, f"tract-test-{uuidlib.uuid4().hex[:12]}.pool")
        made.append(path)
        with Pool.create(path, 16 << 20, "tiny", nodes=nodes) as p:
            return path, p.info.uuid

    yield make
    for path in made:
        remove_region(path)


def segments(segment_dir: str, uuid: str) -> list[int]:
    """The nodes of region UUID that have a segment (or a half-built one)."""
    prefix = f"tract-{uuid}-node"
    return sorted(int(n[len(prefix):].split(".")[0]) for n in os.listdir(segment_dir)
                  if n.startswith(prefix))


def an_older_segment(uuid: str) -> str:
    """A segment of layout version 6 (no origin recorded): nothing says where
    its region is, so it is never judged garbage."""
    path = local_path(uuid, 0)
    with open(path, "wb") as f:
        f.write(struct.pack("<QII16s", 0x434F4C5443415254, 6, 0, uuidlib.UUID(uuid).bytes))
        f.truncate(1 << 20)
    return path


ENTRIES = ["an agent starts", "tract init", "a region is removed"]


@pytest.mark.parametrize("entry", ENTRIES)
def test_a_gone_regions_unused_segments_are_swept_and_no_other(segment_dir, regions, entry):
    gone, gone_uuid = regions()            # node 0's segment: the process that made it
    kept, kept_uuid = regions()            # still there: its node 0's segment stays
    held, held_uuid = regions()            # removed, but a live process maps node 1's
    other, _ = regions()                   # what the entry point works on
    # node 1 of the gone region: a process killed (its journal entry stays,
    # naming a dead pid); node 2: one that exited
    killed = Worker(gone, 1)
    killed.kill()
    killed.close()
    with Worker(gone, 2):
        pass
    holder = Worker(held, 1)
    older = an_older_segment(str(uuidlib.uuid4()))
    try:
        assert segments(segment_dir, gone_uuid) == [0, 1, 2]
        os.unlink(gone)
        os.unlink(held)

        if entry == "an agent starts":
            with RunningAgent(other, 0, manager=True):
                wait_for("the agent's start to sweep the gone region's segments",
                         lambda: not segments(segment_dir, gone_uuid), WAIT_S)
        elif entry == "tract init":
            new = other + ".new"
            try:
                res = subprocess.run([*TRACT, "init", new, "--size", "16M", "--model", "tiny",
                                      "--quiet"], capture_output=True, text=True, timeout=WAIT_S)
                assert res.returncode == 0, res.stderr
            finally:
                # not remove_region: it sweeps too, and the sweep checked is init's
                if os.path.exists(new):
                    os.unlink(new)
        else:
            remove_region(other)
        assert not segments(segment_dir, gone_uuid), os.listdir(segment_dir)
        assert segments(segment_dir, kept_uuid) == [0]        # its region exists
        assert segments(segment_dir, held_uuid) == [1]        # node 0's: no process used it
        assert os.path.exists(older)                          # whose region, nothing says
        assert holder.call("ready")                            # what it maps still works
    finally:
        holder.kill()
        holder.close()
    assert sweep_segments() == [local_path(held_uuid, 1)]     # now nothing uses it
    assert os.path.exists(older) and segments(segment_dir, kept_uuid) == [0]
