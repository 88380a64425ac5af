"""The attention kernels' start-up tuner on CUDA (skipped without a GPU): the real
timings on a Llama-3-8B rank's shape (bfloat16 and float8 caches) stay within the
budget, choose from the search spaces, and every chosen configuration computes as the
untuned one (split-K decode and the unified kernel's prefill tiles); the engine tunes
before capturing its graphs and stays transformers' greedy."""

from __future__ import annotations

import logging
import time

import pytest
import torch

from engine.attention import triton_attn, triton_decode
from engine.attention.triton_attn import PrefillTile
from engine.attention.triton_decode import DecodeTile
from engine.attention.tuning import (
    PREFILL_BLOCK_MS,
    PREFILL_STAGES,
    PREFILL_TILE_NS,
    PREFILL_WARPS,
    STAGES,
    TILE_NS,
    WARPS,
    WAVES,
    tune_attention,
)
from engine.kv_quant import FP8_DTYPE
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.factories import hf_greedy, hf_model, tiny_model_dir

pytestmark = pytest.mark.gpu

HEADS, KV_HEADS, HEAD_DIM, BLOCK, BLOCKS = 32, 8, 128, 16, 4096


def _decode(kv_layer: torch.Tensor, tile: DecodeTile, lens: list[int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    width = max(lens) // BLOCK + 1
    tables = torch.randint(0, BLOCKS, (len(lens), width), generator=gen, dtype=torch.int32)
    q = torch.randn((len(lens), HEADS, HEAD_DIM), generator=gen).to(torch.bfloat16)
    qsl = list(range(len(lens) + 1))
    return triton_decode.decode_attention(
        q.cuda(), kv_layer, tables.cuda(), torch.tensor(lens, dtype=torch.int32).cuda(),
        torch.tensor(qsl, dtype=torch.int32).cuda(), qsl, HEAD_DIM ** -0.5, tile=tile)


def _prefill(kv_layer: torch.Tensor, tile: PrefillTile, ctx: list[int],
             q_lens: list[int]) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    lens = [c + n for c, n in zip(ctx, q_lens, strict=True)]
    tables = torch.randint(0, BLOCKS, (len(lens), max(lens) // BLOCK + 1), generator=gen,
                           dtype=torch.int32)
    q = torch.randn((sum(q_lens), HEADS, HEAD_DIM), generator=gen).to(torch.bfloat16)
    qsl = [sum(q_lens[:i]) for i in range(len(q_lens) + 1)]
    return triton_attn.unified_attention(
        q.cuda(), kv_layer, tables.cuda(), torch.tensor(lens, dtype=torch.int32).cuda(),
        torch.tensor(qsl, dtype=torch.int32).cuda(), qsl, max(q_lens), HEAD_DIM ** -0.5,
        tile=tile)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8_DTYPE], ids=["bf16", "fp8"])
def test_the_tuner_on_cuda(kv_dtype: torch.dtype, caplog: pytest.LogCaptureFixture) -> None:
    cache = torch.randn((BLOCKS, 2, 2, BLOCK, KV_HEADS, HEAD_DIM), device="cuda")
    cache = cache.clamp(-4, 4).to(kv_dtype)
    kv_layer = cache[:, 0]
    t0 = time.perf_counter()
    with caplog.at_level(logging.INFO, logger="engine.attention.tuning"):
        tables = tune_attention(kv_layer, HEADS, torch.bfloat16, None, max_num_seqs=64,
                                max_model_len=8192, max_num_batched_tokens=8192,
                                budget_s=15.0)
    elapsed = time.perf_counter() - t0
    table = tables.decode
    print(f"tuned in {elapsed:.1f} s: decode {table.describe()}; "
          f"prefill {tables.prefill.describe()}")
    assert elapsed < 15.0 + 5.0
    assert "attention tuning (decode)" in caplog.text
    assert "attention tuning (prefill)" in caplog.text
    assert table.entries, "no point tuned"
    assert (8192,) in tables.prefill.entries, "the 8k chunk (tuned first) not tuned"
    prefill_space = {PrefillTile(m, n, w, s) for m in PREFILL_BLOCK_MS
                     for n in PREFILL_TILE_NS for w in PREFILL_WARPS for s in PREFILL_STAGES}
    ctx, q_lens = [0, 300, 2000, 17], [2048, 700, 64, 1]
    want = _prefill(kv_layer, PrefillTile(), ctx, q_lens).float()
    for tile in set(tables.prefill.entries.values()):
        assert tile in prefill_space
        got = _prefill(kv_layer, tile, ctx, q_lens).float()
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    space = {DecodeTile(n, w, s, v) for n in TILE_NS for w in WARPS for s in STAGES
             for v in WAVES}
    lens = [1, 17, 300, 1000, 4097, 8000, 64, 2048]
    want = _decode(kv_layer, DecodeTile(), lens).float()
    for tile in set(table.entries.values()):
        assert tile in space
        got = _decode(kv_layer, tile, lens).float()
        torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)


def test_engine_tunes_before_capture_and_stays_greedy() -> None:
    d = tiny_model_dir("llama")
    prompts = [[(7 * i + 5 * j) % 400 + 1 for j in range(n)] for i, n in enumerate((9, 50))]
    llm = LLM(d, dtype="float32", device="cuda", num_blocks=64, max_num_seqs=8,
              max_num_batched_tokens=64)
    assert llm.engine.runner.attention.decode_table.entries
    assert llm.engine.runner.attention.prefill_table.entries  # a 64-token chunk point
    outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0))
    hf = hf_model(d)
    eos = llm.engine.eos_token_ids[0] if llm.engine.eos_token_ids else None
    for p, o in zip(prompts, outs):
        assert o.token_ids == hf_greedy(hf, p, 12, eos)
    off = LLM(d, dtype="float32", device="cuda", num_blocks=64, max_num_seqs=8,
              max_num_batched_tokens=64, attention_tuning="off")
    assert not off.engine.runner.attention.decode_table.entries
    assert not off.engine.runner.attention.prefill_table.entries
