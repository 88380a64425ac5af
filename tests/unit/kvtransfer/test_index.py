"""Pure logic of the block index: the circuit breaker, the prefix-chain walk, configs."""

from __future__ import annotations

import pytest

from kvtransfer.circuit import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from kvtransfer.index import IndexConfig, check_tier, new_epoch, tier_rank
from kvtransfer.index_pywalk import _extend, _result


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_breaker_opens_after_n_failures_and_probes_once_after_cooldown() -> None:
    clock = Clock()
    b = CircuitBreaker(3, 2.0, clock)
    assert b.allow() and not b.record_failure() and not b.record_failure()
    assert b.record_success() is False  # a success resets the count
    assert not b.record_failure() and not b.record_failure()
    assert b.record_failure() and b.state == OPEN
    assert not b.allow()
    clock.t += 1.9
    assert not b.allow()
    clock.t += 0.2
    assert b.state == HALF_OPEN
    assert b.allow() and not b.allow()  # one probe at a time
    assert b.record_failure() and b.state == OPEN  # failed probe: cooldown restarts
    clock.t += 2.0
    assert b.allow()
    assert b.record_success() and b.state == CLOSED and b.allow()


def test_breaker_rejects_bad_settings() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(0, 1.0)
    with pytest.raises(ValueError):
        CircuitBreaker(1, 0.0)
    with pytest.raises(ValueError):
        IndexConfig(timeout_ms=0)
    with pytest.raises(ValueError):
        IndexConfig(breaker_failures=0)


def walk(rows, epochs, nodes=None):
    runs: dict[str, list[str]] = {}
    stale: list = []
    i = 0
    for row in rows:
        if not _extend(runs, i, f"k{i}", row, epochs, nodes, stale):
            break
        i += 1
    return _result(runs, i), stale


def test_walk_runs_per_node_best_tier_and_stops_at_first_miss() -> None:
    epochs = {"a": "5", "b": "7"}
    rows = [
        {"a@device": "5", "a@host": "5", "b@disk": "7"},
        {"a@host": "5", "b@disk": "7"},
        {"b@device": "7"},  # a's run ends at block 1
        {"a@device": "5"},  # a holds block 3 but not 2: not part of a's leading run
        {},                 # nobody: the chain ends here
        {"a@device": "5", "b@device": "7"},
    ]
    res, stale = walk(rows, epochs)
    assert res.num_blocks == 4
    assert res.nodes == {"a": ("device", "host"), "b": ("disk", "disk", "device")}
    assert res.matched("a") == 2 and res.matched("c") == 0 and not stale


def test_walk_ignores_other_epochs_and_reports_only_older_ones_as_stale() -> None:
    epochs = {"a": "5", "b": "7"}
    rows = [{"a@device": "4", "b@device": "8", "c@device": "1"}]  # old, newer, unregistered
    res, stale = walk(rows, epochs)
    assert res.num_blocks == 0 and res.nodes == {}
    assert stale == [("k0", "a@device", "4")]


def test_walk_node_filter() -> None:
    res, _ = walk([{"a@device": "1", "b@host": "1"}], {"a": "1", "b": "1"}, nodes={"b"})
    assert res.nodes == {"b": ("host",)}


def test_tiers_and_epochs() -> None:
    assert tier_rank("device") < tier_rank("host") < tier_rank("disk") < tier_rank("lmcache")
    assert check_tier("lmcache") == "lmcache"
    for bad in ("", "Dev", "a@b", "x y"):
        with pytest.raises(ValueError):
            check_tier(bad)
    e = new_epoch()
    assert new_epoch(e + 10**9) == e + 10**9 + 1 and new_epoch() >= e
    assert e < 2**53  # exact as a Lua number
