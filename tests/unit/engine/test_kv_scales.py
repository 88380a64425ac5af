"""--calculate-kv-scales (vLLM's meaning): the first real forward pass computes each
layer's float8 scales, max|K| / K_SCALE_CONSTANT and max|V| / V_SCALE_CONSTANT, and they
stay fixed; blocks written under other scales land through KVScales.accept (adopted, or
requantized)."""

import argparse

import pytest
import torch

from engine.cli import add_engine_arguments, engine_config_from_args
from engine.kv_quant import dequantize, quantize
from engine.kv_scales import KVScales, requantize
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.factories import tiny_model_dir
from tests.unit.engine.test_fp8_kv import PROMPTS


def recording(llm: LLM) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Every K and V the calibrating forward pass shows its layers, in layer order."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    scales = llm.engine.runner.kv_scales
    original = scales._calibrate

    def spy(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        seen.append((k.clone(), v.clone()))
        original(layer, k, v)

    scales._calibrate = spy
    return seen


def test_scales_are_the_first_forwards_amax_over_the_constants():
    llm = LLM(tiny_model_dir("llama"), dtype="float32", block_size=8, cache_dtype="fp8",
              calculate_kv_scales=True, kv_scale_constants=(50.0, 20.0))
    scales = llm.engine.runner.kv_scales
    assert scales.pending and bool((scales.tensor == 1).all())  # start-up never calibrates
    seen = recording(llm)
    llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0))
    assert not scales.pending
    assert len(seen) == len(scales.layers)  # one forward pass, each layer once
    ref = torch.tensor([[k.abs().max() / 50.0, v.abs().max() / 20.0] for k, v in seen])
    assert torch.equal(scales.tensor.cpu(), ref)
    assert all(float(a.k_scale) == ref[i, 0] for i, a in enumerate(scales.layers))
    # layer 0 sees the prompt's embeddings only: its K/V are the float32 model's exactly
    ref_llm = LLM(tiny_model_dir("llama"), dtype="float32", block_size=8)
    first = ref_llm.engine.runner.model.model.layers[0].self_attn
    got: list[torch.Tensor] = []
    first.kv_calibrate = lambda k, v: got.append(torch.stack([k.abs().max(), v.abs().max()]))
    ref_llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0))
    assert torch.equal(scales.tensor[0].cpu(), got[0] / torch.tensor([50.0, 20.0]))
    assert scales.values() == [tuple(r) for r in scales.tensor.tolist()]


def compare(model_dir: str, **kw) -> tuple[int, float, float]:
    """Greedy decoding over the float8 cache (calculated scales) against the float32
    cache: (tokens agreed before the first difference, summed over the prompts; the
    largest |logprob difference| of an agreed token; the largest margin by which the
    float32 model preferred its token where the two first differ)."""
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=20, ignore_eos=True)
    ref = LLM(model_dir, dtype="float32", block_size=8).generate(PROMPTS, params)
    outs = LLM(model_dir, dtype="float32", block_size=8, cache_dtype="fp8",
               calculate_kv_scales=True, **kw).generate(PROMPTS, params)
    agree, worst, margin = 0, 0.0, 0.0
    for r, o in zip(ref, outs, strict=True):
        for k, (a, b) in enumerate(zip(r.token_ids, o.token_ids, strict=True)):
            if a != b:  # the float32 model's margin for its token over the fp8's pick
                margin = max(margin, r.logprobs[k][a] - r.logprobs[k].get(b, -1e9))
                break
            agree += 1
            worst = max(worst, abs(r.logprobs[k][a] - o.logprobs[k][a]))
    return agree, worst, margin


# Measured (CPU, torch backend, 3 prompts x 16 greedy tokens, vLLM's constants): llama
# 30/48 tokens agree, max |dlogprob| 0.053, float32's margin where they differ 0.015;
# qwen3 35/48, 0.076, 0.025. Scales 1.0 on the same prompts:
# llama 48/48, 0.060 (tests/unit/engine/test_fp8_kv.py). Random tiny models have
# near-flat distributions (top logprob ~ -4.6), so a 0.01 nudge flips a token.
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_calculated_scales_close_to_float32(arch):
    agree, worst, margin = compare(tiny_model_dir(arch))
    print(f"{arch}: {agree}/48 agree, max |dlogprob| {worst:.3f}, margin {margin:.3f}")
    assert agree >= 24
    assert 0 < worst < 0.1
    assert margin < 0.05  # a difference only where float32 itself nearly tied


