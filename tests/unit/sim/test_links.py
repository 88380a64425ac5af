"""`splitserve sim links`: the link fit recovers a known line, the tier restores run
through the production TieredCache here (CPU), and `sim calibrate --links-json` puts
the chosen links in a profile with their sources."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sim.links import fit_link, load_links, transfer_points
from sim.profile import load_profile

ROOT = Path(__file__).resolve().parents[3]
GPU = ROOT / "docs" / "results" / "gpu"


def _cli(*args: str) -> None:
    p = subprocess.run([sys.executable, "-m", "cluster.cli", *args], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-3000:]


def test_fit_recovers_a_known_link() -> None:
    bw, lat = 40e9, 80e-6
    points = [(b, lat + b / bw) for b in (1 << 20, 4 << 20, 64 << 20, 512 << 20)]
    link, err = fit_link(points)
    assert err < 1e-9
    assert link.bandwidth_bytes_s == pytest.approx(bw, rel=1e-6)
    assert link.latency_s == pytest.approx(lat, rel=1e-6)
    # Relative weighting: a 20 % slow small transfer does not swamp the bandwidth.
    link, err = fit_link([(points[0][0], points[0][1] * 1.2), *points[1:]])
    assert link.bandwidth_bytes_s == pytest.approx(bw, rel=0.05) and 0 < err < 0.2


def test_fit_clamps_the_fixed_cost_and_refuses_what_is_no_link() -> None:
    # Points under a pure bandwidth line: the free fit's intercept would be negative.
    link, _ = fit_link([(1e6, 0.8e-4), (1e7, 1e-3), (1e8, 1e-2)])
    assert link.latency_s == 0.0 and link.bandwidth_bytes_s == pytest.approx(1e10, rel=0.1)
    with pytest.raises(ValueError, match="two sizes"):
        fit_link([(1e6, 1e-3), (1e6, 2e-3)])
    with pytest.raises(ValueError, match="grow"):
        fit_link([(1e6, 2e-3), (1e8, 1e-3)])
    with pytest.raises(ValueError, match="> 0"):
        fit_link([(1e6, 0.0), (1e8, 1e-3)])


def test_kv_points_come_from_a_bench_transfer_run() -> None:
    points, info = transfer_points(str(GPU / "transfer-h100.json"), "ucx", "scattered")
    assert len(points) == 4 and info["device"].startswith("NVIDIA H100")
    assert [b for b, _ in points] == sorted(b for b, _ in points)
    with pytest.raises(SystemExit, match="no tcp rows"):
        transfer_points(str(GPU / "transfer-h100.json"), "tcp", "scattered")


def test_links_measured_here_through_the_tiers(tmp_path: Path) -> None:
    """A real run on this CPU: the host and disk tiers restore the blocks bit-exact
    (the command fails otherwise), the fits are positive, kv comes from the file. Best of
    9 restores per size: this shared box stalls a copy now and then for 100+ ms."""
    out = tmp_path / "links.json"
    _cli("sim", "links", "--out", str(out), "--model-shape", "qwen3-0.6b", "--block-size", "4",
         "--blocks", "1,8,32", "--repeats", "9", "--disk-dir", str(tmp_path),
         "--transfer-json", str(GPU / "transfer-h100.json"))
    d = json.loads(out.read_text())
    assert set(d["links"]) == {"host", "disk", "kv"}
    block = d["layout"]["block_bytes"]
    assert block == 28 * 8 * 128 * 4 * 2 * 2  # qwen3-0.6b: 28 layers, 8 KV heads, K and V
    for name in ("host", "disk"):
        assert [b for b, _ in d["fits"][name]["points"]] == [block, 8 * block, 32 * block]
        assert d["links"][name]["bandwidth_bytes_s"] > 0 and d["links"][name]["latency_s"] >= 0
    assert any(k in d["fits"]["disk"]["source"] for k in ("O_DIRECT", "page cache"))
    links, notes, fits = load_links(str(out), ["disk"])
    assert set(links) == {"disk"} and len(notes) == 1 and "sim links" in notes[0]
    assert fits["disk"]["device"] == d["device"]
    with pytest.raises(SystemExit, match="unknown links"):
        load_links(str(out), ["nvlink"])


def test_checked_in_gpu_profiles_take_their_measured_tier_links() -> None:
    """h100 and h200: host and disk as `sim links` measured on that GPU's machine (the
    files beside the engine runs), kv still the assumed NIC (a note says why)."""
    for name in ("h100", "h200"):
        prof = load_profile(name)
        links, _, _ = load_links(str(GPU / f"links-{name}.json"), ["host", "disk"])
        assert prof.links["host"] == links["host"] and prof.links["disk"] == links["disk"]
        assert set(prof.fit["links"]) == {"host", "disk"}
        assert prof.links["kv"].bandwidth_bytes_s == 25e9
        notes = json.loads((ROOT / "sim" / "profiles" / f"{name}.json").read_text())["notes"]
        assert any(n.startswith("Link kv:") and "assumed" in n for n in notes)


def test_calibrate_takes_the_named_links(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    _cli("sim", "calibrate", "--name", "gpu", "--like", "h100", "--out", str(out),
         "--engine-json", str(GPU / "engine-h100-llama3-8b.json"),
         "--links-json", str(GPU / "links-h200.json"), "--links", "kv,host",
         "--serving-json", str(GPU / "sim-validation-h100.json"))
    prof = load_profile(str(out))
    # the serving overheads: fitted from the record's one-at-a-time requests (on a step
    # model fitted from one of h100.json's two engine runs: close to its figure)
    assert prof.request_overhead_s == pytest.approx(load_profile("h100").request_overhead_s,
                                                    rel=0.02)
    assert prof.fit["serving"]["file"] == "sim-validation-h100.json"
    measured, _, _ = load_links(str(GPU / "links-h200.json"))
    assert prof.links["kv"] == measured["kv"] and prof.links["host"] == measured["host"]
    assert prof.links["disk"] == load_profile("h100").links["disk"]
    notes = json.loads(out.read_text())["notes"]
    assert any(n.startswith("Link kv:") and "transfer-h200.json" in n for n in notes)
    assert any(n.startswith("Links disk: h100's") for n in notes)
    assert any(n.startswith("request_overhead_s 22.") for n in notes)
    assert not any(n.startswith("request_overhead_s and token") for n in notes)
