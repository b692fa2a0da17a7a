#!/usr/bin/env python3
"""TraCT on an emulated CXL Type-3 device: QEMU guests with a real /dev/dax0.0.

    cxlvm.py check                       what is missing on this host (exit 1 if anything)
    cxlvm.py one-host --out DIR          provision, format and use /dev/dax0.0 in one guest
    cxlvm.py two-host --out DIR          two guests share one device: handoffs + shared lock

Each guest boots Debian's kernel under TCG with an initramfs built here (busybox
and the CXL / nvdimm / dax / virtio-9p modules), mounts this host's / read-only
over virtio-9p and runs the project from this checkout with this interpreter in
a chroot: nothing is installed into the guest. The CXL device's memory is a
file on the host (`cxl-mem.raw` in DIR); with `--map=mem` the device-DAX data
starts 2 MiB into it, so this script verifies from the host what the guests
wrote. Every command a guest runs is recorded in DIR/<role>/NN_<command>.txt
(first line `# command: ...`), the guest's console in DIR/<role>.console, and
the results in DIR/result.json. Facts and pitfalls: docs/CXL-VM.md.

Standard library only: it runs with any python3 >= 3.9.
"""
from __future__ import annotations

import argparse
import glob
import gzip
import io
import json
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
PROJECT = os.path.dirname(os.path.dirname(HERE))
QEMU = "qemu-system-x86_64"
DEVICE_SIZE = 256 << 20          # the emulated memdev (and its label area)
DAX_DATA_OFFSET = 0x200000       # --map=mem: device-DAX data starts 2 MiB into the memdev
EXIT_MARK = "TRACT-VM-EXIT rc="
# the CXL, nvdimm, dax and virtio-9p drivers the guest needs, in load order
MODULES = ("cxl_acpi", "cxl_pci", "cxl_mem", "cxl_pmem", "libnvdimm", "nd_pmem", "nd_btt",
           "dax_pmem", "device_dax", "kmem", "virtio_pci", "9pnet_virtio", "9p")
PACKAGES = {QEMU: "qemu-system-x86", "busybox": "busybox-static", "cxl": "ndctl",
            "ndctl": "ndctl", "daxctl": "daxctl", "kernel": "linux-image-amd64",
            "modinfo": "kmod"}


class VmError(Exception):
    """One line for the user: what failed and what to do."""


# ---------------------------------------------------------------- host checks

def kernel() -> tuple[str, str]:
    """(release, vmlinuz path) of the newest kernel in /boot with its modules."""
    found = []
    for path in glob.glob("/boot/vmlinuz-*"):
        release = os.path.basename(path)[len("vmlinuz-"):]
        if os.path.isdir(f"/lib/modules/{release}/kernel/drivers/cxl"):
            found.append((release, path))
    if not found:
        raise VmError("no kernel with CXL modules in /boot: install the package linux-image-amd64")
    return sorted(found, key=lambda r: [int(x) if x.isdigit() else x
                                        for x in r[0].replace("-", ".").split(".")])[-1]


def missing() -> list[str]:
    """Lines naming what this host lacks to run the guests (empty: ready)."""
    out = []
    for tool in (QEMU, "cxl", "ndctl", "daxctl", "modinfo"):
        if shutil.which(tool) is None and not os.path.exists(f"/sbin/{tool}"):
            out.append(f"{tool} (package {PACKAGES[tool]})")
    busybox = shutil.which("busybox")
    if busybox is None or not _is_static(busybox):
        out.append("a static busybox (package busybox-static)")
    try:
        release, vmlinuz = kernel()
        if not os.access(vmlinuz, os.R_OK):
            out.append(f"read access to {vmlinuz} (run as root)")
    except VmError:
        out.append("a kernel with CXL modules (package linux-image-amd64)")
    if not os.path.exists(os.path.join(PROJECT, ".venv", "bin", "python")) and not _importable():
        out.append("the project installed (bash .ci/setup, or pip install -e .)")
    return out


def _is_static(path: str) -> bool:
    """Whether the ELF64 executable at PATH has no PT_INTERP (a static binary)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:4] != b"\x7fELF" or head[4] != 2:
            return False
        phoff, = struct.unpack_from("<Q", head, 32)
        phentsize, phnum = struct.unpack_from("<HH", head, 54)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    return all(struct.unpack_from("<I", table, i * phentsize)[0] != 3     # PT_INTERP
               for i in range(phnum))


def _importable() -> bool:
    return subprocess.run([sys.executable, "-c", "import tract_cli._native"],
                          capture_output=True).returncode == 0


def guest_python() -> str:
    """The interpreter the guests run: the project's .venv, else this one."""
    venv = os.path.join(PROJECT, ".venv", "bin", "python")
    return venv if os.path.exists(venv) else sys.executable


