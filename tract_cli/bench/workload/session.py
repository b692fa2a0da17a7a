"""One `tract bench` run: the region (given, or a temporary one sized to the
workload), the node agent, every transport on the same requests from an empty
prefix cache, the summaries, and the offline hit-rate simulation they are
checked against."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tract_cli.bench import peers, stats
from tract_cli.bench.workload import prefix_sim, runner
from tract_cli.bench.regions import need_space, temp_region_path
from tract_cli.bench.workload.transports import kv_accounting
from tract_cli.bench.workload.workloads import Request
from tract_cli.core import medium
from tract_cli.core.agent_launch import IDLE_EXIT_S, ensure_agent
from tract_cli.core.errors import UsageError
from tract_cli.core.cpu import online_cpus
from tract_cli.core.geometry import ModelProfile
from tract_cli.core.hashing import block_hashes
from tract_cli.core.pool import Pool

ALIGN = 2 << 20
HANDOFF_ENTRY_BYTES = 32          # a key-list entry (FORMAT.md)
META_RESERVE = 16 << 20


@dataclass
class BenchResult:
    summaries: list
    records: dict
    skipped: dict                 # transport -> why, and how to make it available
    medium: str
    pool_slots: int
    unique_blocks: int
    sim_hit_rate: float
    sim_evictions: int
    kv_bytes_mean: int
    memcpy_2x_s: float
    extra: dict = field(default_factory=dict)
    flush_mode: str = "none"      # what the workers ran with (the header's, or TRACT_FLUSH_MODE)


def unique_blocks(requests: list[Request], block_tokens: int) -> tuple[list[np.ndarray], int]:
    """Every request's block keys and the number of distinct ones.  Hashed from the
    default root: which blocks are equal does not depend on the root, so these
    keys serve the sizing and the offline simulation of any region."""
    keys = [block_hashes(r.tokens, block_tokens=block_tokens) for r in requests]
    return keys, len({k.tobytes() for ks in keys for k in ks})


def region_size_for(requests: list[Request], profile: ModelProfile, prefill_workers: int,
                    decode_workers: int, uniq: int, free_bytes: int | None = None) -> int:
    """Every distinct block of the workload (UNIQ) plus what requests in flight
    pin, capped at half the free space (then the cache evicts) but never below
    what the requests in flight need."""
    g = profile.geometry
    longest = max(len(r.tokens) for r in requests) // g.block_tokens + 2
    in_flight = (prefill_workers + decode_workers + 2) * longest + 64 * 4
    slots = uniq + in_flight
    if free_bytes is not None:
        slots = max(in_flight, min(slots, int(free_bytes * 0.5) // g.block_bytes))
    return -(-(slots * g.block_bytes + META_RESERVE) // ALIGN) * ALIGN


def run(requests: list[Request], profile: ModelProfile, transports: list[str],
        compute: runner.Compute, *, pool: str | None = None, pool_size: int | None = None,
        prefill_workers: int = 1, decode_workers: int = 1, nodes: int = 3,
        flush_mode: str = "none", progress=None, reserve_progress=None,
        real_compute: bool = False, groups: list[tuple[object, list[Request]]] | None = None
        ) -> BenchResult:
    """Runs REQUESTS through every transport; with GROUPS ([(label, requests)],
    e.g. one per input length of a sweep), each group runs through every
    transport on its own, from an empty cache, and every summary names its
    group (`group`)."""
    if prefill_workers < 1 or decode_workers < 1:
        raise UsageError("--prefill-workers and --decode-workers must be at least 1", "e.g. 2")
    if nodes < 3:
        raise UsageError("--nodes must be at least 3 (agent, prefill, decode)", "e.g. --nodes 3")
    groups = groups or [(None, requests)]
    requests = [r for _, reqs in groups for r in reqs]
    if real_compute:
        _check_real(requests, profile, prefill_workers, decode_workers)
    keyed = []
    for label, reqs in groups:
        keys, uniq = unique_blocks(reqs, profile.geometry.block_tokens)
        keyed.append((label, reqs, keys, uniq))
    if pool is not None:
        return _run_on(pool, keyed, profile, transports, compute, prefill_workers,
                       decode_workers, progress, real_compute)
    if pool_size is not None and pool_size % ALIGN:
        raise UsageError("--pool-size must be a multiple of 2 MiB", "e.g. --pool-size 4G")
    with temp_region_path() as path:
        # groups run one after the other from an empty cache: the largest decides
        size = pool_size or max(region_size_for(reqs, profile, prefill_workers, decode_workers,
                                                uniq, medium.free_bytes(path))
                                for _, reqs, _, uniq in keyed)
        need_space(path, size, "a smaller --pool-size")
        Pool.create(path, size, profile, nodes=nodes, flush_mode=flush_mode,
                    progress=reserve_progress).close()
        res = _run_on(path, keyed, profile, transports, compute, prefill_workers,
                      decode_workers, progress, real_compute)
        res.medium = "emulated /dev/shm region"
        return res


def load_note(requests: list[Request], compute: runner.Compute, prefill_workers: int) -> str | None:
    """A sentence when the offered load exceeds the modelled prefill capacity
    (then TTFT is mostly queueing), else None."""
    work = sum(len(r.tokens) for r in requests) / compute.prefill_tokens_per_s / prefill_workers
    span = max(r.arrival_s for r in requests) - min(r.arrival_s for r in requests)
    if len(requests) < 2 or work <= 0:
        return None
    if span == 0:
        return (f"all {len(requests)} requests arrive at once: each queues behind the "
                f"modelled prefill of those before it ({work:.2f} s of prefill for "
                f"{prefill_workers} prefill worker(s)), so TTFT includes that queueing")
    if work > span:
        return (f"the offered load exceeds the modelled prefill capacity {work / span:.1f}x: "
                f"{work:.1f} s of prefill ({prefill_workers} worker(s) at "
                f"{compute.prefill_tokens_per_s:g} tokens/s) arrive within {span:.1f} s, so "
                "requests queue and TTFT is mostly queueing; lower --speedup / --qps or add "
                "--prefill-workers")
    return None


def _check_real(requests, profile, prefill_workers: int, decode_workers: int) -> None:
    """Real compute runs the reference engine: the profile needs its architecture
    and every request must fit the engine's context."""
    from tract_cli.serve.model import ModelConfig
    cfg = ModelConfig.from_profile(profile)
    # the engine's random weights are float32, in every worker and in this
    # process (the verification's single-process reference)
    h, inter, kv = cfg.hidden_size, cfg.intermediate_size, cfg.num_kv_heads * cfg.head_dim
    weights = 4 * (2 * cfg.vocab_size * h + cfg.num_layers * (2 * h * h + 2 * h * kv + 3 * h * inter))
    procs = prefill_workers + decode_workers + 1
    avail = medium.mem_available()
    if avail is not None and weights * procs > avail:
        from tract_cli.core.units import format_size
        raise UsageError(f"--compute real with {profile.name} needs ~{format_size(weights)} of "
                         f"random float32 weights in each of {procs} processes, "
                         f"{format_size(avail)} of memory is available",
                         "use --model tiny-llama (the default for real compute), or "
                         "--compute modelled")
    longest = max(len(r.tokens) + r.output_len for r in requests)
    if longest > cfg.max_positions:
        raise UsageError(f"a request needs {longest} positions; {profile.name}'s engine has "
                         f"{cfg.max_positions}", "use --max-input-len, shorter requests, or "
                         "--compute modelled")


