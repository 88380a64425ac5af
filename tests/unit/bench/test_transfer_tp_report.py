"""`bench.transfer_tp_report`: several TP-pair runs of `bench transfer` become one
results-page report whose figures keep their own run's reference."""

from __future__ import annotations

import json

import pytest

from bench.transfer_tp_report import main


def _run(p: int, d: int, rank: float, staging: float, ref: float) -> dict:
    rows = [{"prefill_tp": pp, "decode_tp": dd, "path": path, "tokens": 2048,
             "bytes": 448 << 20, "handoffs": 5, "p50_ms": 100.0, "gbps": g}
            for pp, dd, path, g in ((1, 1, "direct", ref), (p, d, "staging", staging),
                                    (p, d, "rank", rank))]
    summary = {"prefill_tp": p, "decode_tp": d, "path": "rank", "tokens": 2048,
               "tp_gbps": rank, "staging_gbps": staging, "rank_vs_staging": rank / staging,
               "ref_gbps": ref, "tp_vs_ref": rank / ref}
    return {"summary": summary, "rows": rows, "layout": {"num_layers": 28},
            "device": "cpu", "model": "/home/x/.cache/qwen3-0.6b", "transport": "ucx",
            "prefill_tp": p, "decode_tp": d}


def test_pairs_become_one_report_with_same_run_ratios(tmp_path) -> None:
    paths = []
    for i, run in enumerate([_run(2, 1, 1.0, 0.1, 4.0), _run(1, 2, 1.5, 0.5, 3.0)]):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(run))
    out = tmp_path / "report.json"
    assert main(["--out", str(out), *map(str, paths)]) == 0
    report = json.loads(out.read_text())
    assert report["name"] == "transfer-tp-ucx" and report["created"]
    s = report["summary"]
    assert (s["tp2_1_gbps"], s["tp2_1_vs_ref"], s["tp2_1_vs_staging"]) == (1.0, 0.25, 10.0)
    assert (s["tp1_2_ref_gbps"], s["tp1_2_vs_ref"]) == (3.0, 0.5)
    assert "--prefill-tensor-parallel-size 1 --decode-tensor-parallel-size 2 --model-shape " \
           "qwen3-0.6b --handoff-tokens 2048 --repeats 5" in report["command"]
    assert report["command"].endswith(
        f"python -m bench.transfer_tp_report --out {out} tp21.json tp12.json")
    lines = report["tables"][0]
    assert "| 2 -> 1 | rank | 2048 | 448 | 100.0 | 1.000 | 4.000 | 0.25 |" in lines
    assert len(lines) == 2 + 4  # header, rule, staging and rank of each pair


def test_runs_over_different_transports_are_refused(tmp_path) -> None:
    a, b = _run(2, 1, 1, 1, 1), {**_run(1, 2, 1, 1, 1), "transport": "tcp"}
    for name, run in (("a", a), ("b", b)):
        (tmp_path / f"{name}.json").write_text(json.dumps(run))
    with pytest.raises(SystemExit, match="different transports"):
        main(["--out", str(tmp_path / "r.json"), str(tmp_path / "a.json"),
              str(tmp_path / "b.json")])
