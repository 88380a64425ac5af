"""`splitserve bench transfer --device cpu --handoffs`: whole prompts handed off between
two processes over tcp and shm, every hand-off verified by the receiver."""

from __future__ import annotations

import json

from cluster.cli import main


def test_handoffs_on_host_caches(tmp_path):
    out = tmp_path / "handoff.json"
    assert main(["bench", "transfer", "--device", "cpu", "--handoffs", "--handoff-tokens",
                 "16,64", "--handoff-transports", "tcp,shm", "--repeats", "2",
                 "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {(r["transport"], r["mode"], r["tokens"]): r for r in result["rows"]}
    assert len(rows) == 8  # 2 transports x 2 modes x 2 sizes, the warm-up rows dropped
    assert all(r["handoffs"] == 2 and r["gbps"] > 0 for r in rows.values())
    assert result["summary"]["shm_gbps"] > 0 and result["summary"]["tcp_fixed_us"] >= 0
