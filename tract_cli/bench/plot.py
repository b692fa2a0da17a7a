"""`tract bench --plot FILE.png`: the TTFT CDF per transport (one panel per
input length of a sweep) and the mean time per stage (matplotlib, the `plot`
extra)."""
from __future__ import annotations

import numpy as np

from tract_cli.bench import stats
from tract_cli.core.errors import UsageError


def plot_results(res, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys(s.get("group") for s in res.summaries))
    fig, axes = plt.subplots(1, len(groups) + 1, figsize=(4.6 * (len(groups) + 1), 4.6),
                             squeeze=False)
    colors = {}
    for ax, group in zip(axes[0], groups):
        for tr, recs in res.records.items():
            ttft = np.sort([r["ttft"] * 1e3 for r in recs if r.get("group") == group])
            if not len(ttft):
                continue
            line, = ax.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=tr,
                            drawstyle="steps-post", color=colors.get(tr))
            colors[tr] = line.get_color()
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
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}", "pick a writable path") from None
    finally:
        plt.close(fig)
