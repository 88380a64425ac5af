"""The Redis block index: which node holds which KV block, in which tier (DESIGN.md,
"Tiered offload cache and the Redis index"). Imports no torch: the gateway uses it.

Keys, per served model:

    kvidx:<model>:<blockhash hex>   hash {"<node>@<tier>": "<epoch>"}, TTL refreshed on store
    kvidx:<model>:@epochs           hash {"<node>": "<epoch>"}, each node's current epoch

An entry counts only while its epoch equals its node's registered epoch. A node takes a
new epoch when it starts (and when its published state may have diverged, e.g. events
were dropped while Redis was down): it writes its full set of blocks under the new
epoch, then registers it, which hides every older entry at once. Readers delete entries
older than their node's epoch lazily. Entries newer than the registered epoch belong to
a snapshot still being written and are skipped, not deleted.

Redis is advisory: every call has a client-side deadline in milliseconds and goes
through a circuit breaker; while it is open, `lookup` answers None ("no data") at once
and writers get IndexUnavailable without touching the network.

Ownership: a RedisBlockIndex owns its Redis client (`close()`), its breaker and the
background tasks that clean stale entries.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from engine.block_hash import BlockHash
from kvtransfer.circuit import CircuitBreaker
from kvtransfer.errors import KVTransferError

log = logging.getLogger(__name__)

KEY_PREFIX = "kvidx"
TIERS = ("device", "host", "disk")  # a node's own tiers, best first
_TIER_RE = re.compile(r"^[a-z][a-z0-9_]*$")

T = TypeVar("T")
TierEntry = tuple[BlockHash, str]  # (block hash, tier)


class IndexUnavailable(KVTransferError):
    """Redis did not answer in time, failed, or the circuit breaker is open."""


class CacheIndex(Protocol):
    """What a node's caches program against (decode/kv_events.KVEventPublisher)."""

    def publish(self, stored: Sequence[TierEntry], removed: Sequence[TierEntry]) -> None:
        """Queues this node's stores and evictions (non-blocking; sent in batches)."""

    async def lookup(self, hashes: Sequence[BlockHash]) -> IndexLookup | None:
        """Who holds the leading blocks of `hashes`; None when the index has no data."""


def tier_rank(tier: str) -> int:
    """Lower is better: device < host < disk < any other tier."""
    return TIERS.index(tier) if tier in TIERS else len(TIERS)


def check_tier(tier: str) -> str:
    if not _TIER_RE.match(tier):
        raise ValueError(f"tier must match {_TIER_RE.pattern}, got {tier!r}")
    return tier


