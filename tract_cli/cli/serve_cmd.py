"""`tract serve-prefill`, `tract serve-decode` and `tract generate`."""
from __future__ import annotations

import json
import os
import sys
from typing import List, Optional

import typer

from tract_cli.core.errors import TractError, UsageError
from tract_cli.provision.topology import pin

_POOL = typer.Option(..., "--pool", "-p", help="Region file or /dev/daxX.Y (formatted for the model).")
_NODE = typer.Option(..., "--node", "-n", help="This worker's node id.")
_HOST = typer.Option("127.0.0.1", "--host", help="Address to listen on.")
_MODEL_DIR = typer.Option(None, "--model", help="Local Hugging Face Llama checkpoint directory "
                                                "(default: seeded random weights).")
_PROFILE = typer.Option("tiny-llama", "--model-profile",
                        help="Model profile of the random-weight engine.")
_SEED = typer.Option(0, "--weights-seed", help="Seed of the random weights (same on every worker).")
_SIM = typer.Option(False, "--simulate", help="Run metadata through the non-coherence simulator.")
_FLUSH = typer.Option(None, "--flush-mode", help="Override the region header's flush mode.")
_NUMA = typer.Option(None, "--numa-node", help="Pin to this NUMA node's CPUs.")
_CPUS = typer.Option(None, "--cpus", help="Pin to these CPUs (e.g. 0-3,8).")
_THREADS = typer.Option(None, "--threads", help="torch compute threads (default: torch's).")
_ENGINE = typer.Option("reference", "--engine", help="reference (TraCT's own engine) or vllm "
                                                     "(vLLM's OpenAI server with TraCT as its KV "
                                                     "connector; docs/VLLM.md).")
_VLLM_ARG = typer.Option(None, "--vllm-arg", help="An extra argument for vLLM's server "
                                                  "(repeatable), e.g. --vllm-arg=--max-model-len=4096.")
_LOG_LEVEL = typer.Option("info", "--log-level",
                          help="With --engine reference: debug, info (an access line per request "
                               "and a line per prefill or completion), warning or error.")
_AGENT = typer.Option(True, "--agent/--no-agent",
                      help="Start this node's agent if none runs (it stops by itself once the "
                           "node has had no process for 30 s).")


def _engine(model_dir, profile, seed, threads):
    try:
        import torch
    except ImportError:
        raise UsageError("the serving engine needs torch", 'pip install "tract-cxl[serve]"') from None
    from tract_cli.serve.engine import Engine
    if threads is not None:
        if threads < 1:
            raise UsageError("--threads must be at least 1", "pass a positive count")
        torch.set_num_threads(threads)
    return Engine.load(model_dir, profile, seed)


def _check_port(port: int) -> None:
    """Before anything is loaded or attached: a bad port is a usage error."""
    if not 0 <= port <= 65535:
        raise UsageError(f"port {port} is out of range", "use 1..65535 (0 picks a free one)")


def _serve(worker, host: str, port: int, name: str, log_level: str) -> None:
    """The worker's FastAPI app on uvicorn until SIGTERM/SIGINT; the worker is
    closed (handoffs acknowledged, region unmapped) however this ends."""
    try:
        from tract_cli.serve import app
        app.configure_logging(name, log_level)
        asgi = app.make_app(worker.routes(), f"tract {name}")
        try:
            sock = app.listen(host, port)
        except OSError as exc:
            raise TractError(f"cannot listen on {host}:{port}: {exc.strerror or exc}",
                             "pick another --port or stop what uses it") from None
    except BaseException:
        worker.close()
        raise

    def announce():
        print(f"tract {name}: node {worker.node} pid {os.getpid()} model "
              f"{worker.engine.profile.name} pool {worker.pool.path}: listening on "
              f"{app.url_of(sock)}", file=sys.stderr, flush=True)
    app.serve(asgi, sock, worker.close, announce)


def _check_log_level(level: str) -> None:
    from tract_cli.serve.app import LOG_LEVELS
    if level not in LOG_LEVELS:
        raise UsageError(f"--log-level {level!r} is not one of {', '.join(LOG_LEVELS)}",
                         "pass --log-level info, for example")


def _is_vllm(engine_name: str) -> bool:
    if engine_name not in ("reference", "vllm"):
        raise UsageError(f"--engine {engine_name!r} is not reference or vllm",
                         "pass --engine reference or --engine vllm")
    return engine_name == "vllm"


