"""The vLLM configurations `tract bench --engine vllm` compares: which servers
each starts, with which KV connector, in which environment, on which cores.

Every P/D configuration is placed alike: the prefill instance on the first half
of the allowed CPUs, the decode instance on the second (vLLM's CPU worker
otherwise binds every instance to the same first core), the same vLLM
arguments, the same checkpoint.  Each peer is configured as its own
documentation sets it up for P/D (docs/VLLM.md, "Benchmark"):

- `tract`, `prefix`: TraCT's connector on a temporary region (nodes 1 and 2);
  `tract-paired` the same pair, a P/D request's prefill and decode requests
  sent at once as TraCT's front door sends them with `--paired`
  (`calls.PAIRED`);
- `example`: vLLM's ExampleConnector, KV as safetensors files in /dev/shm
  (producer and consumer, as its own P/D example runs it);
- `nixl`, `nixl-tcp`: vLLM's NixlConnector (`kv_producer` and `kv_consumer`:
  vLLM 0.32 deprecates `kv_both` for it; `kv_buffer_device: cpu`, the one its
  CPU platform supports), NIXL's UCX backend with UCX's same-host default transports, and
  with `UCX_TLS=tcp` (the network path); each instance its own NIXL side
  channel port.  It runs in a vLLM with NIXL installed (`peer_envs`);
- `lmcache`: LMCache's cache shared by two vLLM instances (a prefix cache, as
  `prefix`): its multiprocess server (`lmcache_server.py`) and LMCache's own
  `LMCacheMPConnector` in each vLLM (`kv_both`), chunks of vLLM's block size;
  the one LMCache path that runs on vLLM's CPU build (docs/VLLM.md);
- `mooncake`: vLLM's MooncakeConnector (`kv_producer`, `kv_consumer`, the
  transfer engine's `tcp` protocol: no RDMA here), the prefill instance's
  bootstrap server on its own port, requests paired by a `transfer_id` as
  vLLM's Mooncake proxy pairs them.  On vLLM 0.32's CPU build it stops at
  start (its worker asks torch for the accelerator's index): the bench
  reports that, measured, and runs the rest;
- `mono`: one vLLM (the floor: no KV moves).
"""
from __future__ import annotations

import json
import os
import socket
import tempfile
import uuid

from tract_cli.bench.engine import peer_envs
from tract_cli.core.cpu import allowed_cpus

# the configurations, in the order of their rows; "prefix" gives two rows
CONFIGS = ("tract", "tract-paired", "example", "nixl", "nixl-tcp", "mooncake", "mono",
           "prefix", "lmcache")
ROWS = ("tract", "tract-paired", "example", "nixl", "nixl-tcp", "mooncake", "mono",
        "prefix-miss", "prefix-hit", "lmcache-miss", "lmcache-hit")
# what a run compares unless told: every configuration that runs on vLLM's CPU
# build (a peer not installed is skipped, with the command that installs it)
DEFAULT = ("tract", "example", "nixl", "nixl-tcp", "mono", "prefix", "lmcache")
# the configurations through TraCT's connector (a temporary region of their own)
TRACT_CONFIGS = ("tract", "tract-paired", "prefix")
# prefix-cache configurations: a miss on one instance, then the hit on the other
PREFIX = {"prefix": ("prefix-miss", "prefix-hit"), "lmcache": ("lmcache-miss", "lmcache-hit")}
# a configuration -> the peer whose vLLM overlay it runs in
NEEDS_PEER = {"nixl": "nixl", "nixl-tcp": "nixl", "lmcache": "lmcache", "mooncake": "mooncake"}
EXAMPLE = {"kv_connector": "ExampleConnector"}
# a P/D pair's kv_role, where the connector has one per side
ROLE = {"prefill": "kv_producer", "decode": "kv_consumer"}
NIXL = {"kv_connector": "NixlConnector", "kv_buffer_device": "cpu"}


_handed_out: set[int] = set()


