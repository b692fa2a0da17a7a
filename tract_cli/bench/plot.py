"""`tract bench --plot FILE.png`: TTFT CDF per transport and the mean time per
stage (matplotlib, the `plot` extra)."""
from __future__ import annotations

import numpy as np

from tract_cli.bench import runner
from tract_cli.core.errors import UsageError


def plot_results(res, path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cdf, bars) = plt.subplots(1, 2, figsize=(13, 4.8))
    for tr, recs in res.records.items():
        ttft = np.sort([r["ttft"] * 1e3 for r in recs])
        cdf.plot(ttft, np.arange(1, len(ttft) + 1) / len(ttft), label=tr, drawstyle="steps-post")
    cdf.set_xlabel("TTFT (ms)")
    cdf.set_ylabel("fraction of requests")
    cdf.set_title("TTFT CDF")
    cdf.grid(alpha=0.3)
    cdf.legend()
    names = [s["transport"] for s in res.summaries]
    bottom = np.zeros(len(names))
    for stage in runner.STAGES:
        vals = np.array([s["stages_s"][stage]["mean"] * 1e3 for s in res.summaries])
        if vals.any():
            bars.bar(names, vals, bottom=bottom, label=stage)
            bottom += vals
    bars.set_ylabel("mean time (ms)")
    bars.set_title("time per stage (compute modelled)")
    bars.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as exc:
        raise UsageError(f"cannot write {path}: {exc.strerror}", "pick a writable path") from None
    finally:
        plt.close(fig)
