"""`tract doctor` on this machine and on a recorded two-node topology;
pinning to CPUs and NUMA nodes."""
from __future__ import annotations

import json
import os
import platform
import stat
import subprocess
import sys

import pytest

from tract_cli.core.errors import UsageError
from tract_cli.provision import doctor, topology

NAMES = ["cpu flush", "checksum", "virtualization", "numa topology", "placement", "huge pages",
         "memlock", "kernel", "tools"]


def doctor_json(*args, env=None):
    res = subprocess.run([sys.executable, "-m", "tract_cli.cli", "doctor", *args, "--json"],
                         capture_output=True, text=True, timeout=120, env=env or os.environ)
    return res.returncode, json.loads(res.stdout)


def test_doctor_on_this_machine_is_sensible_and_stable():
    rc, first = doctor_json()
    _, second = doctor_json()
    assert rc == 0
    assert [c["name"] for c in first["checks"]] == NAMES
    assert [(c["name"], c["status"]) for c in first["checks"]] == \
        [(c["name"], c["status"]) for c in second["checks"]]
    by = {c["name"]: c for c in first["checks"]}
    assert by["cpu flush"]["status"] == "PASS" and "clflush" in by["cpu flush"]["detail"]
    assert by["numa topology"]["status"] == "PASS"
    assert set(first["summary"]) == {"pass", "warn", "fail", "info"}
    assert all(set(c) == {"name", "status", "detail", "fix"} for c in first["checks"])


def test_doctor_on_a_region_checks_space_and_permissions(region_path):
    from tract_cli.core.pool import Pool
    Pool.create(region_path, 16 << 20, "tiny", flush_mode="clflush").close()
    rc, data = doctor_json(region_path)
    by = {c["name"]: c for c in data["checks"]}
    assert rc == 0
    assert "region flush mode clflush" in by["cpu flush"]["detail"]
    assert by["space"]["status"] == "PASS" and "fully reserved" in by["space"]["detail"]
    assert by["permissions"]["status"] == "PASS"


@pytest.fixture
def two_node_sysfs(tmp_path, monkeypatch):
    """Node 0: CPUs 0-1; node 1: CPU-less CXL memory holding dax0.0 (as in the guests)."""
    sysfs = tmp_path / "sys"
    nodes = sysfs / "devices" / "system" / "node"
    for n, cpus, dist in ((0, "0-1", "10 20"), (1, "", "20 10")):
        (nodes / f"node{n}").mkdir(parents=True)
        (nodes / f"node{n}" / "cpulist").write_text(cpus + "\n")
        (nodes / f"node{n}" / "distance").write_text(dist + "\n")
    (nodes / "online").write_text("0-1\n")
    dax = sysfs / "bus" / "dax" / "devices" / "dax0.0"
    dax.mkdir(parents=True)
    for k, v in (("size", 64 << 20), ("align", 2 << 20), ("target_node", 1), ("numa_node", 0)):
        (dax / k).write_text(f"{v}\n")
    monkeypatch.setenv("TRACT_SYSFS_ROOT", str(sysfs))
    return sysfs


def test_topology_from_sysfs(two_node_sysfs):
    assert topology.online_nodes() == [0, 1]
    assert topology.node_cpus(0) == [0, 1] and topology.node_cpus(1) == []
    assert topology.nearest_cpu_node(1) == 0


def test_placement_names_the_numactl_line(two_node_sysfs, tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mknod needs root")
    zero = os.stat("/dev/zero").st_rdev
    chardir = two_node_sysfs / "dev" / "char"
    chardir.mkdir(parents=True)
    (chardir / f"{os.major(zero)}:{os.minor(zero)}").symlink_to(
        two_node_sysfs / "bus" / "dax" / "devices" / "dax0.0")
    node = tmp_path / "dax0.0"
    os.mknod(node, stat.S_IFCHR | 0o600, zero)
    from tract_cli.core import medium
    rows = doctor.check_numa(medium.inspect_target(str(node), for_write=False))
    placement = next(r for r in rows if r.name == "placement")
    assert "dax0.0 is on node 1; nearest CPU node 0" in placement.detail
    assert "memory-only (CXL?) [1]" in rows[0].detail
    if set(os.sched_getaffinity(0)) <= {0, 1}:
        assert placement.status == "PASS"


def test_pin_rejects_a_cpu_less_node_with_the_nearest(two_node_sysfs):
    with pytest.raises(UsageError, match="has no CPUs .* --numa-node 0"):
        topology.pin(numa_node=1)
    with pytest.raises(UsageError, match="not online"):
        topology.pin(numa_node=5)


def test_pin_to_cpus_in_a_child_process():
    code = ("import os; from tract_cli.provision.topology import pin; pin(cpus='0');"
            "print(sorted(os.sched_getaffinity(0)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[0]", out.stderr


@pytest.mark.parametrize("text,cpus", [("0-3,8", [0, 1, 2, 3, 8]), ("2", [2]), ("", [])])
def test_parse_cpu_list(text, cpus):
    assert topology.parse_cpu_list(text) == cpus


def test_parse_cpu_list_rejects_garbage():
    with pytest.raises(UsageError):
        topology.parse_cpu_list("3-1")


@pytest.mark.skipif(platform.machine() != "x86_64", reason="an x86-64 check")
def test_the_cpu_shown_is_py_cpuinfos_and_the_verdict_the_c_cores(monkeypatch):
    """The flags shown come from py-cpuinfo; the verdict from the C core's own
    CPUID check, and where they disagree the detail says which one counts."""
    from tract_cli.core.native import cpu_features
    from tract_cli.provision import cpu
    monkeypatch.setattr(cpu, "cpu_info", lambda: {"brand_raw": "Test CPU 9000", "flags": ["fpu"]})
    row = doctor.check_flush(None)
    assert row.detail.startswith("Test CPU 9000 has no flush instruction")
    assert "clflush" in cpu_features() and row.status == "PASS"
    assert "TraCT's own CPUID check finds clflush" in row.detail
    monkeypatch.setattr(cpu, "cpu_info", lambda: {})        # py-cpuinfo could not tell
    row = doctor.check_flush(None)
    assert row.status == "PASS" and "has clflush" in row.detail and "CPUID" not in row.detail


def test_doctor_names_the_checksum_path_and_says_where_it_is_narrow():
    from tract_cli.core.cpu import cpu_features
    features = cpu_features()
    rc, data = doctor_json()
    by = {c["name"]: c for c in data["checks"]}
    expect = ("PASS" if {"vpclmulqdq_256", "vpclmulqdq_512"} & features else
              "INFO" if {"pclmulqdq", "sse4_2"} <= features else "WARN")
    assert by["checksum"]["status"] == expect, by["checksum"]
    if not {"pclmulqdq", "sse4_2"} <= features:
        return              # the narrower paths below need the fold to hide
    for env, status in (({"TRACT_NO_VPCLMUL": "1"}, "INFO"), ({"TRACT_NO_PCLMUL": "1"}, "WARN")):
        rc, data = doctor_json(env={**os.environ, **env})
        check = {c["name"]: c for c in data["checks"]}["checksum"]
        assert rc == 0 and check["status"] == status, (env, check)
        assert "tract microbench kvpages" in check["fix"]