def new_epoch(after: int = 0) -> int:
    """A fresh epoch: microseconds since the epoch (exact in Lua's doubles), > `after`."""
    return max(time.time_ns() // 1000, after + 1)


@dataclass(frozen=True, slots=True)
class IndexConfig:
    timeout_ms: int = 50  # client-side deadline of one index call
    ttl_s: float = 600.0  # a block key expires this long after its last store
    breaker_failures: int = 3  # consecutive failures that open the breaker
    breaker_cooldown_s: float = 2.0  # open this long before one probe is let through
    first_chunk: int = 16  # lookup pipelines 16, 64, 256, ... blocks per round trip
    max_lookup_blocks: int = 8192
    max_cleanup_fields: int = 256  # stale entries deleted per cleanup task

    def __post_init__(self) -> None:
        if self.timeout_ms <= 0 or self.ttl_s <= 0 or self.breaker_cooldown_s <= 0:
            raise ValueError("timeout_ms, ttl_s and breaker_cooldown_s must be positive")
        if self.breaker_failures < 1 or self.first_chunk < 1 or self.max_lookup_blocks < 1:
            raise ValueError("breaker_failures, first_chunk, max_lookup_blocks must be >= 1")
        if self.max_cleanup_fields < 0:
            raise ValueError("max_cleanup_fields must be >= 0")


@dataclass(frozen=True, slots=True)
class IndexLookup:
    """`num_blocks`: leading blocks of the query that some (allowed) node holds.
    `nodes`: node -> the best tier of each leading block it holds itself, in order
    (len <= num_blocks; the blocks after its run may come from peers)."""

    num_blocks: int
    nodes: dict[str, tuple[str, ...]]

    def matched(self, node: str) -> int:
        return len(self.nodes.get(node, ()))


# KEYS[1] epochs hash, KEYS[2..] block keys. ARGV: node, epoch, ttl_ms, check, then one
# op per block key: "+<tier>" store / "-<tier>" remove. Ops run in order (a block may be
# evicted and stored again in one batch). With check=1 nothing changes unless the node's
# registered epoch is ours (returns 0: the node must resync). A hash whose last field is
# removed is deleted by Redis itself, so no explicit DEL is needed.
_APPLY = """
local node, epoch, ttl = ARGV[1], ARGV[2], tonumber(ARGV[3])
if ARGV[4] == '1' and redis.call('HGET', KEYS[1], node) ~= epoch then return 0 end
for i = 2, #KEYS do
  local op = ARGV[3 + i]
  local field = node .. '@' .. string.sub(op, 2)
  if string.sub(op, 1, 1) == '+' then
    redis.call('HSET', KEYS[i], field, epoch)
    redis.call('PEXPIRE', KEYS[i], ttl)
  elseif redis.call('HGET', KEYS[i], field) == epoch then
    redis.call('HDEL', KEYS[i], field)
  end
end
return 1
"""

# Registers ARGV[2] as node ARGV[1]'s epoch unless a newer one is registered.
_REGISTER = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur and tonumber(cur) > tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""

# Deletes field ARGV[2i-1] of KEYS[i] if it still holds epoch ARGV[2i] (stale cleanup),
# and with KEYS[1] = epochs hash, ARGV = node, epoch: a node's retirement.
_DEL_IF = """
for i = 1, #KEYS do
  if redis.call('HGET', KEYS[i], ARGV[2 * i - 1]) == ARGV[2 * i] then
    redis.call('HDEL', KEYS[i], ARGV[2 * i - 1])
  end
end
return 1
"""


class RedisBlockIndex:
    """Reads and writes the index of one model. All methods run on one event loop."""

    def __init__(self, url: str, model: str, config: IndexConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not model or "@" in model:
            raise ValueError(f"bad model name for the index: {model!r}")
        self.config = config or IndexConfig()
        self.model = model
        timeout = self.config.timeout_ms / 1000.0
        # No client retries: one failed try is one failure for the breaker.
        self._redis = aioredis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout,
            decode_responses=True, retry=Retry(NoBackoff(), 0))
        self.breaker = CircuitBreaker(self.config.breaker_failures,
                                      self.config.breaker_cooldown_s, clock)
        self._apply = self._redis.register_script(_APPLY)
        self._register = self._redis.register_script(_REGISTER)
        self._del_if = self._redis.register_script(_DEL_IF)
        self._cleanup: asyncio.Task[None] | None = None
        self.errors = 0  # failed calls (timeouts, connection errors), breaker refusals not

    # -- keys ----------------------------------------------------------------------------
    def block_key(self, block_hash: BlockHash) -> str:
        return f"{KEY_PREFIX}:{self.model}:{block_hash.hex()}"

    @property
    def epochs_key(self) -> str:
        return f"{KEY_PREFIX}:{self.model}:@epochs"

    # -- calls through the breaker ---------------------------------------------------------
    async def _call(self, what: str, fn: Callable[[], Awaitable[T]]) -> T:
        if not self.breaker.allow():
            raise IndexUnavailable(f"redis index: circuit open ({what} skipped)")
        try:
            result = await asyncio.wait_for(fn(), self.config.timeout_ms / 1000.0)
        except (OSError, asyncio.TimeoutError, aioredis.RedisError) as e:
            self.errors += 1
            opened = self.breaker.record_failure()
            if opened:
                log.warning("event=index_breaker_open model=%s cause=%r", self.model, e)
            raise IndexUnavailable(f"redis index {what} failed: {e!r}") from e
        if self.breaker.record_success():
            log.info("event=index_breaker_closed model=%s", self.model)
        return result

    # -- writers -----------------------------------------------------------------------
    async def apply(self, node: str, epoch: int, stored: Sequence[TierEntry] = (),
                    removed: Sequence[TierEntry] = (), *, check: bool = True,
                    ordered: Sequence[tuple[bool, BlockHash, str]] | None = None) -> bool:
        """Applies one node's stores and removals atomically (one Lua call). `ordered`
        (True = store) replaces stored/removed when order matters. Returns False when
        `check` is set and `epoch` is not the node's registered epoch (nothing changed:
        resync). Raises IndexUnavailable."""
        ops = list(ordered) if ordered is not None else (
            [(True, h, t) for h, t in stored] + [(False, h, t) for h, t in removed])
        if not ops:
            return True
        keys = [self.epochs_key] + [self.block_key(h) for _, h, _ in ops]
        args: list[Any] = [node, str(epoch), int(self.config.ttl_s * 1000), int(check)]
        args += [("+" if store else "-") + check_tier(t) for store, _, t in ops]
        res = await self._call("apply", lambda: self._apply(keys=keys, args=args))
        return bool(res)

    async def register(self, node: str, epoch: int) -> bool:
        """Makes `epoch` the node's current one (its entries visible, older ones stale).
        False if a newer epoch is registered. Raises IndexUnavailable."""
        res = await self._call("register", lambda: self._register(
            keys=[self.epochs_key], args=[node, str(epoch)]))
        return bool(res)

    async def registered_epoch(self, node: str) -> int | None:
        """The node's registered epoch, None if it has none. Raises IndexUnavailable."""
        async def get() -> bytes | str | None:
            return await self._redis.hget(self.epochs_key, node)  # type: ignore[misc]

        value = await self._call("epoch", get)
        return int(value) if value is not None else None

    async def retire(self, node: str, epoch: int) -> None:
        """A clean stop: the node's entries stop counting now (and expire by TTL)."""
        await self._call("retire", lambda: self._del_if(
            keys=[self.epochs_key], args=[node, str(epoch)]))

    # -- reader ------------------------------------------------------------------------
    async def lookup(self, hashes: Sequence[BlockHash],
                     nodes: set[str] | frozenset[str] | None = None) -> IndexLookup | None:
        """The leading run of `hashes` held by any node (of `nodes`, when given), and each
        node's own run with its tiers. Pipelined in growing chunks, stopping at the first
        block nobody holds. None when Redis is unavailable (advisory: "no data")."""
        hashes = list(hashes)[:self.config.max_lookup_blocks]
        try:
            return await self._call("lookup", lambda: self._walk(hashes, nodes))
        except IndexUnavailable as e:
            log.debug("index lookup: %s", e)
            return None

    async def _walk(self, hashes: list[BlockHash],
                    nodes: set[str] | frozenset[str] | None) -> IndexLookup:
        runs: dict[str, list[str]] = {}
        stale: list[tuple[str, str, str]] = []
        epochs: dict[str, str] = {}
        i, chunk = 0, self.config.first_chunk
        while i < len(hashes):
            pipe = self._redis.pipeline(transaction=False)
            if i == 0:
                pipe.hgetall(self.epochs_key)
            keys = [self.block_key(h) for h in hashes[i:i + chunk]]
            for k in keys:
                pipe.hgetall(k)
            rows = await pipe.execute()
            if i == 0:
                epochs = rows.pop(0)
            for key, row in zip(keys, rows, strict=True):
                if not _extend(runs, i, key, row, epochs, nodes, stale):
                    self._clean_later(stale)
                    return _result(runs, i)
                i += 1
            chunk *= 4
        self._clean_later(stale)
        return _result(runs, i)

    async def holders(self, hashes: Sequence[BlockHash]
                      ) -> dict[BlockHash, frozenset[str]] | None:
        """The nodes holding each of `hashes` (any tier; only entries of a node's current
        epoch count), one pipelined round trip; a block nobody holds maps to an empty set.
        Unlike `lookup` it does not stop at a missing block (for sole-copy sparing, which
        asks about arbitrary blocks). None when Redis is unavailable."""
        hashes = list(hashes)[:self.config.max_lookup_blocks]
        if not hashes:
            return {}

        async def fetch() -> list[dict[str, str]]:
            pipe = self._redis.pipeline(transaction=False)
            pipe.hgetall(self.epochs_key)
            for h in hashes:
                pipe.hgetall(self.block_key(h))
            return list(await pipe.execute())

        try:
            rows = await self._call("holders", fetch)
        except IndexUnavailable as e:
            log.debug("index holders: %s", e)
            return None
        epochs = rows[0]
        return {h: _current_nodes(row, epochs) for h, row in zip(hashes, rows[1:], strict=True)}

    def _clean_later(self, stale: list[tuple[str, str, str]]) -> None:
        """Deletes entries older than their node's epoch in the background (one task at a
        time, bounded; a failure only leaves them for the next reader or their TTL)."""
        if not stale or self.config.max_cleanup_fields == 0 or (
                self._cleanup is not None and not self._cleanup.done()):
            return
        stale = stale[:self.config.max_cleanup_fields]
        keys = [k for k, _, _ in stale]
        args = [x for _, f, e in stale for x in (f, e)]

        async def run() -> None:
            with contextlib.suppress(IndexUnavailable):
                await self._call("cleanup", lambda: self._del_if(keys=keys, args=args))

        self._cleanup = asyncio.create_task(run())

    async def close(self) -> None:
        if self._cleanup is not None:
            self._cleanup.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._cleanup
        with contextlib.suppress(Exception):
            await self._redis.aclose()


def _extend(runs: dict[str, list[str]], i: int, key: str, row: dict[str, str],
            epochs: dict[str, str], nodes: set[str] | frozenset[str] | None,
            stale: list[tuple[str, str, str]]) -> bool:
    """Adds block `i` (its hash row) to the runs of the nodes that hold it and whose run
    reaches block i - 1. False when no allowed node holds it (the chain ends)."""
    best: dict[str, str] = {}
    for field, epoch in row.items():
        node, _, tier = field.rpartition("@")
        if not node or (nodes is not None and node not in nodes):
            continue
        current = epochs.get(node)
        if current is None or epoch != current:
            if current is not None and _older(epoch, current):
                stale.append((key, field, epoch))
            continue
        if node not in best or tier_rank(tier) < tier_rank(best[node]):
            best[node] = tier
    if not best:
        return False
    for node, tier in best.items():
        run = runs.setdefault(node, [])
        if len(run) == i:
            run.append(tier)
    return True


def _current_nodes(row: dict[str, str], epochs: dict[str, str]) -> frozenset[str]:
    """Nodes with an entry of their registered epoch in one block's hash row."""
    nodes = set()
    for field, epoch in row.items():
        node = field.rpartition("@")[0]
        if node and epochs.get(node) == epoch:
            nodes.add(node)
    return frozenset(nodes)


def _older(epoch: str, current: str) -> bool:
    try:
        return int(epoch) < int(current)
    except ValueError:
        return True  # garbage: clean it


def _result(runs: dict[str, list[str]], num_blocks: int) -> IndexLookup:
    return IndexLookup(num_blocks, {n: tuple(r) for n, r in runs.items() if r})
