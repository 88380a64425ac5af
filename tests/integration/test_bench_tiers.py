"""`splitserve bench tiers --quick`: host, disk and LMCache tiers restore the same blocks
bit-exact (the bench checks it) and the JSON summary carries every figure."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.serving_util import splitserve_cli


@pytest.mark.timeout(90)
def test_bench_tiers_quick(tmp_path: Path) -> None:
    from kvtransfer.tiers.lmcache_tier import IMPORT_ERROR

    out = tmp_path / "tiers.json"
    proc = splitserve_cli("bench", "tiers", "--quick", "--disk-dir", str(tmp_path), "--json",
                          str(out), timeout=80)
    result = json.loads(out.read_text())
    s = result["summary"]
    for key in ("host_gbps", "disk_gbps", "recompute_gbps"):
        assert s[key] > 0, key
    assert result["recompute"]["model"]["tokens"] == 16 * 16  # every block recomputed
    assert list(tmp_path.iterdir()) == [out]  # the disk tier's files are gone
    if IMPORT_ERROR is not None:
        assert s["lmcache_gbps"] is None and "lmcache" in result["skipped"]
        return
    assert s["lmcache_gbps"] > 0
    assert s["host_over_lmcache"] == pytest.approx(s["host_gbps"] / s["lmcache_gbps"])
    assert isinstance(s["target_met"], bool)
    assert "host / lmcache" in proc.stdout and "recompute" in proc.stdout


def test_bench_tiers_rejects_bad_sizes() -> None:
    import argparse

    from bench.tiers_bench import add_arguments, check_args

    p = argparse.ArgumentParser()
    add_arguments(p)
    for argv, msg in ((["--prompt-len", "40"], "multiple of --block-size"),
                      (["--blocks", "0"], ">= 1"),
                      (["--disk-dir", "/nonexistent/x"], "not a directory")):
        with pytest.raises(SystemExit, match=msg):
            check_args(p.parse_args(argv))