def free_port() -> int:
    """A port free now for a server to bind later, outside the kernel's ephemeral
    range: a port the kernel hands out (to `bind(0)`, to an outgoing connection)
    could be taken by one of vLLM's own sockets between this check and the bind
    (a NIXL side channel failed so: `Address already in use`).  Random below the
    range, or above it where too few ports lie below (a host tuned to a wide
    range); never the same twice in this process."""
    import random
    try:
        low, high = map(int, open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[:2])
    except (OSError, ValueError):
        low, high = 32768, 60999
    spans = [(lo, hi) for lo, hi in ((10000, low), (max(high + 1, 10000), 65536)) if hi - lo >= 1000]
    rng = random.Random()
    for _ in range(1000 if spans else 0):
        port = rng.randrange(*rng.choice(spans))
        if port in _handed_out:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    with socket.socket() as s:     # no room outside the range: the kernel's pick
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def unavailable(config: str, vllm_python: str) -> str | None:
    """None if CONFIG can run with the vLLM at VLLM_PYTHON, else why and what to do."""
    peer = NEEDS_PEER.get(config)
    return None if peer is None else peer_envs.unavailable(peer, config, vllm_python)


def unavailable_of(configs: list[str], vllm_python: str) -> dict[str, str]:
    """{config: why} for each of CONFIGS that cannot run; the peers are checked
    at once, each a python importing vLLM and its peer (seconds apiece)."""
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(max_workers=max(1, len(configs))) as pool:
        whys = list(pool.map(lambda c: unavailable(c, vllm_python), configs))
    return {c: why for c, why in zip(configs, whys) if why is not None}


def install(config: str, vllm_python: str, log) -> None:
    """Makes what CONFIG needs beside the user's vLLM (its peer's overlay)."""
    peer = NEEDS_PEER.get(config)
    if peer is not None:
        peer_envs.install(peer, config, vllm_python, log)


