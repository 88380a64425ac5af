"""The absorbed MLA kernel for causal query runs (`mla_absorbed`, the mixed CUDA graphs'
attention for MLA models) against the torch reference (`attend_latent`) over the same
paged latent cache. Without a GPU it runs under Triton's interpreter, so shapes are
tiny; the cases are about indexing and masking: prefill chunks over a cached prefix
beside decode rows and fresh prompts, latent blocks scattered through a pool, padding
sequences that own padding tokens (a mixed graph's bucket), query runs longer than one
tile, more heads than one tile, fewer heads than the tile's rows, float32 and
bfloat16. And the Triton MLA backend on a bucket's constant metadata, against the
decompressing torch reference."""

from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

pytest.importorskip("triton")

from engine.attention.base import AttentionMetadata  # noqa: E402
from engine.attention.mla import attend_latent  # noqa: E402
from engine.attention.triton_mla import mla_absorbed  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def make_step(runs: list[tuple[int, int]], *, heads: int, rank: int, rope: int,
              block_size: int, pad_tokens: int = 0, pad_seqs: int = 0,
              dtype: torch.dtype = torch.float32, seed: int = 0):
    """runs[i] = (cached context, new queries) of sequence i; then `pad_seqs` padding
    sequences (seq_len 0) sharing `pad_tokens` padding tokens, the last taking the rest,
    as engine.mixed_graphs pads a bucket. The cache is noise, so a read outside a
    sequence's context, or past a query's position, shows in the output."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [c + q for c, q in runs]
    need = [-(-s // block_size) for s in seq_lens]
    pool = list(range(3 * sum(need) + 2))
    rng.shuffle(pool)
    n = len(runs) + pad_seqs
    tables = torch.zeros((n, max(need) + 1), dtype=torch.int32)
    for i in range(len(runs)):
        tables[i, :need[i]] = torch.tensor([pool.pop() for _ in range(need[i])])
    q_lens = [q for _, q in runs]
    if pad_seqs:
        share = pad_tokens // pad_seqs
        q_lens += [share] * (pad_seqs - 1) + [pad_tokens - share * (pad_seqs - 1)]
    qsl = [0]
    for q in q_lens:
        qsl.append(qsl[-1] + q)
    t = qsl[-1]
    lens = seq_lens + [0] * pad_seqs
    i32 = {"dtype": torch.int32, "device": DEVICE}
    meta = AttentionMetadata(
        num_seqs=n, num_tokens=t, slot_mapping=torch.full((t,), -1, **i32),
        query_start_loc=torch.tensor(qsl, **i32), seq_lens=torch.tensor(lens, **i32),
        block_tables=tables.to(DEVICE), max_query_len=max(q_lens),
        max_seq_len=max(lens), query_start_loc_cpu=qsl, seq_lens_cpu=lens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(DEVICE, dtype)

    cache = rand(len(pool) + sum(need), 1, 1, block_size, 1, rank + rope)
    return rand(t, heads, rank) * rank ** -0.5, rand(t, heads, rope), cache, meta


def check(q_lat, q_pe, cache, meta, atol: float) -> torch.Tensor:
    scale = 0.3
    ref = attend_latent(q_lat, q_pe, cache[:, 0], meta, scale)
    out = mla_absorbed(q_lat, q_pe, cache[:, 0], meta.block_tables, meta.seq_lens,
                       meta.query_start_loc, scale)
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=atol, rtol=atol)
    return out


@pytest.mark.parametrize("block_size", [4, 16])
def test_chunks_over_prefixes_decode_rows_and_fresh_prompts(block_size) -> None:
    # a chunk over a prefix, a decode row, a fresh prompt, a chunk longer than a tile
    runs = [(9, 5), (30, 1), (0, 7), (21, 19)]
    check(*make_step(runs, heads=4, rank=32, rope=16, block_size=block_size), atol=1e-5)


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_a_padded_bucket_writes_zeros_for_its_padding_rows(dtype, atol) -> None:
    """A mixed graph's bucket of 40 tokens: 3 real sequences, 9 padding tokens owned
    by 2 padding sequences."""
    q_lat, q_pe, cache, meta = make_step([(6, 3), (17, 12), (40, 16)], heads=2, rank=32,
                                         rope=16, block_size=16, pad_tokens=9,
                                         pad_seqs=2, dtype=dtype, seed=1)
    assert meta.num_tokens == 40
    out = check(q_lat, q_pe, cache, meta, atol)
    assert not out[31:].any()


def test_many_heads_and_odd_widths() -> None:
    # 20 heads: two head tiles; rank 40 and rope 8 pad to the kernel's tile widths
    runs = [(3, 4), (0, 2), (33, 1)]
    check(*make_step(runs, heads=20, rank=40, rope=8, block_size=16, pad_tokens=3,
                     pad_seqs=1, seed=2), atol=1e-5)


def test_one_token_bucket_and_sequences_without_rows() -> None:
    """A bucket of 1 (its padding sequence owns no token) and a sequence with no new
    token this step: neither reads a row it does not own."""
    q_lat, q_pe, cache, meta = make_step([(12, 1)], heads=4, rank=32, rope=16,
                                         block_size=4, pad_seqs=1, seed=3)
    assert meta.query_start_loc_cpu == [0, 1, 1]
    check(q_lat, q_pe, cache, meta, atol=1e-5)


def test_backend_runs_a_graph_bucket_absorbed_equal_to_decompressed_attention() -> None:
    """The Triton MLA backend on a bucket's metadata (`graph_bucket`, host-side fields
    constant) attends in the latent space from the device tensors alone; the torch
    reference decompresses K/V (kv_b_proj) on the step's own lengths and runs SDPA: the
    same attention through W_UK / W_UV."""
    from engine.attention.mla import TorchMLABackend
    from engine.attention.triton_mla import TritonMLABackend

    heads, rank, rope, nope, v_dim = 4, 32, 16, 16, 24
    _, q_pe, cache, meta = make_step([(9, 5), (30, 1), (0, 7)], heads=heads, rank=rank,
                                     rope=rope, block_size=4, pad_tokens=3, pad_seqs=1,
                                     seed=4)
    gen = torch.Generator().manual_seed(5)
    t = meta.num_tokens
    q_nope = torch.randn(t, heads, nope, generator=gen).to(DEVICE)
    w_kv = (torch.randn(heads * (nope + v_dim), rank, generator=gen) * rank ** -0.5).to(DEVICE)
    latent, k_pe = torch.zeros(t, rank, device=DEVICE), torch.zeros(t, rope, device=DEVICE)
    args = (q_nope, q_pe, latent, k_pe, cache[:, 0])
    scale = (nope + rope) ** -0.5
    ref = TorchMLABackend().forward(*args, meta, scale, w_kv)
    # what a bucket's metadata holds on the host: constants, not this step's lengths
    b = meta.num_seqs
    bucket = replace(meta, max_query_len=t, query_start_loc_cpu=[0] + [t] * b,
                     seq_lens_cpu=[0] * b, graph_bucket=True)
    out = TritonMLABackend().forward(*args, bucket, scale, w_kv)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    assert not out[13:].any()  # the padding sequence's rows
