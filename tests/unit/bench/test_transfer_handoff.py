"""`splitserve bench transfer --device cpu --handoffs`: whole prompts handed off between
two processes over tcp and shm, every hand-off verified by the receiver; its summary's
fixed cost and cost of one more region, from the rows a run measured."""

from __future__ import annotations

import argparse
import json

import pytest

from bench.transfer_handoff import Row, page_fields, summarize
from cluster.cli import main
from kvtransfer import KVLayout

MIB = 1 << 20


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
    assert "tcp_region_us" in result["summary"] and result["tables"] and result["created"]


def row(mode: str, tokens: int, ms: float) -> Row:
    nbytes = tokens // 16 * MIB
    return Row("shm", mode, tokens, nbytes, 8, ms, nbytes / (ms / 1e3) / 1e9)


def test_region_cost_is_the_scattered_excess_per_extra_region() -> None:
    # 4096 tokens: 256 blocks, 256 regions scattered, one contiguous; 16 tokens: 1 block
    rows = [row("contiguous", 16, 0.30), row("scattered", 16, 0.30),
            row("contiguous", 4096, 10.0), row("scattered", 4096, 12.55)]
    s = summarize(rows, {"gbps": 50.0}, [16, 4096], block_size=16)
    assert s["shm_region_us"] == pytest.approx((12.55 - 10.0) * 1e3 / 255)
    big_gbps = 256 * MIB / 12.55e-3 / 1e9
    assert s["shm_fixed_us"] == pytest.approx(300 - MIB / (big_gbps * 1e9) * 1e6)
    # one block at most: no second region to cost
    assert "shm_region_us" not in summarize(rows[:2], {"gbps": 50.0}, [16], block_size=16)


def test_a_region_cost_within_the_noise_is_reported_not_significant() -> None:
    """An excess of the scattered median over the contiguous one within twice the noise
    of their difference (or below zero) is None, not a cost (negative or not)."""
    def noisy(mode: str, tokens: int, ms: float, iqr: float) -> Row:
        nbytes = tokens // 16 * MIB
        return Row("tcp", mode, tokens, nbytes, 32, ms, nbytes / ms / 1e6, iqr)

    small = [noisy("contiguous", 16, 0.3, 0.0), noisy("scattered", 16, 0.3, 0.0)]
    cases = [(10.0, 9.7, 0.0), (10.0, 10.2, 1.0), (10.0, 12.55, 1.0)]
    got = [summarize(small + [noisy("contiguous", 4096, c, iqr),
                              noisy("scattered", 4096, sc, iqr)],
                     {"gbps": 50.0}, [16, 4096])["tcp_region_us"] for c, sc, iqr in cases]
    assert got[:2] == [None, None]
    assert got[2] == pytest.approx(2.55e3 / 255)


def test_the_page_table_has_a_row_per_transport_and_mode() -> None:
    args = argparse.Namespace(device="cpu", handoffs=True, handoff_tokens="16,4096",
                              handoff_transports=None, layout=None, repeats=8)
    layout = KVLayout(num_layers=4, num_kv_heads=2, head_dim=64, block_size=16,
                      dtype="bfloat16")
    fields = page_fields(args, [row("contiguous", 16, 0.3), row("scattered", 4096, 12.5)],
                         layout)
    assert fields["command"] == ("splitserve bench transfer --device cpu --handoffs "
                                 "--handoff-tokens 16,4096 --repeats 8 --json transfer.json")
    table = fields["tables"][0]
    assert table[0] == "| transport | blocks | 16 tok | 4096 tok |"
    assert table[2:] == ["| shm | contiguous | 0.300 ms | - |",
                         "| shm | scattered | - | 12.500 ms |"]
