"""The hardware path end to end: QEMU guests with an emulated CXL Type-3
device, the real kernel drivers and the real cxl/ndctl/daxctl, running the
project on a real /dev/dax0.0 (tools/cxl-vm, docs/CXL-VM.md).

The guest tests need qemu-system-x86, linux-image-amd64, ndctl, daxctl and
busybox-static (.ci/setup installs them); without them they skip and say
what is missing. Under TCG a guest takes minutes, so each scenario runs once,
in the background while the suite goes on (tests/background.py: the guests
share nothing with any other test and have no timing bound that load could
trip), and the test that asserts on it runs last.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

import background
from background import Check, uses
from tract_cli.core.pool import Pool

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VM_DIR = os.path.join(ROOT, "tools", "cxl-vm")
sys.path.insert(0, VM_DIR)
import cxlvm  # noqa: E402

LACKING = cxlvm.missing()
needs_qemu = pytest.mark.skipif(bool(LACKING), reason="no emulated CXL guests on this host: "
                                "missing " + "; ".join(LACKING))


def run_scenario(args: list[str], timeout: float) -> tuple[dict, str]:
    """Runs cxlvm.py as a user would: its result.json (failing with its output)
    and the directory of what it recorded."""
    out = os.path.join(background.session_dir("tract-cxlvm-"), args[0])
    res = background.run([sys.executable, os.path.join(VM_DIR, "cxlvm.py"), *args, "--out", out,
                          "--timeout", str(timeout)], timeout=timeout + 60)
    assert res.returncode == 0, f"cxlvm {args[0]} failed:\n{res.stderr[-4000:]}"
    with open(os.path.join(out, "result.json")) as f:
        return json.load(f), out


TWO_HOST = Check("cxl-vm: two-host", run_scenario,
                 ["two-host", "--requests", "8", "--iterations", "150"], 560, cost=120)


def recorded(out: str, role: str, needle: str) -> str:
    """The text of the one command output of ROLE whose file name contains NEEDLE."""
    names = [n for n in sorted(os.listdir(os.path.join(out, role))) if needle in n]
    assert names, f"no recorded output matching {needle!r} in {out}/{role}"
    with open(os.path.join(out, role, names[0])) as f:
        return f.read()


@needs_qemu
@uses(TWO_HOST)
def test_one_device_provisioned_formatted_used_and_shared_by_two_hosts():
    """One run of `cxlvm.py two-host` (each TCG guest takes minutes): its first
    guest is the one-host scenario (guest/one.sh: provision, format, report,
    round trip, check on a real /dev/dax0.0), checked from the host; then
    guests A and B share the device: locked counters, handoffs, no leftovers."""
    r, out = TWO_HOST.result()
    assert r["ok"], r["problems"]
    # the one-host part (the setup guest)
    one = r["setup"]
    dax = one["device"]["dax"]
    assert [d["name"] for d in dax] == ["dax0.0"]
    assert dax[0]["align"] == 2 << 20 and dax[0]["mode"] == "devdax"
    assert dax[0]["target_node"] == 1 and dax[0]["holds_tract"] is True
    assert one["device"]["namespaces"][0]["map"] == "mem"
    rt = one["roundtrip"]
    assert rt["medium"] == "device-DAX dax0.0" and rt["flush_mode"] == "clflush"
    assert rt["bytes_equal"] and rt["hits"] == rt["blocks_put"] == 64
    # what the guest wrote is in the host's backing file (checked by cxlvm: ok above)
    assert one["host_header"]["magic"] == "TRACTPOL"
    init = recorded(out, "setup", "tract_init")
    assert "cxl create-region -m -d decoder0.0 -w 1 -t pmem mem0" in init
    assert "ndctl create-namespace -m devdax -a 2M --map=mem -r region0" in init
    assert init.rstrip().endswith("# rc=0")
    assert "device-DAX" in recorded(out, "setup", "tract_info")
    assert recorded(out, "setup", "tract_check").rstrip().endswith("# rc=0")
    # the two hosts
    a, b = r["nodeA"], r["nodeB"]
    assert a["medium"] == b["medium"] == "device-DAX dax0.0"
    assert r["counter_in_file"] == r["counter_expected"] == 2 * 2 * 150
    assert a["lock_acquisitions"] == b["lock_acquisitions"] == 2 * 150
    assert b["handoffs_verified"] == 8 and b["corrupt_blocks"] == 0
    assert a["pins_left"] == b["pins_left"] == 0
    # B found the namespace the setup guest made, from the labels: no create-namespace
    node_init = recorded(out, "nodeB", "provision_only")
    assert "cxl create-region" in node_init and "create-namespace" not in node_init
    assert node_init.rstrip().endswith("# rc=0")
    for role in ("nodeA", "nodeB"):
        assert recorded(out, role, "tract_check").rstrip().endswith("# rc=0")
    for role in ("setup", "nodeA", "nodeB"):
        assert os.path.getsize(os.path.join(out, f"{role}.console")) > 0


# ---- the host-side pieces, without QEMU

def test_the_host_reads_a_region_header_at_the_device_dax_data_offset(tmp_path):
    """With --map=mem the device-DAX data starts 2 MiB into the memdev's file."""
    from tract_cli.core.native import lib
    from tract_cli.core.region import remove_region
    region = tmp_path / "region.pool"
    with Pool.create(str(region), 4 << 20, "tiny", nodes=2) as p:
        uuid = p.info.uuid
    backing = tmp_path / "cxl-mem.raw"
    with open(backing, "wb") as f:
        f.write(b"\xAB" * cxlvm.DAX_DATA_OFFSET)     # the namespace's info block lives here
        f.write(region.read_bytes())
    remove_region(str(region))                     # and its node's local segment
    h = cxlvm.read_region_header(str(backing))
    assert h == {"magic": "TRACTPOL", "version": lib.TRACT_FORMAT_VERSION, "uuid": uuid,
                 "region_size": 4 << 20}