def test_tiny_kv_values_need_calculated_scales():
    """The same function with K and V 1000x smaller (q and o_proj 1000x larger): with
    scales 1.0 the cache flushes K/V to e4m3's subnormals and zeros; calculated scales
    keep their precision."""
    d = tiny_model_dir("llama")
    kw = dict(dtype="float32", block_size=8, cache_dtype="fp8")
    params = SamplingParams(max_tokens=1, temperature=0, logprobs=20)

    def shrink(llm: LLM) -> LLM:
        for layer in llm.engine.runner.model.model.layers:
            attn = layer.self_attn
            w = attn.qkv_proj.weight.data
            w[:attn.q_size] *= 1e3
            w[attn.q_size:] *= 1e-3
            attn.o_proj.weight.data *= 1e3
        return llm

    ref = LLM(d, dtype="float32", block_size=8).generate(PROMPTS, params)
    fixed = shrink(LLM(d, **kw)).generate(PROMPTS, params)
    calc = shrink(LLM(d, calculate_kv_scales=True, **kw)).generate(PROMPTS, params)

    def worst(outs):
        # the float32 model's first token, scored by each (-30: out of the top 20)
        return max(abs(r.logprobs[0][r.token_ids[0]] - o.logprobs[0].get(r.token_ids[0], -30))
                   for r, o in zip(ref, outs, strict=True))

    print(f"first token |dlogprob|: calculated {worst(calc):.3f}, 1.0 {worst(fixed):.3f}")
    assert worst(calc) < 0.1 < worst(fixed)


class _Layer:
    k_scale = v_scale = 1.0
    kv_calibrate = None


def test_accept_adopts_then_requantizes():
    torch.manual_seed(0)
    scales = KVScales([_Layer(), _Layer()], [(1.0, 1.0)] * 2, torch.device("cpu"),
                      calculate=True)
    src = [(0.5, 0.25), (2.0, 1.0)]
    cache = quantize(torch.randn(6, 2, 2, 4, 1, 8), 1.0)
    before = cache.clone()
    scales.accept([cache], [1, 2], src)  # not fixed yet: adopts, no conversion
    assert not scales.pending and scales.values() == src
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    scales.accept([cache], [3], src)  # the same scales: nothing to do
    assert torch.equal(cache.view(torch.uint8), before.view(torch.uint8))
    other = [(1.0, 0.5), (1.0, 1.0)]
    scales.accept([cache], [0, 4], other)  # fixed and different: requantized in place
    for b in (0, 4):
        for layer in range(2):
            for kv in range(2):
                want = quantize(dequantize(before[b, layer, kv], other[layer][kv],
                                           torch.float32), src[layer][kv])
                assert torch.equal(cache[b, layer, kv].view(torch.uint8),
                                   want.view(torch.uint8))
    untouched = [1, 2, 3, 5]
    assert torch.equal(cache[untouched].view(torch.uint8), before[untouched].view(torch.uint8))
    # values read back within one e4m3 rounding of what the sender meant
    back = dequantize(requantize(before[:1], other, src), torch.tensor(src).reshape(
        1, 2, 2, 1, 1, 1), torch.float32)
    meant = dequantize(before[:1], torch.tensor(other).reshape(1, 2, 2, 1, 1, 1),
                       torch.float32)
    torch.testing.assert_close(back, meant, rtol=1 / 16, atol=2 ** -9 * 2)
    with pytest.raises(ValueError, match="3 layers"):
        scales.accept([cache], [0], src + [(1.0, 1.0)])


def _args(*flags: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    add_engine_arguments(p)
    return p.parse_args(["--model", tiny_model_dir("llama"), "--device", "cpu", *flags])


def test_cli_flag_and_constants(monkeypatch):
    monkeypatch.setenv("K_SCALE_CONSTANT", "64")
    cfg = engine_config_from_args(_args("--kv-cache-dtype", "fp8", "--calculate-kv-scales"))
    assert cfg.cache.calculate_kv_scales and cfg.cache.kv_scale_constants == (64.0, 100.0)
    with pytest.raises(ValueError, match="--calculate-kv-scales needs --kv-cache-dtype fp8"):
        engine_config_from_args(_args("--calculate-kv-scales"))
    monkeypatch.setenv("V_SCALE_CONSTANT", "0")
    with pytest.raises(ValueError, match="must be positive"):
        engine_config_from_args(_args("--kv-cache-dtype", "fp8", "--calculate-kv-scales"))


def test_calculated_scales_under_tensor_parallelism():
    """TP 2: each rank sees half the KV heads; the scales are the maximum over both, so
    every rank's bytes mean what TP 1's do: the same scales and greedy tokens."""
    from tests.unit.engine.test_correctness import make_prompts

    d = tiny_model_dir("llama")
    prompts = make_prompts(4)
    params = SamplingParams(max_tokens=8, temperature=0)
    kw = dict(dtype="float32", block_size=4, num_blocks=80, max_num_batched_tokens=32,
              cache_dtype="fp8", calculate_kv_scales=True)
    one = LLM(d, **kw)
    want = [o.token_ids for o in one.generate(prompts, params)]
    llm = LLM(d, tensor_parallel_size=2, **kw)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params)] == want
        # (layer 0 equal; later layers within the all-reduce's float32 rounding)
        got, ref = llm.engine.runner.kv_scales.values(), one.engine.runner.kv_scales.values()
        assert got[0] == ref[0]
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-5, atol=0)
    finally:
        llm.engine.close()


