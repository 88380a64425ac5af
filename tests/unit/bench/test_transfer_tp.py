"""`splitserve bench transfer --prefill-tensor-parallel-size P --decode-tensor-parallel-size D`
on a CPU (gloo): real TP engines of a tiny shape hand prompts off by the per-rank path
and the staging path, beside TP 1 -> TP 1; the report's fields and the landed bytes
(checked by the benchmark), not its timings."""

from __future__ import annotations

import json

import pytest

from cluster.cli import main

# one KV head: replicated on both ranks at TP 2 (gathered once, written to both)
TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1024,
        "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "tie_word_embeddings": True, "torch_dtype": "float32"}


def test_bench_transfer_between_tp_sizes_on_cpu(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))  # the shape's directory is cached under ~
    shape, out = tmp_path / "tiny.json", tmp_path / "tp.json"
    shape.write_text(json.dumps(TINY))
    assert main(["bench", "transfer", "--prefill-tensor-parallel-size", "2",
                 "--decode-tensor-parallel-size", "2", "--model-shape", str(shape),
                 "--handoff-tokens", "16,40", "--repeats", "2", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    block_bytes = result["layout"]["block_size"] * 2 * TINY["num_hidden_layers"] \
        * TINY["head_dim"] * 4  # K and V, one KV head, float32
    rows = {(r["prefill_tp"], r["decode_tp"], r["path"], r["tokens"]): r
            for r in result["rows"]}
    assert set(rows) == {(1, 1, "direct", 16), (1, 1, "direct", 40), (2, 2, "staging", 16),
                         (2, 2, "staging", 40), (2, 2, "rank", 16), (2, 2, "rank", 40)}
    for (_, _, path, tokens), r in rows.items():
        assert r["bytes"] == -(-tokens // 16) * block_bytes
        assert r["handoffs"] == 2 and r["p50_ms"] > 0 and r["gbps"] > 0
        assert 0 <= r["tp_share"] <= 1
        if path != "staging":  # the transports read and write the caches, nothing staged
            assert r["gather_ms"] == r["scatter_ms"] == r["tp_share"] == 0
        else:
            assert r["gather_ms"] > 0 and r["scatter_ms"] > 0 and r["tp_share"] > 0
    s = result["summary"]
    assert (s["prefill_tp"], s["decode_tp"], s["path"], s["tokens"]) == (2, 2, "rank", 40)
    assert s["tp_gbps"] == rows[(2, 2, "rank", 40)]["gbps"]
    assert s["staging_gbps"] == rows[(2, 2, "staging", 40)]["gbps"]
    assert s["rank_vs_staging"] == pytest.approx(s["tp_gbps"] / s["staging_gbps"])
    assert s["tp_vs_ref"] == pytest.approx(s["tp_gbps"] / s["ref_gbps"])
    printed = capsys.readouterr().out
    assert "TP 2 -> TP 2 at 40 tokens: rank" in printed and "vs staging" in printed


def test_bench_transfer_refuses_a_bad_tp_size(capsys):
    assert main(["bench", "transfer", "--prefill-tensor-parallel-size", "0",
                 "--decode-tensor-parallel-size", "2"]) == 2
    assert "tensor-parallel sizes must be >= 1, got prefill 0" in capsys.readouterr().err