def _run_on(path, keyed, profile, transports, compute, prefill_workers, decode_workers,
            progress, real_compute=False) -> BenchResult:
    with Pool.attach(path, readonly=True, prefault=False, local=False) as p:
        medium, info, flush = p.medium, p.info, p.flush_mode
    if info.geometry != profile.geometry:
        raise UsageError(f"{path} holds KV of {info.model_name} ({info.geometry.describe()})",
                         f"pass --model {info.model_name}, or no --pool")
    g = info.geometry
    requests = [r for _, reqs, _, _ in keyed for r in reqs]
    fits = info.block_bytes // HANDOFF_ENTRY_BYTES * g.block_tokens
    longest = max(len(r.tokens) for r in requests)
    if longest > fits:
        raise UsageError(f"the workload has a {longest}-token request; a handoff of {info.model_name} "
                         f"holds at most {fits} tokens (its key list fits one "
                         f"{info.block_bytes}-byte slot)",
                         f"use --max-input-len {fits} to skip longer requests, or a model with "
                         "larger blocks (e.g. --model llama-3-8b)")
    # the offline simulation sees what the index can hold: the slots, less the
    # key-list and tail slots of one handoff per worker in flight; each group
    # starts from an empty cache, as the transports do
    capacity = info.slot_count - 2 * (prefill_workers + decode_workers)
    sim_hits = sim_blocks = sim_evictions = 0
    for _, reqs, keys, _ in keyed:
        order = sorted(range(len(reqs)), key=lambda i: reqs[i].arrival_s)
        sim = prefix_sim.simulate([keys[i] for i in order], capacity)
        sim_hits += sim.hit_blocks
        sim_blocks += sim.total_blocks
        sim_evictions += sim.evictions
    # the agents this run starts stop by themselves once idle (also if this
    # process is killed); the driver stays attached to the manager's node
    # meanwhile, so the manager outlives gaps between transports
    driver = Pool.attach(path, node=0, prefault=False)
    # the worker nodes' agents run for the whole run too (their payload sweep
    # matters to every tract transport, peers' runs between them included):
    # the driver stays attached to those nodes, so they never idle out
    holds = [Pool.attach(path, node=n, prefault=False) for n in (1, 2)]
    agent = None
    summaries, records, skipped, logs = [], {}, {}, {}
    extra_agents, cluster = [], None
    try:
        agent = ensure_agent(path, 0, manager=True, idle_exit=IDLE_EXIT_S)
        # the worker nodes' agents, as `tract serve-*` starts them in a deployment
        # (their recovery, and the payload sweep that takes the eviction of a
        # payload new to the decode node off the request path); not standby
        # managers: node 0's manager lives as long as the run
        for n in (1, 2):
            extra_agents.append(ensure_agent(path, n, idle_exit=IDLE_EXIT_S,
                                             takeover_after=None))
        if real_compute:
            from tract_cli.bench.workload import real
            cluster = real.RealCluster(path, profile.name, prefill_workers, decode_workers)
        for tr in transports:
            if real_compute and tr not in real.KV_MODES:
                skipped[tr] = ("real compute runs the serving path (tract serve-*), which moves "
                               "KV only through the pool; use --compute modelled for it")
            elif tr in peers.PEERS:
                why = peers.unavailable(tr)
                if why:
                    skipped[tr] = why
        for label, reqs, _, _ in keyed:
            for tr in transports:
                if tr in skipped:
                    continue
                _empty_cache(driver)    # every transport starts from an empty prefix cache
                tick = progress and (lambda tr=tr: progress(tr if label is None else f"{tr} {label}"))
                if real_compute:
                    res = real.run_transport(cluster, tr, reqs, profile.arch["vocab_size"],
                                             g.block_tokens, progress=tick)
                elif tr in peers.PEERS:
                    res = peers.run(tr, reqs, g, compute, progress=tick)
                else:
                    res = runner.run_transport(path, tr, reqs, compute, prefill_workers,
                                               decode_workers, progress=tick)
                kv = kv_accounting(tr)
                s = stats.summarize(res, g.block_bytes, g.block_tokens,
                                    prefix_cache=kv.prefix_cache,
                                    kv_bytes_moved=kv.kv_bytes_moved)
                s["group"] = label
                summaries.append(s)
                for rec in res.records:
                    rec["group"] = label
                records.setdefault(tr, []).extend(res.records)
                if res.log_path:
                    logs[tr] = res.log_path
    finally:
        if cluster is not None:
            cluster.stop()
        for a in [agent, *extra_agents]:
            if a is not None:
                a.terminate()
                a.wait(timeout=30)
        for h in holds:
            h.close()
        driver.close()
    # the references, measured after the run: two memcpy of each group's mean KV
    refs = {}
    for label, reqs, _, _ in keyed:
        kv = int(np.mean([len(r.tokens) // g.block_tokens for r in reqs]) * g.block_bytes)
        refs[label] = (kv, stats.memcpy_reference(kv))
    for s in summaries:
        s["kv_bytes_mean"], s["memcpy_2x_s"] = refs[s["group"]]
    kv_mean, memcpy_2x = refs[keyed[-1][0]]
    uniq = sum(u for *_, u in keyed)
    notes = {} if real_compute else \
        {label: n for label, reqs, _, _ in keyed if (n := load_note(reqs, compute, prefill_workers))}
    return BenchResult(summaries, records, skipped, medium, info.slot_count, uniq,
                       sim_hits / sim_blocks if sim_blocks else 0.0, sim_evictions, kv_mean,
                       memcpy_2x, extra={"peer_logs": logs, "load_notes": notes},
                       flush_mode=flush)


def _empty_cache(p: Pool) -> None:
    while p.index.evict(1 << 20):
        pass
    p.allocator.drain()


def machine() -> str:
    """The CPU a report was measured on, e.g. "Intel(R) Xeon(R) Processor, 16 CPUs"."""
    from tract_cli.provision.cpu import model_name
    return f"{model_name()}, {len(online_cpus())} CPUs"
