"""`splitserve bench engine --model-shape`: the shape benchmark end to end on a CPU with a
tiny shape (workloads a, b, d scaled down, float32), its workloads and its roofline."""

from __future__ import annotations

import json

from bench.engine_roofline import ModelCost, causal_pairs
from bench.engine_shape_bench import make_workloads
from cluster.cli import main
from engine.config import ModelConfig

TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1024,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "tie_word_embeddings": True, "torch_dtype": "float32"}


def test_bench_engine_model_shape_on_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))  # the shape's directory is cached under ~
    shape, out = tmp_path / "tiny.json", tmp_path / "bench.json"
    shape.write_text(json.dumps(TINY))
    assert main(["bench", "engine", "--device", "cpu", "--model-shape", str(shape),
                 "--workloads", "a,b,d", "--scale", "0.04", "--dtype", "float32",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert set(result["summary"]) == {"a", "b", "d"}
    for name, s in result["summary"].items():
        assert {"ours_tok_s", "hf_tok_s", "ratio_hf", "roofline_frac"} <= set(s)
        assert s["ours_tok_s"] > 0 and s["hf_tok_s"] > 0 and s["ratio_hf"] > 0, name
        assert 0 < s["roofline_frac"] < 1.5, name
    w = result["workloads"]
    assert w["b"]["requests"] == 3 and w["b"]["ours"]["decode"]["steps"] > 0
    assert w["d"]["ours"]["prefill"]["tokens"] == w["d"]["prompt_tokens"] == 328
    assert w["d"]["ours"]["decode"] is None  # one output token: the prefill step only
    assert "CPU memcpy" in result["limits"]["bandwidth_method"]
    assert "float32 GEMM" in result["limits"]["matmul_method"]
    assert result["limits"]["bandwidth_GB_s"] > 0 and result["config"]["params"] > 0
    printed = capsys.readouterr().out
    assert "ours tok/s" in printed and "GB/s" in printed


def test_workloads_follow_the_issue_and_scale():
    full = {w.name: w for w in make_workloads(["a", "b", "c", "d"], 1.0, 151936, 40960)}
    assert (len(full["a"].prompts[0]), full["a"].out_lens) == (512, [256])
    assert len(full["b"].prompts) == 64 and set(full["b"].out_lens) == {128}
    c = full["c"]
    assert len(c.prompts) == 256 and c.temperature == 0.6
    assert all(100 <= len(p) <= 1024 for p in c.prompts)
    assert all(100 <= o <= 1024 for o in c.out_lens) and len(set(c.out_lens)) > 100
    assert len(full["d"].prompts[0]) == 8192 and full["d"].counted_tokens == 8192
    # an 8k-context model keeps the prompt + its one output token inside the context
    (d,) = make_workloads(["d"], 1.0, 128256, 8192)
    assert len(d.prompts[0]) == 8191
    (b,) = make_workloads(["b"], 0.5, 1024, 4096)
    assert len(b.prompts) == 32 and len(b.prompts[0]) == 256
    # e: long contexts at a modest batch, kept inside the model's context
    (e,) = make_workloads(["e"], 1.0, 128256, 8192)
    assert len(e.prompts) == 16 and {len(p) for p in e.prompts} == {7168}
    assert set(e.out_lens) == {128} and e.kind == "output"
    (e,) = make_workloads(["e"], 1.0, 128256, 4096)
    assert len(e.prompts[0]) + e.out_lens[0] < 4096


def test_roofline_counts():
    assert causal_pairs(0, 4) == 1 + 2 + 3 + 4 and causal_pairs(9, 10) == 10
    cfg = ModelConfig.from_dict(TINY)
    cost = ModelCost.from_config(cfg, 4)
    # K and V of 2 layers x 2 kv heads x 16 dims, float32
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert cost.step_bytes(10) == cost.weight_bytes + 10 * cost.kv_bytes_per_token
    assert cost.step_flops(3, 1, 0) == 2 * cost.layer_params * 3 + 2 * 1024 * 64


def test_bench_engine_with_an_fp8_kv_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    shape, out = tmp_path / "tiny.json", tmp_path / "bench.json"
    shape.write_text(json.dumps(TINY))
    assert main(["bench", "engine", "--device", "cpu", "--model-shape", str(shape),
                 "--workloads", "a", "--scale", "0.04", "--dtype", "float32", "--skip-hf",
                 "--kv-cache-dtype", "fp8", "--json", str(out)]) == 0
    config = json.loads(out.read_text())["config"]
    assert config["kv_cache_dtype"] == "fp8"
    # 2 layers x K and V x 2 heads x 16 dims, one byte each
    assert config["kv_bytes_per_token"] == 2 * 2 * 2 * 16


def test_async_scheduling_is_timed_without_a_synchronize_per_step(tmp_path, monkeypatch):
    # Under async scheduling a call reads the step the previous call launched: each
    # recorded step is still the step its time covers, so both schedulings record the
    # same steps (tokens, decode-only steps), and only async runs without a per-step sync.
    monkeypatch.setenv("HOME", str(tmp_path))
    shape = tmp_path / "tiny.json"
    shape.write_text(json.dumps(TINY))
    runs = {}
    for flag in ("--async-scheduling", "--no-async-scheduling"):
        out = tmp_path / f"{flag}.json"
        assert main(["bench", "engine", "--device", "cpu", "--model-shape", str(shape),
                     "--workloads", "a,b", "--scale", "0.04", "--dtype", "float32",
                     "--skip-hf", flag, "--json", str(out)]) == 0
        runs[flag] = json.loads(out.read_text())
    on, off = runs["--async-scheduling"], runs["--no-async-scheduling"]
    assert on["config"]["engine"]["async_scheduling"] and not on["config"]["engine"]["step_sync"]
    assert off["config"]["engine"]["step_sync"]
    for name in ("a", "b"):
        fields = on["workloads"][name]["ours"]["step_fields"]
        tok, dec, smp = (fields.index(f) for f in ("tokens", "decode_only", "sampled"))
        steps = {k: r["workloads"][name]["ours"]["steps"] for k, r in runs.items()}
        want = on["workloads"][name]["prompt_tokens"] + on["workloads"][name]["output_tokens"]
        for k, s in steps.items():  # every token computed once (the last one never)
            assert sum(x[tok] for x in s) == want - on["workloads"][name]["requests"], k
        for col in (dec, smp):  # (a row sampling its token in flight samples)
            assert [x[col] for x in steps["--async-scheduling"]] == \
                [x[col] for x in steps["--no-async-scheduling"]]


def test_a_lagging_recorder_times_each_step_by_the_return_that_reads_it():
    from bench.engine_shape_bench import _Recorder

    rec = _Recorder(lag=True)
    prefill, decode = [(0, 8, 8, 8)], [(8, 9, 9, 8)]
    for shapes, seconds in [(prefill, 0.25), (decode, 0.5), ([], 0.125)]:
        rec.last = shapes  # what this call scheduled and launched
        rec.record(seconds)  # its return: the previous call's step has been read
    # (the first call read nothing: its launch counts toward the first step)
    assert [(s.seconds, s.tokens, s.decode_only) for s in rec.steps] == \
        [(0.75, 8, False), (0.125, 1, True)]


def test_kernels_compiled_inside_a_timed_run_are_recorded_by_step():
    # Triton calls its compile hook once per new kernel variant; here it is called as
    # Triton calls it (the CPU interpreter compiles nothing).
    from triton import knobs

    from bench.jit_compiles import jit_compiles

    seen = []
    knobs.runtime.jit_cache_hook = lambda **kw: (seen.append(kw["fn"].name), False)[1]
    step = [0]
    try:
        with jit_compiles(lambda: step[0]) as compiles:
            jit = type("Jit", (), {"arg_names": ["out_ptr", "q_ptr", "BLOCK_M"]})()
            fn = type("Fn", (), {"name": "_unified_kernel", "jit_function": jit})()
            step[0] = 7
            # Triton keys constants by argument path: (2,) is BLOCK_M
            assert knobs.runtime.jit_cache_hook(fn=fn, compile={"constants": {(2,): 64}},
                                                key=None) is False
        assert compiles == [{"step": 7, "kernel": "_unified_kernel",
                             "constants": {"BLOCK_M": "64"}}]
        assert seen == ["_unified_kernel"]  # a hook already set still sees every compile
        assert knobs.runtime.jit_cache_hook is not None and \
            knobs.runtime.jit_cache_hook(fn=fn, compile={}) is False  # the previous hook back
        assert len(compiles) == 1
    finally:
        knobs.runtime.jit_cache_hook = None
