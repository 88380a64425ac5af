"""The routing plugin interfaces and their typed registries.

A route is: filters drop candidates that cannot serve; every scorer gives each
remaining candidate a score in [0, 1]; the weighted sum goes to the picker, which
chooses the decode worker; then the PD decider chooses whether a prefill worker
prefills the prompt remotely. A scorer with no data scores 0 and logs: routing
degrades, it never fails. Plugins register by name (`SCORERS.register("queue")`) and
are chosen by a RoutingProfile (profile.py).

The plugins see the candidates as columns (CandidateSet: one numpy array per load
figure, a row per worker) and score every worker at once: at hundreds of workers a
route's per-worker Python would cost more than everything else the gateway does for a
request (the simulator, sim/, routes a million requests over 512 workers this way).
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import numpy as np

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


ROLE_CODES = {"prefill": 0, "decode": 1, "colocated": 2}
_KEEP_ROWS = 32  # CandidateSet.rows_of keeps its answers for this many workers or more,
_KEPT_ROWS = 16  # the last this many


class CandidateSet:
    """The candidates as columns: each load figure the plugins read is a numpy array
    with a row per worker; `ids`, `roles` and `addresses` are lists in the same order,
    and `cs[i]` is row i as a Candidate (made on first use: a route picks one or two
    rows of hundreds). Built once per registry snapshot; immutable, apart from
    `set_inflight` and `set_load` by the snapshot's owner."""

    COLUMNS = ("ready", "num_waiting", "num_running", "kv_usage", "num_free_blocks",
               "num_blocks", "inflight")
    _DTYPES = (bool, np.int64, np.int64, np.float64, np.int64, np.int64, np.int64)

    __slots__ = ("ids", "addresses", "roles", "role_code", *COLUMNS, "_items", "_pos",
                 "_selected", "_subsets", "_rows")
    ids: list[str]
    addresses: list[str]
    roles: list[str]
    role_code: np.ndarray
    ready: np.ndarray
    num_waiting: np.ndarray
    num_running: np.ndarray
    kv_usage: np.ndarray
    num_free_blocks: np.ndarray
    num_blocks: np.ndarray
    inflight: np.ndarray

    def __init__(self, items: Sequence[Candidate] = ()) -> None:
        items = list(items)
        self._set(*([getattr(c, name) for c in items] for name in (
            "worker_id", "address", "role", *self.COLUMNS)))
        self._items: list[Candidate | None] = list(items)

    @classmethod
    def from_columns(cls, ids: list[str], addresses: list[str], roles: list[str],
                     *columns: Sequence[Any] | np.ndarray) -> CandidateSet:
        """A set from its columns, in COLUMNS' order (no Candidate is made)."""
        if len(columns) != len(cls.COLUMNS):
            raise ValueError(f"need the columns {cls.COLUMNS}")
        out = cls.__new__(cls)
        out._set(ids, addresses, roles, *columns)
        out._items = [None] * len(ids)
        return out

    def _set(self, ids: list[str], addresses: list[str], roles: list[str],
             *columns: Sequence[Any] | np.ndarray) -> None:
        self.ids, self.addresses, self.roles = ids, addresses, roles
        self.role_code = np.array([ROLE_CODES.get(r, -1) for r in roles], np.int8)
        for name, dtype, col in zip(self.COLUMNS, self._DTYPES, columns, strict=True):
            setattr(self, name, np.asarray(col, dtype))
        self._pos: dict[str, int] | None = None
        self._selected: dict[tuple[str, ...], CandidateSet | None] = {}
        self._subsets = False  # some of `_selected` is a subset (not None)
        self._rows: dict[tuple[str, ...], np.ndarray] = {}  # rows_of's last large answers

    @classmethod
    def of(cls, candidates: CandidateSet | Sequence[Candidate]) -> CandidateSet:
        return candidates if isinstance(candidates, CandidateSet) else cls(candidates)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, row: int) -> Candidate:
        c = self._items[row]
        if c is None:
            c = self._items[row] = Candidate(
                self.ids[row], self.addresses[row], self.roles[row],
                *(getattr(self, name).item(row) for name in self.COLUMNS))
        return c

    def __iter__(self) -> Iterator[Candidate]:
        return (self[i] for i in range(len(self.ids)))

    @property
    def pos(self) -> dict[str, int]:
        """worker id -> row."""
        if self._pos is None:
            self._pos = {w: i for i, w in enumerate(self.ids)}
        return self._pos

    def rows_of(self, worker_ids: Iterable[str]) -> np.ndarray:
        """The row of each of `worker_ids` (-1: not a candidate), at C speed; read-only.
        The answers for long lists are kept (the rows never change): the holders of a
        popular prefix are the same hundreds of workers route after route, and a tuple's
        hash and compare cost a fraction of a row lookup per worker."""
        ids = tuple(worker_ids)
        got = self._rows.get(ids) if len(ids) >= _KEEP_ROWS else None
        if got is None:
            got = np.fromiter(map(self.pos.get, ids, itertools.repeat(-1)), np.int64,
                              len(ids))
            got.flags.writeable = False  # shared with later calls
            if len(ids) >= _KEEP_ROWS:
                if len(self._rows) >= _KEPT_ROWS:
                    del self._rows[next(iter(self._rows))]  # the oldest
                self._rows[ids] = got
        return got

    def ready_in(self, roles: tuple[str, ...]) -> CandidateSet:
        """The ready candidates whose role is one of `roles` (this set itself when all
        are); a subset is kept until the set changes."""
        if roles in self._selected:
            got = self._selected[roles]
        else:
            keep = self.ready & np.isin(self.role_code, [ROLE_CODES.get(r, -2) for r in roles])
            # None for the set itself: a reference to it would make a cycle, garbage only
            # the cyclic collector frees (the simulator runs with it off)
            got = self._selected[roles] = None if keep.all() \
                else self.take(np.flatnonzero(keep).tolist())
            self._subsets = self._subsets or got is not None
        return self if got is None else got

    def take(self, rows: Sequence[int]) -> CandidateSet:
        """The rows `rows` as a new set."""
        idx = np.asarray(rows, np.int64)
        out = CandidateSet.from_columns(
            [self.ids[i] for i in rows], [self.addresses[i] for i in rows],
            [self.roles[i] for i in rows], *(getattr(self, name)[idx] for name in self.COLUMNS))
        out._items = [self._items[i] for i in rows]
        return out

    def set_inflight(self, worker_id: str, n: int) -> None:
        """The owner's update of one worker's in-flight count between snapshots."""
        i = self.pos.get(worker_id)
        if i is not None:
            self.inflight[i] = n
            self._changed((i,))

    def set_load(self, rows: Sequence[int] | np.ndarray, num_waiting: Sequence[int] | np.ndarray,
                 num_running: Sequence[int] | np.ndarray, kv_usage: Sequence[float] | np.ndarray,
                 num_free_blocks: Sequence[int] | np.ndarray) -> None:
        """The owner's update of some workers' load reports between snapshots: row
        `rows[i]` gets the i-th of each figure (the simulator's registry, whose workers
        report on their own schedules)."""
        idx = np.asarray(rows, np.int64)
        self.num_waiting[idx] = num_waiting
        self.num_running[idx] = num_running
        self.kv_usage[idx] = kv_usage
        self.num_free_blocks[idx] = num_free_blocks
        self._changed(rows)

    def _changed(self, rows: Iterable[int]) -> None:
        items = self._items
        for row in rows:
            items[row] = None
        # a subset holds its own copy of the columns: made again on next use
        if self._subsets:
            self._selected = {k: v for k, v in self._selected.items() if v is None}
            self._subsets = False


