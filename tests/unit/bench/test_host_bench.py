"""`splitserve bench host`: a small batch end to end; every phase of the decode steps is
accounted for, and the engine it wraps still produces full decode steps."""

from __future__ import annotations

import gc
import json

from bench.host_bench import PHASES
from cluster.cli import main


def test_bench_host_small_batch(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert main(["bench", "host", "--batch", "6", "--input-len", "20", "60",
                 "--output-len", "10", "20", "--steps", "4", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    s, phases = result["summary"], result["phases_us_per_step"]
    assert set(PHASES) | {"other", "step"} <= set(phases)
    assert all(phases[k] > 0 for k in PHASES), phases
    assert s["host_us_per_step"] > 0 and s["forward_us_per_step"] > 0
    assert abs(s["host_us_per_request"] * 6 - s["host_us_per_step"]) < 1e-6
    assert s["step_us"] >= s["forward_us_per_step"]
    assert "batch 6: host" in capsys.readouterr().out


def test_bench_host_with_a_wide_vocabulary(tmp_path, capsys):
    out = tmp_path / "host.json"
    assert main(["bench", "host", "--batch", "4", "--input-len", "20", "40",
                 "--output-len", "10", "20", "--steps", "2", "--vocab-size", "5000",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["config"]["vocab_size"] == 5000
    assert all(result["phases_us_per_step"][k] > 0 for k in PHASES)


def test_widened_tokenizer_decodes_its_new_words_and_encodes_as_before(tmp_path):
    from bench.engine_bench import build_model
    from engine.tokenizer import Tokenizer

    plain, wide = tmp_path / "plain", tmp_path / "wide"
    plain.mkdir()
    wide.mkdir()
    _, small = build_model(str(plain), 64, 1)
    assert build_model(str(wide), 64, 1, vocab_size=5000) == (str(wide), 5000)
    assert json.loads((wide / "config.json").read_text())["vocab_size"] == 5000
    a, b = Tokenizer(str(plain)), Tokenizer(str(wide))
    assert b.vocab_size == 5000 > small == a.vocab_size
    text = "The prefill writes KV blocks; décodé 中文."
    assert b.encode(text) == a.encode(text)
    words = [b.decode([i]) for i in range(small, 5000)]
    assert all(w.strip() for w in words)
    assert sum(w.startswith(" ") for w in words) > len(words) // 3
    assert any(not w.isascii() for w in words)


def test_bench_host_times_from_the_decoded_tokens_asked(tmp_path):
    out = tmp_path / "host.json"
    assert main(["bench", "host", "--batch", "3", "--input-len", "20", "30",
                 "--output-len", "5", "10", "--steps", "2", "--decoded", "40",
                 "--json", str(out)]) == 0
    lo, hi = json.loads(out.read_text())["summary"]["decoded_at_start"]
    assert 40 <= lo <= hi


def test_bench_host_serves_a_request_stream_unfrozen_then_frozen(tmp_path, capsys):
    """`--gc-churn`: the same engine serves a stream of requests with the start-up heap
    unfrozen, then frozen, and reports the collector's full collections in each; the
    process that ran the bench gets its collector back as it was."""
    out = tmp_path / "host.json"
    assert main(["bench", "host", "--batch", "4", "--input-len", "20", "40",
                 "--output-len", "10", "20", "--steps", "2", "--gc-churn", "0.5",
                 "--json", str(out)]) == 0
    churn = json.loads(out.read_text())["gc_churn"]
    assert set(churn) == {"unfrozen", "frozen"}
    for phase in churn.values():
        assert phase["requests"] >= 4 and phase["steps"] > 0
        assert 0 <= phase["full_max_ms"] <= phase["full_ms"]
        assert phase["full_collections"] >= 0
    assert "start-up heap frozen" in capsys.readouterr().out
    assert gc.get_freeze_count() == 0

