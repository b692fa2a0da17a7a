"""`tract bench --engine vllm`: the runs on real vLLM, and their reports (the
static experiment: `bench/engine/vllm_runs.py`; the workloads under load:
`bench/engine/vllm_workloads.py`)."""
from __future__ import annotations

import json
import math

import typer
from rich.markup import escape
from rich.table import Table

from tract_cli.bench.engine import answers
from tract_cli.bench.engine import configs as engine_configs
from tract_cli.bench.engine import vllm_runs, vllm_workloads
from tract_cli.bench.workload import workloads
from tract_cli.cli import render
from tract_cli.core.errors import TractError, UsageError
from tract_cli.core.units import format_duration, format_size

# the paper's static experiment (Fig. 5): input lengths of --engine vllm by default
STATIC_LENGTHS = (1500, 3000, 4500, 6000)
# outputs of the workloads on vLLM's CPU build, unless --output-len says: the
# paper's ~215 tokens would take a CPU minutes a request under load
OUTPUT_CAP = 16
# a longer quiet before each request only makes the run longer: a typo
MAX_REQUEST_GAP_S = 60.0


def check_kv_cache_gib(gib: float | None) -> float:
    """--vllm-kv-cache-gib: at least VllmServer's least, and what this host's
    memory holds for a P/D pair (two instances up at once; --interleave's own
    check counts every configuration's)."""
    from tract_cli.core.medium import mem_available
    from tract_cli.serve.vllm_engine import MIN_KV_CACHE_BYTES
    if gib is None:
        return vllm_runs.DEFAULT_KV_CACHE_GIB
    have = mem_available()
    low = MIN_KV_CACHE_BYTES / (1 << 30)
    if not math.isfinite(gib) or gib < low or (have is not None and 2 * gib * (1 << 30) > have):
        limit = (f", and a P/D pair's two within the {have / (1 << 30):.1f} GiB available"
                 if have else "")
        raise UsageError(f"--vllm-kv-cache-gib {gib:g} is not a KV cache size of at least "
                         f"{low:g} GiB (1 MiB){limit}",
                         f"e.g. --vllm-kv-cache-gib {vllm_runs.DEFAULT_KV_CACHE_GIB:g}")
    return gib


def check_plot_dependency():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise UsageError("--plot needs matplotlib", 'pip install "tract-cxl[plot]"') from None


def _check_tract_modes(load_mode: str, handoff_publish: str) -> None:
    """--load-mode and --handoff-publish, checked before anything starts."""
    from tract_cli.core.handoff import HANDOFF_PUBLISH
    from tract_cli.core.kvpages import LOAD_MODES
    if load_mode not in LOAD_MODES:
        raise UsageError(f"--load-mode {load_mode!r} is not one of {', '.join(LOAD_MODES)}",
                         "pass --load-mode sync or --load-mode async")
    if handoff_publish not in HANDOFF_PUBLISH:
        raise UsageError(f"--handoff-publish {handoff_publish!r} is not one of "
                         f"{', '.join(HANDOFF_PUBLISH)}",
                         "pass --handoff-publish after_step or --handoff-publish in_step")