# ---------------------------------------------------------------- initramfs

def module_order(release: str) -> list[str]:
    """Module files in dependency order, each once (from modinfo: modprobe's
    --show-depends stops at "install" rules such as ndctl's for libnvdimm)."""
    order: list[str] = []

    def add(name: str, seen: tuple = ()) -> None:
        if name in seen:
            return
        info = {}
        for field in ("filename", "depends"):
            res = subprocess.run(["modinfo", "-k", release, "-F", field, name],
                                 capture_output=True, text=True)
            if res.returncode != 0:
                raise VmError(f"kernel {release} has no module {name}: {res.stderr.strip()}")
            info[field] = res.stdout.strip()
        for dep in filter(None, info["depends"].split(",")):
            add(dep, seen + (name,))
        if info["filename"] not in order and info["filename"] != "(builtin)":
            order.append(info["filename"])

    for name in MODULES:
        add(name)
    return order


class Cpio:
    """A gzip'd cpio archive in the kernel's "newc" format."""

    def __init__(self):
        self.buf = io.BytesIO()
        self.ino = 1
        self.dirs: set[str] = set()

    def _entry(self, name: str, mode: int, data: bytes = b"") -> None:
        name_b = name.encode() + b"\0"
        fields = [self.ino, mode, 0, 0, 1, 0, len(data), 0, 0, 0, 0, len(name_b), 0]
        self.ino += 1
        self.buf.write(b"070701" + b"".join(b"%08X" % v for v in fields) + name_b)
        self.buf.write(b"\0" * (-(110 + len(name_b)) % 4))
        self.buf.write(data + b"\0" * (-len(data) % 4))

    def dir(self, name: str) -> None:
        parts = name.strip("/").split("/")
        for i in range(1, len(parts) + 1):
            d = "/".join(parts[:i])
            if d not in self.dirs:
                self.dirs.add(d)
                self._entry(d, stat.S_IFDIR | 0o755)

    def file(self, name: str, data: bytes, mode: int = 0o644) -> None:
        self.dir(os.path.dirname(name.strip("/")))
        self._entry(name.strip("/"), stat.S_IFREG | mode, data)

    def finish(self) -> bytes:
        self._entry("TRAILER!!!", 0)
        return gzip.compress(self.buf.getvalue(), compresslevel=1)


def build_initramfs(release: str, dest: str) -> str:
    """Writes the guest's initramfs (busybox, modules, /init) to DEST."""
    arc = Cpio()
    busybox = shutil.which("busybox")
    if busybox is None:
        raise VmError("no busybox: install the package busybox-static")
    with open(busybox, "rb") as f:
        arc.file("bin/busybox", f.read(), 0o755)
    with open(os.path.join(HERE, "init.sh"), "rb") as f:
        arc.file("init", f.read(), 0o755)
    inside = []
    for path in module_order(release):
        data = open(path, "rb").read()
        if path.endswith(".xz"):
            import lzma
            data, path = lzma.decompress(data), path[:-3]
        elif path.endswith(".zst"):
            raise VmError(f"{path}: zstd-compressed modules are not supported; use a kernel "
                          "with xz or plain modules")
        name = "lib/modules/" + os.path.basename(path)
        arc.file(name, data)
        inside.append("/" + name)
    arc.file("modules.order", ("\n".join(inside) + "\n").encode())
    for d in ("proc", "sys", "dev", "host", "keep", "out", "tmp"):
        arc.dir(d)
    with open(dest, "wb") as f:
        f.write(arc.finish())
    return dest


# ---------------------------------------------------------------- guests

