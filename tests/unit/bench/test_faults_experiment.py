"""`bench experiment faults` covers every fault kind the fault layers inject, each with
a spec they accept, and its table reads the rows right."""

from __future__ import annotations

from bench.experiments.faults import KINDS, table
from kvtransfer.faults import RPC_KINDS, WIRE_KINDS, FaultSpec


def test_every_injectable_kind_has_a_row() -> None:
    names = [k.name for k in KINDS]
    assert names[0] == "none" and len(set(names)) == len(names)
    assert set(names) == {"none", "kill.write", "kill.token", *(f"wire.{k}" for k in WIRE_KINDS),
                          *(f"rpc.{k}" for k in RPC_KINDS)}
    for k in KINDS[1:]:
        spec = FaultSpec.parse(f"seed=1,{k.spec}")
        assert spec is not None
        layer, _, what = k.name.partition(".")
        if layer == "kill":
            assert getattr(spec, f"kill_{what}") is not None and k.target
        else:
            assert dict(getattr(spec, layer))[what] > 0 and not k.target


def test_table_compares_with_the_fault_free_row() -> None:
    row = {"kind": "none", "spec": "", "requests": 4, "succeeded": 4, "wrong": 0,
           "failed_cleanly": 0, "hung": 0, "p50_s": 0.1, "p99_s": 0.2, "leaked_blocks": 0,
           "faults_fired": 0, "errors": []}
    slow = row | {"kind": "rpc.delay", "spec": "rpc.delay=1", "succeeded": 3,
                  "failed_cleanly": 1, "p50_s": 0.3, "errors": ["UNAVAILABLE"]}
    lines = table([row, slow])
    assert lines[2].startswith("| none | `-` | 4 | 4 (100%) | 0 | 0 | 0 | 0.10 / 0.20 | 1.0x |")
    assert "| 3 (75%) | 0 | 1 | 0 | 0.30 / 0.20 | 3.0x | 0 | 0 | UNAVAILABLE |" in lines[3]