def static(model, input_len, requests, output_len, configs, seed, json_file, plot,
                load_mode, install_peers=False, vllm_prefix_caching=False,
                handoff_publish="after_step",
                request_gap=vllm_runs.DEFAULT_REQUEST_GAP_S, mono_beside=False,
                interleave=False, kv_cache_gib=None) -> None:
    """`--engine vllm`: the static workload through real vLLM configurations."""
    from tract_cli.serve.vllm_engine import check_model_dir
    _check_tract_modes(load_mode, handoff_publish)
    if not (math.isfinite(request_gap) and 0 <= request_gap <= MAX_REQUEST_GAP_S):
        raise UsageError(f"--request-gap {request_gap:g} is not between 0 and "
                         f"{MAX_REQUEST_GAP_S:g} seconds",
                         f"e.g. --request-gap {vllm_runs.DEFAULT_REQUEST_GAP_S:g}")
    request_gap += 0.0          # -0.0 is 0 (shown and recorded so)
    kv_cache_gib = check_kv_cache_gib(kv_cache_gib)
    check_model_dir(model)
    if plot:
        check_plot_dependency()
    lengths = list(input_len) if input_len else list(STATIC_LENGTHS)
    if any(n < 1 for n in lengths) or output_len < 1:
        raise UsageError("--input-len and --output-len must be positive", "e.g. --input-len 1500")
    per = requests or 4
    for c in configs:
        if c not in vllm_runs.CONFIGS:
            raise UsageError(f"unknown vLLM configuration {c!r}",
                             f"use {', '.join(vllm_runs.CONFIGS)}")
    if interleave:      # refused before minutes of --install-peers, not after
        vllm_runs.check_room(model, list(dict.fromkeys(configs)), lengths, per, kv_cache_gib)
    _install(configs, install_peers)
    res = vllm_runs.run(model, lengths, per, output_len, configs, seed, render.stderr.file,
                         load_mode=load_mode, vllm_prefix_caching=vllm_prefix_caching,
                         handoff_publish=handoff_publish, request_gap=request_gap,
                         mono_beside=mono_beside, interleave=interleave,
                         kv_cache_gib=kv_cache_gib)
    _check_some_ran(res)
    table = Table(title=f"vLLM prefill/decode on {model} (CPU; {per} requests per length, "
                        f"{output_len} output tokens; TraCT region flush mode "
                        f"{res['flush_mode'] or 'n/a (no TraCT configuration)'}, loads "
                        f"{load_mode}, handoffs published {handoff_publish.replace('_', ' ')}; "
                        f"each request after {request_gap:g} s of quiet; vLLM's own prefix cache "
                        f"{'on' if vllm_prefix_caching else 'off'}"
                        + ("" if vllm_prefix_caching else
                           " (on in one vLLM, for its second answer to each prompt: the "
                           "reference of a path that loads whole blocks)")
                        + ("; one vLLM beside every configuration" if mono_beside else "")
                        + ("; every configuration up at once, each prompt sent to each in "
                           "turn" if interleave else "") + ")")
    cols = ["input", "config", "TTFT mean", "in vLLM", "p50", "p90", "p99", "prefill",
            "decode", "from KV path", "verified"]
    if mono_beside:
        cols[4:4] = ["one vLLM beside", "ratio"]
    for col in cols:
        table.add_column(col, justify="left" if col in ("config", "verified") else "right",
                         no_wrap=col == "config")
    dur = lambda v: "—" if v is None else format_duration(v)
    for s in res["summaries"]:
        row = [str(s["input_len"]), s["config"], dur(s["ttft_mean_s"]),
               dur(s.get("engine_mean_s")), dur(s["ttft_p50_s"]), dur(s["ttft_p90_s"]),
               dur(s["ttft_p99_s"]),
               dur(s["prefill_s"]), dur(s["decode_s"]),
               "—" if s["kv_tokens_mean"] is None else f"{s['kv_tokens_mean']:.0f} tokens",
               _verified(s)]
        if mono_beside:
            row[4:4] = [dur(s.get("beside_ttft_mean_s")),
                        "—" if s.get("vs_beside") is None else f"{s['vs_beside']:.2f}x"]
        table.add_row(*row)
    for s in res["summaries"]:
        if s["handed_over"] is not None and s["handed_over"] < s["requests"]:
            render.stdout.print(f"[yellow]{s['config']} at {s['input_len']} tokens: only "
                                f"{s['handed_over']} of {s['requests']} requests were handed "
                                "over; the others were computed by the decode instance")
    render.stdout.print(table)
    render.stdout.print("in vLLM: the mean TTFT's path as vLLM times it (its front ends' "
                        "request times: a P/D prefill instance's whole request and its decode "
                        "instance's time to first token; one instance's time to first token), "
                        "without the HTTP and the client around them. "
                        + ("One vLLM beside: its mean TTFT for the same prompts, each sent to "
                           "it seconds before or after the row's; ratio: the row's TTFT mean "
                           "over it. " if mono_beside else "")
                        + "Verified: one vLLM's "
                        f"answer within {answers.TOLERANCE:g} nats on every token's top "
                        f"{answers.TOP_LOGPROBS} logprobs, up to a near-tie that parts them (a "
                        "prompt partly loaded rounds otherwise; a wrong KV block moves them "
                        "further); a path that took the prompt's whole blocks is held to one "
                        "vLLM's answer over its own prefix cache of them, the same split")
    _report_tail(res)
    for kind, fig in res["memcpy"].items():
        render.stdout.print(kv_path_line(kind, fig))
    publishes = [r["ms"] for r in (res["kv"] or {}).get("publishes", [])]
    if publishes:
        where = ("after the prefill's commit, off its step" if handoff_publish == "after_step"
                 else "in the prefill's step")
        render.stdout.print(f"TraCT handoff publish ({where}): "
                            f"{len(publishes)} handoffs, mean "
                            f"{format_duration(sum(publishes) / len(publishes) / 1e3)}, max "
                            f"{format_duration(max(publishes) / 1e3)}")
    from tract_cli.bench.plot import plot_vllm
    _finish(res, json_file, plot and (lambda: plot_vllm(res, plot, vllm_runs.ROWS)))




