"""`splitserve bench transfer --quick`: every transport moves bytes between two processes
and the JSON summary carries all five figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.serving_util import splitserve_cli


@pytest.mark.timeout(120)
def test_bench_transfer_quick(tmp_path: Path) -> None:
    out = tmp_path / "transfer.json"
    proc = splitserve_cli("bench", "transfer", "--quick", "--json", str(out), timeout=110)
    summary = json.loads(out.read_text())["summary"]
    for key in ("memcpy_gbps", "raw_tcp_gbps", "shm_gbps", "tcp_gbps", "ucx_gbps"):
        assert summary[key] > 0, key
    assert "ucx" in proc.stdout and "raw tcp" in proc.stdout