def test_initramfs_archive_lists_init_busybox_and_modules_in_order(tmp_path):
    try:
        release, _ = cxlvm.kernel()
        path = cxlvm.build_initramfs(release, str(tmp_path / "initramfs.img"))
    except cxlvm.VmError as exc:
        pytest.skip(str(exc))
    names, files = read_newc(path)
    assert {"init", "bin/busybox", "modules.order", "host", "out"} <= set(names)
    order = [os.path.basename(p) for p in files["modules.order"].decode().split()]
    # a module comes after what it depends on (libnvdimm before cxl_pmem: an
    # "install" rule in modprobe.d hides that dependency from --show-depends)
    assert order.index("libnvdimm.ko") < order.index("cxl_pmem.ko")
    assert order.index("9pnet.ko") < order.index("9pnet_virtio.ko") < order.index("9p.ko")
    assert files["init"].startswith(b"#!/bin/busybox sh")


def read_newc(path: str) -> tuple[list[str], dict[str, bytes]]:
    """Names and contents of a gzip'd newc cpio archive (an independent reader)."""
    import gzip
    data = gzip.decompress(open(path, "rb").read())
    pos, names, files = 0, [], {}
    while True:
        assert data[pos:pos + 6] == b"070701", f"bad cpio header at {pos}"
        fields = [int(data[pos + 6 + 8 * i:pos + 14 + 8 * i], 16) for i in range(13)]
        size, namesize = fields[6], fields[11]
        name = data[pos + 110:pos + 110 + namesize - 1].decode()
        pos += 110 + namesize
        pos += -pos % 4
        if name == "TRAILER!!!":
            return names, files
        names.append(name)
        files[name] = data[pos:pos + size]
        pos += size
        pos += -pos % 4


def test_check_names_what_is_missing():
    res = subprocess.run([sys.executable, os.path.join(VM_DIR, "cxlvm.py"), "check"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == (1 if LACKING else 0)
    assert ("missing:" in res.stdout) == bool(LACKING)


def test_bad_arguments_give_one_line(tmp_path):
    res = subprocess.run([sys.executable, os.path.join(VM_DIR, "cxlvm.py"), "two-host",
                          "--out", str(tmp_path), "--requests", "0"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 1
    assert res.stderr.strip().startswith("cxlvm: ") and len(res.stderr.strip().splitlines()) == 1