def test_worker_refuses_what_the_scales_do_not_cover():
    from engine.llm import make_engine_config
    from kvtransfer.tiers import TierConfig
    from kvtransfer.tiers.config import LMCacheTierConfig
    from worker.server import check_kv_scales

    calc = make_engine_config(tiny_model_dir("llama"), cache_dtype="fp8",
                              calculate_kv_scales=True)
    check_kv_scales(calc, TierConfig(host_blocks=8, disk_dir="/tmp/x", disk_blocks=4))
    check_kv_scales(calc, None)
    lmcache = TierConfig(lmcache=LMCacheTierConfig())
    check_kv_scales(make_engine_config(tiny_model_dir("llama"), cache_dtype="fp8"), lmcache)
    with pytest.raises(ValueError, match="--calculate-kv-scales runs without --lmcache"):
        check_kv_scales(calc, lmcache)


def _handoff_run(convert: bool) -> tuple[list[tuple[float, float]], list, list]:
    """A prefill and a decode engine (two engines in one process, tests/unit/engine/
    test_disagg_hooks.py) that each calculated their scales on a different first request;
    then a prompt prefilled on the one and decoded on the other, its blocks landed with
    (`convert`) or without KVScales.accept. Returns (the two engines' scales, the
    decode's output, the float32 engine's)."""
    import asyncio

    from engine.kv_scales import accept_blocks, wire_scales
    from tests.unit.engine.test_disagg_hooks import BS, make_async, remote_prefill

    fp8 = dict(cache_dtype="fp8", calculate_kv_scales=True)
    first = [SamplingParams(max_tokens=1, temperature=0)]
    prompt = list(range(40, 75))
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=0, ignore_eos=True)
    ref = LLM(tiny_model_dir("llama"), dtype="float32", block_size=BS).generate(
        [prompt], params)[0]

    async def main():
        p, d = make_async(max_num_batched_tokens=8, **fp8), make_async(**fp8)
        try:
            for llm, own in ((p, list(range(200, 230))), (d, list(range(300, 304)))):
                _ = [o async for o in llm.generate(f"own-{id(llm)}", own, first[0])]

            async def remote(alloc):
                token = await remote_prefill(p, d, alloc, prompt, [])
                if convert:
                    wire = await p.call(lambda eng: wire_scales(eng.runner))
                    ids = alloc.block_ids[alloc.num_computed_tokens // BS:]
                    await d.call(lambda eng: accept_blocks(eng.runner, ids, wire))
                return token

            outs = [o async for o in d.generate("r", prompt, params, kv_params=remote)]
            scales = [llm.engine.runner.kv_scales.values() for llm in (p, d)]
            return scales, outs[-1]
        finally:
            p.shutdown()
            d.shutdown()

    scales, out = asyncio.run(main())
    return scales, out, ref


def _worst(out, ref) -> tuple[int, float]:
    agree, worst = 0, 0.0
    # (the first token's logprobs stay with the prefill engine of this harness)
    skip = len(out.token_ids) - len(out.logprobs)
    for k, (a, b) in enumerate(zip(ref.token_ids, out.token_ids, strict=True)):
        if a != b:
            break
        agree += 1
        if k >= skip:
            worst = max(worst, abs(ref.logprobs[k][a] - out.logprobs[k - skip][a]))
    return agree, worst


def test_decode_with_other_scales_requantizes_the_landed_blocks():
    (p_scales, d_scales), out, ref = _handoff_run(convert=True)
    assert p_scales != d_scales  # each engine's own first request
    agree, worst = _worst(out, ref)
    _, raw, _ = _handoff_run(convert=False)
    raw_agree, raw_worst = _worst(raw, ref)
    print(f"requantized: {agree}/10 agree, max |dlogprob| {worst:.3f}; read under the "
          f"wrong scales: {raw_agree}/10, {raw_worst:.3f}")
    assert agree >= 8 and worst < 0.1
    assert raw_agree < agree or raw_worst > 2 * worst