def kv_path_line(kind: str, fig: dict) -> str:
    """The connector's loads or saves (KIND) against memcpy of the same bytes, from
    FIG (`vllm_runs._memcpy_figures`, sums over its count): told as the mean one,
    beside the count, so that no sum reads as one request's time.  The real copy
    is set first against the memcpy in the step, where it runs (it meets what the
    copy meets: the forward's leftovers in the TLB and the caches), then against
    the memcpy both cold and warm: a load meets slots its acquire evicted, a
    save reads pages its forward may have left in the caches."""
    n = fig["count"]
    ms = lambda v: "—" if v is None else format_duration(v / n / 1e3)
    x = lambda v: "—" if v is None else f"{v:.2f}x"
    one = kind[:-1]
    warm, step = fig.get("memcpy_warm_ms"), fig.get("memcpy_step_ms")
    same = ("no memcpy timed (no full block)"
            if fig["memcpy_ms"] is None and warm is None and step is None else
            f"memcpy of as many bytes between vLLM's pages and the region's slots, timed on "
            f"warm-ups of the same lengths: {ms(step)} in the step where the copy runs (the "
            f"median of up to {vllm_runs.REFERENCE_WARMUPS} a length), {ms(fig['memcpy_ms'])} from "
            f"cold caches, {ms(warm)} warm. The copy {x(fig.get('copy_vs_step_ratio'))} the "
            f"memcpy in the step (each {one}'s: median {x(fig.get('step_ratio_median'))}, max "
            f"{x(fig.get('step_ratio_max'))}), {x(fig['copy_ratio'])} the cold one (median "
            f"{x(fig.get('copy_ratio_median'))}, max {x(fig.get('copy_ratio_max'))}), "
            f"{x(fig.get('copy_vs_warm_ratio'))} the warm one; the {one} in all "
            f"{x(fig.get('step_ratio'))} the memcpy in the step, {x(fig['ratio'])} the cold "
            f"one (a warm-up's copy again against its memcpy: "
            f"{x(fig.get('cold_copy_ratio'))} both cold, {x(fig.get('warm_copy_ratio'))} both "
            "warm)")
    meta = ms(fig["meta_ms"])
    if kind == "saves":
        meta += (f": the claim's wait past the forward {ms(fig['claim_wait_ms'])}, "
                 f"commit {ms(fig['commit_ms'])}, {ms(fig['commit_in_step_ms'])} of it in "
                 f"the step")
    return (f"TraCT KV {one}: {n} {kind} of {format_size(fig['bytes'])} in all; the mean "
            f"{one}, {format_size(fig['bytes'] // n)}, in {ms(fig['tract_ms'])} (copy "
            f"{ms(fig['copy_ms'])}, checksummed as it copied; pool metadata {meta}); {same}")


