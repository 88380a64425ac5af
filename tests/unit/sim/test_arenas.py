"""The simulator's huge-page arenas (sim/arenas.py, sim/_arenas.c): they serve and
reuse CPython's arenas, and a simulation on them computes what one without does. Each
case runs in its own interpreter: an install lasts for the process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sim import arenas

BUILT = any(Path(arenas.__file__).parent.glob("_arenas.*.so"))
needs_build = pytest.mark.skipif(not BUILT, reason="sim/_arenas.c not built (`make deps`)")


def _python(code: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout


ROOT = Path(__file__).resolve().parents[3]


@needs_build
def test_arenas_are_served_from_the_region_and_reused() -> None:
    out = _python("""
import json
from sim import arenas
first = arenas.install(64 << 20)
again = arenas.install()
before = arenas.stats()
rounds = []
for _ in range(3):  # ~40 MB of small objects, dropped: their arenas go back, come again
    junk = [(i, float(i)) for i in range(400_000)]
    del junk
    rounds.append(arenas.stats())
print(json.dumps([first, again, before, rounds]))
""", ROOT)
    first, again, before, rounds = json.loads(out)
    assert first in ("huge-page arenas",
                     "reused arenas, 4 KiB pages (the kernel refused huge pages)")
    assert again == first  # once per process
    handed, reused, passed = rounds[-1]
    assert handed > before[0]  # the first round's arenas came from the region
    # the later rounds' arenas were the first round's, given back and reused
    assert reused > 0 and rounds[-1][0] - rounds[0][0] < rounds[0][0] - before[0]
    assert passed == 0  # every arena fit the 64 MiB region


@needs_build
def test_a_full_region_passes_arenas_on() -> None:
    out = _python("""
import json
from sim import arenas
arenas.install(2 << 20)  # two arenas' room
keep = [(i, float(i)) for i in range(400_000)]
print(json.dumps(arenas.stats()))
""", ROOT)
    handed, _, passed = json.loads(out)
    assert handed == 2 and passed > 0


@needs_build
def test_a_simulation_on_them_computes_the_same(tmp_path: Path) -> None:
    from sim.cluster import Simulator
    from tests.unit.sim.test_simulator import CONFIGS, key, profile, trace_specs

    want = [list(map(repr, r)) for r in key(
        Simulator(CONFIGS["disaggregated"], profile()).run(trace_specs(tmp_path)))]
    out = _python(f"""
import json
from pathlib import Path
from sim import arenas
print(arenas.install())
from sim.cluster import Simulator
from tests.unit.sim.test_simulator import CONFIGS, key, profile, trace_specs
got = key(Simulator(CONFIGS["disaggregated"], profile()).run(trace_specs(Path({str(tmp_path)!r}))))
print(json.dumps([list(map(repr, r)) for r in got]))
""", ROOT)
    status, got = out.splitlines()
    assert status.endswith("arenas") or "reused arenas" in status
    assert json.loads(got) == want


def test_without_an_install_the_status_says_so() -> None:
    out = _python("""
from sim import arenas
print(arenas.status(), arenas.stats())
""", ROOT)
    assert out.strip() == "4 KiB pages (not installed) None"


def _sim_run(tmp: Path, name: str, **env: str) -> dict:
    """`splitserve sim run` as its own process (as a user starts it), its JSON report."""
    out = tmp / f"{name}.json"
    done = subprocess.run(
        [sys.executable, "-m", "cluster.cli", "sim", "run", "--workload", "shared-prefix",
         "--requests", "80", "--colocated", "2", "--no-progress",
         "--out-dir", str(tmp / name), "--json", str(out)],
        cwd=ROOT, env={**os.environ, **env}, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.skipif(arenas.malloc_library() is None,
                    reason="no TCMalloc on this machine (`make sysdeps`)")
def test_splitserve_sim_runs_on_tcmalloc_and_computes_the_same(tmp_path: Path) -> None:
    on = _sim_run(tmp_path, "tcmalloc")
    off = _sim_run(tmp_path, "system", SPLITSERVE_SIM_MALLOC="system")
    assert on["config"]["sim"]["heap"].endswith(", tcmalloc")  # started again on it
    assert off["config"]["sim"]["heap"].endswith(", system malloc")
    [a], [b] = on["phases"], off["phases"]
    assert a["requests"] == b["requests"] and len(a["requests"]) == 80
    assert a["summary"] == b["summary"]


def test_an_unknown_malloc_choice_is_refused(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "cluster.cli", "sim", "run", "--requests", "1"],
                          cwd=ROOT, env={**os.environ, "SPLITSERVE_SIM_MALLOC": "jemalloc"},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "SPLITSERVE_SIM_MALLOC must be tcmalloc or system, got 'jemalloc'" in done.stderr


def test_the_heap_names_the_malloc() -> None:
    out = _python("""
from sim import arenas
print(arenas.heap())
""", ROOT)
    missing = "" if arenas.malloc_library() else \
        " (no libtcmalloc_minimal.so.4 here: `make sysdeps` installs it)"
    assert out.strip() == "4 KiB pages (not installed), system malloc" + missing


def test_the_heap_says_how_to_get_tcmalloc_where_the_machine_has_none(monkeypatch) -> None:
    monkeypatch.setattr(arenas, "malloc_library", lambda: None)
    monkeypatch.setattr(arenas, "malloc_in_use", lambda: "system malloc")
    assert arenas.heap().endswith(
        ", system malloc (no libtcmalloc_minimal.so.4 here: `make sysdeps` installs it)")