class Guest:
    """One QEMU guest running tools/cxl-vm/guest/ROLE.sh in the chroot."""

    def __init__(self, role: str, workdir: str, initramfs: str, vmlinuz: str, mem: str,
                 lsa: str, script: str | None = None, smp: int = 2):
        self.role = role
        self.out = os.path.join(workdir, role)
        os.makedirs(self.out, exist_ok=True)
        self.console_path = os.path.join(workdir, f"{role}.console")
        script = os.path.join(HERE, "guest", script or f"{role}.sh")
        python = guest_python()
        keep = sorted({p for p in (PROJECT, os.path.dirname(python)) if _under_private(p)})
        words = {
            "tract_role": role, "tract_script": script, "tract_out": self.out,
            "tract_project": PROJECT, "tract_keep": ":".join(keep),
            "tract_path": f"{os.path.dirname(python)}:/usr/local/sbin:/usr/local/bin:"
                          "/usr/sbin:/usr/bin:/sbin:/bin",
        }
        for k, v in words.items():
            if not v.strip() and k != "tract_keep":
                raise VmError(f"empty {k}")
            if any(c.isspace() for c in v):
                raise VmError(f"{k}={v!r} contains white space: the kernel command line "
                              "cannot carry it; move the project to a path without spaces")
        append = "console=ttyS0 rdinit=/init panic=-1 quiet " + " ".join(
            f"{k}={v}" for k, v in words.items() if v)
        self.argv = [
            QEMU, "-accel", "tcg", "-M", "q35,cxl=on", "-m", "2G,maxmem=8G,slots=8",
            "-smp", str(smp), "-cpu", "max", "-nographic", "-no-reboot",
            "-kernel", vmlinuz, "-initrd", initramfs, "-append", append,
            "-object", f"memory-backend-file,id=cxl-mem1,share=on,mem-path={mem},"
                       f"size={DEVICE_SIZE}",
            "-object", f"memory-backend-file,id=cxl-lsa1,share=on,mem-path={lsa},"
                       f"size={DEVICE_SIZE}",
            "-device", "pxb-cxl,bus_nr=12,bus=pcie.0,id=cxl.1",
            # QEMU 7.2 needs a second root port: with one, reads return zeros
            # and writes are dropped (docs/CXL-VM.md)
            "-device", "cxl-rp,port=0,bus=cxl.1,id=root_port13,chassis=0,slot=2",
            "-device", "cxl-rp,port=1,bus=cxl.1,id=root_port14,chassis=0,slot=3",
            "-device", "cxl-type3,bus=root_port13,memdev=cxl-mem1,lsa=cxl-lsa1,id=cxl-pmem0,"
                       "sn=0x1234",
            "-M", "cxl-fmw.0.targets.0=cxl.1,cxl-fmw.0.size=4G",
            # the host's / read-only (the project, its venv, the tools) and DIR/ROLE writable
            "-fsdev", "local,id=hostroot,path=/,security_model=none,readonly=on,"
                      "multidevs=remap",
            "-device", "virtio-9p-pci,bus=pcie.0,fsdev=hostroot,mount_tag=hostroot",
            "-fsdev", f"local,id=out,path={self.out},security_model=none",
            "-device", "virtio-9p-pci,bus=pcie.0,fsdev=out,mount_tag=out",
        ]
        self.proc = None
        self.started = 0.0

    def start(self) -> "Guest":
        self.console = open(self.console_path, "wb")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=self.console,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def wait(self, timeout: float) -> dict:
        """Waits (bounded) for the guest to power off; its exit code and timings."""
        try:
            self.proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            self.kill()
            raise VmError(f"guest {self.role} did not finish within {timeout:.0f} s; console: "
                          f"{self.console_path}\n{self.tail()}") from None
        finally:
            self.console.close()
        wall = time.monotonic() - self.started
        text = open(self.console_path, errors="replace").read()
        rc = None
        for line in text.splitlines():
            if line.startswith(EXIT_MARK):
                rc = int(line[len(EXIT_MARK):].strip() or -1)
        ready = _guest_seconds(text, "ready after")
        if rc is None:
            raise VmError(f"guest {self.role} stopped without finishing its script (qemu exit "
                          f"{self.proc.returncode}); console: {self.console_path}\n{self.tail()}")
        return {"role": self.role, "rc": rc, "wall_s": round(wall, 2),
                "guest_ready_s": ready, "guest_uptime_s": _guest_seconds(text, "finished in")}

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, 9)
            self.proc.wait()

    def tail(self, lines: int = 25) -> str:
        try:
            text = open(self.console_path, errors="replace").read().splitlines()
        except OSError:
            return ""
        return "\n".join("    " + line for line in text[-lines:])


def _guest_seconds(text: str, phrase: str) -> float | None:
    for line in text.splitlines():
        if phrase in line and line.startswith("tract-vm:"):
            try:
                return float(line.split(phrase)[1].split()[0])
            except (IndexError, ValueError):
                return None
    return None


def _under_private(path: str) -> bool:
    """Whether the guest covers PATH with its private tmpfs (/tmp, /run, /dev/shm)."""
    return any(path == p or path.startswith(p + "/") for p in ("/tmp", "/run", "/dev/shm"))


