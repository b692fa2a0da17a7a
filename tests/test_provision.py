"""Provisioning against the real tools' recorded outputs (tests/data/cxl),
replayed by test doubles on PATH that log the command lines they get."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tract_cli.core.errors import AlreadyFormattedError
from tract_cli.provision import discovery, provision, tools
from tract_cli.provision.tools import ToolError

DATA = pathlib.Path(__file__).resolve().parent / "data" / "cxl"
FAKE = pathlib.Path(__file__).resolve().parent / "fake_tools" / "fake_tool.py"


def recorded(name: str) -> dict:
    """A recorded run as a fake response: body to stdout on success, stderr on failure."""
    lines = (DATA / name).read_text().splitlines(keepends=True)
    assert lines[0].startswith("# command:") and lines[1].startswith("# rc=")
    rc = int(lines[1].split("=", 1)[1])
    body = "".join(lines[2:])
    return {"rc": rc, "stdout": body if rc == 0 else "", "stderr": "" if rc == 0 else body,
            "_command": lines[0].split(":", 1)[1].strip()}


def items(name: str) -> list:
    return tools.parse_list(recorded(name)["stdout"])


EMPTY = {"rc": 0, "stdout": "[]\n"}
NOTHING = {"rc": 0, "stdout": ""}


@pytest.fixture
def fake_tools(tmp_path, monkeypatch):
    """Installs cxl/ndctl/daxctl doubles; returns (set_script, read_log)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("cxl", "ndctl", "daxctl"):
        (bin_dir / tool).write_text(f"#!/bin/sh\nexec {sys.executable} {FAKE} {tool} \"$@\"\n")
        os.chmod(bin_dir / tool, 0o755)
    script, log = tmp_path / "script.json", tmp_path / "calls.log"
    log.write_text("")
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("TRACT_FAKE_SCRIPT", str(script))
    monkeypatch.setenv("TRACT_FAKE_LOG", str(log))
    monkeypatch.setenv("TRACT_SYSFS_ROOT", str(tmp_path / "sys"))

    def set_script(mapping: dict) -> None:
        script.write_text(json.dumps({k: v if isinstance(v, list) else [v]
                                      for k, v in mapping.items()}))

    return set_script, lambda: log.read_text().splitlines()


# ---- parsers ----

def test_parse_memdevs_regions_namespaces_and_dax():
    (m,) = discovery.parse_memdevs(items("run3-tcg/06_cxl_list_M.txt"))
    assert (m.name, m.pmem_size, m.ram_size, m.serial) == ("mem0", 256 << 20, 0, 4660)
    (r,) = discovery.parse_regions(items("run3-tcg/13_cxl_list_R.txt"))
    assert (r.name, r.size, r.decode_state) == ("region0", 256 << 20, "commit")
    (ns,) = discovery.parse_namespaces(items("run3-tcg/16_ndctl_list_N_X.txt"))
    assert ns == {"dev": "namespace0.0", "mode": "devdax", "map": "dev", "size": 262144000,
                  "region": "region0", "chardevs": ["dax0.0"]}
    (d,) = discovery.parse_dax(items("run3-tcg/19_daxctl_list_D.txt"))
    assert (d.name, d.size, d.align, d.mode, d.target_node) == ("dax0.0", 262144000, 2 << 20,
                                                                 "devdax", 1)


def test_parse_a_device_onlined_as_system_ram():
    modes = {d.mode for d in discovery.parse_dax(items("run3-tcg/29_daxctl_list_D.txt"))}
    assert modes == {"system-ram"}


def test_a_ram_region_lists_its_type():
    regions = discovery.parse_regions(items("runD4-ram612/08_cxl_list_R_X.txt"))
    assert regions and regions[0].type == "ram"


# ---- planning ----

def inventory(**kw) -> discovery.Inventory:
    inv = discovery.Inventory()
    for k, v in kw.items():
        setattr(inv, k, v)
    return inv


