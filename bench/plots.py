"""PNG plots of phases with matplotlib (Agg backend, no display needed): latency CDFs,
TTFT/TPOT against request rate, and per-configuration comparison bars.

Each function writes one file and returns its path, or None when the phases give it
nothing to show (e.g. a rate plot needs at least two rates). matplotlib is the `bench`
extra's (pip install -e '.[bench]'): without it, reports are written without plots
(`available`, with a one-line note).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Sequence
from typing import Any

from bench.runner import Phase

_noted = False


def available() -> bool:
    """Whether matplotlib is installed; when not, says so on stderr (once) and reports
    skip their plots."""
    global _noted
    if importlib.util.find_spec("matplotlib") is not None:
        return True
    if not _noted:
        _noted = True
        print("plots skipped: matplotlib is not installed (pip install -e '.[bench]')",
              file=sys.stderr)
    return False


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _series(phase: Phase, metric: str) -> list[float]:
    done = [r for r in phase.results if r.ok]
    if metric == "ttft":
        vals = [r.ttft_s for r in done]
    elif metric == "tpot":
        vals = [r.tpot_s for r in done]
    elif metric == "itl":
        vals = [g for r in done for g in r.itl_s]
    else:
        vals = [r.e2e_s for r in done]
    return sorted(v * 1000.0 for v in vals if v is not None)


def latency_cdfs(phases: Sequence[Phase], path: str, title: str) -> str | None:
    if not any(r.ok for p in phases for r in p.results):
        return None
    plt = _plt()
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for ax, metric in zip(axes.flat, ("ttft", "tpot", "itl", "e2e"), strict=True):
        for p in phases:
            xs = _series(p, metric)
            if xs:
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                ax.step(xs, ys, where="post", label=p.name)
        lows = [min(xs) for p in phases if (xs := _series(p, metric))]
        if metric == "itl" and lows and min(lows) > 0:
            ax.set_xscale("log")  # gaps span decode steps to whole prefills
        ax.set_title(f"{metric.upper()} CDF")
        ax.set_xlabel(f"{metric.upper()} (ms)")
        ax.set_ylabel("fraction of requests" if metric != "itl" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


SWEEP_LABELS = {"rate": "request rate (req/s)", "threshold": "decider threshold (tokens)"}


def param_sweep(phases: Sequence[Phase], path: str, title: str, param: str = "rate",
                ) -> str | None:
    """TTFT and TPOT (p50, p99) against a swept parameter, one line per config."""
    with_rate = [p for p in phases if param in p.params]
    if len({p.params[param] for p in with_rate}) < 2:
        return None
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for config in sorted({p.config for p in with_rate}):
        ps = sorted((p for p in with_rate if p.config == config), key=lambda p: p.params[param])
        xs = [p.params[param] for p in ps]
        for ax, key in zip(axes, ("ttft_s", "tpot_s"), strict=True):
            for q, style in (("p50", "-o"), ("p99", "--^")):
                ys = [_ms(p.summary[key][q]) for p in ps]
                ax.plot(xs, ys, style, label=f"{config or 'run'} {q}")
    for ax, name in zip(axes, ("TTFT", "TPOT"), strict=True):
        ax.set_xlabel(SWEEP_LABELS.get(param, param))
        ax.set_ylabel(f"{name} (ms)")
        ax.set_title(f"{name} against {param}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def comparison_bars(phases: Sequence[Phase], path: str, title: str) -> str | None:
    if len(phases) < 2:
        return None
    plt = _plt()
    panels = (("ttft_s", "p50", "TTFT p50 (ms)"), ("tpot_s", "p99", "TPOT p99 (ms)"),
              ("output_throughput", None, "output tokens/s"))
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    names = [p.name for p in phases]
    for ax, (key, q, label) in zip(axes, panels, strict=True):
        vals = [(_ms(p.summary[key][q]) if q else p.summary[key]) or 0.0 for p in phases]
        bars = ax.bar(range(len(phases)), vals, color=[f"C{i}" for i in range(len(phases))])
        ax.bar_label(bars, fmt="%.1f", fontsize=8)
        ax.set_xticks(range(len(phases)), names, rotation=20, ha="right", fontsize=8)
        ax.set_title(label)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ms(v: float | None) -> float | None:
    return None if v is None else v * 1000.0


def all_plots(phases: Sequence[Phase], out_dir: str, stem: str, title: str) -> list[str]:
    if not available():
        return []
    os.makedirs(out_dir, exist_ok=True)
    made = [latency_cdfs(phases, os.path.join(out_dir, f"{stem}-latency-cdf.png"), title),
            param_sweep(phases, os.path.join(out_dir, f"{stem}-rate.png"), title, "rate"),
            param_sweep(phases, os.path.join(out_dir, f"{stem}-threshold.png"), title,
                        "threshold"),
            comparison_bars(phases, os.path.join(out_dir, f"{stem}-compare.png"), title)]
    return [p for p in made if p]
