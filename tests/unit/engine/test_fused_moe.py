"""engine.fused_moe (the Triton grouped GEMMs) against the torch loop over experts.

Without CUDA the kernel runs under Triton's CPU interpreter (TRITON_INTERPRET is set in
tests/conftest.py before triton is imported): shapes stay tiny.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine import fused_moe as fm  # noqa: E402
from engine.models.moe import fused_experts_ref, select_experts  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
H, INTER, E = 32, 24, 8


@pytest.fixture(autouse=True)
def _kernel_is_runnable() -> None:
    if DEVICE == "cpu" and type(fm._moe_gemm_kernel).__name__ != "InterpretedFunction":
        pytest.skip("triton was imported before TRITON_INTERPRET was set")


def _weights(seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * INTER, H, generator=g) * 0.2
    w2 = torch.randn(E, H, INTER, generator=g) * 0.2
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def _check(x: torch.Tensor, ids: torch.Tensor, seed: int = 0) -> None:
    w13, w2 = _weights(seed, x.dtype)
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(seed + 1))
    weights, ids = weights.to(DEVICE), ids.to(DEVICE)
    got = fm.fused_moe(x, w13, w2, weights, ids)
    want = fused_experts_ref(x, w13, w2, weights, ids)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def _hidden(t: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(t, H, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_ragged_routing_with_an_idle_expert(top_k: int) -> None:
    """Experts get 0..many pairs (expert 3 none), crossing the 16-row tile."""
    t = 21
    g = torch.Generator().manual_seed(top_k)
    logits = torch.randn(t, E, generator=g) + torch.linspace(2, -2, E)
    logits[:, 3] = -1e4
    _, ids = select_experts(logits, top_k, renormalize=True)
    assert 3 not in ids and len(torch.unique(ids)) > top_k
    _check(_hidden(t), ids)


def test_every_token_on_one_expert() -> None:
    t = 19  # 38 pairs on expert 5: three tiles of 16 rows, the last one padded
    ids = torch.stack([torch.full((t,), 5), torch.arange(t) % 2], dim=1)
    _check(_hidden(t, 1), ids)
    _check(_hidden(t, 2), torch.full((t, 1), 5))


def test_decode_sized_batch_and_large_tiles() -> None:
    _check(_hidden(1, 3), torch.tensor([[7, 0, 2, 5]]))  # few pairs: the small tiles
    t = 40  # more pairs than experts: the 64-row tiles
    _check(_hidden(t, 4), torch.randint(0, E, (t, 2), generator=torch.Generator().manual_seed(4)))


def test_align_block_size_layout() -> None:
    ids = torch.tensor([[2, 0], [2, 1], [0, 2]])
    pairs, experts, padded_len = fm.moe_align_block_size(ids, 4, 4)
    # | e0: pairs 1, 4 + pad | e1: pair 3 + pad | e2: pairs 0, 2, 5 + pad | e3: none |
    assert int(padded_len) == 12
    assert pairs[:12].tolist() == [1, 4, 6, 6, 3, 6, 6, 6, 0, 2, 5, 6]
    assert experts[:3].tolist() == [0, 1, 2]
    assert (pairs[12:] == 6).all()


def test_no_tokens_and_bad_weights() -> None:
    w13, w2 = _weights(0)
    empty = torch.zeros(0, H, device=DEVICE)
    out = fm.fused_moe(empty, w13, w2, torch.zeros(0, 2, device=DEVICE),
                       torch.zeros(0, 2, dtype=torch.int64, device=DEVICE))
    assert out.shape == (0, H)
    with pytest.raises(ValueError, match="do not fit"):
        fm.fused_moe(_hidden(2), w13, w2[:, :, :-1], torch.ones(2, 1, device=DEVICE),
                     torch.zeros(2, 1, dtype=torch.int64, device=DEVICE))


def test_bfloat16_close_to_the_reference() -> None:
    x = _hidden(13, 5).bfloat16()
    ids = torch.randint(0, E, (13, 2), generator=torch.Generator().manual_seed(5)).to(DEVICE)
    w13, w2 = _weights(5, torch.bfloat16)
    weights = torch.rand(13, 2, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    got = fm.fused_moe(x, w13, w2, weights, ids)
    want = fused_experts_ref(x.float(), w13.float(), w2.float(), weights, ids)
    # bf16 rounds the gate_up and down outputs (8 mantissa bits) where float32 does not.
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)
