"""Access as a real other user (docs/PROTOCOLS.md §12): every command that
opens a region, run as `nobody` through setpriv, on a root-owned region that
is private (mode 0600), world-readable but not shared (0644), or shared with
one of the caller's groups (`tract init --group`). A refusal is one line and a
non-zero exit, never a traceback; a shared region works, local segments
included. Needs root (to become another user); skipped otherwise."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                                reason="needs root and setpriv to run as another user")

NOBODY = 65534
SHARED_GID = 4242
TRACT = [sys.executable, "-m", "tract_cli.cli"]


def as_nobody(args: list[str], groups: tuple[int, ...] = (), timeout: float = 120):
    """Runs ARGS as uid/gid 65534 with exactly GROUPS as supplementary groups."""
    group_opt = ["--groups", ",".join(map(str, groups))] if groups else ["--clear-groups"]
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/tmp"}
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", *group_opt,
                           *args], capture_output=True, text=True, timeout=timeout, env=env,
                          cwd="/tmp")


@pytest.fixture(scope="module", autouse=True)
def nobody_can_run_the_checkout():
    """Skips (with the reason) where user nobody cannot read this checkout."""
    res = as_nobody([sys.executable, "-c", "import tract_cli.cli"], timeout=120)
    if res.returncode != 0:
        err = (res.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"user nobody cannot run this checkout ({err}); make its folders "
                    "readable by others (o+rx) to run these tests")


def init(path: str, *extra: str) -> None:
    subprocess.run([*TRACT, "init", path, "--size", "16M", "--model", "tiny", "--nodes", "3",
                    *extra], check=True, capture_output=True, timeout=120)


@pytest.fixture
def region(region_path):
    init(region_path)
    return region_path


def wait_for_heartbeat(path: str, node: int, proc) -> None:
    """Waits (bounded) for PROC's heartbeat as NODE's agent."""
    from tract_cli.core.nodes import read_nodes
    from tract_cli.core.pool import Pool
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stderr.read()
        with Pool.attach(path, readonly=True, prefault=False) as p:
            rec = read_nodes(p)[node]
        if rec.agent_pid == proc.pid and rec.alive():
            return
        time.sleep(0.02)          # polling a heartbeat another process writes
    raise AssertionError(f"node {node}'s agent did not heartbeat within 30 s")


def one_line_refusal(res, *needles: str) -> None:
    err = res.stderr.strip()
    assert res.returncode != 0, (res.stdout, err)
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for needle in needles:
        assert needle in err, err


COMMANDS = [
    ["info", "{p}"],
    ["check", "{p}"],
    ["check", "{p}", "--json"],
    ["inspect", "{p}", "--locks"],
    ["agent", "--pool", "{p}", "--node", "1"],
    ["bench", "--pool", "{p}", "--input-len", "64", "--requests", "1"],
]


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(a for a in c if "{" not in a))
def test_a_private_region_is_refused_in_one_line(region, command):
    res = as_nobody([*TRACT, *(a.format(p=region) for a in command)])
    one_line_refusal(res, region, "no permission")


@pytest.mark.parametrize("command", COMMANDS, ids=lambda c: " ".join(a for a in c if "{" not in a))
def test_another_users_readable_region_is_still_refused(region, command):
    os.chmod(region, 0o644)
    res = as_nobody([*TRACT, *(a.format(p=region) for a in command)])
    if command[0] == "agent":       # it opens it read-write at once: the mode says no first
        one_line_refusal(res, region, "no permission to read and write")
    else:
        one_line_refusal(res, "belongs to user root", "--group")


def test_init_where_the_user_may_not_write_is_one_line(tmp_path):
    os.chmod(tmp_path, 0o755)
    res = as_nobody([*TRACT, "init", str(tmp_path / "r.pool"), "--size", "16M"])
    one_line_refusal(res, "permission denied")


def test_a_region_shared_with_my_group_works_local_segments_included(region_path):
    init(region_path, "--group", str(SHARED_GID))
    st = os.stat(region_path)
    assert (st.st_mode & 0o777, st.st_gid) == (0o660, SHARED_GID)
    for cmd in (["info", region_path], ["check", region_path]):
        res = as_nobody([*TRACT, *cmd], groups=(SHARED_GID,))
        assert res.returncode == 0, res.stderr
    # a whole node run by nobody: its agent (the lock manager) and a worker;
    # the local segments they create take the region's group and mode
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "HOME": "/tmp"}
    agent = subprocess.Popen(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}",
                              "--groups", str(SHARED_GID), *TRACT, "agent", "--pool", region_path,
                              "--node", "0", "--manager"], env=env, cwd="/tmp",
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_heartbeat(region_path, 0, agent)
        script = ("from tract_cli.core.pool import Pool\n"
                  f"with Pool.attach({region_path!r}, node=1) as p:\n"
                  "    p.allocator.free(p.allocator.alloc(4))\n"
                  "    print(p.allocator.local_free().size)\n")
        res = as_nobody([sys.executable, "-c", script], groups=(SHARED_GID,))
        assert res.returncode == 0 and int(res.stdout) >= 4, res.stderr
        from tract_cli.core.pool import Pool
        with Pool.attach(region_path, readonly=True, prefault=False) as p:
            uuid = p.info.uuid
        for node in (0, 1):
            seg = os.stat(f"/dev/shm/tract-{uuid}-node{node}.local")
            assert (seg.st_uid, seg.st_gid, seg.st_mode & 0o777) == (NOBODY, SHARED_GID, 0o660)
        # and the owner's processes of that node use the segment nobody created
        with Pool.attach(region_path, node=1) as p:
            assert p.allocator.local_free().size >= 4
    finally:
        agent.terminate()
        agent.wait(timeout=30)
    assert agent.returncode == 0, agent.stderr.read()
    # without the group, the same region is refused
    one_line_refusal(as_nobody([*TRACT, "info", region_path]), "no permission")
