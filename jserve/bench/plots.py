"""PNG plots of benchmark runs (matplotlib is optional: the `bench` extra)."""

from __future__ import annotations

import sys
from pathlib import Path


def write_plots(out_dir: Path, runs: list[dict], sweep_key: str | None) -> list[str]:
    """PNG latency CDFs per run, and throughput / p99 TTFT against the swept variable."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: skipping plots (pip install matplotlib)", file=sys.stderr)
        return []
    written = []
    for run in runs:
        ok = [r for r in run["requests"] if r["ok"]]
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
        for ax, (name, key) in zip(axes, (("TTFT", "ttft"), ("TPOT", "tpot"), ("E2E latency", "e2e"))):
            xs = sorted(r[key] * 1000 for r in ok if r[key] is not None)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], drawstyle="steps-post")
            ax.set_xlabel(f"{name} (ms)")
            ax.set_ylabel("CDF")
            ax.set_ylim(0, 1.02)
            ax.grid(alpha=0.3)
        fig.suptitle(run["label"])
        fig.tight_layout()
        path = out_dir / f"cdf_{run['label'].replace('=', '').replace(' ', '_')}.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(str(path))
    if sweep_key and len(runs) > 1:
        values = [r["load"][sweep_key] for r in runs]
        xs = list(range(len(runs)))  # evenly spaced categories: sweeps are often geometric, and may end in 'inf'
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.6))
        a1.plot(xs, [r["metrics"]["output_throughput"] for r in runs], "o-", label="output tok/s")
        a1.set_ylabel("output tokens/s")
        a1b = a1.twinx()
        a1b.plot(xs, [r["metrics"]["request_throughput"] for r in runs], "s--", color="tab:orange", label="req/s")
        if runs[0]["metrics"].get("goodput") is not None:
            a1b.plot(xs, [r["metrics"]["goodput"] for r in runs], "^:", color="tab:green", label="goodput req/s")
        a1b.set_ylabel("requests/s")
        handles = a1.get_legend_handles_labels()[0] + a1b.get_legend_handles_labels()[0]
        a1b.legend(handles, [h.get_label() for h in handles], loc="lower right", fontsize=8)
        a2.plot(xs, [r["metrics"]["ttft_ms"]["p99"] or float("nan") for r in runs], "o-", color="tab:red")
        a2.set_ylabel("p99 TTFT (ms)")
        for ax in (a1, a2):
            ax.set_xlabel("concurrency" if sweep_key == "concurrency" else "request rate (req/s)")
            ax.set_xticks(xs, [f"{v:g}" for v in values])
            ax.grid(alpha=0.3)
        fig.tight_layout()
        path = out_dir / "sweep.png"
        fig.savefig(path, dpi=90)
        plt.close(fig)
        written.append(str(path))
    return written

