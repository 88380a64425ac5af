"""Sets two `bench engine --device cuda` runs of one workload side by side: with CUDA
graphs for mixed and prefill steps and without (`bench/gpu_checks.sh`'s `mixed` step).

    python3 -m bench.mixed_compare WITH.json WITHOUT.json [--workload c]

Prints, per run, output tok/s, the graph replays, and the mixed steps (not decode-only)
that fit the graphs (at most max_graph_tokens tokens of the run with graphs): how many,
their mean time and their tokens per second; then the ratios. Writes nothing."""

from __future__ import annotations

import argparse
import json
from typing import Any


def summarize(path: str, workload: str, max_tokens: int | None) -> dict[str, Any]:
    with open(path) as f:
        run = json.load(f)
    w = run["workloads"][workload]
    fields = w["ours"]["step_fields"]
    steps = [dict(zip(fields, s, strict=True)) for s in w["ours"]["steps"]]
    engine = run["config"]["engine"]
    limit = max_tokens if max_tokens is not None else min(
        engine.get("max_graph_tokens", 0), engine["max_num_batched_tokens"])
    mixed = [s for s in steps if not s["decode_only"] and s["tokens"] <= limit]
    secs = sum(s["seconds"] for s in mixed)
    return {"tok_s": w["summary"]["ours_tok_s"], "replays": engine.get("graph_replays"),
            "mixed_steps": len(mixed), "mixed_limit": limit,
            "mixed_mean_ms": 1e3 * secs / max(1, len(mixed)),
            "mixed_tok_s": sum(s["tokens"] for s in mixed) / secs if secs else None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("with_graphs")
    p.add_argument("without_graphs")
    p.add_argument("--workload", default="c")
    args = p.parse_args(argv)
    on = summarize(args.with_graphs, args.workload, None)
    off = summarize(args.without_graphs, args.workload, on["mixed_limit"])
    for name, r in (("mixed graphs", on), ("eager mixed", off)):
        print(f"{name}: {r['tok_s']:.0f} output tok/s; replays {r['replays']}; "
              f"{r['mixed_steps']} mixed steps <= {r['mixed_limit']} tokens, "
              f"{r['mixed_mean_ms']:.2f} ms each, {r['mixed_tok_s'] or 0:.0f} tok/s")
    print(f"with / without: output tok/s {on['tok_s'] / off['tok_s']:.3f}, mixed step time "
          f"{on['mixed_mean_ms'] / max(off['mixed_mean_ms'], 1e-9):.3f}")
    print(json.dumps({"with": on, "without": off}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
