"""Reports from hand-built phases: JSON, Markdown with the phase table, PNG plots (a
rate plot only when there are two rates), and the benchmarks page."""

from __future__ import annotations

import json
from pathlib import Path

from bench.base import RequestResult
from bench.metrics import by_tag, summarize
from bench.report import Report, write_report
from bench.results_page import publish
from bench.runner import Phase


def phase(name: str, rate: float, ttft: float) -> Phase:
    results = [RequestResult(ok=True, prompt_len=100, output_len=9, ttft_s=ttft * (1 + i / 10),
                             e2e_s=ttft + 0.4, itl_s=[0.05] * 8, tag="a" if i % 2 else "b")
               for i in range(10)] + [RequestResult(ok=False, prompt_len=100, error="x")]
    return Phase(name, f"poisson {rate} req/s", results, summarize(results, 2.0),
                 by_tag(results, 2.0), {"rate": rate}, "cfg")


def test_report_files(tmp_path: Path) -> None:
    phases = [phase("slow", 1.0, 0.2), phase("fast", 2.0, 0.1)]
    report = Report("demo", "Demo report", phases, summary={"ttft_p50": 0.15})
    paths = write_report(report, str(tmp_path / "out"), str(tmp_path / "copy.json"))
    data = json.loads((tmp_path / "copy.json").read_text())
    assert data["summary"] == {"ttft_p50": 0.15}
    assert [p["summary"]["completed"] for p in data["phases"]] == [10, 10]
    assert len(data["phases"][0]["requests"]) == 11
    assert sorted(data["plots"]) == ["demo-compare.png", "demo-latency-cdf.png", "demo-rate.png"]
    for png in paths["plots"]:
        blob = Path(png).read_bytes()
        assert blob[:8] == b"\x89PNG\r\n\x1a\n" and len(blob) > 10_000
    md = Path(paths["markdown"]).read_text()
    assert "| slow | poisson 1.0 req/s | 10/11 |" in md
    assert "![demo-rate](demo-rate.png)" in md and "Per workload class in `fast`" in md
    # publishing copies the JSON and plots and renders the page from the JSON alone
    page_path = publish(report, paths, docs_dir=str(tmp_path / "docs"))
    assert page_path == str(tmp_path / "docs" / "benchmarks.md")
    page = Path(page_path).read_text()
    assert "### Demo report (`demo`)" in page and "| `ttft_p50` | 0.15 |" in page
    assert "splitserve bench experiment demo --publish" in page  # how to reproduce it
    assert "| slow | poisson 1.0 req/s | 10/11 |" in page  # the phase table
    assert (tmp_path / "docs" / "results" / "demo.json").is_file()
    assert (tmp_path / "docs" / "results" / "demo-rate.png").is_file()
    assert not list((tmp_path / "docs" / "results").glob("*.md"))

def test_one_rate_makes_no_rate_plot(tmp_path: Path) -> None:
    paths = write_report(Report("one", "One", [phase("p", 1.0, 0.1)]), str(tmp_path))
    assert [Path(p).name for p in paths["plots"]] == ["one-latency-cdf.png"]


def test_without_matplotlib_the_report_skips_its_plots_with_a_note(
        tmp_path: Path, monkeypatch, capsys) -> None:
    """matplotlib is the `bench` extra's: without it the report is written whole, its
    plots (the standard ones and a report's own) skipped, with one line saying why."""
    import importlib.util

    from bench import plots

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "matplotlib" else find_spec(name, *a))
    monkeypatch.setattr(plots, "_noted", False)
    drawn: list[str] = []
    report = Report("bare", "Bare", [phase("a", 1.0, 0.1), phase("b", 2.0, 0.2)],
                    plotters=[lambda out, stem: drawn.append(stem)])  # type: ignore[list-item]
    paths = write_report(report, str(tmp_path))
    assert paths["plots"] == [] and drawn == []
    assert json.loads(Path(paths["json"][0]).read_text())["plots"] == []
    assert "![" not in Path(paths["markdown"]).read_text()
    write_report(report, str(tmp_path))  # the note once per process
    err = capsys.readouterr().err
    assert err.count("plots skipped: matplotlib is not installed") == 1, err
