"""The routing plugin interfaces and their typed registries.

A route is: filters drop candidates that cannot serve; every scorer gives each
remaining candidate a score in [0, 1]; the weighted sum goes to the picker, which
chooses the decode worker; then the PD decider chooses whether a prefill worker
prefills the prompt remotely. A scorer with no data scores 0 and logs: routing
degrades, it never fails. Plugins register by name (`SCORERS.register("queue")`) and
are chosen by a RoutingProfile (profile.py).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from engine.block_hash import BlockHash


@dataclass(frozen=True, slots=True)
class Candidate:
    """A worker as the router sees it (a snapshot from the registry)."""

    worker_id: str
    address: str
    role: str  # prefill | decode | colocated
    ready: bool = True
    num_waiting: int = 0
    num_running: int = 0
    kv_usage: float = 0.0
    num_free_blocks: int = 0
    num_blocks: int = 0
    inflight: int = 0  # this gateway's requests on the worker now (fresher than reports)


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What routing may look at. `block_hashes` are the prompt's full-block hashes
    (engine.block_hash). Filled from the Redis block index (gateway/locality.py), empty
    without it: `cached_tokens` maps worker id -> prompt tokens it is predicted to hold
    (what it will not recompute); `locality` worker id -> the tier of each leading block
    it holds; `indexed_blocks` the leading blocks some node holds (a peer could serve
    them); `locality_trust` worker id -> [0, 1], how far the index proved right for it."""

    request_id: str
    prompt_token_ids: Sequence[int]
    block_hashes: Sequence[BlockHash] = ()
    block_size: int = 16
    cached_tokens: dict[str, int] = field(default_factory=dict)
    locality: dict[str, tuple[str, ...]] = field(default_factory=dict)
    indexed_blocks: int = 0
    locality_trust: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    decode: Candidate
    prefill: Candidate | None  # None: the decode prefills locally
    scores: dict[str, float]  # worker id -> weighted score (for logs and metrics)
    kv_peer: Candidate | None = None  # holds a longer prefix: the decode pulls it first
    kv_peer_blocks: int = 0  # leading prompt blocks the index says kv_peer holds

    def predicted_cached(self, req: RouteRequest) -> int:
        """Prompt tokens the decode should not compute: its own hit or the pulled run."""
        own = req.cached_tokens.get(self.decode.worker_id, 0)
        cap = (len(req.prompt_token_ids) - 1) // req.block_size
        return max(own, min(self.kv_peer_blocks, cap) * req.block_size)


class Filter(Protocol):
    def filter(self, req: RouteRequest, candidates: list[Candidate]) -> list[Candidate]: ...


class Scorer(Protocol):
    def score(self, req: RouteRequest, candidates: list[Candidate]) -> list[float]:
        """One score in [0, 1] per candidate, in order; higher is better."""
        ...


class Picker(Protocol):
    def pick(self, candidates: list[Candidate], scores: list[float]) -> Candidate: ...


class PDDecider(Protocol):
    def decide(self, req: RouteRequest, decode: Candidate,
               prefill_candidates: list[Candidate]) -> bool:
        """True: prefill remotely (only ever when prefill_candidates is non-empty)."""
        ...


T = TypeVar("T")


class PluginRegistry(Generic[T]):
    """Name -> factory. Filled at import time by the plugin modules; read-only after."""

    def __init__(self, kind: str) -> None:
        self.kind = kind
        self._factories: dict[str, Callable[..., T]] = {}

    def register(self, name: str) -> Callable[[Callable[..., T]], Callable[..., T]]:
        def deco(factory: Callable[..., T]) -> Callable[..., T]:
            if name in self._factories:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._factories[name] = factory
            return factory
        return deco

    def create(self, name: str, **kwargs: Any) -> T:
        if name not in self._factories:
            raise ValueError(f"unknown {self.kind} {name!r}; known: {sorted(self._factories)}")
        return self._factories[name](**kwargs)

    def names(self) -> list[str]:
        return sorted(self._factories)


FILTERS: PluginRegistry[Filter] = PluginRegistry("filter")
SCORERS: PluginRegistry[Scorer] = PluginRegistry("scorer")
PICKERS: PluginRegistry[Picker] = PluginRegistry("picker")
DECIDERS: PluginRegistry[PDDecider] = PluginRegistry("decider")


def make_rng(seed: int | None) -> random.Random:
    return random.Random(seed)
