"""Tensor parallelism (gloo, float32) through the decode graphs' path: every rank builds
the same buckets, and each decode-only step reaches every rank in its graph buffer's
fixed addresses, padded to rank 0's bucket (CUDA capture aside, what a replay runs).
Greedy output token-identical to transformers and to eager TP."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from engine.cuda_graphs import DecodeGraphs
from engine.distributed import TPGroup
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.factories import hf_greedy, hf_model, tiny_model_dir
from tests.unit.engine.test_correctness import make_prompts


def _generate(model_dir: str, prompts: list[list[int]], max_tokens: int, padded: bool,
              **kw: object) -> tuple[list[list[int]], list[int], int | None]:
    """(token ids per prompt, the buckets rank 0 ran, eos) of a TP 2 engine."""
    llm = LLM(model_dir, dtype="float32", block_size=4, num_blocks=64, max_num_seqs=8,
              max_num_batched_tokens=32, tensor_parallel_size=2, padded_decode=padded, **kw)
    replays: list[int] = []
    try:
        runner = llm.engine.runner
        assert (runner.graphs is not None) == padded
        if padded:
            assert runner.graphs is not None and not runner.graphs._graphs  # no capture on CPU
            run = runner.graphs.run
            runner.graphs.run = lambda b, step: replays.append(b) or run(b, step)  # type: ignore
        outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0))
        llm.engine.check_integrity()
        stats = llm.engine.stats()
        assert stats.num_free_blocks == stats.num_blocks
        eos = llm.engine.eos_token_ids[0] if llm.engine.eos_token_ids else None
    finally:
        llm.engine.close()
    group = llm.engine.runner.tp
    assert group is not None and all(not p.is_alive() for p in group.procs)
    return [o.token_ids for o in outs], replays, eos


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe", "deepseek_v2"])
def test_tp2_padded_decode_equals_eager_tp_and_transformers(arch: str) -> None:
    d = tiny_model_dir(arch)
    prompts = make_prompts(6)
    padded, replays, eos = _generate(d, prompts, 12, padded=True)
    eager, none, _ = _generate(d, prompts, 12, padded=False)
    assert not none
    # decode-only steps of 1..6 sequences: buckets 1, 2, 4 and 8, several of them padded
    assert replays and set(replays) <= {1, 2, 4, 8} and any(b > 1 for b in replays)
    hf = hf_model(d)
    for prompt, got, ref in zip(prompts, padded, eager, strict=True):
        assert got == ref == hf_greedy(hf, prompt, 12, eos), prompt


def test_tp2_padded_decode_with_triton_kernels_on_each_ranks_heads() -> None:
    """The Triton attention and elementwise kernels (under Triton's interpreter here)
    over each rank's half of the query and KV heads, through the padded path."""
    pytest.importorskip("triton")
    d = tiny_model_dir("llama")
    prompts = make_prompts(3, seed=3)
    got, replays, eos = _generate(d, prompts, 6, padded=True, attention_backend="triton")
    assert replays and any(b > 1 for b in replays)
    hf = hf_model(d)
    for prompt, tokens in zip(prompts, got, strict=True):
        assert tokens == hf_greedy(hf, prompt, 6, eos), prompt


def _capture_on_two_ranks(max_num_seqs: tuple[int, int]) -> list[BaseException | None]:
    """`DecodeGraphs.capture` on two gloo ranks (threads of this process) whose engines
    allow `max_num_seqs` sequences each; what each raised."""
    store = dist.HashStore()
    errors: list[BaseException | None] = [None, None]
    cpu = torch.device("cpu")

    def rank(r: int) -> None:
        pg = dist.ProcessGroupGloo(store, r, 2, timedelta(seconds=30))
        graphs = DecodeGraphs(lambda *a: torch.zeros(0), max_num_seqs[r], 8, cpu, None,
                              capture=False, tp=TPGroup(r, 2, cpu, pg, 30.0))
        try:
            graphs.capture()
        except RuntimeError as e:
            errors[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors


def test_ranks_refuse_to_capture_different_buckets() -> None:
    assert _capture_on_two_ranks((16, 16)) == [None, None]
    errors = _capture_on_two_ranks((16, 24))
    assert all(e is not None and "differ from a peer's" in str(e) for e in errors), errors