def workload_points(workload, trace, limit, speedup, max_input_len, output_cap, requests,
                    prefix_ratio, num_prefix_prompts, isl_mean, osl_mean, qps_sweep, seed,
                    vocab, positions) -> tuple[list, str]:
    """[(offered rate, its requests)] and a description.  Each rate its own draw (a
    synthetic workload's seed + k; a trace salted with seed + k): every rate starts
    from a cold cache; outputs capped at OUTPUT_CAP."""
    cap = lambda reqs: [workloads.Request(r.rid, r.arrival_s, r.tokens,
                                          min(r.output_len, output_cap)) for r in reqs]
    if trace:
        ignored = [flag for flag, v in (("--requests", requests), ("--isl-mean", isl_mean),
                                        ("--osl-mean", osl_mean), ("--prefix-ratio", prefix_ratio),
                                        ("--num-prefix-prompts", num_prefix_prompts))
                   if v is not None]
        if ignored:
            raise UsageError(f"{', '.join(ignored)} {'shapes' if len(ignored) == 1 else 'shape'} "
                             "a synthetic workload, not a trace",
                             "drop them, or drop --trace")
        if qps_sweep and speedup != 1.0:
            raise UsageError("--speedup and --qps both set a trace's rate",
                             "use one: --qps rescales the trace to each rate given")
        if max_input_len is not None and max_input_len < 1:
            raise UsageError("--max-input-len must be positive", "e.g. --max-input-len 8000")
        longest = positions - output_cap - 32          # what the model's positions hold
        if max_input_len is None or max_input_len > longest:
            max_input_len = longest
        load = lambda k: workloads.trace(trace, limit, speedup, vocab, salt=seed + k,
                                         max_input_len=max_input_len)
        first = load(0)
        span = first[-1].arrival_s
        native = (len(first) - 1) / span if len(first) > 1 and span > 0 else None
        if qps_sweep and native is None:
            raise UsageError("this trace has no arrival rate to rescale (one request, or all "
                             "at one time)", "drop --qps, or use a longer --limit")
        if not qps_sweep:
            points = [(native or 0.0, cap(first))]
        else:
            points = []
            for k, q in enumerate(qps_sweep):
                reqs = first if k == 0 else load(k)
                factor = native / q if q > 0 else 0.0       # 0: all at once
                points.append((q, cap([workloads.Request(r.rid, r.arrival_s * factor, r.tokens,
                                                         r.output_len) for r in reqs])))
        rate = (f"its {native * speedup:.2f} QPS rescaled to each rate" if qps_sweep and native
                else f"at speedup {speedup:g} ({native or 0:.2f} QPS)")
        return points, (f"trace {trace}: {len(first)} requests of at most {max_input_len} "
                        f"tokens (the model's {positions} positions), {rate}; outputs capped "
                        f"at {output_cap} tokens")
    ignored = [flag for flag, v in (("--limit", limit), ("--max-input-len", max_input_len))
               if v is not None] + (["--speedup"] if speedup != 1.0 else [])
    if ignored:
        raise UsageError(f"{', '.join(ignored)} {'shapes' if len(ignored) == 1 else 'shape'} a "
                         "trace's replay, not a synthetic workload",
                         "drop them, or pass --trace FILE")
    params = {} if workload == "synthetic" else workloads.load_preset(workload)
    params.pop("description", None)
    overrides = {"requests": requests, "prefix_ratio": prefix_ratio,
                 "num_prefix_prompts": num_prefix_prompts, "isl_mean": isl_mean,
                 "osl_mean": osl_mean}
    params.update({k: v for k, v in overrides.items() if v is not None})
    params.setdefault("requests", 16)
    rates = qps_sweep or [params.get("qps", 1.0)]
    params.pop("qps", None)
    points = [(q, cap(workloads.synthetic(seed=seed + k, qps=q, vocab=vocab, **params)))
              for k, q in enumerate(rates)]
    return points, (f"{workload}: {params['requests']} requests a rate, mean "
                    f"{params.get('isl_mean', 4449)} tokens in, "
                    f"{params.get('prefix_ratio', 0.5):g} of each prompt shared among "
                    f"{params.get('num_prefix_prompts', 10)} prefixes; outputs capped at "
                    f"{output_cap} tokens")


