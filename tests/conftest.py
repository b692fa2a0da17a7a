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
import background  # noqa: E402


# long self-contained checks run beside the suite (tests/background.py): the
# tests that assert on them run last, and whatever is still running when the
# session ends is stopped

def pytest_sessionstart(session):
    background.reset()


@pytest.hookimpl(trylast=True)          # after -k/-m have deselected
def pytest_collection_modifyitems(session, config, items):
    later = [item for item in items if background.checks_of(item)]
    if later:
        items[:] = [item for item in items if not background.checks_of(item)] + later


@pytest.hookimpl(tryfirst=True)
def pytest_runtestloop(session):
    if session.config.option.collectonly or session.testsfailed:
        return                  # nothing will run: start nothing
    background.start(c for item in session.items if not background.will_skip(item)
                     for c in background.checks_of(item))


def pytest_sessionfinish(session):
    kept = background.stop(keep_dirs=bool(session.testsfailed))
    if kept:
        print("\nthe background checks' directories are kept for a look: " + " ".join(kept))


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


@pytest.fixture
def managed_region(region_path):
    """An 8 MiB region of the tiny model (4 nodes, 4 index stripes) with node
    0's agent running the lock manager (stopped afterwards)."""
    from agents import RunningAgent
    from tract_cli.core.pool import Pool

    Pool.create(region_path, 8 << 20, "tiny", nodes=4, index_stripes=4).close()
    agent = RunningAgent(region_path, 0, manager=True)
    yield region_path
    agent.stop()


# real vLLM (tests/test_vllm*.py): what every module can share is made once a session

@pytest.fixture(scope="session")
def vllm_checkpoint(tmp_path_factory):
    """The tiny random-weight checkpoint the real-vLLM tests serve (tests/vllm_model.py),
    made once: a fresh one per module only repeated the same seconds of imports."""
    from tests.vllm_stack import make_checkpoint
    return make_checkpoint(str(tmp_path_factory.mktemp("vllm-ckpt") / "ckpt"))


@pytest.fixture(scope="session")
def vllm_mono(vllm_checkpoint, tmp_path_factory):
    """The monolithic vLLM (no connector) that every answer is compared with, one for
    the session: no test stops, kills or reconfigures it, and its answers at
    temperature 0 do not depend on what it served before. Started here, waited for
    by `tests.vllm_stack.start_stack` beside the stack's own servers (they start
    together); stopped at the end of the session."""
    from tests.vllm_stack import start_mono
    server = start_mono(vllm_checkpoint, str(tmp_path_factory.mktemp("vllm-mono") / "mono.log"))
    try:
        yield server
    finally:
        server.stop()
