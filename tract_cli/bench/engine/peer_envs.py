"""A vLLM with a peer's KV connector installed, made without touching the user's vLLM.

vLLM ships the peers' connectors (NixlConnector, LMCache's, Mooncake's) but
not the libraries they need, and installing those into the user's vLLM
environment would change it.  Each peer gets an overlay instead:
`$TRACT_PEERS_DIR/vllm-<peer>`, a virtual environment of the same Python
whose only packages are the peer's (pinned), with a `.pth` file that appends
the user's vLLM environment (its site-packages, `TRACT_VLLM_PYTHON`'s) after
its own.  So the overlay runs the user's very vLLM, torch and TraCT, and the
peer's packages shadow nothing of them that the peer does not need itself.
pip runs from the user's vLLM (`pip --python OVERLAY`): it sees the vLLM
environment's packages through the `.pth`, installs only what is missing, and
never removes anything outside the overlay.

An overlay records the vLLM it was made over (`tract-overlay.json`: that
environment's prefix, written last); made over another one, or left incomplete,
it is reported, with the command that remakes it.
"""
from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys

from tract_cli.bench.peers import peers_dir
from tract_cli.core.errors import TractError

# peer -> (pip install steps, the import that proves it works beside vLLM)
ENGINE_PEERS = {
    # NIXL's CPU-capable wheels, as `tract bench --transport nixl` installs them;
    # `nixl` itself pulls nixl-cu13 too, which a CPU host does not need
    "nixl": ([["nixl-cu12==1.5.1"], ["--no-deps", "nixl==1.5.1"]],
             "from nixl._api import nixl_agent"),
    # LMCache without its dependencies, then only those vLLM's environment lacks:
    # its own pins (numpy<=2.2.6, protobuf<7, prometheus_client, OpenTelemetry)
    # are older than vLLM's and would shadow them, and its CUDA packages (cupy,
    # cuda-python) are for GPUs; its multiprocess mode, the one that runs on a
    # CPU, needs neither
    "lmcache": ([["--no-deps", "lmcache==0.5.6"],
                 ["sortedcontainers==2.4.0", "aiofile==3.12.3", "caio==0.12.10",
                  "aiofiles==25.1.0", "redis==8.2.0", "nvtx==0.2.17", "awscrt==0.38.1"]],
                "import lmcache.integration.vllm.lmcache_mp_connector, lmcache.cli.main"),
    # Mooncake's transfer engine without CUDA (vLLM's MooncakeConnector imports it;
    # it links libibverbs and librdmacm)
    "mooncake": ([["--no-deps", "mooncake-transfer-engine-non-cuda==0.3.13.post1"],
                  ["msgpack==1.2.4"]],
                 "from mooncake.engine import TransferEngine"),
}
MARKER = "tract-overlay.json"
PTH = "_tract_vllm_base.pth"


def root_of(peer: str) -> pathlib.Path:
    return peers_dir() / f"vllm-{peer}"


def python_of(peer: str) -> pathlib.Path:
    return root_of(peer) / "bin" / "python"


def install_hint(config: str) -> str:
    return f"run `tract bench --engine vllm --vllm-config {config} --install-peers`"


# what the vLLM environment's python says of itself: its prefix (the identity an
# overlay records) and, importing vLLM, the directories its packages come from:
# every sys.path entry but the standard library's own (site-packages, the user
# site, a system site a venv includes, PYTHONPATH), in its order
_BASE_CODE = """
import json, os, sys, sysconfig
std = {os.path.realpath(sysconfig.get_paths()[k]) for k in ("stdlib", "platstdlib")}
out = {"prefix": os.path.realpath(sys.prefix)}
if "paths" in sys.argv:
    import vllm
    out["paths"] = [p for p in sys.path if p and os.path.isdir(p)
                    and os.path.realpath(p) not in std
                    and os.path.basename(p) != "lib-dynload"]
print(json.dumps(out))
"""


def _describe(vllm_python: str, paths: bool, hint: str) -> dict:
    """VLLM_PYTHON's prefix (and its package directories, if PATHS), or a TractError."""
    try:
        r = subprocess.run([vllm_python, "-c", _BASE_CODE, *(["paths"] if paths else [])],
                           capture_output=True, text=True, timeout=300)
    except OSError as exc:
        raise TractError(f"cannot run vLLM's python {vllm_python}: {exc.strerror}",
                         hint) from None
    except subprocess.TimeoutExpired:
        raise TractError(f"{vllm_python} took over 300 s to import vLLM",
                         "retry on a less loaded machine") from None
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        raise TractError(f"{vllm_python} does not import vLLM ({last})", hint)
    return json.loads(r.stdout)