def test_plan_from_a_bare_memdev():
    inv = inventory(memdevs=discovery.parse_memdevs(items("run3-tcg/06_cxl_list_M.txt")),
                    root_decoders=items("run3-tcg/08_cxl_list_D_d_root.txt"))
    steps = provision.plan("dax0.0", inv)
    assert [s.command for s in steps] == [
        "cxl create-region -m -d decoder0.0 -w 1 -t pmem mem0",
        "ndctl create-namespace -m devdax -a 2M --map=mem -r region0"]


def test_plan_for_a_region_without_namespace():
    inv = inventory(regions=discovery.parse_regions(items("run3-tcg/13_cxl_list_R.txt")))
    assert [s.command for s in provision.plan("dax0.0", inv)] == [
        "ndctl create-namespace -m devdax -a 2M --map=mem -r region0"]


def test_a_ready_device_needs_nothing():
    inv = inventory(dax=discovery.parse_dax(items("run3-tcg/19_daxctl_list_D.txt")))
    assert provision.plan("dax0.0", inv) == []


def test_system_ram_is_taken_back_only_with_force():
    inv = inventory(dax=discovery.parse_dax(items("run3-tcg/29_daxctl_list_D.txt")))
    with pytest.raises(AlreadyFormattedError, match="onlined as system RAM.*--force"):
        provision.plan("dax0.0", inv)
    assert [s.command for s in provision.plan("dax0.0", inv, force=True)] == [
        "daxctl reconfigure-device --mode=devdax --force dax0.0"]


def test_missing_tools_are_named_with_their_package():
    with pytest.raises(ToolError, match="install the package.*ndctl"):
        provision.plan("dax0.0", inventory(missing_tools=["cxl", "ndctl"]))


# ---- running, with the doubles ----

def bare_machine_script(after_region: bool = True) -> dict:
    region_list = recorded("run3-tcg/13_cxl_list_R.txt")
    return {
        "cxl list -M": recorded("run3-tcg/06_cxl_list_M.txt"),
        "cxl list -R": [EMPTY, region_list] if after_region else EMPTY,
        "cxl list -D -d root": recorded("run3-tcg/08_cxl_list_D_d_root.txt"),
        "ndctl list -N -X": [EMPTY, EMPTY, recorded("run3-tcg/16_ndctl_list_N_X.txt")],
        "daxctl list -D": [NOTHING, NOTHING, recorded("run3-tcg/19_daxctl_list_D.txt")],
        "cxl create-region -m -d decoder0.0 -w 1 -t pmem mem0":
            recorded("runC1-A/01_cxl_create_region_m_d_decoder0_0_w_1_t_pmem_mem0.txt"),
        "ndctl create-namespace -m devdax -a 2M --map=mem -r region0":
            recorded("run3-tcg/15_ndctl_create_namespace_m_devdax_a_2M_r_region0.txt"),
    }


def test_provisioning_walks_region_then_namespace(fake_tools):
    set_script, calls = fake_tools
    set_script(bare_machine_script())
    echoed = []
    done = provision.provision("/dev/dax0.0", echo=echoed.append)
    assert [s.command for s in done] == [
        "cxl create-region -m -d decoder0.0 -w 1 -t pmem mem0",
        "ndctl create-namespace -m devdax -a 2M --map=mem -r region0"]
    changing = [c for c in calls() if " list" not in c]
    assert changing == [s.command for s in done]
    assert all(line.startswith("running: ") for line in echoed)


def test_dry_run_prints_the_commands_and_changes_nothing(fake_tools, tmp_path):
    set_script, calls = fake_tools
    set_script(bare_machine_script())
    res = subprocess.run([sys.executable, "-m", "tract_cli.cli", "init", "/dev/dax0.0",
                          "--provision", "--dry-run"], capture_output=True, text=True, timeout=60,
                         env=os.environ)
    assert res.returncode == 0, res.stderr
    assert "would run: cxl create-region -m -d decoder0.0 -w 1 -t pmem mem0" in res.stderr
    assert "would run: ndctl create-namespace -m devdax -a 2M --map=mem -r region0" in res.stderr
    assert all(" list" in c for c in calls()), calls()