def _free_port(host: str) -> int:
    import socket
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _serve_vllm(name: str, pool: str, node: int, host: str, port: int, model_dir, vllm_args,
                extra: dict, front_door=None, paired: bool = False) -> None:
    """vLLM's server with TraCT's connector (and, for decode, the front door) until a signal."""
    import signal
    import tempfile
    from tract_cli.core.pool import Pool
    from tract_cli.serve.vllm_engine import VllmServer, check_model_dir
    check_model_dir(model_dir)
    with Pool.attach(pool, node=node, readonly=True, prefault=False):
        pass                                    # a missing or unformatted region: one line now
    fd, log_path = tempfile.mkstemp(prefix=f"tract-{name}-vllm-", suffix=".log")
    os.close(fd)
    server = VllmServer(model_dir, port or _free_port(host), pool=pool, node=node,
                        extra=extra, host=host, args=tuple(vllm_args or ()), log_path=log_path)
    def interrupt(*_):
        raise KeyboardInterrupt
    stop = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGTERM, interrupt)     # SIGTERM stops vLLM as Ctrl-C does
    try:
        print(f"tract {name}: starting vLLM (log {log_path})", file=sys.stderr, flush=True)
        server.wait_ready()
        if front_door is None:
            print(f"tract {name}: node {node} pid {os.getpid()} engine vllm model {model_dir} "
                  f"pool {pool}: listening on {server.url}", file=sys.stderr, flush=True)
            server.proc.wait()
            raise TractError(f"vLLM exited with code {server.proc.returncode}",
                             f"see its log {log_path}")
        from tract_cli.serve.app import configure_logging
        from tract_cli.serve.vllm_proxy import serve
        prefill_urls, door_port = front_door
        configure_logging(name, "warning")      # the front door logs its warnings only

        def announce(url):
            print(f"tract {name}: node {node} pid {os.getpid()} engine vllm model {model_dir} pool "
                  f"{pool} (vLLM at {server.url}): listening on {url}", file=sys.stderr, flush=True)
        serve(prefill_urls, server.url, host, door_port, announce, paired=paired)
    except KeyboardInterrupt:
        pass
    finally:
        signal.signal(signal.SIGTERM, stop)
        server.stop()


def serve_prefill(
    pool: str = _POOL, node: int = _NODE, host: str = _HOST,
    port: int = typer.Option(8100, "--port", help="Port to listen on (0: any free port)."),
    model_dir: Optional[str] = _MODEL_DIR, profile: str = _PROFILE, seed: int = _SEED,
    ttl: float = typer.Option(30.0, "--handoff-ttl", help="Seconds a handoff stays pinned "
                                                          "without an acknowledgement."),
    simulate: bool = _SIM, flush_mode: Optional[str] = _FLUSH, numa_node: Optional[int] = _NUMA,
    cpus: Optional[str] = _CPUS, threads: Optional[int] = _THREADS, agent: bool = _AGENT,
    engine_name: str = _ENGINE, vllm_args: Optional[List[str]] = _VLLM_ARG,
    log_level: str = _LOG_LEVEL,
) -> None:
    """Prefill worker: computes prompts, writes KV to the pool, returns handoffs."""
    from tract_cli.serve.prefill import PrefillWorker
    if ttl <= 0:
        raise UsageError("--handoff-ttl must be positive", "pass seconds, e.g. 30")
    _check_port(port)
    _check_log_level(log_level)
    if _is_vllm(engine_name):
        _serve_vllm("serve-prefill", pool, node, host, port, model_dir, vllm_args,
                    {"handoff_ttl_s": ttl, "simulate": simulate, "start_agent": agent}
                    | ({"flush_mode": flush_mode} if flush_mode else {}))
        return
    pin(numa_node, cpus)
    engine = _engine(model_dir, profile, seed, threads)
    worker = PrefillWorker(pool, node, engine, simulate=simulate, flush_mode=flush_mode,
                           start_agent=agent, handoff_ttl_s=ttl)
    _serve(worker, host, port, "serve-prefill", log_level)