def run_guests(guests: list[Guest], timeout: float) -> list[dict]:
    """Starts GUESTS together and waits for all (bounded); kills the rest on failure."""
    try:
        for g in guests:
            g.start()
        deadline = time.monotonic() + timeout
        return [g.wait(deadline - time.monotonic()) for g in guests]
    finally:
        for g in guests:
            g.kill()


# ---------------------------------------------------------------- the device file

def new_device(workdir: str) -> tuple[str, str]:
    """Sparse backing files for the memdev's memory and its label storage area."""
    mem, lsa = os.path.join(workdir, "cxl-mem.raw"), os.path.join(workdir, "cxl-lsa.raw")
    for path in (mem, lsa):
        with open(path, "wb") as f:
            f.truncate(DEVICE_SIZE)
    return mem, lsa


def read_region_header(mem: str) -> dict:
    """The TraCT header the guests wrote, read from the host's backing file.

    Independent of the C core: the header's leading fields per docs/FORMAT.md
    (magic, version, UUID, size), at the device-DAX data offset.
    """
    with open(mem, "rb") as f:
        f.seek(DAX_DATA_OFFSET)
        page = f.read(4096)
    magic, version = page[:8], struct.unpack_from("<I", page, 8)[0]
    return {"magic": magic.decode(errors="replace"), "version": version,
            "uuid": str(uuid.UUID(bytes=page[16:32])),
            "region_size": struct.unpack_from("<Q", page, 32)[0]}


def read_span(mem: str, offset: int, length: int) -> bytes:
    """LENGTH bytes at region offset OFFSET, from the backing file."""
    with open(mem, "rb") as f:
        f.seek(DAX_DATA_OFFSET + offset)
        return f.read(length)


# ---------------------------------------------------------------- scenarios

def _prepare(out: str) -> tuple[str, str]:
    lack = missing()
    if lack:
        raise VmError("cannot run the CXL guests: missing " + "; ".join(lack))
    os.makedirs(out, exist_ok=True)
    release, vmlinuz = kernel()
    initramfs = build_initramfs(release, os.path.join(out, f"initramfs-{release}.img"))
    return initramfs, vmlinuz


def _guest_json(guest_out: str, name: str) -> dict:
    path = os.path.join(guest_out, name)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise VmError(f"the guest did not leave {path}: {exc}") from None


def _check_rc(runs: list[dict], guests: list[Guest]) -> None:
    for r, g in zip(runs, guests):
        if r["rc"] != 0:
            raise VmError(f"guest {g.role}: its script failed with exit code {r['rc']}; "
                          f"commands in {g.out}, console {g.console_path}\n{g.tail()}")


def _verify_one(g: "Guest", mem: str) -> dict:
    """What one.sh leaves (a formatted /dev/dax0.0, its platform report, a round
    trip), checked from the host: the backing file holds the guest's header and
    blocks."""
    info = _guest_json(g.out, "info.json")
    rt = _guest_json(g.out, "roundtrip.json")
    header = read_region_header(mem)
    problems = []
    if header["magic"] != "TRACTPOL" or header["uuid"] != info["uuid"]:
        problems.append(f"the backing file's header ({header}) is not the one the guest "
                        f"formatted (uuid {info['uuid']})")
    for blk in rt["blocks"]:
        data = read_span(mem, blk["offset"], blk["length"])
        if data.hex() != blk["head_hex"]:
            problems.append(f"block {blk['index']} at region offset {blk['offset']:#x} differs "
                            "in the backing file")
    return {"problems": problems, "device": _guest_json(g.out, "device.json"),
            "provision_s": _guest_json(g.out, "timings.json").get("provision_s"),
            "host_header": header, "roundtrip": rt}


def one_host(out: str, timeout: float) -> dict:
    """Provision, format and use /dev/dax0.0 in one guest; verify from the host."""
    initramfs, vmlinuz = _prepare(out)
    mem, lsa = new_device(out)
    g = Guest("one", out, initramfs, vmlinuz, mem, lsa)
    t0 = time.monotonic()
    runs = run_guests([g], timeout)
    _check_rc(runs, [g])
    one = _verify_one(g, mem)
    return {"scenario": "one-host", "ok": not one["problems"],
            "wall_s": round(time.monotonic() - t0, 2), "guests": runs, **one}