def test_provision_only_provisions_and_does_not_format(fake_tools):
    """A second host attaching to a device another host formatted: region and
    namespace as needed, then stop (there is no /dev/dax0.0 here to format)."""
    set_script, calls = fake_tools
    set_script(bare_machine_script())
    res = subprocess.run([sys.executable, "-m", "tract_cli.cli", "init", "/dev/dax0.0",
                          "--provision-only"], capture_output=True, text=True, timeout=60,
                         env=os.environ)
    assert res.returncode == 0, res.stderr
    assert "is provisioned (not formatted: --provision-only)" in res.stdout
    assert [c for c in calls() if " list" not in c] == [
        "cxl create-region -m -d decoder0.0 -w 1 -t pmem mem0",
        "ndctl create-namespace -m devdax -a 2M --map=mem -r region0"]


@pytest.mark.parametrize("command,recording,needle", [
    ("cxl create-region -m -d decoder0.0 -w 1 -t pmem mem0",
     "run3-tcg/11_cxl_create_region_m_d_decoder0_0_w_1_mem0.txt", "no free decoder"),
    ("daxctl reconfigure-device --mode=devdax --force dax0.0",
     "runD4-ram612/14_daxctl_reconfigure_device_mode_devdax_dax0_0.txt", "online as system RAM"),
])
def test_tool_failures_become_one_line_causes(fake_tools, command, recording, needle):
    set_script, _ = fake_tools
    set_script({command: recorded(recording)})
    with pytest.raises(ToolError, match=needle):
        tools.run(command.split(), device="dax0.0")


@pytest.mark.parametrize("recording,needle", [
    ("run3-tcg/33_daxctl_reconfigure_device_a_1G_dax0_0.txt", "does not support that alignment"),
    ("runD4-ram612/19_daxctl_reconfigure_device_mode_system_ram_dax0_0.txt", "auto-onlines"),
])
def test_recorded_failures_are_translated(recording, needle):
    r = recorded(recording)
    res = tools.ToolResult(tuple(r["_command"].split()), r["rc"], r["stdout"], r["stderr"])
    err = tools.translate(res, "dax0.0")
    assert needle in str(err) and len(str(err).splitlines()) == 1


def test_the_notes_failures_are_translated():
    for text, needle in [("failed to create namespace: No such device or address", "modprobe"),
                         ("cxl region: failed to commit decode: No such device or address",
                          "-hypervisor"),
                         ("Failed to synchronize CPU cache state", "-hypervisor")]:
        err = tools.translate(tools.ToolResult(("x",), 1, "", text))
        assert needle in str(err)


def test_devices_json_with_the_doubles(fake_tools):
    set_script, _ = fake_tools
    set_script({"cxl list -M": recorded("run3-tcg/06_cxl_list_M.txt"),
                "cxl list -R": recorded("run3-tcg/13_cxl_list_R.txt"),
                "cxl list -D -d root": recorded("run3-tcg/08_cxl_list_D_d_root.txt"),
                "ndctl list -N -X": recorded("run3-tcg/16_ndctl_list_N_X.txt"),
                "daxctl list -D": recorded("run3-tcg/19_daxctl_list_D.txt")})
    res = subprocess.run([sys.executable, "-m", "tract_cli.cli", "devices", "--json"],
                         capture_output=True, text=True, timeout=60, env=os.environ)
    assert res.returncode == 0, res.stderr
    data = json.loads(res.stdout)
    assert data["memdevs"][0]["name"] == "mem0"
    assert data["dax"][0] == {"name": "dax0.0", "size": 262144000, "align": 2097152,
                              "mode": "devdax", "target_node": 1, "numa_node": None,
                              "path": "/dev/dax0.0", "holds_tract": None}
    assert data["missing_tools"] == []
