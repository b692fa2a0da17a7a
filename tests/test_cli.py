"""`tract init` / `tract info` end to end: output, JSON, exit codes, one-line errors."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from tract_cli.core.native import lib

TRACT = [sys.executable, "-c", "from tract_cli.cli import main; main()"]


def tract(*args, no_dac_override: bool = False, env: dict | None = None):
    cmd = TRACT + list(args)
    if no_dac_override:
        # root without the capabilities that bypass file permissions
        cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search"] + cmd
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                          env={**os.environ, **(env or {})})


def assert_one_line_error(res, code: int, *needles: str):
    assert res.returncode == code, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("tract: error:"), lines[0]
    assert "Traceback" not in res.stderr
    for n in needles:
        assert n in lines[0], lines[0]


def test_init_then_info_json(region_path):
    res = tract("init", region_path, "--size", "64M", "--nodes", "4", "--model", "llama-3-8b",
                "--json")
    assert res.returncode == 0, res.stderr
    created = json.loads(res.stdout)
    assert 0 < created["timings"]["format_s"] < 60
    res = tract("info", region_path, "--json")
    assert res.returncode == 0, res.stderr
    info = json.loads(res.stdout)
    assert info["uuid"] == created["uuid"]
    assert info["geometry"]["num_layers"] == 32
    assert info["block_bytes"] == 2 << 20
    assert info["max_nodes"] == 4
    assert info["slot_usage"] == {"total": info["slot_count"], "used": 0,
                                  "free": info["slot_count"], "claimed_by_node": {}}
    assert info["medium"] == "emulated /dev/shm region"
    assert [s["name"] for s in info["sections"]] == [
        "locks", "nodes", "objdir", "alloc", "bitmap", "owners", "buckets", "pins", "lru",
        "transfer", "events", "records", "data"]


def test_info_human_output_names_the_essentials(region_path):
    assert tract("init", region_path, "--size", "32M", "--model", "tiny", "-q").returncode == 0
    res = tract("info", region_path)
    assert res.returncode == 0
    for needle in (f"TraCT v{lib.TRACT_FORMAT_VERSION}", "tiny", "flush mode", "none", "buckets", "data", "emulated"):
        assert needle in res.stdout


def test_init_refuses_an_existing_region_then_force_overwrites(region_path):
    assert tract("init", region_path, "--size", "32M", "--model", "tiny", "-q").returncode == 0
    assert_one_line_error(tract("init", region_path, "--size", "32M", "--model", "tiny"), 1,
                          "already holds a TraCT region", "model tiny", "--force")
    assert tract("init", region_path, "--size", "32M", "--model", "tiny", "--force",
                 "-q").returncode == 0


@pytest.mark.parametrize("args,code,needle", [
    (["--size", "33M"], 2, "not a multiple of the alignment"),
    (["--size", "2M"], 2, "too small"),
    (["--size", "lots"], 2, "cannot read size"),
    (["--size", "32M", "--nodes", "0"], 2, "out of range"),
    (["--size", "32M", "--model", "gpt-x"], 2, "unknown model"),
    (["--size", "32M", "--flush-mode", "magic"], 2, "unknown flush mode"),
    ([], 2, "needs --size"),
])
def test_init_rejects_bad_arguments_and_writes_nothing(region_path, args, code, needle):
    assert_one_line_error(tract("init", region_path, "--model", "tiny", *args)
                          if "--model" not in args else tract("init", region_path, *args),
                          code, needle)
    assert not os.path.exists(region_path)


def test_init_in_a_missing_directory():
    assert_one_line_error(tract("init", "/nonexistent-dir/x.pool", "--size", "32M"), 2,
                          "does not exist")


def test_init_on_a_directory(tmp_path):
    assert_one_line_error(tract("init", str(tmp_path), "--size", "32M"), 2, "is a directory")


def test_info_on_missing_path():
    assert_one_line_error(tract("info", "/dev/shm/definitely-not-here.pool"), 2, "does not exist")


def test_info_on_a_file_of_other_data(region_path):
    with open(region_path, "wb") as f:
        f.write(os.urandom(8192))
    assert_one_line_error(tract("info", region_path), 1, "holds no TraCT region", "tract init")


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root to drop capabilities")
def test_no_permission(region_path):
    assert tract("init", region_path, "--size", "32M", "--model", "tiny", "-q").returncode == 0
    os.chown(region_path, 65534, 65534)
    os.chmod(region_path, 0o600)
    assert_one_line_error(tract("info", region_path, no_dac_override=True), 1, "no permission")
    assert_one_line_error(tract("init", region_path, "--size", "32M", "--force",
                                no_dac_override=True), 1, "no permission")


@pytest.fixture
def small_tmpfs(tmp_path):
    """An 8 MiB tmpfs, to run out of space in (needs root)."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                         capture_output=True)
    if res.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    yield mnt
    subprocess.run(["umount", str(mnt)], check=True)


def test_full_tmpfs_is_reported_at_init_and_nothing_is_left(small_tmpfs):
    path = small_tmpfs / "r.pool"
    assert_one_line_error(tract("init", str(path), "--size", "32M", "--model", "tiny"), 1,
                          "free but the region needs", "smaller --size")
    assert not path.exists()


def test_usage_errors_exit_2():
    res = tract("init")
    assert res.returncode == 2
    assert "Traceback" not in res.stderr
