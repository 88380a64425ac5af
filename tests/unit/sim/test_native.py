"""The simulator's modules compiled with mypyc (sim/native.py, Makefile): a run on them
computes exactly what one on their source does (colocated, disaggregated, tiers, peer
fetch; decode windows and one-iteration steps). A build older than its source is refused
by engine.refuse_stale_builds (tests/unit/engine/test_block_pool.py)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sim.native import compiled_modules

ROOT = Path(__file__).resolve().parents[3]
BUILT = compiled_modules()
needs_build = pytest.mark.skipif(not BUILT, reason="the simulator's modules are not "
                                 "compiled (`make deps`; no C compiler: they run as source)")

# Runs the three test clusters; with SOURCE, sim's compiled modules load from their .py.
RUN = """
import dataclasses, importlib.util, json, sys
from pathlib import Path
if SOURCE:
    class Source:  # found before the path finder, which prefers an extension
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name.startswith("sim.") and name[4:] in MODULES:
                return importlib.util.spec_from_file_location(name, f"sim/{name[4:]}.py")
    sys.meta_path.insert(0, Source)
from gateway.routing.profile import RoutingProfile
from sim.cluster import Simulator
from sim.config import ClusterConfig
from sim.workload import shared_prefix
from tests.unit.sim.test_simulator import CONFIGS, key, profile, trace_specs
out = {"files": {m: Path(sys.modules["sim." + m].__file__).name for m in MODULES}}
trace = trace_specs(Path(TMP))
cases = {name: (cfg, trace) for name, cfg in CONFIGS.items()}
cases["one-iteration steps"] = (dataclasses.replace(CONFIGS["tiers"], decode_windows=False),
                                trace)
cases["peer fetch"] = (ClusterConfig(prefill=1, decode=2, colocated=0,
    routing=RoutingProfile.from_dict({"scorers": [{"name": "queue"}], "picker": "round_robin",
        "decider": {"name": "threshold", "threshold": 64}, "peer_fetch": {"min_blocks": 2}})),
    shared_prefix(2, 6, 1024, 32, 8, rate=40.0, seed=1))
for name, (cfg, specs) in cases.items():
    s = Simulator(cfg, profile())
    got = key(s.run(specs))
    s.check_integrity()
    out[name] = [[list(map(repr, r)) for r in got], dataclasses.asdict(s.stats)]
print(json.dumps(out))
"""


def _run(source: bool, tmp: Path) -> dict:
    code = f"SOURCE = {source}\nMODULES = {BUILT!r}\nTMP = {str(tmp)!r}\n" + RUN
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@needs_build
def test_compiled_and_source_runs_are_the_same(tmp_path: Path) -> None:
    compiled, source = _run(False, tmp_path), _run(True, tmp_path)
    assert all(f.endswith(".so") for f in compiled.pop("files").values())
    assert all(f.endswith(".py") for f in source.pop("files").values())
    assert set(compiled) == {"colocated", "disaggregated", "tiers", "one-iteration steps",
                             "peer fetch"}
    assert compiled["peer fetch"][1]["peer_fetches"] > 0  # the path ran
    assert compiled["disaggregated"][1]["remote_prefills"] > 0
    for name in compiled:
        assert compiled[name] == source[name], name
