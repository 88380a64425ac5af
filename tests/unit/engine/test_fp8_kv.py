"""The FP8 KV cache (--kv-cache-dtype fp8): its accuracy against the float32 cache on
tiny real-architecture models, checkpoint scales, and the flag's errors."""

import os
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.attention.torch_sdpa import TorchSDPABackend
from engine.kv_quant import dequantize, load_kv_scales, quantize
from engine.llm import LLM
from engine.sampling_params import SamplingParams
from tests.factories import tiny_model_dir

PROMPTS = ["The quick brown fox", "Once upon a time, in a land", "def generate(prompt"]
N = 16
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def agreement(model_dir: str, **kw) -> tuple[int, float, LLM]:
    """(greedy tokens the fp8 cache agrees on before the first difference, summed over
    the prompts; the largest |logprob difference| of a chosen token over those)."""
    params = SamplingParams(max_tokens=N, temperature=0, logprobs=0, ignore_eos=True)
    ref = LLM(model_dir, dtype="float32", block_size=8).generate(PROMPTS, params)
    fp8 = LLM(model_dir, dtype="float32", block_size=8, cache_dtype="fp8", **kw)
    outs = fp8.generate(PROMPTS, params)
    agree, worst = 0, 0.0
    for r, o in zip(ref, outs, strict=True):
        for k, (a, b) in enumerate(zip(r.token_ids, o.token_ids, strict=True)):
            if a != b:
                break
            agree += 1
            worst = max(worst, abs(r.logprobs[k][a] - o.logprobs[k][a]))
    return agree, worst, fp8


# Measured (CPU, torch backend, 3 prompts x 16 greedy tokens): llama 48/48 tokens,
# max |dlogprob| 0.060; qwen3 43/48, 0.064; mixtral 8/48, 0.32 (random tiny models
# have near-flat distributions, so one close call ends the agreement).
@pytest.mark.parametrize("arch,min_agree,max_diff", [("llama", 48, 0.1), ("qwen3", 40, 0.1),
                                                     ("mixtral", 3, 0.5)])
def test_fp8_cache_close_to_float32(arch, min_agree, max_diff):
    agree, worst, llm = agreement(tiny_model_dir(arch))
    assert llm.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
    assert llm.engine.runner.kv_cache.element_size() == 1
    assert agree >= min_agree
    assert 0 < worst < max_diff  # not exact (it is quantized), but close


def test_quantize_clamps_and_round_trips():
    x = torch.tensor([0.0, 1.0, -3.0, 1000.0, -1000.0, 0.3])
    q = quantize(x, 2.0)
    assert q.dtype == torch.float8_e4m3fn
    back = dequantize(q, 2.0, torch.float32)
    assert back[:3].tolist() == [0.0, 1.0, -3.0]
    assert back[3].item() == 896.0 and back[4].item() == -896.0  # +-448 * scale
    assert abs(back[5].item() - 0.3) < 0.3 / 8  # 3 mantissa bits


def test_backend_writes_quantized_and_reads_dequantized():
    """The torch backend's write stores x / scale in e4m3; a decode step that reads the
    cache sees the stored values times the scale."""
    from engine.attention.base import AttentionMetadata

    torch.manual_seed(0)
    kv = torch.zeros(2, 2, 4, 1, 16, dtype=torch.float8_e4m3fn)
    k, v = torch.randn(3, 1, 16), torch.randn(3, 1, 16)
    q = torch.randn(3, 2, 16)
    i32 = {"dtype": torch.int32}
    meta = AttentionMetadata(
        num_seqs=1, num_tokens=3, slot_mapping=torch.tensor([4, 5, 6], **i32),
        query_start_loc=torch.tensor([0, 3], **i32), seq_lens=torch.tensor([3], **i32),
        block_tables=torch.tensor([[1]], **i32), max_query_len=3, max_seq_len=3,
        query_start_loc_cpu=[0, 3], seq_lens_cpu=[3])
    out = TorchSDPABackend().forward(q, k, v, kv, meta, 0.25, k_scale=0.5, v_scale=2.0)
    assert torch.equal(kv[1, 0, :3].view(torch.uint8), quantize(k, 0.5).view(torch.uint8))
    assert torch.equal(kv[1, 1, :3].view(torch.uint8), quantize(v, 2.0).view(torch.uint8))
    kd, vd = dequantize(kv[1, 0, :3], 0.5, q.dtype), dequantize(kv[1, 1, :3], 2.0, q.dtype)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), kd.transpose(0, 1).expand(2, 3, 16),
        vd.transpose(0, 1).expand(2, 3, 16), is_causal=True, scale=0.25).transpose(0, 1)
    torch.testing.assert_close(out, ref)


