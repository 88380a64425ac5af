"""Metric definitions checked against hand-computed examples."""

from __future__ import annotations

import pytest

from bench.base import BenchError, RequestResult
from bench.metrics import meets_slo, parse_slo, stats, summarize


def ok(ttft: float, e2e: float, out: int, prompt: int = 10, itl: list[float] | None = None,
       cached: int = 0, tag: str = "") -> RequestResult:
    return RequestResult(ok=True, prompt_len=prompt, output_len=out, ttft_s=ttft, e2e_s=e2e,
                         itl_s=itl or [], cached_tokens=cached, tag=tag)


def failed(prompt: int = 10) -> RequestResult:
    return RequestResult(ok=False, prompt_len=prompt, error="HTTP 500: boom")


def test_tpot_is_decode_time_over_tokens_after_the_first() -> None:
    # 0.2 s to the first token, 1.1 s in all, 11 tokens: 0.9 s for 10 more tokens.
    assert ok(0.2, 1.1, 11).tpot_s == pytest.approx(0.09)
    assert ok(0.2, 0.2, 1).tpot_s is None  # one token: no TPOT
    assert failed().tpot_s is None


def test_percentiles_interpolate_linearly_like_numpy() -> None:
    s = stats([1.0, 2.0, 3.0, 4.0])
    # p50 of 1..4 is 2.5; p90 = 1 + 0.9*3 = 3.7; p99 = 1 + 0.99*3 = 3.97
    assert (s["mean"], s["p50"], s["p90"], s["p99"], s["max"]) == pytest.approx(
        (2.5, 2.5, 3.7, 3.97, 4.0))
    assert stats([])["p50"] is None


def test_summary_throughputs_errors_cached_tokens() -> None:
    results = [ok(0.1, 0.5, 5, prompt=100, itl=[0.1, 0.1, 0.1, 0.1], cached=64),
               ok(0.3, 1.5, 13, prompt=50, itl=[0.1] * 12),
               failed(prompt=1000)]
    s = summarize(results, duration_s=2.0)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["error_rate"] == pytest.approx(1 / 3)
    assert s["request_throughput"] == pytest.approx(1.0)  # 2 completed / 2 s
    assert s["input_throughput"] == pytest.approx(75.0)  # (100 + 50) / 2; failed not counted
    assert s["output_throughput"] == pytest.approx(9.0)  # (5 + 13) / 2
    assert s["cached_tokens"] == 64 and s["cached_ratio"] == pytest.approx(64 / 150)
    # TPOTs: (0.5-0.1)/4 = 0.1 and (1.5-0.3)/12 = 0.1
    assert s["tpot_s"]["mean"] == pytest.approx(0.1)
    assert s["ttft_s"]["p50"] == pytest.approx(0.2)
    assert s["itl_s"]["mean"] == pytest.approx(0.1)  # 16 gaps pooled
    assert s["e2e_s"]["max"] == pytest.approx(1.5)
    assert s["errors"] == {"HTTP 500": 1}
    assert "goodput" not in s


def test_goodput_counts_exactly_the_requests_meeting_every_slo() -> None:
    slo = parse_slo("ttft=0.5,tpot=0.05")
    results = [
        ok(0.5, 0.5 + 9 * 0.04, 10),   # meets both (ttft exactly at the limit)
        ok(0.6, 0.6 + 9 * 0.01, 10),   # misses ttft
        ok(0.1, 0.1 + 9 * 0.06, 10),   # misses tpot
        ok(0.2, 0.2, 1),               # one token: no tpot, meets ttft
        failed(),                      # never good
    ]
    assert [meets_slo(r, slo) for r in results] == [True, False, False, True, False]
    s = summarize(results, duration_s=4.0, slo=slo)
    assert s["good_requests"] == 2
    assert s["goodput"] == pytest.approx(0.5)
    assert s["goodput_fraction"] == pytest.approx(2 / 5)
    assert summarize(results, 4.0, parse_slo("e2e=0.65"))["good_requests"] == 2


@pytest.mark.parametrize("bad", ["ttft", "ttft=", "ttft=-1", "latency=1", "tpot=abc"])
def test_bad_slo_is_a_clear_error(bad: str) -> None:
    with pytest.raises(BenchError):
        parse_slo(bad)