def start(config: str, model_dir: str, work: str, args: tuple, gib: float,
          pool: str | None, load_mode: str = "sync", block_tokens: int = 128,
          cache_bytes: int = 1 << 30, mono_all_cpus: bool = False,
          reference: bool = True, mono_env: dict | None = None,
          handoff_publish: str = "after_step") -> dict:
    """The servers of CONFIG, started (not yet ready): {"mono": s} or
    {"prefill": s, "decode": s} (and {"cache": s} after them, where the
    configuration has a cache server of its own, started and ready first).  A
    server's `store` (ExampleConnector's directory) is the caller's to remove.
    LOAD_MODE, HANDOFF_PUBLISH: the TraCT connector's settings of those names;
    BLOCK_TOKENS: vLLM's block size; CACHE_BYTES: what a cache server must hold;
    MONO_ALL_CPUS: one vLLM on every CPU the pairs share (under load, the floor
    with as many cores as a pair), else on vLLM's default binding; MONO_ENV its
    environment besides.  REFERENCE: the TraCT connector also times a memcpy of
    the same bytes beside its copies of a request that asks for it (the static
    experiment's warm-ups: the reference; more copies in the step, so not
    under load)."""
    from tract_cli.serve.vllm_engine import VllmServer
    log = lambda role: os.path.join(work, f"{config}-{role}.log")

    def pair(cfg_of, env_of=lambda role: {}, python=None) -> dict:
        """A prefill and a decode vLLM, CFG_OF(role) their connector's configuration,
        ENV_OF(role) beside their cores, PYTHON their environment's; both stopped if
        either fails to start."""
        out = {}
        try:
            for role in ROLE:
                out[role] = VllmServer(model_dir, free_port(), python=python and str(python),
                                       args=args + ("--kv-transfer-config",
                                                    json.dumps(cfg_of(role))),
                                       kv_cache_gib=gib, log_path=log(role),
                                       env=cores(role) | env_of(role))
        except BaseException:
            stop_all(out)
            raise
        return out

    if config == "mono":
        return {"mono": VllmServer(model_dir, free_port(), args=args, kv_cache_gib=gib,
                                   log_path=log("mono"),
                                   env=(cores("all") if mono_all_cpus else {}) | (mono_env or {}))}
    if config in TRACT_CONFIGS:
        out = {}
        try:
            for role, node in (("prefill", 1), ("decode", 2)):
                out[role] = VllmServer(model_dir, free_port(), pool=pool, node=node, args=args,
                                       kv_cache_gib=gib,
                                       extra={"load_mode": load_mode,
                                              "handoff_publish": handoff_publish},
                                       log_path=log(role),
                                       env={"TRACT_CONNECTOR_TIMINGS": "1"}
                                       | ({"TRACT_CONNECTOR_REFERENCE": "1"} if reference else {})
                                       | cores(role))
        except BaseException:          # the first is stopped if the second cannot start
            stop_all(out)
            raise
        return out
    if config == "example":
        store = tempfile.mkdtemp(prefix="tract-bench-example-", dir="/dev/shm")
        try:
            # producer/consumer: what ExampleConnector's own P/D example runs (it has
            # no kv_both behaviour worth comparing)
            out = pair(lambda role: EXAMPLE | {
                "kv_role": ROLE[role], "kv_connector_extra_config": {"shared_storage_path": store}})
        except BaseException:
            import shutil
            shutil.rmtree(store, ignore_errors=True)
            raise
        out["prefill"].store = store
        return out
    if config in ("nixl", "nixl-tcp"):
        transport = {"UCX_TLS": "tcp"} if config == "nixl-tcp" else {}
        # producer and consumer: vLLM 0.32 deprecates kv_both for NixlConnector
        return pair(lambda role: NIXL | {"kv_role": ROLE[role]},
                    lambda role: transport | {"VLLM_NIXL_SIDE_CHANNEL_HOST": "127.0.0.1",
                                              "VLLM_NIXL_SIDE_CHANNEL_PORT": str(free_port())},
                    peer_envs.python_of(NEEDS_PEER[config]))
    if config == "mooncake":
        bootstrap = {role: free_port() for role in ROLE}
        out = pair(lambda role: {"kv_connector": "MooncakeConnector", "kv_role": ROLE[role],
                                 "kv_connector_extra_config": {"mooncake_protocol": "tcp"}},
                   lambda role: {"VLLM_MOONCAKE_BOOTSTRAP_PORT": str(bootstrap[role])},
                   peer_envs.python_of(NEEDS_PEER[config]))
        for role, s in out.items():
            s.bootstrap_url = f"http://127.0.0.1:{bootstrap[role]}"
        return out
    if config == "lmcache":
        from tract_cli.bench.engine.lmcache_server import LmcacheServer
        python = peer_envs.python_of(NEEDS_PEER[config])
        cache = LmcacheServer(str(python), free_port(), free_port(), block_tokens,
                              cache_server_gib(cache_bytes),
                              f"tract-bench-lmcache-{uuid.uuid4().hex}", log("cache"))
        try:
            cache.wait_ready()
            cfg = {"kv_connector": "LMCacheMPConnector",
                   "kv_connector_module_path": "lmcache.integration.vllm.lmcache_mp_connector",
                   "kv_role": "kv_both",
                   "kv_connector_extra_config": {"lmcache.mp.host": "tcp://127.0.0.1",
                                                 "lmcache.mp.port": cache.port,
                                                 "lmcache.mp.mq_timeout": 60}}
            out = pair(lambda role: cfg, lambda role: {"LMCACHE_TRACK_USAGE": "false",
                                                       "PYTHONHASHSEED": "0"}, python)
        except BaseException:
            cache.stop()
            raise
        out["cache"] = cache
        return out
    raise ValueError(f"unknown configuration {config!r}")


def stop_all(servers: dict) -> None:
    """Stops each of SERVERS, every one even where stopping one before it failed
    or was interrupted."""
    call_each([s.stop for s in servers.values()])


def call_each(calls: list) -> None:
    """Calls each of CALLS in order, every one even where one before it failed or
    was interrupted (the first error raised once all were tried, each later
    one chained to it)."""
    if calls:
        try:
            calls[0]()
        finally:
            call_each(calls[1:])


def cache_server_gib(cache_bytes: int) -> int:
    """The GiB a configuration's own cache server (LMCache's) is started with to
    hold CACHE_BYTES: whole GiB, at least one."""
    return max(1, -(-cache_bytes // (1 << 30)))


def cores(role: str) -> dict:
    """Prefill and decode on different cores, as a deployment would place them (vLLM's
    CPU worker otherwise binds every instance to the same first core); "all": every
    allowed CPU."""
    cpus = sorted(allowed_cpus())          # ids need not be 0..n-1 (a cpuset)
    if role == "all":
        return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cpus))}
    if len(cpus) < 2:
        return {}
    half = len(cpus) // 2
    cores_ = cpus[:half] if role == "prefill" else cpus[half:]
    return {"VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, cores_))}
