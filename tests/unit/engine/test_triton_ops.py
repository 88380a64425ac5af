"""engine.kernels against the torch reference arithmetic of engine/models/llama.py.

Without CUDA the kernels run under Triton's CPU interpreter: TRITON_INTERPRET must be set
before engine.kernels is imported, because triton.jit reads it when a kernel is defined
(tests/conftest.py sets it).
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402

from engine import kernels  # noqa: E402
from engine.config import RopeConfig  # noqa: E402
from engine.models.llama import (  # noqa: E402
    LlamaForCausalLM,
    RMSNorm,
    apply_rope,
    rope_inv_freq,
)
from engine.sampler import gumbel_race, row_keys  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]
LLAMA3_ROPE = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                         high_freq_factor=4.0, original_max_position_embeddings=1024)


@pytest.fixture(autouse=True)
def _kernels_are_runnable() -> None:
    # If engine.kernels was imported before tests/conftest.py set TRITON_INTERPRET, the
    # kernels were built for a GPU and fail on CPU tensors with an obscure pointer error.
    if DEVICE == "cpu" and type(kernels._rms_norm_kernel).__name__ != "InterpretedFunction":
        pytest.fail("engine.kernels was imported before TRITON_INTERPRET=1 was set; "
                    "set it in tests/conftest.py for CPU-only runs")


def assert_matches(actual: torch.Tensor, expected: torch.Tensor, min_exact: float) -> None:
    """float32: within 1e-6 relative. bf16: within one bf16 step everywhere, and bit-equal
    on at least `min_exact` of the elements: a kernel that skipped one of torch's roundings
    to bf16 would still be within a step, but would differ on many elements."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    if expected.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
        return
    torch.testing.assert_close(actual.float(), expected.float(), rtol=2**-7, atol=1e-6)
    exact = (actual == expected).float().mean().item()
    assert exact >= min_exact, f"only {exact:.3f} of elements bit-equal to torch"


def make_norm(hidden: int, dtype: torch.dtype, eps: float = 1e-5) -> RMSNorm:
    norm = RMSNorm(hidden, eps)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(hidden) + 0.5)
    return norm.to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [96, 200])
def test_rms_norm_matches_module(dtype: torch.dtype, hidden: int) -> None:
    torch.manual_seed(hidden)
    norm = make_norm(hidden, dtype)
    x = (torch.randn(5, hidden) * 3).to(device=DEVICE, dtype=dtype)
    out, res = kernels.rms_norm(x, norm.weight.detach(), norm.eps)
    assert res is None
    assert_matches(out, norm(x).detach(), min_exact=0.98)


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_add_rms_norm_returns_norm_of_sum_and_sum(dtype: torch.dtype) -> None:
    torch.manual_seed(1)
    norm = make_norm(200, dtype)
    x = torch.randn(4, 200).to(device=DEVICE, dtype=dtype)
    residual = (torch.randn(4, 200) * 10).to(device=DEVICE, dtype=dtype)
    x_before, residual_before = x.clone(), residual.clone()
    out, summed = kernels.rms_norm(x, norm.weight.detach(), norm.eps, residual=residual)
    assert summed is not None
    # The sum is one rounding in both implementations: bit-equal.
    assert torch.equal(summed, x + residual)
    assert_matches(out, norm(x + residual).detach(), min_exact=0.98)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_promotes_like_torch_and_reads_strided_rows() -> None:
    # float32 weight on bf16 activations: torch's `weight * normed` yields float32.
    torch.manual_seed(2)
    norm = make_norm(96, torch.float32)
    wide = torch.randn(3, 2 * 96).to(device=DEVICE, dtype=torch.bfloat16)
    x = wide[:, 96:]  # row stride 192, not 96
    out, _ = kernels.rms_norm(x, norm.weight.detach(), norm.eps)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, norm(x).detach(), rtol=1e-6, atol=1e-6)


