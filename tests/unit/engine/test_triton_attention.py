"""The Triton attention backend against the torch SDPA reference, over the same paged
cache. Without a GPU the kernels run under Triton's interpreter (numpy), so shapes are
tiny; the cases are about indexing: ragged batches, blocks scattered through a pool,
a strided per-layer view, cached prefixes, GQA packing, windows, padding."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("triton")

from engine.attention.base import AttentionMetadata  # noqa: E402
from engine.attention.torch_sdpa import TorchSDPABackend  # noqa: E402
from engine.attention.triton_backend import TritonBackend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
NUM_LAYERS, LAYER = 2, 1


@dataclass
class Case:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    cache: torch.Tensor  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
    meta: AttentionMetadata
    scale: float


def make_case(ctx_lens: list[int], q_lens: list[int], *, kv_heads: int = 2, group: int = 1,
              head_dim: int = 16, block_size: int = 16, window: int | None = None,
              pad_seqs: int = 0, dtype: torch.dtype = torch.float32, seed: int = 0) -> Case:
    """A step of sequences with `ctx_lens[i]` cached tokens and `q_lens[i]` new ones,
    plus `pad_seqs` padding sequences (one token, slot -1, seq_len 0). Blocks are drawn
    at random from a pool twice the size needed; the cache starts as noise, so a read
    of a slot outside a sequence's context shows up in the output."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    seq_lens = [c + n for c, n in zip(ctx_lens, q_lens, strict=True)]
    need = [-(-s // block_size) for s in seq_lens]
    pool = list(range(2 * sum(need) + 3))
    rng.shuffle(pool)
    width = max(need) + 1
    tables = torch.zeros((len(seq_lens) + pad_seqs, width), dtype=torch.int32)
    slots: list[int] = []
    for i, (ctx, n) in enumerate(zip(ctx_lens, q_lens, strict=True)):
        blocks = [pool.pop() for _ in range(need[i])]
        tables[i, :len(blocks)] = torch.tensor(blocks)
        slots += [blocks[p // block_size] * block_size + p % block_size
                  for p in range(ctx, ctx + n)]
    slots += [-1] * pad_seqs
    q_lens_all = list(q_lens) + [1] * pad_seqs
    qsl = [0]
    for n in q_lens_all:
        qsl.append(qsl[-1] + n)
    t, heads = qsl[-1], kv_heads * group

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype).to(DEVICE)

    cache = rand(len(pool) + sum(need), NUM_LAYERS, 2, block_size, kv_heads, head_dim)
    meta = AttentionMetadata(
        num_seqs=len(q_lens_all), num_tokens=t,
        slot_mapping=torch.tensor(slots, dtype=torch.int32, device=DEVICE),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens + [0] * pad_seqs, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE), max_query_len=max(q_lens_all),
        max_seq_len=max(seq_lens), query_start_loc_cpu=qsl,
        seq_lens_cpu=seq_lens + [0] * pad_seqs, sliding_window=window)
    return Case(rand(t, heads, head_dim), rand(t, kv_heads, head_dim),
                rand(t, kv_heads, head_dim), cache, meta, head_dim ** -0.5)


def run_both(case: Case, backend: TritonBackend | None = None
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(triton output, reference output, triton cache, reference cache)."""
    ref_cache = case.cache.clone()
    ref = TorchSDPABackend().forward(case.q, case.k, case.v, ref_cache[:, LAYER],
                                     case.meta, case.scale)
    out = (backend or TritonBackend()).forward(case.q, case.k, case.v,
                                               case.cache[:, LAYER], case.meta, case.scale)
    return out, ref, case.cache, ref_cache


def assert_matches(case: Case, atol: float = 1e-5,
                   backend: TritonBackend | None = None) -> torch.Tensor:
    out, ref, cache, ref_cache = run_both(case, backend)
    assert out.dtype == case.q.dtype and out.shape == case.q.shape
    assert torch.equal(cache, ref_cache), "the KV write differs from the reference"
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=atol, rtol=atol)
    return out


def test_write_kv_matches_reference_and_skips_padding() -> None:
    from engine.attention import triton_attn
    from engine.attention.torch_sdpa import write_kv as ref_write_kv

    case = make_case([5, 40], [3, 20], kv_heads=3, block_size=16, pad_seqs=2)
    before = case.cache.clone()
    triton_attn.write_kv(case.k, case.v, case.cache[:, LAYER], case.meta.slot_mapping)
    ref = before.clone()
    ref_write_kv(case.k, case.v, ref[:, LAYER], case.meta.slot_mapping)
    assert torch.equal(case.cache, ref)
    # Exactly the 23 real tokens' K and V changed, in the written layer only.
    changed = (case.cache != before).any(dim=-1).any(dim=-1)  # [blocks, layers, 2, bs]
    assert int(changed[:, LAYER].sum()) == 2 * 23
    assert not changed[:, 1 - LAYER].any()


def test_write_kv_all_padding_leaves_cache_untouched() -> None:
    from engine.attention import triton_attn

    case = make_case([8], [4], pad_seqs=3)
    before = case.cache.clone()
    slots = torch.full_like(case.meta.slot_mapping, -1)
    triton_attn.write_kv(case.k, case.v, case.cache[:, LAYER], slots)
    assert torch.equal(case.cache, before)


@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("block_size", [16, 32])
def test_decode_ragged(group: int, block_size: int) -> None:
    case = make_case([0, 15, 16, 47, 100], [1] * 5, group=group, block_size=block_size,
                     seed=group + block_size)
    assert case.meta.is_decode_only
    assert_matches(case)


@pytest.mark.parametrize("num_splits", [1, 16])
def test_decode_split_counts(num_splits: int) -> None:
    # 16 splits over contexts of 1..3 tiles: most splits are empty and must not count.
    case = make_case([3, 33, 90], [1, 1, 1], group=2, seed=num_splits)
    assert_matches(case, backend=TritonBackend(num_splits=num_splits))


@pytest.mark.parametrize("group", [1, 4, 8])
def test_chunked_prefill_over_cached_prefix(group: int) -> None:
    case = make_case([37, 64, 5], [20, 17, 30], group=group, block_size=16, seed=group)
    assert_matches(case)


def test_fresh_prefill_without_cache() -> None:
    case = make_case([0, 0], [45, 7], kv_heads=1, group=4, head_dim=32, block_size=32)
    assert_matches(case)


@pytest.mark.parametrize("block_size", [16, 32])
def test_mixed_decode_and_prefill(block_size: int) -> None:
    # Decode rows, a chunk over a cached prefix and a fresh prompt in one launch.
    case = make_case([50, 9, 0, 70, 31], [1, 24, 13, 1, 1], group=4,
                     block_size=block_size, seed=block_size)
    assert not case.meta.is_decode_only
    assert_matches(case)


@pytest.mark.parametrize("group", [1, 4])
def test_sliding_window_decode(group: int) -> None:
    case = make_case([10, 40, 99], [1, 1, 1], group=group, window=24, seed=group)
    assert_matches(case, backend=TritonBackend(num_splits=2))


def test_sliding_window_prefill_and_mixed() -> None:
    case = make_case([60, 0, 80], [30, 40, 1], group=4, window=20, block_size=16)
    assert_matches(case)


def test_padding_sequences_give_zero_rows() -> None:
    decode = make_case([20, 70], [1, 1], group=4, pad_seqs=3)
    out = assert_matches(decode)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    mixed = make_case([20, 0], [1, 18], group=4, pad_seqs=2)
    out = assert_matches(mixed)
    assert torch.equal(out[-2:], torch.zeros_like(out[-2:]))
    assert out[:-2].abs().sum() > 0


def test_all_padding_decode_batch() -> None:
    # What a CUDA graph capture records: every row padding, nothing read or written.
    case = make_case([4], [1], pad_seqs=3)
    case.meta.seq_lens.zero_()
    case.meta.slot_mapping.fill_(-1)
    case.meta.seq_lens_cpu = [0] * 4
    before = case.cache.clone()
    out = TritonBackend().forward(case.q, case.k, case.v, case.cache[:, LAYER],
                                  case.meta, case.scale)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(case.cache, before)


def test_strided_qkv_views() -> None:
    # q, k, v as column slices of one fused projection output (not contiguous).
    case = make_case([30, 3], [1, 12], kv_heads=2, group=2, head_dim=32)
    t, d = case.q.shape[0], 32
    qkv = torch.randn(t, (4 + 2 + 2) * d, device=DEVICE)
    case.q = qkv[:, :4 * d].view(t, 4, d)
    case.k = qkv[:, 4 * d:6 * d].view(t, 2, d)
    case.v = qkv[:, 6 * d:].view(t, 2, d)
    assert not case.q.is_contiguous()
    assert_matches(case)


@pytest.mark.parametrize(("dtype", "q_lens", "atol"), [
    (torch.bfloat16, [1, 1, 1], 2e-2), (torch.bfloat16, [1, 16, 9], 2e-2),
    (torch.float16, [1, 16, 9], 2e-3)])
def test_half_precision(dtype: torch.dtype, q_lens: list[int], atol: float) -> None:
    # Measured on CPU: bf16 differs from the reference by <= 8e-3, fp16 by <= 5e-4.
    case = make_case([40, 17, 70], q_lens, group=4, dtype=dtype)
    assert_matches(case, atol=atol)


@pytest.mark.parametrize("q_lens", [[1, 1], [1, 9]])
def test_rows_past_the_last_sequence_are_zero(q_lens: list[int]) -> None:
    # Two trailing token rows that no sequence owns (slot -1): zeros, never garbage.
    case = make_case([30, 12], q_lens, group=2)
    t = case.q.shape[0]
    case.q = torch.cat([case.q, torch.randn(2, *case.q.shape[1:], device=DEVICE)])
    case.k = torch.cat([case.k, torch.randn(2, *case.k.shape[1:], device=DEVICE)])
    case.v = torch.cat([case.v, torch.randn(2, *case.v.shape[1:], device=DEVICE)])
    pad = torch.full((2,), -1, dtype=torch.int32, device=DEVICE)
    case.meta.slot_mapping = torch.cat([case.meta.slot_mapping, pad])
    case.meta.num_tokens = t + 2
    out = assert_matches(case)
    assert torch.equal(out[t:], torch.zeros_like(out[t:]))


def test_rejects_non_power_of_two_head_dim() -> None:
    case = make_case([4], [1], head_dim=16)
    q = torch.zeros(1, 2, 24, device=DEVICE)
    kv = torch.zeros(4, 2, 16, 2, 24, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim"):
        TritonBackend().forward(q, q, q, kv, case.meta, 1.0)


def test_registered_as_triton() -> None:
    from engine.attention import make_backend

    assert make_backend("triton").name == "triton"