def serve_decode(
    pool: str = _POOL, node: int = _NODE, host: str = _HOST,
    port: int = typer.Option(8000, "--port", help="Port to listen on (0: any free port)."),
    prefill: List[str] = typer.Option(..., "--prefill", help="Prefill worker URL (repeatable)."),
    kv_mode: str = typer.Option("copy", "--kv-mode", help="copy (private KV, as a GPU) or "
                                                          "zero-copy (attend over pool slots)."),
    model_dir: Optional[str] = _MODEL_DIR, profile: str = _PROFILE, seed: int = _SEED,
    simulate: bool = _SIM, flush_mode: Optional[str] = _FLUSH, numa_node: Optional[int] = _NUMA,
    cpus: Optional[str] = _CPUS, threads: Optional[int] = _THREADS, agent: bool = _AGENT,
    engine_name: str = _ENGINE, vllm_args: Optional[List[str]] = _VLLM_ARG,
    log_level: str = _LOG_LEVEL,
    engine_port: int = typer.Option(0, "--engine-port", help="With --engine vllm: the port of the "
                                                           "decode vLLM behind the front door "
                                                           "(0: a free one)."),
    paired: bool = typer.Option(False, "--paired", help="With --engine vllm: send each request's "
                                                      "prefill and decode requests at once, the "
                                                      "decode finding the handoff in the pool "
                                                      "(docs/VLLM.md, Topologies)."),
) -> None:
    """Decode worker and front door: OpenAI /v1/completions, /health, /metrics."""
    from tract_cli.serve.decode import DecodeWorker, MODES
    _check_port(port)
    _check_log_level(log_level)
    if _is_vllm(engine_name):
        _check_port(engine_port)
        for url in prefill:
            if not url.startswith(("http://", "https://")):
                raise UsageError(f"--prefill {url!r} is not an http:// URL",
                                 "pass the prefill worker's address, e.g. http://127.0.0.1:8100")
        _serve_vllm("serve-decode", pool, node, host, engine_port or _free_port(host), model_dir,
                    vllm_args, {"simulate": simulate, "start_agent": agent}
                    | ({"flush_mode": flush_mode} if flush_mode else {}),
                    front_door=(prefill, port), paired=paired)
        return
    if paired:
        raise UsageError("--paired is a flow of vLLM's front door",
                         "pass --engine vllm with it, or leave it out")
    if kv_mode not in MODES:
        raise UsageError(f"--kv-mode {kv_mode!r} is not one of {', '.join(MODES)}",
                         "pass --kv-mode copy or --kv-mode zero-copy")
    for url in prefill:
        if not url.startswith(("http://", "https://")):
            raise UsageError(f"--prefill {url!r} is not an http:// URL",
                             "pass the prefill worker's address, e.g. http://127.0.0.1:8100")
    pin(numa_node, cpus)
    engine = _engine(model_dir, profile, seed, threads)
    worker = DecodeWorker(pool, node, engine, prefill, kv_mode=kv_mode, simulate=simulate,
                          flush_mode=flush_mode, start_agent=agent)
    _serve(worker, host, port, "serve-decode", log_level)


def generate(
    prompt: str = typer.Argument(..., help="Prompt text (or token ids with --token-ids)."),
    max_tokens: int = typer.Option(16, "--max-tokens"),
    temperature: float = typer.Option(0.0, "--temperature"),
    sample_seed: int = typer.Option(0, "--seed", help="Sampling seed."),
    token_ids: bool = typer.Option(False, "--token-ids", help="PROMPT is comma-separated token ids."),
    model_dir: Optional[str] = _MODEL_DIR, profile: str = _PROFILE, seed: int = _SEED,
    threads: Optional[int] = _THREADS,
) -> None:
    """The single-process reference: the same engine, no pool (prints JSON)."""
    from tract_cli.serve.engine import Sampling
    engine = _engine(model_dir, profile, seed, threads)
    if token_ids:
        try:
            tokens = [int(t) for t in prompt.split(",") if t.strip()]
        except ValueError:
            raise UsageError("--token-ids wants comma-separated integers", "e.g. 256,72,105") from None
    else:
        tokens = engine.tokenizer.encode(prompt)
    if max_tokens < 1:
        raise UsageError("--max-tokens must be at least 1", "pass a positive count")
    engine.check_prompt(tokens, max_tokens)
    out = engine.generate(tokens, Sampling(max_tokens, temperature, sample_seed))
    print(json.dumps({"prompt_tokens": len(tokens), "token_ids": out,
                      "text": engine.tokenizer.decode(out)}))
