"""The Triton kernels over a float8 (e4m3) KV cache against the torch reference: the
write quantizes bit-exactly as torch does, and attention over the dequantized cache
matches the reference (float32 q: 1e-5; bfloat16 q: 2e-2). Off CUDA under Triton's
interpreter, on tiny shapes, as tests/unit/engine/test_triton_attention.py."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.attention import triton_attn  # noqa: E402
from engine.attention.torch_sdpa import TorchSDPABackend  # noqa: E402
from engine.attention.torch_sdpa import write_kv as ref_write_kv  # noqa: E402
from engine.attention.triton_backend import TritonBackend  # noqa: E402
from engine.kv_quant import FP8_DTYPE, quantize  # noqa: E402
from tests.unit.engine.test_triton_attention import DEVICE, LAYER, make_case  # noqa: E402

K_SCALE, V_SCALE = 0.5, 2.0


def fp8_case(ctx_lens: list[int], q_lens: list[int], **kw):
    case = make_case(ctx_lens, q_lens, **kw)
    case.cache = quantize(case.cache, 1.0)
    # K and V over e4m3's whole range: subnormals, values that round up into the next
    # power of two, and values past +-448 * scale (clamped).
    span = torch.logspace(-4, 3, case.k.numel()).reshape(case.k.shape)
    sign = torch.where(torch.arange(case.k.numel()) % 2 == 0, 1.0, -1.0).reshape(case.k.shape)
    case.k = (span * sign).to(case.k.dtype).to(case.k.device)
    return case


def test_write_kv_quantizes_bit_exactly():
    case = fp8_case([5, 40], [3, 20], kv_heads=3, pad_seqs=2)
    ref = case.cache.clone()
    triton_attn.write_kv(case.k, case.v, case.cache[:, LAYER], case.meta.slot_mapping,
                         K_SCALE, V_SCALE)
    ref_write_kv(case.k, case.v, ref[:, LAYER], case.meta.slot_mapping, K_SCALE, V_SCALE)
    assert case.cache.dtype == FP8_DTYPE
    assert torch.equal(case.cache.view(torch.uint8), ref.view(torch.uint8))


def test_e4m3_codes_round_trip():
    """Every finite e4m3 value, and the midpoints between neighbours (ties to even),
    encode as torch encodes them."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(FP8_DTYPE).float()
    values = values[values.isfinite()].sort().values
    mids = (values[1:] + values[:-1]) / 2
    x = torch.cat([values, mids, values * 1.01, values * 0.99])
    n = 16 * ((x.numel() + 15) // 16)
    x = torch.cat([x, torch.zeros(n - x.numel())]).reshape(-1, 1, 16).to(DEVICE)
    cache = torch.zeros(x.shape[0], 2, 1, 1, 16, dtype=FP8_DTYPE, device=DEVICE)
    slots = torch.arange(x.shape[0], dtype=torch.int32, device=DEVICE)
    triton_attn.write_kv(x, x, cache, slots)
    assert torch.equal(cache[:, 0, 0].view(torch.uint8), quantize(x, 1.0).view(torch.uint8))


def run_both(case, backend=None):
    ref_cache = case.cache.clone()
    ref = TorchSDPABackend().forward(case.q, case.k, case.v, ref_cache[:, LAYER], case.meta,
                                     case.scale, K_SCALE, V_SCALE)
    out = (backend or TritonBackend()).forward(case.q, case.k, case.v, case.cache[:, LAYER],
                                               case.meta, case.scale, K_SCALE, V_SCALE)
    assert torch.equal(case.cache.view(torch.uint8), ref_cache.view(torch.uint8))
    return out, ref


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_decode_over_fp8_cache(dtype, tol):
    case = make_case([0, 15, 47], [1] * 3, group=2, dtype=dtype, seed=3)
    case.cache = quantize(case.cache, 1.0)
    out, ref = run_both(case)
    assert out.dtype == dtype and not out.isnan().any()
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_unified_over_fp8_cache(dtype, tol):
    # a prefill over a cached prefix, a fresh prefill and a decode row, with a window
    case = make_case([20, 0, 33], [7, 9, 1], group=2, dtype=dtype, window=24, seed=5)
    case.cache = quantize(case.cache, 1.0)
    out, ref = run_both(case)
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_llama_through_the_triton_backend_with_an_fp8_cache() -> None:
    """The whole model on the triton backend over an FP8 cache (chunked prefill, a
    prefix-cache hit, decode): the torch backend's greedy tokens over the same cache."""
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams
    from tests.factories import tiny_model_dir

    d = tiny_model_dir("llama")
    base = [(7 * j) % 400 + 9 for j in range(40)]
    prompts = [base, base[:33] + [11, 12, 13], [5, 6, 7]]
    params = SamplingParams(max_tokens=6, temperature=0)
    outs = {}
    for backend in ("torch", "triton"):
        llm = LLM(d, dtype="float32", device=DEVICE.type, attention_backend=backend,
                  enforce_eager=True, block_size=16, num_blocks=32, max_num_batched_tokens=32,
                  cache_dtype="fp8")
        assert llm.engine.runner.kv_cache.dtype == FP8_DTYPE
        outs[backend] = [o.token_ids for o in llm.generate(prompts, params)]
        assert llm.engine.stats().prefix_cache_hits > 0
    assert outs["triton"] == outs["torch"]
