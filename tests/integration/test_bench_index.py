"""`splitserve bench index --quick`: both walks run against a real redis-server, agree
(the bench checks it), and every row of the JSON carries both walks' figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.serving_util import splitserve_cli


@pytest.mark.timeout(60)
def test_bench_index_quick(tmp_path: Path) -> None:
    out = tmp_path / "index.json"
    proc = splitserve_cli("bench", "index", "--quick", "--json", str(out), timeout=50)
    rows = json.loads(out.read_text())
    assert [r["workers"] for r in rows] == [8, 32]
    for r in rows:
        assert r["python_p50_ms"] > 0 and r["lua_p50_ms"] > 0
        assert r["python_redis_ms"] > 0 and r["lua_redis_ms"] > 0
        assert r["ratio"] == pytest.approx(r["python_p50_ms"] / r["lua_p50_ms"])
    assert "python/lua" in proc.stdout
