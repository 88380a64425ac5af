"""Metrics over a phase's `RequestResult`s, with `vllm bench serve`'s definitions.

- TTFT: send -> first content chunk. TPOT: (E2E - TTFT) / (output tokens - 1), per
  request, for requests with >= 2 output tokens. ITL: every gap between consecutive
  content chunks, pooled over requests. E2E: send -> end of stream.
- Throughputs over the phase's wall time: completed requests/s, input tokens/s
  (prompt tokens of completed requests), output tokens/s.
- Goodput: completed requests meeting every SLO given (`ttft`, `tpot`, `e2e`, seconds),
  per second and as a fraction of all requests sent. A request with one output token
  has no TPOT and meets a TPOT SLO (as in vLLM).
- Percentiles are numpy's linear interpolation (as vLLM); latencies in seconds.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from bench.base import BenchError, RequestResult

SLO_KEYS = ("ttft", "tpot", "e2e")
PERCENTILES = (50, 90, 99)


def parse_slo(text: str) -> dict[str, float]:
    """`ttft=0.5,tpot=0.05` -> {"ttft": 0.5, "tpot": 0.05}; values in seconds, > 0."""
    out: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise BenchError(f"bad SLO {part!r}: use KEY=SECONDS with KEY in {SLO_KEYS}")
        try:
            v = float(value)
        except ValueError as e:
            raise BenchError(f"bad SLO value in {part!r}: not a number") from e
        if not v > 0:
            raise BenchError(f"SLO {key} must be > 0 seconds, got {v}")
        out[key] = v
    return out


def meets_slo(r: RequestResult, slo: dict[str, float]) -> bool:
    if not r.ok:
        return False
    tpot = r.tpot_s
    checks = {"ttft": r.ttft_s, "tpot": 0.0 if tpot is None else tpot, "e2e": r.e2e_s}
    return all(checks[k] is not None and float(checks[k] or 0.0) <= v for k, v in slo.items())


def stats(values: Sequence[float]) -> dict[str, float | None]:
    """mean, p50, p90, p99, max; all None when there are no values."""
    keys = ["mean", *(f"p{p}" for p in PERCENTILES), "max"]
    if not values:
        return dict.fromkeys(keys)
    a = np.asarray(values, dtype=float)
    out: dict[str, float | None] = {"mean": float(a.mean())}
    for p, v in zip(PERCENTILES, np.percentile(a, PERCENTILES), strict=True):
        out[f"p{p}"] = float(v)
    out["max"] = float(a.max())
    return out


def summarize(results: Sequence[RequestResult], duration_s: float,
              slo: dict[str, float] | None = None) -> dict[str, Any]:
    """The phase's summary (a JSON-able dict)."""
    if duration_s <= 0:
        raise BenchError("a phase's duration must be > 0")
    done = [r for r in results if r.ok]
    n, n_ok = len(results), len(done)
    in_tok = sum(r.prompt_len for r in done)
    out_tok = sum(r.output_len for r in done)
    cached = sum(r.cached_tokens for r in done)
    summary: dict[str, Any] = {
        "requests": n, "completed": n_ok, "failed": n - n_ok,
        "error_rate": (n - n_ok) / n if n else 0.0,
        "duration_s": duration_s,
        "request_throughput": n_ok / duration_s,
        "input_throughput": in_tok / duration_s,
        "output_throughput": out_tok / duration_s,
        "total_input_tokens": in_tok, "total_output_tokens": out_tok,
        "cached_tokens": cached, "cached_ratio": cached / in_tok if in_tok else 0.0,
        "ttft_s": stats([r.ttft_s for r in done if r.ttft_s is not None]),
        "tpot_s": stats([t for r in done if (t := r.tpot_s) is not None]),
        "itl_s": stats([g for r in done for g in r.itl_s]),
        "e2e_s": stats([r.e2e_s for r in done if r.e2e_s is not None]),
        "errors": _error_counts(results),
    }
    if slo:
        good = sum(meets_slo(r, slo) for r in results)
        summary["slo"] = dict(slo)
        summary["good_requests"] = good
        summary["goodput"] = good / duration_s
        summary["goodput_fraction"] = good / n if n else 0.0
    return summary


def by_tag(results: Sequence[RequestResult], duration_s: float,
           slo: dict[str, float] | None = None) -> dict[str, dict[str, Any]]:
    """One summary per workload tag (only when there are several tags)."""
    tags = sorted({r.tag for r in results})
    if len(tags) < 2:
        return {}
    return {t: summarize([r for r in results if r.tag == t], duration_s, slo) for t in tags}


def _error_counts(results: Sequence[RequestResult]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in results:
        if not r.ok:
            key = r.error.split(":")[0][:60] or "unknown"
            out[key] = out.get(key, 0) + 1
    return out