@dataclass(frozen=True, slots=True)
class RouteRequest:
    """What routing may look at. `block_hashes` are the prompt's full-block hashes
    (engine.block_hash). Filled from the Redis block index (gateway/locality.py), empty
    without it: `locality` maps worker id -> the tier of each leading block it holds;
    `indexed_blocks` the leading blocks some node holds (a peer could serve them);
    `locality_trust` worker id -> [0, 1], how far the index proved right for it (a
    worker not in it: 1)."""

    request_id: str
    prompt_token_ids: Sequence[int]
    block_hashes: Sequence[BlockHash] = ()
    block_size: int = 16
    locality: dict[str, tuple[str, ...]] = field(default_factory=dict)
    indexed_blocks: int = 0
    locality_trust: dict[str, float] = field(default_factory=dict)

    @property
    def max_cached_blocks(self) -> int:
        """Leading blocks an engine can take from its cache: the last prompt token is
        always computed (its logits are sampled)."""
        return (len(self.prompt_token_ids) - 1) // self.block_size

    def cached_tokens(self, worker_id: str) -> int:
        """Prompt tokens `worker_id` is predicted to hold (what it will not recompute)."""
        held = len(self.locality.get(worker_id, ()))
        return min(held, self.max_cached_blocks) * self.block_size


