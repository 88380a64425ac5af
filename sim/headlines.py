"""The answers of `splitserve sim experiment` (sim/experiments.py): each experiment's
headline (its report's summary: one line per figure, the configs side by side) and the
per-phase goodput / hit-rate plot."""

from __future__ import annotations

from typing import Any

from bench.runner import Phase
from sim.run_cli import SimRun


def _r(v: float | None) -> float | None:
    return None if v is None else round(float(v), 4)


def _row(runs: list[SimRun], metric: str, q: str | None = None) -> str:
    """One figure of several phases, ' / '-separated (in the phases' order)."""
    def one(r: SimRun) -> str:
        s = r.phase.summary
        v = s[metric][q] if q else s.get(metric)
        return "-" if v is None else f"{v:.3g}"
    return " / ".join(one(r) for r in runs)


def _rates(runs: list[SimRun]) -> list[float]:
    return sorted({r.phase.params["rate"] for r in runs})


def routing_headline(runs: list[SimRun]) -> dict[str, Any]:
    """Per cluster rate: TTFT p50, goodput and hit rate of round_robin / least_loaded /
    cache_aware."""
    out: dict[str, Any] = {"order": "round_robin / least_loaded / cache_aware"}
    for rate in _rates(runs):
        at = [r for r in runs if r.phase.params["rate"] == rate]
        out[f"ttft_p50 @ {rate:g} req/s"] = _row(at, "ttft_s", "p50")
        out[f"goodput @ {rate:g} req/s"] = _row(at, "goodput_fraction")
        out[f"hit_rate @ {rate:g} req/s"] = _row(at, "cached_ratio")
    return out


def pd_headline(runs: list[SimRun]) -> dict[str, Any]:
    """Per rate, the split with the best goodput next to all-colocated; per config, its
    goodput at each rate."""
    out: dict[str, Any] = {}
    rates = _rates(runs)
    for rate in rates:
        at = [r for r in runs if r.phase.params["rate"] == rate]
        best = max(at, key=lambda r: r.phase.summary.get("goodput_fraction") or 0.0)
        colo = next(r for r in at if r.phase.config.startswith("colocated"))
        out[f"best @ {rate:g} req/s"] = (
            f"{best.phase.config}: goodput {best.phase.summary['goodput_fraction']:.3g} "
            f"(colocated {colo.phase.summary['goodput_fraction']:.3g})")
    out["rates"] = " / ".join(f"{r:g}" for r in rates)
    for config in dict.fromkeys(r.phase.config for r in runs):
        mine = sorted((r for r in runs if r.phase.config == config),
                      key=lambda r: r.phase.params["rate"])
        out[f"goodput {config}"] = _row(mine, "goodput_fraction")
        out[f"ttft_p50 / tpot_p50 {config}"] = " ; ".join(
            f"{r.phase.summary['ttft_s']['p50']:.3g} / {r.phase.summary['tpot_s']['p50']:.3g}"
            for r in mine)
        out[f"429 / stalled {config}"] = " ; ".join(
            f"{r.extras['rejected']} / {r.extras['stalled']}" for r in mine)
    return out


def _by_size(runs: list[SimRun]) -> dict[str, list[SimRun]]:
    """Runs by the device cache size their config ends with ("1/8"), in order."""
    out: dict[str, list[SimRun]] = {}
    for r in runs:
        out.setdefault(r.phase.config.rsplit(" ", 1)[1], []).append(r)
    return out


def tiers_headline(runs: list[SimRun]) -> dict[str, Any]:
    """Per device cache size: hit rate, TTFT p50 and goodput with device only / +host /
    +host+disk; then per size, peer fetch on / off."""
    out: dict[str, Any] = {"order": "device / +host / +host+disk"}
    peer = [r for r in runs if "peer" in r.phase.config]
    for frac, at in _by_size([r for r in runs if "peer" not in r.phase.config]).items():
        blocks = at[0].phase.params["device_blocks"]
        out[f"hit_rate device {frac} ({blocks} blocks)"] = _row(at, "cached_ratio")
        out[f"ttft_p50 device {frac}"] = _row(at, "ttft_s", "p50")
        out[f"goodput device {frac}"] = _row(at, "goodput_fraction")
    if peer:
        rate = peer[0].phase.params["rate_per_gpu"]
        out[f"order (P:D = 1:3 @ {rate:g} req/s per GPU)"] = "peer fetch / no peer fetch"
    for frac, at in _by_size(peer).items():
        out[f"hit_rate peer fetch {frac}"] = _row(at, "cached_ratio")
        out[f"ttft_p50 peer fetch {frac}"] = _row(at, "ttft_s", "p50")
        out[f"goodput peer fetch {frac}"] = _row(at, "goodput_fraction")
        out[f"peer GiB {frac}"] = " / ".join(
            f"{r.extras['transfer_bytes'].get('peer', 0) / (1 << 30):.0f}" for r in at)
    return out