def test_rms_norm_rejects_mismatched_weight() -> None:
    with pytest.raises(ValueError, match="weight shape"):
        kernels.rms_norm(torch.ones(2, 96, device=DEVICE), torch.ones(95, device=DEVICE), 1e-6)


def reference_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor,
                      dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    # The model's own method, bound to a stand-in carrying just the buffer it reads.
    return LlamaForCausalLM.rope_cos_sin(SimpleNamespace(inv_freq=inv_freq),  # type: ignore[arg-type]
                                         positions, dtype)


def test_cos_sin_cache_holds_each_half_of_rope_cos_sin_once() -> None:
    inv_freq = rope_inv_freq(LLAMA3_ROPE, 96).to(DEVICE)
    cache = kernels.build_cos_sin_cache(inv_freq, 4096)
    positions = torch.tensor([4095, 0, 7, 1500], device=DEVICE)
    cos, sin = reference_cos_sin(inv_freq, positions, torch.float32)
    assert cache.shape == (4096, 96) and cache.dtype == torch.float32
    torch.testing.assert_close(cache[positions, :48], cos[:, 0, :48], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(cache[positions, 48:], sin[:, 0, 48:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 96])
def test_rotary_in_place_on_fused_qkv_views(dtype: torch.dtype, head_dim: int) -> None:
    torch.manual_seed(head_dim)
    num_q_heads, num_kv_heads = 4, 2
    positions = torch.tensor([3000, 3, 17, 0, 2047, 9], device=DEVICE)  # out of order
    num_tokens = positions.numel()
    qkv = torch.randn(num_tokens, (num_q_heads + 2 * num_kv_heads) * head_dim)
    qkv = qkv.to(device=DEVICE, dtype=dtype)
    q_size, kv_size = num_q_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    q = q.view(num_tokens, num_q_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    assert not q.is_contiguous() and not k.is_contiguous()
    inv_freq = rope_inv_freq(LLAMA3_ROPE, head_dim).to(DEVICE)
    cos, sin = reference_cos_sin(inv_freq, positions, dtype)
    q_ref, k_ref, v_before = apply_rope(q, cos, sin), apply_rope(k, cos, sin), v.clone()

    kernels.rotary_embedding(q, k, positions, kernels.build_cos_sin_cache(inv_freq, 4096))

    assert_matches(q, q_ref, min_exact=0.99)
    assert_matches(k, k_ref, min_exact=0.99)
    assert torch.equal(v, v_before)  # writes through the strides stayed inside q and k


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inter", [96, 200, 1500])  # 1500: more than one column block
def test_silu_and_mul_matches_torch(dtype: torch.dtype, inter: int) -> None:
    torch.manual_seed(inter)
    x = (torch.randn(3, 2 * inter) * 4).to(device=DEVICE, dtype=dtype)
    gate, up = x.split(inter, dim=-1)
    assert_matches(kernels.silu_and_mul(x), F.silu(gate) * up, min_exact=0.98)


def _race_inputs(b: int, vocab: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(b, vocab, generator=gen) * 3
    logits[0, : vocab // 2] = float("-inf")  # filtered entries (top-k, min-p) never win
    temps = torch.rand(b, generator=gen) + 0.2
    seeds = np.array([0, 5, 2**63 - 1, 2**32, 77, 12345][:b], dtype=np.uint64)
    k1, k2 = row_keys(seeds, np.arange(b) * 977 + 1)
    keys = [torch.from_numpy(k.astype(np.int64)) for k in (k1, k2)]
    return tuple(t.to(DEVICE) for t in (logits, temps, *keys))


@pytest.mark.parametrize(("b", "vocab"), [(3, 300), (2, 8192), (4, 8193), (6, 20000)])
def test_fused_race_draws_the_torch_references_tokens(b: int, vocab: int) -> None:
    # Row chunks of 8192 entries raced apart: a vocabulary of one chunk, one entry past
    # it, and several; the noise is the same bits as sampler.uniform_noise's.
    logits, temps, k1, k2 = _race_inputs(b, vocab, vocab)
    want = gumbel_race(logits.cpu(), temps.cpu(), k1.cpu(), k2.cpu())
    got = kernels.gumbel_race(logits, temps, k1, k2)
    assert got.dtype == torch.int64 and got.device == logits.device
    assert got.cpu().tolist() == want.tolist()
    assert bool((got.cpu() >= vocab // 2)[0])  # row 0: only its finite half can win


def test_fused_race_reads_strided_rows_and_columns_and_empty_batches() -> None:
    logits, temps, k1, k2 = _race_inputs(3, 1000, 0)
    want = kernels.gumbel_race(logits, temps, k1, k2).tolist()
    wide = torch.zeros(3, 1500, device=DEVICE)
    wide[:, :1000] = logits
    # The sampler's per-row columns are views of one parameter table.
    keys = torch.stack([k2, k1, k2], dim=1)
    temps_col = torch.stack([temps, temps.flip(0)], dim=1)[:, 0]
    assert not keys[:, 1].is_contiguous() and not temps_col.is_contiguous()
    assert kernels.gumbel_race(wide[:, :1000], temps, k1, k2).tolist() == want
    assert kernels.gumbel_race(logits, temps_col, keys[:, 1], keys[:, 2]).tolist() == want
    assert kernels.gumbel_race(logits[:0], temps[:0], k1[:0], k2[:0]).numel() == 0


def test_sampler_draws_the_same_tokens_fused_or_not() -> None:
    # Every sampling feature that reaches the race, in one batch: temperatures, greedy
    # rows, top-k, top-p, min-p, penalties, seeded and unseeded rows.
    from engine.request import Request
    from engine.sampler import Sampler
    from engine.sampling_params import SamplingParams

    rows = [dict(temperature=0.7, seed=1), dict(temperature=0.0),
            dict(temperature=1.0, top_p=0.9, seed=3), dict(temperature=1.3, top_k=20),
            dict(temperature=0.9, min_p=0.05, seed=5), dict(temperature=1.0),
            dict(temperature=0.8, presence_penalty=0.5, top_p=0.95, seed=7)]
    cpu = torch.device("cpu")
    # (and without filters: the race divides by the temperature itself)
    plain = [dict(temperature=0.7, seed=1), dict(temperature=0.0), dict(temperature=1.7)]
    for trial, batch in enumerate([rows] * 4 + [plain] * 2):
        gen = torch.Generator().manual_seed(trial)
        logits = torch.randn(len(batch), 3000, generator=gen) * 4
        reqs = [Request(f"r{i}", [1, 2, 3 + trial], SamplingParams(max_tokens=5, **kw))
                for i, kw in enumerate(batch)]
        torch_path = Sampler(cpu, seed=trial)
        fused = Sampler(torch.device(DEVICE), seed=trial)  # CUDA: the kernel's own choice
        if DEVICE == "cpu":
            fused._race = kernels.gumbel_race
        want = torch_path(logits, reqs)[0]
        assert fused(logits.to(DEVICE), reqs)[0] == want


def test_fused_race_picks_as_argmax_on_rows_without_a_finite_entry() -> None:
    # A grammar or token masks can leave a row all -inf, a diverged forward NaN: the id
    # stays inside the vocabulary, as torch.argmax's.
    _, temps, k1, k2 = _race_inputs(3, 9000, 1)
    logits = torch.randn(3, 9000)
    logits[0] = float("-inf")
    logits[1, 8500] = float("nan")
    logits[2] = float("nan")
    logits = logits.to(DEVICE)
    assert kernels.gumbel_race(logits, temps, k1, k2).tolist() == [0, 8500, 0]
    assert gumbel_race(logits.cpu(), temps.cpu(), k1.cpu(), k2.cpu()).tolist() == [0, 8500, 0]
