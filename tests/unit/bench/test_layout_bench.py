"""`splitserve bench layout` on a tiny shape: the report's fields and byte counts, and the
check that both layouts' gathered head slices hold the same values (not the timings)."""

from __future__ import annotations

import json

import pytest
import torch

from bench.layout_bench import Probe
from cluster.cli import main

TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 256,
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 8,
        "max_position_embeddings": 128, "rms_norm_eps": 1e-5, "rope_theta": 1e4,
        "torch_dtype": "float32"}


def test_bench_layout_report(tmp_path, capsys):
    shape, out = tmp_path / "tiny.json", tmp_path / "layout.json"
    shape.write_text(json.dumps(TINY))
    assert main(["bench", "layout", "--model-shape", str(shape), "--block-size", "4",
                 "--tp", "2,4", "--blocks", "5", "--pool-mib", "1", "--repeats", "3",
                 "--dtype", "float32", "--device", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    block = 3 * 2 * 4 * 4 * 8 * 4  # layers, K/V, tokens, KV heads, dim, float32
    assert report["name"] == "layout" and report["config"]["block_bytes"] == block
    assert report["machine"]["cpus"] and report["created"]
    rows = {r["gather"]: r for r in report["result"]["rows"]}
    assert rows["full"]["bytes"] == 5 * block and rows["full"]["vs_full"] == 1
    for tp in (2, 4):
        for layout in ("token_major", "head_major"):
            r = rows[f"tp{tp}_{layout}"]
            assert r["bytes"] == 5 * block // tp and r["median_ms"] > 0 and r["gbps"] > 0
        s = report["summary"]
        assert s[f"tp{tp}_run_bytes_token_major"] == 4 // tp * 8 * 4
        assert s[f"tp{tp}_run_bytes_head_major"] == 4 // tp * 4 * 8 * 4
        assert s[f"tp{tp}_token_vs_head"] > 0
    assert "tp2_token_vs_head" in capsys.readouterr().out
    assert "| tp4_head_major |" in report["tables"][0][3 + 3]


def test_probe_check_refuses_layouts_that_differ():
    probe = Probe(2, 4, 8, 4, 6, torch.float32, torch.device("cpu"))
    ids = torch.tensor([4, 1, 3])
    probe.check(2, ids)
    probe.head_major[3, 1, 0, 1, 2, 5] += 1  # rank 0's second head, in a gathered block
    with pytest.raises(RuntimeError, match="head slices differ"):
        probe.check(2, ids)
    probe.check(4, ids)  # TP 4's rank 0 holds the first head only: untouched
