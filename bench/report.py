"""Reports: one JSON file, one Markdown summary and PNG plots per run or experiment.

Layout under `out_dir`: `<stem>.json`, `<stem>.md`, `<stem>-*.png` (the Markdown links
the plots by relative path, so the directory can be moved or committed as a whole).
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.plots import all_plots
from bench.plots import available as plots_available
from bench.runner import Phase


def machine() -> dict[str, Any]:
    """What the figures were measured on."""
    cpu = ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")),
                       "")
    except OSError:
        pass
    mem_gib = None
    try:
        mem_gib = round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        pass
    return {"cpus": os.cpu_count(), "cpu_model": cpu or platform.processor(),
            "memory_gib": mem_gib, "platform": platform.platform(),
            # the version and where its build lives: builds of one version differ in speed
            "python": f"{platform.python_version()} from {sys.base_prefix}", "gpu": None}


@dataclass(slots=True)
class Report:
    """`summary` holds the headline figures (an experiment's named keys); `plotters`
    draw an experiment's own figures: each takes (out_dir, stem) and returns the PNG's
    path (or None), after the standard plots."""

    name: str
    title: str
    phases: list[Phase]
    summary: dict[str, Any] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    created: str = field(default_factory=lambda: time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    plotters: list[Callable[[str, str], str | None]] = field(default_factory=list)
    tables: list[list[str]] = field(default_factory=list)  # an experiment's own, Markdown

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "title": self.title, "created": self.created,
                "machine": machine(), "config": self.config, "summary": self.summary,
                "notes": self.notes, "tables": self.tables,
                "phases": [p.to_json() for p in self.phases]}


def write_report(report: Report, out_dir: str, json_path: str | None = None,
                 ) -> dict[str, Any]:
    """Writes JSON, Markdown and plots; returns {"json", "markdown", "plots"} paths."""
    os.makedirs(out_dir, exist_ok=True)
    plots = all_plots(report.phases, out_dir, report.name, report.title)
    if plots_available():
        plots += [p for draw in report.plotters if (p := draw(out_dir, report.name))]
    data = report.to_json()
    data["plots"] = [os.path.basename(p) for p in plots]
    paths = [os.path.join(out_dir, f"{report.name}.json")]
    if json_path:
        paths.append(json_path)
    for path in paths:
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(data, f, indent=1)
    md_path = os.path.join(out_dir, f"{report.name}.md")
    with open(md_path, "w") as f:
        f.write(markdown(report, data["machine"], data["plots"]))
    return {"json": paths, "markdown": md_path, "plots": plots}


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1000:.1f}"


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return str(v)


def phase_table(phases: list[Phase]) -> list[str]:
    head = ("| phase | load | ok/sent | req/s | out tok/s | TTFT p50 / p99 ms | "
            "TPOT p50 / p99 ms | ITL p99 ms | E2E p50 ms | cached | goodput |")
    lines = [head, "|" + "---|" * 11]
    for p in phases:
        s = p.summary
        good = f"{s['goodput_fraction']:.0%}" if "goodput_fraction" in s else "-"
        lines.append(
            f"| {p.name} | {p.load} | {s['completed']}/{s['requests']} | "
            f"{s['request_throughput']:.2f} | {s['output_throughput']:.1f} | "
            f"{_ms(s['ttft_s']['p50'])} / {_ms(s['ttft_s']['p99'])} | "
            f"{_ms(s['tpot_s']['p50'])} / {_ms(s['tpot_s']['p99'])} | "
            f"{_ms(s['itl_s']['p99'])} | {_ms(s['e2e_s']['p50'])} | "
            f"{s['cached_ratio']:.0%} | {good} |")
    return lines


def markdown(report: Report, mach: dict[str, Any], plots: list[str]) -> str:
    lines = [f"# {report.title}", "",
             f"Measured {report.created} on {mach['cpus']} CPUs ({mach['cpu_model']}), "
             f"{mach['memory_gib']} GiB, no GPU; {mach['platform']}, Python {mach['python']}.",
             ""]
    if report.summary:
        lines += ["Headline figures (latencies in seconds):", "", "| figure | value |",
                  "|---|---|"]
        lines += [f"| `{k}` | {_fmt(v)} |" for k, v in report.summary.items()]
        lines.append("")
    for table in report.tables:
        lines += [*table, ""]
    if report.phases:
        lines += phase_table(report.phases) + [""]
    tagged = [p for p in report.phases if p.tags]
    for p in tagged:
        lines += [f"Per workload class in `{p.name}`:", "",
                  "| class | ok/sent | TTFT p50 / p99 ms | TPOT p50 / p99 ms |", "|---|---|---|---|"]
        for tag, s in p.tags.items():
            lines.append(f"| {tag} | {s['completed']}/{s['requests']} | "
                         f"{_ms(s['ttft_s']['p50'])} / {_ms(s['ttft_s']['p99'])} | "
                         f"{_ms(s['tpot_s']['p50'])} / {_ms(s['tpot_s']['p99'])} |")
        lines.append("")
    for note in report.notes:
        lines += [f"- {note}"]
    if report.notes:
        lines.append("")
    lines += [f"![{os.path.splitext(p)[0]}]({p})" for p in plots]
    if report.config:
        lines += ["", "Configuration:", "", "```json", json.dumps(report.config, indent=1),
                  "```"]
    return "\n".join(lines) + "\n"
