"""The fairness experiment's service measure: VTC's cost (prompt + 2 x output tokens),
the prompt counted at the first token, the output spread over the stream."""

from __future__ import annotations

import pytest

from bench.base import RequestResult
from bench.experiments.fairness import service_rate


def test_service_rate_spreads_output_over_the_stream() -> None:
    # tenant a: first token at 1 s, last at 3 s, 10 prompt + 20 output tokens.
    rs = [RequestResult(True, 10, 20, start_s=0.5, ttft_s=0.5, e2e_s=2.5, tag="a"),
          RequestResult(True, 5, 4, start_s=0.0, ttft_s=0.2, e2e_s=0.4, tag="b"),
          RequestResult(False, 7, tag="a")]
    assert service_rate(rs, "a", 0.0, 4.0) == pytest.approx((10 + 2 * 20) / 4.0)
    assert service_rate(rs, "a", 1.0, 2.0) == pytest.approx(10 + 2 * 10)  # half the stream
    assert service_rate(rs, "a", 2.0, 3.0) == pytest.approx(2 * 10)
    assert service_rate(rs, "b", 0.0, 1.0) == pytest.approx(5 + 2 * 4)
