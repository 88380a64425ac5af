"""`splitserve bench index --quick`: both walks run against a real redis-server, agree
(the bench checks it), and every row of the JSON carries both walks' figures."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(60)
def test_bench_index_quick(tmp_path: Path) -> None:
    out = tmp_path / "index.json"
    proc = subprocess.run([sys.executable, "-m", "cluster.cli", "bench", "index", "--quick",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=50)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = json.loads(out.read_text())
    assert [r["workers"] for r in rows] == [8, 32]
    for r in rows:
        assert r["python_p50_ms"] > 0 and r["lua_p50_ms"] > 0
        assert r["python_redis_ms"] > 0 and r["lua_redis_ms"] > 0
        assert r["ratio"] == pytest.approx(r["python_p50_ms"] / r["lua_p50_ms"])
    assert "python/lua" in proc.stdout
