"""The Triton MLA kernels (latent write, absorbed paged decode with split-K) against
the torch reference over the same paged latent cache. Without a GPU they run under
Triton's interpreter, so shapes are tiny; the cases are about indexing: latent blocks
scattered through a pool, block sizes 16 and 32, ragged contexts, padding sequences,
more heads than one tile, a rank and rope width that are not powers of two."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")

from engine.attention.base import AttentionMetadata  # noqa: E402
from engine.attention.mla import TorchMLABackend  # noqa: E402
from engine.attention.mla import write_latent as ref_write_latent  # noqa: E402
from engine.attention.triton_mla import TritonMLABackend, write_latent  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_LAYERS, LAYER = 2, 1


def make_decode_step(ctx_lens: list[int], *, heads: int, rank: int, rope: int, nope: int,
                     v_dim: int, block_size: int, pad_seqs: int = 0, seed: int = 0):
    """Decode-only step: sequence i has ctx_lens[i] cached tokens and one new one.
    Blocks come at random from a pool three times the size needed; the cache starts
    as noise, so a read outside a sequence's context shows in the output."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [c + 1 for c in ctx_lens]
    need = [-(-s // block_size) for s in seq_lens]
    pool = list(range(3 * sum(need) + 2))
    rng.shuffle(pool)
    tables = torch.zeros((len(seq_lens) + pad_seqs, max(need) + 1), dtype=torch.int32)
    slots = []
    for i, ctx in enumerate(ctx_lens):
        blocks = [pool.pop() for _ in range(need[i])]
        tables[i, :len(blocks)] = torch.tensor(blocks)
        slots.append(blocks[ctx // block_size] * block_size + ctx % block_size)
    slots += [-1] * pad_seqs
    n = len(seq_lens) + pad_seqs
    i32 = {"dtype": torch.int32, "device": DEVICE}
    meta = AttentionMetadata(
        num_seqs=n, num_tokens=n, slot_mapping=torch.tensor(slots, **i32),
        query_start_loc=torch.arange(n + 1, **i32),
        seq_lens=torch.tensor(seq_lens + [0] * pad_seqs, **i32),
        block_tables=tables.to(DEVICE), max_query_len=1, max_seq_len=max(seq_lens),
        query_start_loc_cpu=list(range(n + 1)), seq_lens_cpu=seq_lens + [0] * pad_seqs)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE)

    cache = rand(len(pool) + sum(need), NUM_LAYERS, 1, block_size, 1, rank + rope)
    args = (rand(n, heads, nope), rand(n, heads, rope), rand(n, rank), rand(n, rope))
    w_kv = rand(heads * (nope + v_dim), rank) * rank ** -0.5
    return args, cache, meta, (nope + rope) ** -0.5, w_kv


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_decode_matches_reference_over_scattered_latent_blocks(block_size, splits) -> None:
    args, cache, meta, scale, w_kv = make_decode_step(
        [0, 5, 47, 100], heads=4, rank=32, rope=16, nope=16, v_dim=24,
        block_size=block_size, pad_seqs=1)
    ref_cache = cache.clone()
    ref = TorchMLABackend().forward(*args, ref_cache[:, LAYER], meta, scale, w_kv)
    out = TritonMLABackend(splits).forward(*args, cache[:, LAYER], meta, scale, w_kv)
    assert torch.equal(cache, ref_cache), "the latent write differs from the reference"
    assert out.shape == ref.shape == (5, 4, 24)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert not out[4].any()  # the padding sequence's row


def test_decode_with_many_heads_and_odd_widths() -> None:
    # 20 heads: two head tiles; rank 40 and rope 8 pad to the kernel's tile widths.
    args, cache, meta, scale, w_kv = make_decode_step(
        [3, 33], heads=20, rank=40, rope=8, nope=8, v_dim=8, block_size=16, seed=3)
    ref = TorchMLABackend().forward(*args, cache.clone()[:, LAYER], meta, scale, w_kv)
    out = TritonMLABackend().forward(*args, cache[:, LAYER], meta, scale, w_kv)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_write_latent_touches_exactly_the_new_slots_of_one_layer() -> None:
    args, cache, meta, _, _ = make_decode_step([4, 20, 31], heads=2, rank=32, rope=16,
                                               nope=16, v_dim=16, block_size=16, pad_seqs=2)
    _, _, latent, k_pe = args
    before = cache.clone()
    write_latent(latent, k_pe, cache[:, LAYER], meta.slot_mapping)
    ref = before.clone()
    ref_write_latent(latent, k_pe, ref[:, LAYER], meta.slot_mapping)
    assert torch.equal(cache, ref)
    changed = (cache != before).any(dim=-1)  # [blocks, layers, 1, bs, 1]
    assert int(changed[:, LAYER].sum()) == 3
    assert not changed[:, 1 - LAYER].any()


def test_deepseek_through_the_triton_backend_matches_transformers() -> None:
    """The whole model on the triton backend (latent write and absorbed paged decode,
    fused MoE, Triton norms): transformers' greedy tokens, with a prefix-cache hit."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from tests.factories import hf_greedy, hf_model, tiny_model_dir

    d = tiny_model_dir("deepseek_v3", q_lora_rank=24, n_group=4, topk_group=2)
    hf = hf_model(d)
    llm = LLM(d, dtype="float32", device=DEVICE.type, attention_backend="triton",
              enforce_eager=True, block_size=16, num_blocks=32, max_num_batched_tokens=32)
    assert llm.engine.config.backend == "triton"
    base = [(7 * j) % 400 + 9 for j in range(40)]
    prompts = [base, base[:33] + [11, 12, 13], [5, 6, 7]]
    outs = llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0))
    eos = llm.engine.eos_token_ids[0]
    for p, o in zip(prompts, outs, strict=True):
        assert o.token_ids == hf_greedy(hf, p, 6, eos), p
    assert llm.engine.stats().prefix_cache_hits > 0
