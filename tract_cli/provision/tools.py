"""Running cxl / ndctl / daxctl and turning their failures into one-line errors.

The tools speak JSON on stdout; their errors are lines on stderr.  Every
failure seen in QEMU guests with an emulated CXL Type-3 device (pmem regions
on kernel 6.1, ram regions on kernel 6.12; listed in docs/PROVISIONING.md) is
translated into its cause and fix; anything else is reported with the tool's
own words.
"""
from __future__ import annotations

import json
import shutil
import subprocess
from dataclasses import dataclass

from tract_cli.core.errors import TractError

PACKAGES = {"cxl": "ndctl", "ndctl": "ndctl", "daxctl": "daxctl"}
TIMEOUT_S = 120


class ToolError(TractError):
    """A provisioning tool is missing or failed."""


@dataclass(frozen=True)
class ToolResult:
    argv: tuple[str, ...]
    rc: int
    stdout: str
    stderr: str


# (substring of the tool's output, problem, fix); the first match wins, so
# specific causes come before generic ones ("busy" follows "auto-online")
KNOWN_FAILURES = [
    ("could not get a free decoder",
     "{dev}: no free decoder on the memdev: a region already exists on it",
     "use the existing region (`cxl list -R`), or remove it with `cxl destroy-region -f REGION`"),
    ("failed to create namespace: No such device or address",
     "cannot create a namespace: the nvdimm/dax modules are not loaded",
     "load them: `modprobe -a dax_pmem nd_pmem device_dax`"),
    ("failed to set align",
     "{dev} does not support that alignment (a pmem-backed device takes 2M, not 1G)",
     "use 2M alignment"),
    ("kernel policy will auto-online memory",
     "the kernel auto-onlines hot-added memory, so {dev} would become system RAM",
     "boot with memhp_default_state=offline, or `echo offline > "
     "/sys/devices/system/memory/auto_online_blocks`, and keep kmem unloaded"),
    ("Device or resource busy",
     "{dev} is online as system RAM and in use by the kernel",
     "take it back with --force (`daxctl reconfigure-device --mode=devdax --force {dev}`): "
     "the kernel's data on it is migrated away first"),
    ("Failed to synchronize CPU cache state",
     "the kernel refused to commit the region: it runs under a hypervisor (CPUID bit set)",
     "start the guest with `-cpu max,-hypervisor` (volatile regions inside VMs)"),
    ("failed to commit decode: No such device or address",
     "the kernel refused to commit the region's decoder (inside a VM: the hypervisor CPUID bit)",
     "start the guest with `-cpu max,-hypervisor`, or check `dmesg` for the cause"),
]


def which(tool: str) -> str | None:
    return shutil.which(tool)


def require(tool: str) -> str:
    path = which(tool)
    if not path:
        raise ToolError(f"`{tool}` is not installed",
                        f"install the Debian/Ubuntu package {PACKAGES[tool]} "
                        f"(Fedora: {PACKAGES[tool]}; or build ndctl from source)")
    return path


def run(argv: list[str], check: bool = True, device: str = "the device") -> ToolResult:
    """Runs a tool; with check, a non-zero exit raises the translated ToolError."""
    require(argv[0])
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise ToolError(f"`{' '.join(argv)}` did not finish within {TIMEOUT_S} s",
                        "check `dmesg` for a hung device") from None
    res = ToolResult(tuple(argv), p.returncode, p.stdout, p.stderr)
    # some failures exit 0 ("created 0 regions"): recognise them by their words
    if check and (p.returncode != 0 or known_failure(res)):
        raise translate(res, device)
    return res


def known_failure(res: ToolResult) -> bool:
    text = res.stderr + res.stdout
    return any(needle in text for needle, _, _ in KNOWN_FAILURES)


def translate(res: ToolResult, device: str = "the device") -> ToolError:
    """The one-line error for a failed tool run."""
    text = res.stderr + res.stdout
    for needle, problem, fix in KNOWN_FAILURES:
        if needle in text:
            return ToolError(problem.format(dev=device), fix.format(dev=device))
    last = next((l.strip() for l in reversed(text.splitlines()) if l.strip()), "no output")
    return ToolError(f"`{' '.join(res.argv)}` failed (exit {res.rc}): {last}",
                     "see the tool's message; `dmesg` may say more")


def list_json(argv: list[str]) -> list:
    """Runs a `... list` command and returns its JSON as a list ([] for no output)."""
    res = run(argv)
    return parse_list(res.stdout)


def parse_list(text: str) -> list:
    """Parses a tool's list output: a JSON array or object, or nothing."""
    text = text.strip()
    if not text:
        return []
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ToolError(f"cannot parse the tool's JSON output ({exc.msg})",
                        "check the ndctl version (76 or newer)") from None
    return data if isinstance(data, list) else [data]
