"""Tensor parallelism on CUDA (NCCL): TP 2 greedy output token-identical to
transformers' for each architecture (mixtures of experts and MLA too), float32, through
chunked prefill, prefix hits and preemption; CUDA graphs captured on both ranks
replay decode steps, token-identical to eager TP. Needs two GPUs (skipped on fewer: a
one-GPU machine runs none of these)."""

from __future__ import annotations

import pytest

from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.factories import ARCHS, DEEPSEEK_ARCHS, hf_greedy, hf_model, tiny_model_dir
from tests.unit.engine.test_correctness import MAX_TOKENS, make_prompts

pytestmark = [pytest.mark.gpu, pytest.mark.multi_gpu]


@pytest.mark.parametrize("arch", ARCHS + DEEPSEEK_ARCHS)
def test_tp2_on_two_gpus_matches_transformers(arch: str) -> None:
    d = tiny_model_dir(arch, **({"num_key_value_heads": 1} if arch == "mistral" else {}))
    hf = hf_model(d)
    llm = LLM(d, dtype="float32", device="cuda", block_size=4, num_blocks=40,
              max_num_batched_tokens=32, tensor_parallel_size=2)
    try:
        prompts = make_prompts(10)
        outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
        eos = llm.engine.eos_token_ids[0]
        for prompt, out in zip(prompts, outs, strict=True):
            assert out.token_ids == hf_greedy(hf, prompt, MAX_TOKENS, eos), prompt
        assert llm.engine.stats().num_preemptions > 0
        llm.engine.check_integrity()
        assert str(llm.engine.runner.device) == "cuda:0"
    finally:
        llm.engine.close()


def test_tp2_cuda_graphs_capture_the_collectives() -> None:
    """Both ranks capture every bucket (the all-reduces and the logits' all-gather inside
    the graphs) and replay rank 0's bucket each decode step: greedy output identical to
    eager TP 2 and to transformers'."""
    d = tiny_model_dir("llama")
    hf = hf_model(d)
    prompts = make_prompts(6)
    outs: dict[bool, list[list[int]]] = {}
    replays: list[int] = []
    for eager in (True, False):
        llm = LLM(d, dtype="float32", device="cuda", block_size=4, num_blocks=64,
                  max_num_seqs=8, max_num_batched_tokens=32, tensor_parallel_size=2,
                  enforce_eager=eager, collective_timeout_s=60)
        try:
            graphs = llm.engine.runner.graphs
            if eager:
                assert graphs is None
            else:
                assert graphs is not None and sorted(graphs._graphs) == graphs.buckets
                graphs.run = (  # type: ignore[method-assign]
                    lambda b, step, run=graphs.run: replays.append(b) or run(b, step))
            got = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0))
            outs[eager] = [o.token_ids for o in got]
            llm.engine.check_integrity()
            eos = llm.engine.eos_token_ids[0]
        finally:
            llm.engine.close()
    assert replays and any(b > 1 for b in replays)
    for prompt, g, e in zip(prompts, outs[False], outs[True], strict=True):
        assert g == e == hf_greedy(hf, prompt, MAX_TOKENS, eos), prompt


def test_a_hung_rank_ends_graph_replays_within_the_collective_timeout() -> None:
    """Rank 1 stopped (SIGSTOP) while decode steps replay CUDA graphs: the captured
    collectives are outside the NCCL watchdog, yet rank 0 gives up within the timeout
    (its bounded wait on the replay, or the watchdog on the step's broadcast) and takes
    the stopped rank with it."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from cluster.launcher import ROOT
    from tests.factories import child_env
    from tests.integration.serving_util import wait_for
    from tests.integration.test_tp_serving import _gone, _ranks

    # decode steps until stopped: every step replays a graph on both ranks
    script = (
        "import sys\n"
        "from engine.llm import LLM\n"
        "from engine.sampling_params import SamplingParams\n"
        f"llm = LLM({tiny_model_dir('llama')!r}, dtype='float32', device='cuda',\n"
        "          num_blocks=128, tensor_parallel_size=2, collective_timeout_s=3)\n"
        "assert sorted(llm.engine.runner.graphs._graphs) == llm.engine.runner.graphs.buckets\n"
        "print('decoding', file=sys.stderr, flush=True)\n"
        "while True:\n"
        "    llm.generate([[5, 6, 7]] * 4, SamplingParams(max_tokens=500, ignore_eos=True))\n")
    proc = subprocess.Popen(
        [sys.executable, "-c", script], cwd=ROOT, env=child_env(PYTHONUNBUFFERED="1"),
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert proc.stderr is not None
        err = ""
        while "decoding" not in err:
            line = proc.stderr.readline()
            assert line, err
            err += line
        [rank] = _ranks(proc.pid)
        os.kill(rank, signal.SIGSTOP)
        t0 = time.monotonic()
        rest = proc.communicate(timeout=60)[1]
        assert time.monotonic() - t0 < 3 + 20, err + rest
        assert proc.returncode != 0, err + rest
        if "a decode graph's replay failed" in rest:  # ours, not the watchdog's abort
            assert proc.returncode == 70 and "goes down whole" in rest, rest
            wait_for(lambda: _gone(rank), 10, "the stopped rank to be killed")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # a rank the watchdog's abort left behind
        except ProcessLookupError:
            pass