def workload(model, name, trace, limit, speedup, max_input_len, input_len, output_len, requests,
             prefix_ratio, num_prefix_prompts, isl_mean, osl_mean, qps_sweep, seed, configs,
             json_file, plot, load_mode, install_peers, vllm_prefix_caching,
             handoff_publish="after_step", kv_cache_gib=None) -> None:
    """`--engine vllm` with a synthetic workload or a trace: each system under load,
    at each rate of the sweep."""
    from tract_cli.serve.vllm_engine import check_model_dir, model_config
    _check_tract_modes(load_mode, handoff_publish)
    if input_len:
        raise UsageError("--input-len is for the static experiment",
                         "use --isl-mean for a synthetic workload; a trace has its own lengths")
    kv_cache_gib = check_kv_cache_gib(kv_cache_gib)
    check_model_dir(model)
    if plot:
        check_plot_dependency()
    output_cap = OUTPUT_CAP if output_len is None else output_len
    if output_cap < 1:
        raise UsageError("--output-len must be positive", "e.g. --output-len 16")
    for c in configs:
        if c not in vllm_workloads.SYSTEMS:
            raise UsageError(f"unknown vLLM configuration {c!r}",
                             f"use {', '.join(vllm_workloads.SYSTEMS)}")
    cfg = model_config(model)
    points, described = workload_points(
        name, trace, limit, speedup, max_input_len, output_cap, requests, prefix_ratio,
        num_prefix_prompts, isl_mean, osl_mean, qps_sweep, seed, cfg["vocab_size"],
        cfg["max_position_embeddings"])
    _install(configs, install_peers)
    res = vllm_workloads.run(model, points, configs, render.stderr.file, load_mode=load_mode,
                             vllm_prefix_caching=vllm_prefix_caching,
                             handoff_publish=handoff_publish, kv_cache_gib=kv_cache_gib)
    res["workload"] = described
    _check_some_ran(res)
    table = Table(title=f"vLLM under load on {model} (CPU): {described}; vLLM's own prefix "
                        f"cache {'on' if vllm_prefix_caching else 'off'}; TraCT region flush "
                        f"mode {res['flush_mode'] or 'n/a'}, loads {load_mode}, handoffs "
                        f"published {handoff_publish.replace('_', ' ')}",
                  title_justify="left")
    for col in ("QPS", "config", "req/s", "out tok/s", "TTFT mean", "p50", "p99", "hit rate",
                "queue", "compute", "KV read", "KV write", "decode leg", "verified"):
        table.add_column(col, justify="left" if col in ("config", "verified") else "right",
                         no_wrap=col == "config")
    dur = lambda v: "—" if v is None else format_duration(v)
    for s in sorted(res["summaries"], key=lambda s: (s["point"],
                                                     vllm_workloads.SYSTEMS.index(s["config"]))):
        b = s["breakdown"]
        table.add_row(f"{s['qps']:g}", s["config"], f"{s['throughput_rps']:.2f}",
                      f"{s['output_tps']:.1f}", dur(s["ttft_mean_s"]), dur(s["ttft_p50_s"]),
                      dur(s["ttft_p99_s"]),
                      "—" if s["hit_rate"] is None else f"{100 * s['hit_rate']:.1f}%",
                      dur(b["queue_s"]), dur(b["compute_s"]), dur(b["kv_read_s"]),
                      dur(b["kv_write_s"]), dur(b["decode_leg_s"]),
                      _verified(s))
    render.stdout.print(table)
    render.stdout.print(
        "req/s: served from the first arrival to the last answer. queue: vLLM's (P/D: the "
        "two instances' added); compute: vLLM's prefill time on the instances that compute "
        "prompts (TraCT's in-step load of pool hits and its save are in it, and shown apart); "
        "KV read / KV write: TraCT's connector's own load (handoff, pool hits) and save times "
        "(the peers do not time theirs apart); decode leg: P/D, the prefill's answer to the "
        "decode's first token (transfer, decode queue, first step). "
        "Verified: one vLLM's answer, one request at a time, within "
        f"{answers.TOLERANCE:g} nats on every token's top {answers.TOP_LOGPROBS} logprobs, "
        "up to a near-tie that parts them (a batch rounds otherwise; a wrong KV block moves "
        "them further).", soft_wrap=True)
    for s in res["summaries"]:
        if s["handed_over"] is not None and s["handed_over"] < 0.5:
            render.stdout.print(f"[yellow]{s['config']} at {s['qps']:g} QPS: the decode instance "
                                f"took only {100 * s['handed_over']:.0f}% of the prompt tokens "
                                "from its KV path; it computed the rest")
    _report_tail(res)
    from tract_cli.bench.plot import plot_vllm_workload
    _finish(res, json_file,
            plot and (lambda: plot_vllm_workload(res, plot, vllm_workloads.SYSTEMS)))


