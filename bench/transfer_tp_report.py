"""One results-page report from several `bench transfer --prefill-tensor-parallel-size P
--decode-tensor-parallel-size D --json FILE` runs (one TP pair each), for
`docs/results/` (`python -m bench.results_page` renders it):

    python -m bench.transfer_tp_report --out docs/results/transfer-tp-ucx.json \\
        tp21.json tp12.json tp22.json

Each pair's figures keep the reference of their own run (TP 1 -> TP 1 and the staging
path, measured in the same process as the pair): on a shared machine only those ratios
compare, not figures of different runs.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import datetime, timezone
from typing import Any


def _command(run: dict[str, Any]) -> str:
    s, rows = run["summary"], run["rows"]
    tokens = sorted({r["tokens"] for r in rows})
    repeats = max(r["handoffs"] for r in rows)
    shape = os.path.basename(run["model"])
    return (f"splitserve bench transfer --tp-transport {run['transport']} "
            f"--prefill-tensor-parallel-size {s['prefill_tp']} "
            f"--decode-tensor-parallel-size {s['decode_tp']} --model-shape {shape} "
            f"--handoff-tokens {','.join(map(str, tokens))} --repeats {repeats} "
            f"--json tp{s['prefill_tp']}{s['decode_tp']}.json")


def table(runs: list[dict[str, Any]]) -> list[str]:
    lines = ["| TP pair | path | tokens | MiB | p50 ms | GB/s | TP 1 -> 1 GB/s, same run "
             "| vs TP 1 -> 1 |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for run in runs:
        s = run["summary"]
        ref = {r["tokens"]: r["gbps"] for r in run["rows"] if r["path"] == "direct"}
        for r in run["rows"]:
            if r["path"] == "direct":
                continue
            lines.append(f"| {s['prefill_tp']} -> {s['decode_tp']} | {r['path']} | "
                         f"{r['tokens']} | {r['bytes'] / 2**20:.0f} | {r['p50_ms']:.1f} | "
                         f"{r['gbps']:.3f} | {ref[r['tokens']]:.3f} | "
                         f"{r['gbps'] / ref[r['tokens']]:.2f} |")
    return lines


def report(runs: list[dict[str, Any]], out: str = "report.json") -> dict[str, Any]:
    from bench.report import machine

    transports = {run["transport"] for run in runs}
    if len(transports) != 1:
        raise SystemExit(f"runs over different transports: {sorted(transports)}")
    transport = transports.pop()
    summary: dict[str, Any] = {}
    for run in runs:
        s = run["summary"]
        key = f"tp{s['prefill_tp']}_{s['decode_tp']}"
        summary[f"{key}_gbps"] = round(s["tp_gbps"], 3)
        summary[f"{key}_ref_gbps"] = round(s["ref_gbps"], 3)
        summary[f"{key}_vs_ref"] = round(s["tp_vs_ref"], 3)
        summary[f"{key}_vs_staging"] = round(s["rank_vs_staging"], 2)
    big = max(run["summary"]["tokens"] for run in runs)
    return {
        "name": f"transfer-tp-{transport}",
        "title": f"KV hand-off between tensor-parallel sizes over {transport}",
        "created": datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
        "machine": machine(), "command": "\n".join(
            [_command(run) for run in runs] + [
                f"python -m bench.transfer_tp_report --out {out} " + " ".join(
                    f"tp{r['summary']['prefill_tp']}{r['summary']['decode_tp']}.json"
                    for r in runs)]),
        "config": {"transport": transport, "model": os.path.basename(runs[0]["model"]),
                   "device": runs[0]["device"], "layout": runs[0]["layout"]},
        "summary": summary, "tables": [table(runs)],
        "notes": [f"Summary at {big} tokens: `tpP_D_gbps` is the per-rank path (each decode "
                  "rank's KV heads straight from the prefill rank holding them), "
                  "`_ref_gbps` TP 1 -> TP 1 and `_vs_staging` the ratio to the path "
                  "through rank 0's staging copies, all three from the same run",
                  "One hand-off at a time, p50 of the repeats; source blocks a run, "
                  "destination blocks scattered over the decode's pool; each run checks "
                  "the landed bytes"],
        "plots": [], "runs": runs}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.transfer_tp_report",
                                description=__doc__)
    p.add_argument("--out", required=True, help="the report (docs/results/NAME.json)")
    p.add_argument("runs", nargs="+", help="`bench transfer ... --json` files, one a TP pair")
    args = p.parse_args(argv)
    runs = []
    for path in args.runs:
        with open(path) as f:
            runs.append(json.load(f))
    with open(args.out, "w") as f:
        json.dump(report(runs, args.out), f, indent=1)
        f.write("\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
