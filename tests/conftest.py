"""Shared fixtures: region files in /dev/shm, removed after each test."""
from __future__ import annotations

import os
import uuid

import pytest

SHM = "/dev/shm"

# the peer environments .ci/setup installs (tract bench's NIXL transport)
_PEERS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), ".peers")
if os.path.isdir(_PEERS):
    os.environ.setdefault("TRACT_PEERS_DIR", _PEERS)


from tract_cli.core.region import remove_region  # noqa: E402  (re-exported for tests)


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
