"""`tract bench --plot FILE.png`: the TTFT CDF per transport (one panel per
input length of a sweep) and the mean time per stage; with `--engine vllm`,
the TTFT CDF per configuration, one panel per input length, and under load
throughput, TTFT and the time split per system and rate (matplotlib, the
`plot` extra)."""
from __future__ import annotations

import numpy as np

from tract_cli.bench import stats
from tract_cli.core.errors import UsageError


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _cdf(ax, ms, label: str, color=None):
    """One TTFT CDF line (MS: the requests' TTFTs in milliseconds) on AX."""
    ms = np.sort(ms)
    line, = ax.plot(ms, np.arange(1, len(ms) + 1) / len(ms), label=label,
                    drawstyle="steps-post", color=color)
    return line


def _save(plt, fig, path: str, dpi: int) -> None:
    try:
        fig.savefig(path, dpi=dpi)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}", "pick a writable path") from None
    finally:
        plt.close(fig)


def plot_results(res, path: str, title: str) -> None:
    plt = _pyplot()

    groups = list(dict.fromkeys(s.get("group") for s in res.summaries))
    fig, axes = plt.subplots(1, len(groups) + 1, figsize=(4.6 * (len(groups) + 1), 4.6),
                             squeeze=False)
    colors = {}
    for ax, group in zip(axes[0], groups):
        for tr, recs in res.records.items():
            ttft = [r["ttft"] * 1e3 for r in recs if r.get("group") == group]
            if ttft:
                colors[tr] = _cdf(ax, ttft, tr, colors.get(tr)).get_color()
        ax.set_xlabel("TTFT (ms)")
        ax.set_ylabel("fraction of requests")
        ax.set_title("TTFT CDF" + (f", {group} tokens in" if group is not None else ""))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    bars = axes[0][-1]
    names = [s["transport"] + (f"\n{s['group']}" if s.get("group") is not None else "")
             for s in res.summaries]
    bottom = np.zeros(len(names))
    for stage in stats.STAGES:
        vals = np.array([(s["stages_s"][stage] or {"mean": 0.0})["mean"] * 1e3
                         for s in res.summaries])
        if vals.any():
            bars.bar(range(len(names)), vals, bottom=bottom, label=stage)
            bottom += vals
    bars.set_xticks(range(len(names)), names, fontsize=6 if len(names) > 6 else 8,
                    rotation=90 if len(names) > 6 else 0)
    bars.set_ylabel("mean time (ms)")
    bars.set_title("time per stage")
    bars.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    _save(plt, fig, path, 100)


def _log_ms(axis) -> None:
    """A log-scale axis of milliseconds labelled 10, 20, 50, 100, ... in plain
    numbers: matplotlib's default labels every minor tick of a short range
    (2x10^1, 3x10^1, ...), and they overlap."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    axis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot_vllm(result: dict, path: str, rows) -> None:
    """`--engine vllm`: TTFT CDF per input length, one line per configuration
    (ROWS, in their order), on a log time axis (the paths differ by orders of
    magnitude), the legend beside the panels."""
    plt = _pyplot()
    lengths = sorted({r["input_len"] for r in result["records"]})
    fig, axes = plt.subplots(1, len(lengths), figsize=(3.6 * len(lengths) + 1.8, 3.4),
                             squeeze=False)
    for ax, n in zip(axes[0], lengths):
        for config in rows:
            t = [r["ttft_s"] * 1e3 for r in result["records"]
                 if r["config"] == config and r["input_len"] == n]
            if t:
                _cdf(ax, t, config)
        ax.set_title(f"{n} input tokens")
        ax.set_xscale("log")
        _log_ms(ax.xaxis)
        ax.set_xlabel("TTFT (ms, log scale)")
        ax.set_ylim(0, 1.02)
    axes[0][0].set_ylabel("CDF")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize="small")
    fig.suptitle("vLLM (CPU build): TTFT CDF per KV path")
    fig.tight_layout(rect=(0, 0, 1 - 1.7 / (3.6 * len(lengths) + 1.8), 1))
    _save(plt, fig, path, 110)


def plot_vllm_workload(result: dict, path: str, systems) -> None:
    """`--engine vllm` under load: throughput and mean / P99 TTFT against the
    offered rate, one line per system (SYSTEMS, in their order); the TTFT CDF
    and each system's time split at the highest rate."""
    plt = _pyplot()
    sums = result["summaries"]
    names = [c for c in systems if any(s["config"] == c for s in sums)]
    top = max(sums, key=lambda s: s["qps"])["point"]       # the highest rate's point
    fig, ((thr, lat), (cdf, bars)) = plt.subplots(2, 2, figsize=(11, 7.5))
    for c in names:
        rows = sorted((s for s in sums if s["config"] == c), key=lambda s: s["qps"])
        q = [s["qps"] for s in rows]
        line, = thr.plot(q, [s["throughput_rps"] for s in rows], marker="o", label=c)
        lat.plot(q, [s["ttft_mean_s"] * 1e3 for s in rows], marker="o", color=line.get_color(),
                 label=f"{c} mean")
        lat.plot(q, [s["ttft_p99_s"] * 1e3 for s in rows], marker="x", linestyle="--",
                 color=line.get_color(), label=f"{c} P99")
        t = [r["ttft_s"] * 1e3 for r in result["records"] if r["config"] == c
             and r["point"] == top]
        if t:
            _cdf(cdf, t, c, line.get_color())
    thr.set_xlabel("offered rate (QPS)")
    thr.set_ylabel("served (requests/s)")
    thr.set_title("throughput")
    thr.legend(fontsize="small")
    lat.set_xlabel("offered rate (QPS)")
    lat.set_ylabel("TTFT (ms, log scale)")
    lat.set_yscale("log")
    _log_ms(lat.yaxis)
    lat.set_title("TTFT: mean (solid), P99 (dashed)")
    top_qps = next(s["qps"] for s in sums if s["point"] == top)
    cdf.set_xscale("log")
    _log_ms(cdf.xaxis)
    cdf.set_xlabel("TTFT (ms, log scale)")
    cdf.set_ylabel("CDF")
    cdf.set_ylim(0, 1.02)
    cdf.set_title(f"TTFT CDF at {top_qps:g} QPS")
    cdf.legend(fontsize="small")
    # side by side, not stacked: vLLM's compute holds a connector's in-step work
    # (TraCT's synchronous load of pool hits, its save), which is also shown apart
    parts = ("queue_s", "compute_s", "kv_read_s", "kv_write_s", "decode_leg_s")
    width = 0.8 / len(parts)
    for i, part in enumerate(parts):
        vals = [next((s["breakdown"][part] or np.nan) * 1e3 for s in sums
                     if s["config"] == c and s["point"] == top) for c in names]
        bars.bar(np.arange(len(names)) + (i - (len(parts) - 1) / 2) * width, vals, width,
                 label=part[:-2].replace("_", " "))
    bars.set_xticks(range(len(names)), names, fontsize=8)
    bars.set_yscale("log")           # the paths' parts differ by orders of magnitude
    low, high = bars.get_ylim()
    bars.set_ylim(low, high * 30)    # room for the legend above the bars
    bars.set_ylabel("mean per request (ms, log scale)")
    bars.set_title(f"time split at {top_qps:g} QPS (no bar: none, or not timed apart)")
    bars.legend(fontsize="x-small", ncol=3, loc="upper center")
    fig.suptitle(f"vLLM (CPU build) under load: {result.get('workload', '')}"[:160], fontsize=9)
    fig.tight_layout()
    _save(plt, fig, path, 110)