_checked: dict[tuple[str, str], str | None] = {}


def unavailable(peer: str, config: str, vllm_python: str) -> str | None:
    """None if PEER's overlay over VLLM_PYTHON's vLLM runs, else why and how to fix it."""
    key = (peer, vllm_python)
    if key not in _checked:
        try:
            _checked[key] = _why_not(peer, config, vllm_python)
        except TractError as exc:
            _checked[key] = str(exc)
    return _checked[key]


def _why_not(peer: str, config: str, vllm_python: str) -> str | None:
    py, hint = python_of(peer), install_hint(config)
    if not py.exists():
        return f"vLLM with {peer} is not installed in {root_of(peer)}; {hint}"
    try:
        made_over = json.loads((root_of(peer) / MARKER).read_text())["prefix"]
    except (OSError, ValueError, KeyError, TypeError):
        return f"{root_of(peer)} is an incomplete install (no {MARKER}); {hint}"
    prefix = _describe(vllm_python, False, "set TRACT_VLLM_PYTHON to vLLM's python")["prefix"]
    if made_over != prefix:
        return f"{root_of(peer)} was made over another vLLM ({made_over}, not {prefix}); {hint}"
    try:
        r = subprocess.run([str(py), "-c", "import vllm; " + ENGINE_PEERS[peer][1]],
                           capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"{peer} could not be checked beside vLLM in {root_of(peer)} ({exc}); {hint}"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"{peer} does not import beside vLLM in {root_of(peer)} ({last}); {hint}"
    return None


def _run(cmd: list[str], timeout: float) -> None:
    """CMD in its own process group, killed with it if this one is interrupted or
    CMD overruns (pip --python runs the installer as a child of its own)."""
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    if proc.returncode != 0:
        raise subprocess.CalledProcessError(proc.returncode, cmd, out, err)


def install(peer: str, config: str, vllm_python: str, log=sys.stderr) -> None:
    """Makes PEER's overlay over the vLLM at VLLM_PYTHON (a no-op when it works)."""
    if unavailable(peer, config, vllm_python) is None:
        return
    _checked.pop((peer, vllm_python), None)
    root = root_of(peer)
    base = _describe(vllm_python, True, "set TRACT_VLLM_PYTHON to the python of vLLM's "
                                        "environment")
    real = os.path.realpath(root)
    if real == base["prefix"] or base["prefix"].startswith(real + os.sep):
        raise TractError(f"{root} is vLLM's own environment: making the overlay there would "
                         "replace it", "set TRACT_PEERS_DIR to another directory")
    print(f"installing vLLM with {peer} into {root} (an overlay of {vllm_python}) ...",
          file=log, flush=True)
    try:
        # the same interpreter as vLLM's; no pip of its own (pip runs from vLLM's)
        _run([vllm_python, "-m", "venv", "--clear", "--without-pip", str(root)], 600)
        site = subprocess.run([str(python_of(peer)), "-c",
                               "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                              check=True, capture_output=True, text=True, timeout=60).stdout.strip()
        # a .pth line that starts with `import` is run: addsitedir also reads the
        # vLLM environment's own .pth files (an editable TraCT's among them)
        pathlib.Path(site, PTH).write_text(
            "".join(f"import site; site.addsitedir({p!r})\n" for p in base["paths"]))
        for step in ENGINE_PEERS[peer][0]:
            _run([vllm_python, "-m", "pip", "--python", str(python_of(peer)), "install", "-q",
                  *step], 1800)
        # written last: an overlay without it is an incomplete install
        (root / MARKER).write_text(json.dumps({"prefix": base["prefix"],
                                               "vllm_python": vllm_python,
                                               "base": base["paths"]}))
    except subprocess.CalledProcessError as exc:
        tail = (exc.stderr or "").strip().splitlines() if isinstance(exc.stderr, str) else []
        tail = [ln for ln in tail if not ln.startswith("WARNING")] or tail
        raise TractError(f"installing vLLM with {peer} failed: {tail[-1] if tail else exc}",
                         "check network access to the package index, and that vLLM's "
                         "environment has pip") from None
    except subprocess.TimeoutExpired:
        raise TractError(f"installing vLLM with {peer} took too long",
                         "retry, or install it by hand") from None
    except OSError as exc:
        raise TractError(f"cannot write the overlay {root}: {exc.strerror or exc}",
                         "set TRACT_PEERS_DIR to a writable directory") from None
    why = unavailable(peer, config, vllm_python)
    if why:
        raise TractError(f"vLLM with {peer} was installed but does not work: {why}",
                         "see the message")


__all__ = ["ENGINE_PEERS", "install", "python_of", "unavailable"]
