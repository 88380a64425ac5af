"""The CUDA graphs' pool estimate (engine/runner_graphs.py graph_pool_bytes) runs the
forwards the graphs capture: a decode bucket's logits for every row, the mixed graphs'
logits for their S sampled rows only, into the static buffer they share (no logits of
every token of the bucket). On CPU the graph sets exist uncaptured (padded_decode,
padded_mixed) and the measure is the test's."""

from __future__ import annotations

from collections.abc import Callable

import torch

from engine.llm import LLM
from engine.runner_graphs import graph_pool_bytes
from tests.factories import tiny_model_dir


def test_estimate_takes_logits_for_the_sampled_rows_only() -> None:
    llm = LLM(tiny_model_dir("llama"), dtype="float32", block_size=8, num_blocks=64,
              max_num_seqs=4, max_num_batched_tokens=64, max_graph_tokens=48,
              padded_decode=True, padded_mixed=True)
    runner = llm.engine.runner
    assert runner.graphs is not None and runner.mixed_graphs is not None
    vocab = runner.model_cfg.vocab_size
    logits: list[tuple[int, bool]] = []  # (rows, into a buffer given by the caller)
    compute = runner.model.compute_logits

    def spy(hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        logits.append((hidden.shape[0], out is not None))
        return compute(hidden, out=out)

    runner.model.compute_logits = spy  # type: ignore[method-assign]
    fresh: list[int] = []  # float32 logits bytes each measured forward allocated

    def measure(fn: Callable[[], object]) -> int:
        logits.clear()
        fn()
        fresh.append(sum(r * vocab * 4 for r, given in logits if not given))
        return fresh[-1]

    t = min(runner.mixed_graphs.max_tokens, 64)
    need = graph_pool_bytes(runner, 64, measure)
    b, s = runner.graphs.max_batch, runner.mixed_graphs.pad(t)[2]
    assert (t, s) == (48, 4)
    # the decode bucket: b rows of fresh logits; the mixed bucket: s rows (not all t),
    # into the graphs' static buffer
    assert fresh == [b * vocab * 4, 0]
    assert logits == [(s, True)]
    assert need == b * vocab * 4