_HELD = (("hit_rate", "cached_ratio", None), ("ttft_p50", "ttft_s", "p50"),
         ("ttft_p99", "ttft_s", "p99"), ("tpot_p50", "tpot_s", "p50"),
         ("tpot_p99", "tpot_s", "p99"), ("itl_p99", "itl_s", "p99"),
         ("goodput", "goodput_fraction", None), ("throughput", "request_throughput", None))


def block_size_headline(runs: list[SimRun]) -> dict[str, Any]:
    """Per rate and block size: each answer, and how far it moved from the first block
    size's (the reference), next to how far the reseeded references moved; the
    simulator's speed against the reference's."""
    def value(r: SimRun, metric: str, q: str | None) -> float | None:
        v = r.phase.summary.get(metric)
        if q is not None:
            v = (v or {}).get(q)
        return None if v is None else float(v)

    def moved(runs: list[SimRun], ref: SimRun, metric: str, q: str | None) -> str:
        base = value(ref, metric, q)
        out = []
        for r in runs:
            v = value(r, metric, q)
            out.append("-" if v is None or not base else f"{100 * (v / base - 1):+.1f} %")
        return " / ".join(out)

    block_sizes = sorted({r.phase.params["block_tokens"] for r in runs})
    out: dict[str, Any] = {"order": " / ".join(str(b) for b in block_sizes) + " tokens"}
    ref_bs = block_sizes[0]  # the reference the others are held to
    for rate in _rates(runs):
        at = [r for r in runs if r.phase.params["rate"] == rate]
        sizes = sorted((r for r in at if not r.phase.params["reseeded"]),
                       key=lambda r: r.phase.params["block_tokens"])
        reseeded = [r for r in at if r.phase.params["reseeded"]]
        ref = sizes[0]
        for label, metric, q in _HELD:
            out[f"{label} @ {rate:g} req/s"] = _row(sizes, metric, q)
            out[f"{label} vs {ref_bs} @ {rate:g} req/s"] = moved(sizes[1:], ref, metric, q)
            if reseeded:
                out[f"{label} {ref_bs} reseeded @ {rate:g} req/s"] = \
                    moved(reseeded, ref, metric, q)
        speed = [r.extras["sim_requests_per_s"] for r in sizes]
        out[f"simulated req/s @ {rate:g} req/s"] = " / ".join(
            f"{s:g} ({s / speed[0]:.2f}x)" for s in speed)
    return out


def metric_plot(phases: list[Phase], path: str, title: str) -> str | None:
    """Goodput and hit rate per phase, grouped by config, against the request rate."""
    from bench.plots import _plt

    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.4))
    configs = list(dict.fromkeys(p.config for p in phases))
    rates = sorted({p.params["rate"] for p in phases})
    for ax, key, label in ((axes[0], "goodput_fraction", "goodput (fraction meeting SLO)"),
                           (axes[1], "cached_ratio", "prefix hit rate")):
        if len(rates) > 1:
            for c in configs:
                ps = sorted((p for p in phases if p.config == c), key=lambda p: p.params["rate"])
                ax.plot([p.params["rate"] for p in ps], [p.summary.get(key) or 0 for p in ps],
                        "-o", label=c)
            ax.set_xlabel("request rate (req/s)")
            ax.legend(fontsize=7)
        else:
            vals = [p.summary.get(key) or 0 for p in phases]
            ax.bar(range(len(phases)), vals, color=[f"C{i % 10}" for i in range(len(phases))])
            ax.set_xticks(range(len(phases)), [p.config for p in phases], rotation=30,
                          ha="right", fontsize=7)
        ax.set_title(label)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
