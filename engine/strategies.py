"""Scheduling strategies: who is served first, in what share, and for how long.

The contract between the gateway (which takes strategies over HTTP and stores them)
and the workers (whose schedulers apply them). Torch-free and dependency-free apart
from the Redis client passed in: the gateway imports it.

Shape (Gthulhu's `/api/v1/scheduling/strategies`, adapted to requests)::

    {"scheduling": [
        {"priority": true, "execution_time": 20000000,
         "selectors": [{"key": "tenant", "value": "gold"}]},
        {"weight": 2, "max_running": 8, "selectors": [{"key": "tier", "value": "paid"}]},
        {"priority": true, "request_id": "cmpl-42"}]}

- `priority`: served before requests without it; under KV-block or token-budget
  pressure it preempts them (they are recomputed later, token-identical).
- `execution_time`: a decode time slice in ns; a request that has decoded this long
  while a request of the same priority waits yields its place in the batch.
- `weight`: share under VTC fair scheduling (a tenant's counter grows by cost / weight).
- `max_running`: at most this many running requests per tenant.
- A target: `selectors` (all must match the request's labels, where the tenant is the
  label "tenant") or a single `request_id`.

Several strategies may match one request; each field is taken from the first matching
strategy that sets it, request-id strategies before selector strategies, each group in
list order. Stored in Redis under `splitserve:<served_model_name>:strategies` as
`{"version": N, "scheduling": [...]}`; `store_strategies` bumps the version atomically.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

TENANT_LABEL = "tenant"
DEFAULT_TENANT = ""  # requests without a tenant share this one
MAX_STRATEGIES = 1024
_FIELDS = ("priority", "execution_time", "weight", "max_running", "selectors", "request_id")
_EFFECTS = ("priority", "execution_time", "weight", "max_running")


@dataclass(frozen=True, slots=True)
class Selector:
    key: str
    value: str


@dataclass(frozen=True, slots=True)
class Policy:
    """What the strategies mean for one request (defaults: no strategy matched)."""

    priority: bool = False
    execution_time_ns: int | None = None  # None: no time slice
    weight: float = 1.0
    max_running: int | None = None  # None: no cap


DEFAULT_POLICY = Policy()


@dataclass(frozen=True, slots=True)
class Strategy:
    """One entry of `scheduling`. Effect fields left None are not set by it."""

    selectors: tuple[Selector, ...] = ()
    request_id: str | None = None
    priority: bool | None = None
    execution_time: int | None = None  # ns
    weight: float | None = None
    max_running: int | None = None

    def matches(self, labels: Mapping[str, str], request_id: str) -> bool:
        """`labels` include the tenant under "tenant"."""
        if self.request_id is not None:
            return self.request_id == request_id
        return all(labels.get(s.key) == s.value for s in self.selectors)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {}
        for name in _EFFECTS:
            v = getattr(self, name)
            if v is not None:
                d[name] = v
        if self.request_id is not None:
            d["request_id"] = self.request_id
        else:
            d["selectors"] = [{"key": s.key, "value": s.value} for s in self.selectors]
        return d


@dataclass(frozen=True, slots=True)
class StrategySet:
    """A versioned list of strategies (version 0: nothing stored yet)."""

    version: int = 0
    strategies: tuple[Strategy, ...] = ()
    _by_id: dict[str, Strategy] = field(default_factory=dict, init=False, repr=False,
                                        compare=False)

    def __post_init__(self) -> None:
        for s in self.strategies:
            if s.request_id is not None:
                self._by_id.setdefault(s.request_id, s)

    def for_request(self, tenant: str, labels: Mapping[str, str] | None = None,
                    request_id: str = "") -> Policy:
        """The effective policy of a request: each field from the first matching
        strategy that sets it (request-id strategies first), else the default."""
        if not self.strategies:
            return DEFAULT_POLICY
        all_labels = {**(labels or {}), TENANT_LABEL: tenant}
        by_id = self._by_id.get(request_id) if request_id else None
        matching = ([by_id] if by_id is not None else []) + [
            s for s in self.strategies if s.request_id is None and s.matches(all_labels, "")]
        if not matching:
            return DEFAULT_POLICY
        got: dict[str, Any] = {}
        for s in matching:
            for name in _EFFECTS:
                v = getattr(s, name)
                if v is not None:
                    got.setdefault(name, v)
        return Policy(priority=bool(got.get("priority", False)),
                      execution_time_ns=got.get("execution_time"),
                      weight=float(got.get("weight", 1.0)),
                      max_running=got.get("max_running"))

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version,
                "scheduling": [s.to_dict() for s in self.strategies]}


EMPTY = StrategySet()


def parse(obj: Any) -> StrategySet:
    """Validates Gthulhu's shape `{"scheduling": [...]}` (an optional "version" too, as
    stored in Redis). Raises ValueError saying what is wrong and where."""
    if not isinstance(obj, dict):
        raise ValueError("strategies must be a JSON object with a 'scheduling' list")
    unknown = sorted(set(obj) - {"scheduling", "version"})
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r} (expected 'scheduling')")
    items = obj.get("scheduling")
    if not isinstance(items, list):
        raise ValueError("'scheduling' must be a list of strategies")
    if len(items) > MAX_STRATEGIES:
        raise ValueError(f"at most {MAX_STRATEGIES} strategies, got {len(items)}")
    version = obj.get("version", 0)
    if not _is_int(version) or version < 0:
        raise ValueError("'version' must be a non-negative integer")
    return StrategySet(version, tuple(_parse_strategy(s, f"scheduling[{i}]")
                                      for i, s in enumerate(items)))


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _parse_strategy(obj: Any, where: str) -> Strategy:
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: a strategy must be a JSON object")
    unknown = sorted(set(obj) - set(_FIELDS))
    if unknown:
        raise ValueError(f"{where}: unknown field {unknown[0]!r}; allowed: {list(_FIELDS)}")
    if not any(obj.get(k) is not None for k in _EFFECTS):
        raise ValueError(f"{where}: sets none of {list(_EFFECTS)}")
    priority = obj.get("priority")
    if priority is not None and not isinstance(priority, bool):
        raise ValueError(f"{where}: 'priority' must be true or false")
    exec_ns = obj.get("execution_time")
    if exec_ns is not None and (not _is_int(exec_ns) or exec_ns <= 0):
        raise ValueError(f"{where}: 'execution_time' must be a positive integer (ns), "
                         f"got {exec_ns!r}")
    weight = obj.get("weight")
    if weight is not None and (isinstance(weight, bool) or not isinstance(weight, int | float)
                               or not math.isfinite(weight) or weight <= 0):
        raise ValueError(f"{where}: 'weight' must be a number > 0, got {weight!r}")
    cap = obj.get("max_running")
    if cap is not None and (not _is_int(cap) or cap < 1):
        raise ValueError(f"{where}: 'max_running' must be an integer >= 1, got {cap!r}")
    selectors, request_id = obj.get("selectors"), obj.get("request_id")
    if (selectors is None) == (request_id is None):
        raise ValueError(f"{where}: needs exactly one target: 'selectors' or 'request_id'")
    if request_id is not None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"{where}: 'request_id' must be a non-empty string")
        sels: tuple[Selector, ...] = ()
    else:
        sels = _parse_selectors(selectors, where)
    return Strategy(selectors=sels, request_id=request_id, priority=priority,
                    execution_time=exec_ns,
                    weight=None if weight is None else float(weight), max_running=cap)


def _parse_selectors(obj: Any, where: str) -> tuple[Selector, ...]:
    if not isinstance(obj, list) or not obj:
        raise ValueError(f"{where}: 'selectors' must be a non-empty list of "
                         "{'key': ..., 'value': ...}")
    out: list[Selector] = []
    for j, s in enumerate(obj):
        at = f"{where}.selectors[{j}]"
        if not isinstance(s, dict) or set(s) != {"key", "value"}:
            raise ValueError(f"{at}: a selector is exactly {{'key': ..., 'value': ...}}")
        key, value = s["key"], s["value"]
        if not isinstance(key, str) or not key or len(key) > 256:
            raise ValueError(f"{at}: 'key' must be a non-empty string (at most 256 chars)")
        if not isinstance(value, str) or len(value) > 256:
            raise ValueError(f"{at}: 'value' must be a string (at most 256 chars)")
        if any(o.key == key for o in out):
            raise ValueError(f"{at}: key {key!r} is selected twice")
        out.append(Selector(key, value))
    return tuple(out)


# -- Redis storage ---------------------------------------------------------------------

def strategies_key(served_model_name: str) -> str:
    return f"splitserve:{served_model_name}:strategies"


def loads(raw: str | bytes | None) -> StrategySet:
    """The stored document (None: nothing stored, version 0). ValueError if corrupt."""
    if raw is None:
        return EMPTY
    try:
        return parse(json.loads(raw))
    except json.JSONDecodeError as e:
        raise ValueError(f"stored strategies are not JSON: {e}") from e


# KEYS[1]: the strategies key; ARGV[1]: the scheduling list as JSON. Returns the new
# version. Read, bump and write in one script, so concurrent stores get distinct versions.
_STORE = """
local cur = redis.call('GET', KEYS[1])
local v = 0
if cur then
  local ok, doc = pcall(cjson.decode, cur)
  if ok and type(doc) == 'table' and type(doc['version']) == 'number' then
    v = math.floor(doc['version'])
  end
end
v = v + 1
redis.call('SET', KEYS[1], '{"version": ' .. string.format('%d', v) ..
           ', "scheduling": ' .. ARGV[1] .. '}')
return v
"""


async def load_strategies(client: Any, served_model_name: str) -> StrategySet:
    """Reads the current set through a `redis.asyncio.Redis` client (the caller owns its
    timeouts). Version 0 if none is stored; ValueError if the stored one is corrupt."""
    return loads(await client.get(strategies_key(served_model_name)))


async def store_strategies(client: Any, served_model_name: str,
                           strategies: StrategySet) -> StrategySet:
    """Replaces the stored set (its version is ignored) and returns it with the new,
    atomically bumped version."""
    body = json.dumps(strategies.to_dict()["scheduling"], separators=(",", ":"))
    version = await client.eval(_STORE, 1, strategies_key(served_model_name), body)
    return StrategySet(int(version), strategies.strategies)
