"""RoutingProfile: which plugins route, with what weights (from YAML or a dict), and
the Router that runs them.

    scorers:                      # weighted sum of [0, 1] scores
      - {name: prefix_locality, weight: 2.0, tiers: {device: 1.0, host: 0.8}}
      - {name: queue, weight: 1.0}
      - {name: kv_usage, weight: 0.5}
    picker: power_of_two          # or max_score
    decider: {name: threshold, threshold: 256}
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import gateway.routing.locality  # noqa: F401  (registers prefix_locality)
import gateway.routing.plugins  # noqa: F401  (registers the built-in plugins)
from gateway.routing.base import (
    DECIDERS,
    FILTERS,
    PICKERS,
    SCORERS,
    Candidate,
    CandidateSet,
    RouteDecision,
    RouteRequest,
    Scorer,
    Scores,
    clamp01,
    predicted_cached,
)
from gateway.routing.plugins import DECODE_ROLES

log = logging.getLogger(__name__)


class NoCandidates(LookupError):
    """No ready worker can take the request."""


@dataclass(frozen=True, slots=True)
class ScorerSpec:
    """A scorer, its weight and its options (keyword arguments of its factory)."""

    name: str
    weight: float = 1.0
    options: tuple[tuple[str, Any], ...] = ()

    def __post_init__(self) -> None:
        if self.name not in SCORERS.names():
            raise ValueError(f"unknown scorer {self.name!r}; known: {SCORERS.names()}")
        if not self.weight >= 0:
            raise ValueError(f"scorer {self.name!r}: weight must be >= 0")
        self.create()  # bad options fail here, not at the first request

    def create(self) -> Scorer:
        try:
            return SCORERS.create(self.name, **dict(self.options))
        except TypeError as e:  # an option the scorer does not take
            raise ValueError(f"scorer {self.name!r}: {e}") from e

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "weight": self.weight, **dict(self.options)}


def _default_scorers() -> tuple[ScorerSpec, ...]:
    return (ScorerSpec("prefix_locality", 2.0), ScorerSpec("queue", 1.0),
            ScorerSpec("kv_usage", 0.5))


@dataclass(frozen=True, slots=True)
class RoutingProfile:
    scorers: tuple[ScorerSpec, ...] = field(default_factory=_default_scorers)
    picker: str = "power_of_two"
    decider: str = "threshold"
    decider_threshold: int = 256  # uncached prompt tokens above which P prefills
    # A decode pulls a prefix from the worker holding the longest one (peer fetch) when
    # that holds at least this many blocks more than the decode itself; 0: never.
    peer_fetch_min_blocks: int = 2
    seed: int | None = None  # for the pickers' randomness (tests)

    def __post_init__(self) -> None:
        if not self.scorers:
            raise ValueError("a routing profile needs at least one scorer")
        if sum(s.weight for s in self.scorers) <= 0:
            raise ValueError("scorer weights must not all be 0")
        if self.picker not in PICKERS.names():
            raise ValueError(f"unknown picker {self.picker!r}; known: {PICKERS.names()}")
        if self.decider not in DECIDERS.names():
            raise ValueError(f"unknown decider {self.decider!r}; known: {DECIDERS.names()}")
        if self.decider_threshold < 0:
            raise ValueError("decider threshold must be >= 0")
        if self.peer_fetch_min_blocks < 0:
            raise ValueError("peer_fetch min_blocks must be >= 0")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RoutingProfile:
        unknown = set(d) - {"scorers", "picker", "decider", "peer_fetch", "seed"}
        if unknown:
            raise ValueError(f"unknown routing keys: {sorted(unknown)}")
        kw: dict[str, Any] = {}
        if "scorers" in d:
            if not isinstance(d["scorers"], list):
                raise ValueError("scorers must be a list")
            specs = []
            for s in d["scorers"]:
                s = {"name": s} if isinstance(s, str) else s
                if not isinstance(s, dict) or "name" not in s:
                    raise ValueError(f"a scorer is a name or {{name, weight, options...}}, "
                                     f"got {s!r}")
                opts = tuple(sorted((str(k), v) for k, v in s.items()
                                    if k not in ("name", "weight")))
                specs.append(ScorerSpec(str(s["name"]), _number(s.get("weight", 1.0)), opts))
            kw["scorers"] = tuple(specs)
        if "picker" in d:
            kw["picker"] = str(d["picker"])
        dec = d.get("decider")
        if isinstance(dec, str):
            kw["decider"] = dec
        elif isinstance(dec, dict):
            kw["decider"] = str(dec.get("name", "threshold"))
            kw["decider_threshold"] = int(dec.get("threshold", 256))
        elif dec is not None:
            raise ValueError(f"decider must be a name or a mapping, got {dec!r}")
        pf = d.get("peer_fetch")
        if isinstance(pf, dict) and set(pf) <= {"min_blocks"}:
            kw["peer_fetch_min_blocks"] = int(pf.get("min_blocks", 2))
        elif pf is not None:
            raise ValueError(f"peer_fetch is a mapping {{min_blocks: N}}, got {pf!r}")
        if d.get("seed") is not None:
            kw["seed"] = int(d["seed"])
        return cls(**kw)

    def to_dict(self) -> dict[str, Any]:
        """The profile as `from_dict` reads it (round-trips)."""
        return {"scorers": [s.to_dict() for s in self.scorers], "picker": self.picker,
                "decider": {"name": self.decider, "threshold": self.decider_threshold},
                "peer_fetch": {"min_blocks": self.peer_fetch_min_blocks}, "seed": self.seed}

    @classmethod
    def from_yaml(cls, path: str) -> RoutingProfile:
        import yaml

        with open(path) as f:
            data = yaml.safe_load(f) or {}
        if not isinstance(data, dict):
            raise ValueError(f"{path}: a routing profile is a mapping")
        return cls.from_dict(data.get("routing", data))


def _number(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"a scorer weight must be a number, got {v!r}")
    return float(v)


class Router:
    """Runs a profile's plugins. Stateless apart from the pickers' random streams."""

    def __init__(self, profile: RoutingProfile) -> None:
        self.profile = profile
        self._decode_filter = FILTERS.create("ready_role", roles=DECODE_ROLES)
        self._prefill_filter = FILTERS.create("ready_role", roles=("prefill",))
        self._scorers = [(s.create(), s.weight) for s in profile.scorers]
        self._weights = sum(w for _, w in self._scorers)
        self._picker = PICKERS.create(profile.picker, seed=profile.seed)
        self._decider = DECIDERS.create(profile.decider, threshold=profile.decider_threshold)

    def _weighted(self, req: RouteRequest, cands: CandidateSet) -> np.ndarray:
        total = np.zeros(len(cands))
        part = np.empty(len(cands))
        for scorer, weight in self._scorers:
            # a plugin may return a list: as an array (no copy when it is one)
            clamp01(np.asarray(scorer.score(req, cands), np.float64), out=part)
            part *= weight
            total += part
        total /= self._weights
        return total

    def route(self, req: RouteRequest,
              workers: CandidateSet | Sequence[Candidate]) -> RouteDecision:
        """Raises NoCandidates when no ready decode/colocated worker exists."""
        workers = CandidateSet.of(workers)
        decodes = self._decode_filter.filter(req, workers)
        if not len(decodes):
            raise NoCandidates("no ready decode or colocated worker")
        scores = self._weighted(req, decodes)
        decode = self._picker.pick(decodes, scores)
        peer, peer_blocks = self._kv_peer(req, decode, workers)
        prefill = None
        if decode.role == "decode":
            prefills = self._prefill_filter.filter(req, workers)
            # The decider judges what is left after the pull.
            if self._decider.decide(req, decode, prefills,
                                    predicted_cached(req, decode, peer_blocks)):
                prefill = self._picker.pick(prefills, self._weighted(req, prefills))
        if peer is not None and prefill is not None and peer.worker_id == prefill.worker_id:
            peer, peer_blocks = None, 0  # the prefill worker sends those blocks anyway
        return RouteDecision(decode, prefill, Scores(decodes.ids, scores), peer, peer_blocks)

    def _kv_peer(self, req: RouteRequest, decode: Candidate,
                 workers: CandidateSet) -> tuple[Candidate | None, int]:
        """The ready worker with a transport (decode or prefill role) whose caches hold
        the longest leading run of the prompt's blocks, if it beats the decode's own by
        `peer_fetch_min_blocks` (the first such in the candidates' order)."""
        need = self.profile.peer_fetch_min_blocks
        locality = req.locality
        if decode.role != "decode" or need <= 0 or not locality:
            return None, 0
        own = len(locality.get(decode.worker_id, ()))
        able = workers.ready_in(("decode", "prefill"))
        if not len(able):
            return None, 0
        rows = able.rows_of(locality.keys())
        found = rows >= 0
        held = np.zeros(len(able), np.int64)  # leading blocks per row
        held[rows[found]] = np.fromiter(map(len, locality.values()), np.int64,
                                        len(locality))[found]
        if (me := able.pos.get(decode.worker_id)) is not None:
            held[me] = 0
        best = int(held.argmax())  # the first of the longest
        if held[best] - own < need:  # need >= 1: beating the decode own run
            return None, 0
        return able[best], int(held[best])