def _verified(s: dict) -> str:
    if s["verified"] is None:
        return "—"
    if not s["verified"]:
        return "NO"
    n = s.get("near_ties") or 0
    gap = s.get("answer_gap")
    detail = [f"{n} near-tie{'s' if n > 1 else ''}"] if n else []
    detail += [f"gap {gap:.3f}"] if gap else []
    return "yes" + (f" ({', '.join(detail)})" if detail else "")


def _install(configs, install_peers: bool) -> None:
    """--install-peers: each configuration's peer overlay; one that cannot be
    installed is reported and later skipped, with why."""
    if not install_peers:
        return
    from tract_cli.serve.vllm_engine import vllm_python
    for c in configs:
        try:
            engine_configs.install(c, vllm_python(), render.stderr.file)
        except TractError as exc:
            render.stderr.print(f"[yellow]{c}: {escape(str(exc))}", soft_wrap=True)


def _report_tail(res: dict) -> None:
    """What was skipped, what failed and where the logs are."""
    for config, why in res["skipped"].items():
        render.stdout.print(f"[yellow]{config} skipped: {escape(why)}", soft_wrap=True)
    for config, why in res["failed"].items():   # a server's log line may hold [brackets]
        render.stdout.print(f"[red]{config} failed: {escape(why)}", soft_wrap=True)
    if res["logs"]:
        render.stdout.print(f"the vLLM servers' logs: {escape(res['logs'])}", soft_wrap=True)


def _check_some_ran(res: dict) -> None:
    if not res["summaries"]:
        raise TractError("no configuration ran: " + "; ".join(
            f"{c}: {why}" for c, why in (res["skipped"] | res["failed"]).items()),
            "install what is missing, or pick other --vllm-config")


def _finish(res: dict, json_file: str | None, draw) -> None:
    """The run's JSON and its plot (DRAW, if asked for); exit code 1 if an answer
    was not verified or a configuration failed."""
    if json_file:
        try:
            with open(json_file, "w") as f:
                json.dump(res, f, indent=2)
        except OSError as exc:
            raise UsageError(f"cannot write {json_file}: {exc.strerror}",
                             "pick a writable path") from None
    if draw:
        draw()
    if any(s["verified"] is False for s in res["summaries"]) or res["failed"]:
        raise typer.Exit(1)
