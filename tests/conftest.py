"""Shared fixtures: region files in /dev/shm, removed after each test."""
from __future__ import annotations

import os
import uuid

import pytest

SHM = "/dev/shm"


def remove_region(path: str) -> None:
    """Removes a region file and its nodes' local segments."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as f:
        head = f.read(32)
    if head[:8] == b"TRACTPOL":
        from tract_cli.core.local import remove_segments
        remove_segments(str(uuid.UUID(bytes=head[16:32])))
    os.unlink(path)


@pytest.fixture
def region_path():
    """A fresh path for a region file in /dev/shm (removed afterwards, with
    its local segments)."""
    path = os.path.join(SHM, f"tract-test-{uuid.uuid4().hex[:12]}.pool")
    yield path
    remove_region(path)


@pytest.fixture
def tiny_pool(region_path):
    """A 16 MiB region of the tiny model (8 KiB blocks), attached as node 0."""
    from tract_cli.core.pool import Pool

    pool = Pool.create(region_path, 16 << 20, "tiny", nodes=4)
    yield pool
    if not pool.closed:
        pool.close()
