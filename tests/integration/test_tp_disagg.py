"""Disaggregated serving with tensor-parallel workers (CPU, gloo, real processes): the
prefill worker at TP p, the decode worker at TP d, every prompt prefilled remotely
(decider threshold 0). Each decode rank receives exactly its KV heads from the prefill
rank(s) holding them, straight between the ranks' caches (no block goes through rank
0's staging copy on either side: its counter stays 0). Greedy output through the
gateway equals transformers' for p != d, p == d, a model with fewer KV heads than
ranks (each replicated), over tcp and shm, and both directions over ucx."""

from __future__ import annotations

import importlib.util

import pytest

from cluster.placement import WorkerPlacement
from engine.config import ModelConfig
from tests.factories import tiny_model_dir
from tests.integration.disagg_util import (
    child,
    generate_remotely,
    logs,
    shm_left_behind,
    start_cluster,
    transformers_greedy,
)
from tests.integration.serving_util import metric

# 9 shares 7's first 48 tokens: its prefix is a hit on the decode, the rest is sent
_LENGTHS = (17, 40, 90, 64)


def _prompts() -> tuple[list[list[int]], list[int]]:
    prompts = [[(11 * i + 17 * j) % 500 + 1 for j in range(n)] for i, n in enumerate(_LENGTHS)]
    prompts.append(prompts[3][:48] + [(5 * j) % 500 + 3 for j in range(21)])
    return prompts, [5, 9, 6, 4, 7]


UCX = pytest.mark.skipif(importlib.util.find_spec("ucxx") is None, reason="no ucxx")


@pytest.mark.parametrize(("prefill_tp", "decode_tp", "transport", "kv_heads"), [
    (1, 2, "tcp", 2), (2, 1, "tcp", 2), (2, 2, "tcp", 1), (2, 2, "shm", 2),
    (1, 2, "shm", 1), (2, 1, "shm", 2), pytest.param(1, 2, "ucx", 2, marks=UCX),
    pytest.param(2, 1, "ucx", 2, marks=UCX)])
def test_tp_prefill_to_tp_decode_equals_transformers(tmp_path, prefill_tp: int,
                                                     decode_tp: int, transport: str,
                                                     kv_heads: int) -> None:
    model_dir = tiny_model_dir("llama", num_key_value_heads=kv_heads)
    prompts, max_tokens = _prompts()
    cluster = start_cluster(
        tmp_path, transport, ("--dtype", "float32"), model_dir=model_dir, ready_timeout_s=180,
        placement={"prefill-0": WorkerPlacement(("--tensor-parallel-size", str(prefill_tp))),
                   "decode-0": WorkerPlacement(("--tensor-parallel-size", str(decode_tp)))})
    try:
        got, moved = generate_remotely(cluster, prompts, max_tokens)
        staged = [metric(int(child(cluster, n).extra["metrics_port"]),
                         "splitserve:kv_staging_blocks_total") for n in ("prefill-0", "decode-0")]
    finally:
        cluster.stop()
    assert staged == [0, 0], staged  # the per-rank path on both sides
    assert shm_left_behind(cluster) == []  # the ranks' cache segments went with them
    cfg = ModelConfig.from_model_dir(model_dir)
    # every decode rank's heads crossed: K and V of every KV head (replicated heads once
    # per rank holding them), every layer, whole blocks
    block_bytes = 2 * cfg.num_kv_heads * cfg.head_dim * cfg.num_layers * 4 * 16
    assert moved > 0 and moved % block_bytes == 0
    for g, want in zip(got, transformers_greedy(model_dir, prompts, max_tokens), strict=True):
        assert g == want, logs(cluster)


def test_tp2_decode_adopts_a_prefills_calculated_kv_scales(tmp_path) -> None:
    """--kv-cache-dtype fp8 --calculate-kv-scales, prefill TP 1, decode TP 2: the decode
    adopts the prefill's scales with the first blocks that land, on both its ranks (the
    ("scales", ...) command), and never calculates its own; greedy output equals the
    offline TP 1 engine whose first forward pass is the prefill's (the first prompt
    alone, the same chunk size)."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from tests.integration.disagg_util import NUM_BLOCKS

    model_dir = tiny_model_dir("llama")
    prompts, max_tokens = _prompts()
    offline = LLM(model_dir, num_blocks=NUM_BLOCKS, max_num_seqs=32, dtype="float32",
                  max_num_batched_tokens=64, cache_dtype="fp8", calculate_kv_scales=True)
    ref = [o.token_ids for i in range(len(prompts)) for o in offline.generate(
        prompts[i:i + 1], SamplingParams(max_tokens=max_tokens[i], temperature=0))]
    cluster = start_cluster(
        tmp_path, "tcp", ("--dtype", "float32", "--kv-cache-dtype", "fp8",
                          "--calculate-kv-scales"), model_dir=model_dir, ready_timeout_s=180,
        placement={"decode-0": WorkerPlacement(("--tensor-parallel-size", "2"))})
    try:
        got = [generate_remotely(cluster, prompts[i:i + 1], max_tokens[i:i + 1])[0][0]
               for i in range(len(prompts))]
        log = child(cluster, "decode-0").log_tail(400)
    finally:
        cluster.stop()
    assert got == ref, logs(cluster)
    assert "KV scales adopted" in log and "calculated from the first" not in log