def two_host(out: str, timeout: float, requests: int, iterations: int) -> dict:
    """A setup guest formats the shared device; guests A and B then share it."""
    initramfs, vmlinuz = _prepare(out)
    mem, lsa = new_device(out)
    t0 = time.monotonic()
    # the first guest is the one-host scenario's (one.sh), which also creates
    # the objects the two hosts share: one boot fewer than a setup guest of its own
    setup = Guest("setup", out, initramfs, vmlinuz, mem, lsa, script="one.sh")
    runs = run_guests([setup], timeout)
    _check_rc(runs, [setup])
    one = _verify_one(setup, mem)
    params = {"requests": requests, "iterations": iterations}
    with open(os.path.join(out, "params.json"), "w") as f:
        json.dump(params, f)
    nodes = [Guest(role, out, initramfs, vmlinuz, mem, lsa, script="node.sh")
             for role in ("nodeA", "nodeB")]
    for g in nodes:      # each guest reads the parameters from its own (shared) folder
        shutil.copy(os.path.join(out, "params.json"), os.path.join(g.out, "params.json"))
    runs += run_guests(nodes, max(1.0, timeout - (time.monotonic() - t0)))
    _check_rc(runs[1:], nodes)
    a, b = (_guest_json(g.out, "result.json") for g in nodes)
    info = _guest_json(setup.out, "shared.json")
    header = read_region_header(mem)
    counter = int.from_bytes(read_span(mem, info["counter_offset"], 8), "little")
    expected = 2 * a["counter_processes"] * iterations
    problems = list(one["problems"])
    if header["magic"] != "TRACTPOL" or header["uuid"] != info["uuid"]:
        problems.append("the backing file's header is not the one the setup guest formatted")
    if counter != expected or a["counter_seen"] != expected or b["counter_seen"] != expected:
        problems.append(f"shared counter: {counter} in the file, A saw {a['counter_seen']}, "
                        f"B saw {b['counter_seen']}, expected {expected} (lost updates)")
    for who, r in (("A", a), ("B", b)):
        if r["lock_acquisitions"] != a["counter_processes"] * iterations:
            problems.append(f"{who}'s node counted {r['lock_acquisitions']} acquisitions of the "
                            f"counter lock, not {a['counter_processes'] * iterations}")
        if r["pins_left"] or r["handoffs_left"]:
            problems.append(f"{who} saw {r['pins_left']} pin(s) and {r['handoffs_left']} "
                            "handoff(s) left after the test")
    if b["handoffs_verified"] != requests or b["corrupt_blocks"]:
        problems.append(f"decode verified {b['handoffs_verified']} of {requests} handoffs, "
                        f"{b['corrupt_blocks']} corrupt block(s)")
    return {"scenario": "two-host", "ok": not problems, "problems": problems,
            "wall_s": round(time.monotonic() - t0, 2), "guests": runs,
            "host_header": header, "counter_in_file": counter, "counter_expected": expected,
            "setup": {k: v for k, v in one.items() if k != "problems"},
            "nodeA": a, "nodeB": b}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("check", help="say what this host lacks to run the guests")
    one = sub.add_parser("one-host", help="one guest: provision, format, use /dev/dax0.0")
    two = sub.add_parser("two-host", help="two guests share one device")
    for p in (one, two):
        p.add_argument("--out", required=True, help="folder for the device files and outputs")
        p.add_argument("--timeout", type=float, default=600, help="seconds for the whole run")
    two.add_argument("--requests", type=int, default=8, help="handoffs from A to B")
    two.add_argument("--iterations", type=int, default=200,
                     help="lock-protected increments per counter process")
    args = ap.parse_args(argv)
    # stopped by SIGTERM (a test session ending, a supervisor), the guests go
    # too: SystemExit unwinds through run_guests' finally, which kills them
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        if args.cmd == "check":
            lack = missing()
            for line in lack:
                print(f"missing: {line}")
            if not lack:
                print(f"ready: {QEMU}, kernel {kernel()[0]}, python {guest_python()}")
            return 1 if lack else 0
        if args.timeout <= 0:
            raise VmError("--timeout must be positive")
        out = os.path.abspath(args.out)
        if args.cmd == "one-host":
            result = one_host(out, args.timeout)
        else:
            if args.requests < 1 or args.iterations < 1:
                raise VmError("--requests and --iterations must be at least 1")
            result = two_host(out, args.timeout, args.requests, args.iterations)
    except VmError as exc:
        print(f"cxlvm: {exc}", file=sys.stderr)
        return 1
    with open(os.path.join(out, "result.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    if not result["ok"]:
        print("cxlvm: FAILED: " + "; ".join(result["problems"]), file=sys.stderr)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