class Scores(Mapping[str, float]):
    """worker id -> weighted score, as a mapping built on first use (for logs and
    metrics: a route does not pay for a dict of every worker)."""

    __slots__ = ("_ids", "_scores", "_dict")

    def __init__(self, ids: Sequence[str] = (), scores: Sequence[float] | np.ndarray = ()
                 ) -> None:
        self._ids, self._scores = ids, scores
        self._dict: dict[str, float] | None = None

    def _get(self) -> dict[str, float]:
        if self._dict is None:
            self._dict = dict(zip(self._ids, np.asarray(self._scores, float).tolist(),
                                  strict=True))
        return self._dict

    def __getitem__(self, worker_id: str) -> float:
        return self._get()[worker_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._get())

    def __len__(self) -> int:
        return len(self._ids)


@dataclass(frozen=True, slots=True)
class RouteDecision:
    decode: Candidate
    prefill: Candidate | None  # None: the decode prefills locally
    scores: Mapping[str, float]  # worker id -> weighted score (for logs and metrics)
    kv_peer: Candidate | None = None  # holds a longer prefix: the decode pulls it first
    kv_peer_blocks: int = 0  # leading prompt blocks the index says kv_peer holds

    def predicted_cached(self, req: RouteRequest) -> int:
        """Prompt tokens the decode should not compute: its own hit or the pulled run."""
        return predicted_cached(req, self.decode, self.kv_peer_blocks)


def predicted_cached(req: RouteRequest, decode: Candidate, kv_peer_blocks: int) -> int:
    own = req.cached_tokens(decode.worker_id)
    return max(own, min(kv_peer_blocks, req.max_cached_blocks) * req.block_size)


def clamp01(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """Scores clamped to [0, 1], NaN -> 0 (as min(1, max(0, x)) would: fmax takes the
    number of a NaN and a number); into `out` when given."""
    return np.minimum(np.fmax(x, 0.0, out=out), 1.0, out=out)


class Filter(Protocol):
    def filter(self, req: RouteRequest, candidates: CandidateSet) -> CandidateSet: ...


class Scorer(Protocol):
    def score(self, req: RouteRequest, candidates: CandidateSet) -> np.ndarray:
        """One score in [0, 1] per candidate row (float64), higher is better."""
        ...


class Picker(Protocol):
    def pick(self, candidates: CandidateSet, scores: np.ndarray) -> Candidate: ...


class PDDecider(Protocol):
    def decide(self, req: RouteRequest, decode: Candidate, prefill_candidates: CandidateSet,
               cached_tokens: int) -> bool:
        """True: prefill remotely (only ever when prefill_candidates is non-empty).
        `cached_tokens`: prompt tokens the decode will not compute (its own prefix hit
        or the run it pulls from a peer)."""
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
