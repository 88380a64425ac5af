"""`splitserve bench soak` for a few seconds against the cluster `splitserve up` starts
(one prefill, one decode, Redis, the gateway: real processes): every request kind
answered right, nothing leaked, restarted or grown (bench/soak.py has the invariants)."""

from __future__ import annotations

import json

from bench.invariants import ProcSample
from bench.soak import WEIGHTS, Outcome, SoakResult
from cluster.cli import main
from tests.factories import tiny_model_dir


def test_short_soak_holds_every_invariant(tmp_path, capsys) -> None:
    out = tmp_path / "soak.json"
    rc = main(["bench", "soak", "--model", tiny_model_dir("llama"), "--duration", "6",
               "--warmup", "1.5", "--concurrency", "3", "--json", str(out)])
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert rc == 0 and "invariants: all hold" in printed, result["failures"]
    assert all(n >= 1 for n in result["kinds"].values()), result["kinds"]
    assert set(result["leaked_blocks"]) == {"prefill-0", "decode-0"}
    assert not any(result["leaked_blocks"].values()) and not any(result["restarts"].values())
    assert set(result["end"]) == {"redis", "prefill-0", "decode-0", "gateway"}
    for kind in WEIGHTS:  # the table names every kind
        assert f"| {kind} |" in printed


def test_soak_result_names_each_broken_invariant() -> None:
    mib = 2**20
    r = SoakResult(1.0, [Outcome("valid", 500, 0.1, "status 500"), Outcome("n", 200, 0.1)],
                   start={"gateway": ProcSample(100 * mib, 20), "decode-0": ProcSample(mib, 9)},
                   end={"gateway": ProcSample(200 * mib, 30), "decode-0": None},
                   restarts={"gateway": 0, "decode-0": 1}, leaked={"decode-0": 3},
                   max_rss_growth_mb=64, concurrency=4)
    assert r.failures() == ["valid: status 500", "decode-0 restarted 1 time(s)",
                            "decode-0 is not running", "decode-0: 3 KV blocks not free when idle",
                            "gateway: RSS grew 100 MiB", "gateway: open fds 20 -> 30"]