def test_checkpoint_scales_are_read(tmp_path):
    src = tiny_model_dir("llama")
    for name in os.listdir(src):
        shutil.copy(os.path.join(src, name), tmp_path / name)
    weights = load_file(str(tmp_path / "model.safetensors"))
    weights["model.layers.0.self_attn.k_scale"] = torch.tensor(0.5)
    weights["model.layers.0.self_attn.v_scale"] = torch.tensor(0.25)
    weights["model.layers.1.self_attn.kv_scale"] = torch.tensor(2.0)
    save_file(weights, str(tmp_path / "model.safetensors"))
    assert load_kv_scales(str(tmp_path), 2) == [(0.5, 0.25), (2.0, 2.0)]
    assert load_kv_scales(src, 2) == [(1.0, 1.0), (1.0, 1.0)]
    agree, worst, llm = agreement(str(tmp_path))
    attn = llm.engine.runner.model.model.layers[1].self_attn
    assert (float(attn.k_scale), float(attn.v_scale)) == (2.0, 2.0)
    assert agree >= 40 and worst < 0.2
    # the auto cache loads the same directory (the scales are not model parameters)
    LLM(str(tmp_path), dtype="float32").generate(["Hi"], SamplingParams(max_tokens=2))


def test_bad_kv_cache_dtype_is_refused():
    with pytest.raises(ValueError, match="fp8_e5m2 is not supported.*auto, fp8, fp8_e4m3"):
        LLM(tiny_model_dir("llama"), cache_dtype="fp8_e5m2")
    r = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", "--prompt", "Hi",
                        "--kv-cache-dtype", "fp8_e5m2"], capture_output=True, text=True,
                       timeout=120, cwd=ROOT)
    assert r.returncode == 2 and "fp8_e4m3" in r.stderr.strip().splitlines()[-1]


def test_mla_refuses_fp8():
    with pytest.raises(ValueError, match="not supported for MLA"):
        LLM(tiny_model_dir("deepseek_v2"), cache_dtype="fp8")


def test_generate_cli_with_fp8_cache():
    d = tiny_model_dir("llama")
    r = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", "--model", d,
                        "--prompt", "Hello", "--max-tokens", "4", "--kv-cache-dtype", "fp8"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert "4 generated" in r.stderr


def test_fp8_cache_through_the_host_tier():
    """An FP8 engine's prefixes evicted from the device and loaded back from the host
    tier: the same greedy tokens as the first run, one byte a value moved."""
    import random

    from engine.llm import make_engine_config
    from kvtransfer.tiers import TierConfig
    from kvtransfer.tiers.manager import TieredCache, engine_layout

    d = tiny_model_dir("llama")
    layout = engine_layout(make_engine_config(d, dtype="float32", block_size=4,
                                              cache_dtype="fp8"))
    assert layout.dtype == "float8_e4m3fn" and layout.itemsize == 1
    rng = random.Random(5)
    prompts = [[rng.randrange(5, 500) for _ in range(26)] for _ in range(4)]
    params = SamplingParams(max_tokens=6, temperature=0)
    with TieredCache(TierConfig(host_blocks=64), layout) as tiers:
        llm = LLM(d, offload=tiers, dtype="float32", block_size=4, num_blocks=16,
                  cache_dtype="fp8")
        first = llm.generate(prompts, params)
        assert tiers.wait_idle(10.0)
        second = llm.generate(prompts, params)
        assert [o.token_ids for o in second] == [o.token_ids for o in first]
        s = tiers.stats()
        assert s.hits.get("host", 0) >= 4
        assert s.bytes_loaded["host"] == s.hits["host"] * layout.block_bytes
        assert second[0].num_cached_tokens == 24
        tiers.check_integrity()


def test_fp8_cache_under_tensor_parallelism():
    """TP 2 (gloo, two processes): each rank's float8 cache holds its KV heads, with the
    checkpoint's scales; greedy tokens as TP 1 over the same FP8 cache."""
    from tests.unit.engine.test_correctness import make_prompts

    d = tiny_model_dir("llama")
    prompts = make_prompts(4)
    params = SamplingParams(max_tokens=8, temperature=0)
    kw = dict(dtype="float32", block_size=4, num_blocks=80, max_num_batched_tokens=32,
              cache_dtype="fp8")
    one = [o.token_ids for o in LLM(d, **kw).generate(prompts, params)]
    llm = LLM(d, tensor_parallel_size=2, **kw)
    try:
        assert llm.engine.runner.kv_cache.dtype == torch.float8_e4m3fn
        assert llm.engine.runner.kv_cache.shape[4] == 1  # one of the 2 KV heads
        assert [o.token_ids for o in llm.generate(prompts, params)] == one
        llm.engine.check_integrity()
    finally:
        llm.engine.close()
