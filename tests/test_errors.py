"""Errors are typed all the way up: every code of the C core becomes its own
`TractError` subclass, with a one-line message, wherever it is raised; so a
lock timeout inside an index lookup is caught as `LockTimeout`, and no code
decides by an error's text."""
from __future__ import annotations

import numpy as np
import pytest

from tract_cli.core import errors
from tract_cli.core.errors import BlocksPending, HandoffError, LockTimeout, TractError
from tract_cli.core.hashing import block_hashes, pool_root
from tract_cli.core.native import lib, raise_for
from tract_cli.core.pool import Pool

CODES = sorted((name, getattr(lib, name)) for name in dir(lib) if name.startswith("TRACT_E_"))


def test_the_core_has_error_codes():
    assert len(CODES) >= 20, CODES


@pytest.mark.parametrize("name,code", CODES, ids=[n for n, _ in CODES])
def test_every_code_raises_its_own_class_with_one_line(name, code):
    with pytest.raises(TractError) as got:
        raise_for(code, "/dev/shm/x")
    err = got.value
    assert type(err) is not TractError, f"{name} raises the bare TractError"
    assert type(err).__module__ == errors.__name__, f"{name}: {type(err)} is not in core.errors"
    text = str(err)
    assert "\n" not in text and "C core error" not in text and text.startswith("/dev/shm/x")


def test_a_lock_timeout_inside_a_lookup_is_a_lock_timeout(region_path):
    """Once the agent is gone no manager grants the stripe locks: the lookup of
    blocks the pool holds (a miss takes no lock) waits, bounded, and ends as
    LockTimeout, not as a TractError whose text says so."""
    from agents import RunningAgent
    Pool.create(region_path, 16 << 20, "tiny", nodes=2).close()
    with Pool.attach(region_path, node=1) as p:
        keys = block_hashes(np.arange(32, dtype=np.int32), root=pool_root(p.info))
        with RunningAgent(region_path, 0, manager=True):
            p.index.put(keys, np.zeros((len(keys), p.info.block_bytes), np.uint8))
        with pytest.raises(LockTimeout):
            p.index.lookup(keys, timeout=0.3)


def test_publishing_absent_blocks_is_blocks_pending(region_path):
    """The handoff's retry loop keys on this type (core/handoff.py
    retry_while_pending), not on the message."""
    from agents import RunningAgent
    Pool.create(region_path, 16 << 20, "tiny", nodes=2).close()
    with RunningAgent(region_path, 0, manager=True), Pool.attach(region_path, node=1) as p:
        keys = block_hashes(np.arange(32, dtype=np.int32), root=pool_root(p.info))
        with pytest.raises(BlocksPending) as got:
            p.handoffs.publish("r", keys, 32)
        assert isinstance(got.value, HandoffError)
