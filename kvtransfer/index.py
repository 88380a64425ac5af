"""The Redis block index: which node holds which KV block, in which tier (docs/architecture.md,
"Tiers and the index"). Imports no torch: the gateway uses it.

Keys, per served model:

    kvidx:<model>:<blockhash hex>   hash {"<node>@<tier>": "<epoch>"}, TTL refreshed on store
    kvidx:<model>:@epochs           hash {"<node>": "<epoch>"}, each node's current epoch

An entry counts only while its epoch equals its node's registered epoch. A node takes a
new epoch when it starts (and when its published state may have diverged, e.g. events
were dropped while Redis was down): it writes its full set of blocks under the new
epoch, then registers it, which hides every older entry at once. Readers delete entries
older than their node's epoch lazily. Entries newer than the registered epoch belong to
a snapshot still being written and are skipped, not deleted.

Readers walk on the server: one Lua script (kvtransfer/index_walk.py, EVALSHA) reads a
stretch of the prompt's block keys in order and returns only the runs, not the holder
fields (the client-side walk it replaced is the reference: kvtransfer/index_pywalk.py).
The index is one Redis (no Redis Cluster): a script may touch any key; every key it
touches is still passed in KEYS.

Redis is advisory: every call has a client-side deadline in milliseconds and goes
through a circuit breaker; while it is open, `lookup` answers None ("no data") at once
and writers get IndexUnavailable without touching the network.

Ownership: a RedisBlockIndex owns its Redis client (`close()`), its breaker and the
background tasks that clean stale entries.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
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
from kvtransfer.index_walk import WALK, run_tiers

log = logging.getLogger(__name__)

KEY_PREFIX = "kvidx"
TIERS = ("device", "host", "disk")  # a node's own tiers, best first
_TIER_RE = re.compile(r"^[a-z][a-z0-9_]*$")

T = TypeVar("T")
TierEntry = tuple[BlockHash, str]  # (block hash, tier)
StaleEntry = tuple[str, str, str]  # (block key, field, epoch) older than the node's epoch


class IndexUnavailable(KVTransferError):
    """Redis did not answer in time, failed, or the circuit breaker is open."""


class CacheIndex(Protocol):
    """What a node's caches program against (worker/kv_events.py KVEventPublisher)."""

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
    walk_blocks: int = 64  # blocks one server-side walk reads; a longer run takes more calls
    max_lookup_blocks: int = 8192
    max_cleanup_fields: int = 256  # stale entries deleted per cleanup task

    def __post_init__(self) -> None:
        if self.timeout_ms <= 0 or self.ttl_s <= 0 or self.breaker_cooldown_s <= 0:
            raise ValueError("timeout_ms, ttl_s and breaker_cooldown_s must be positive")
        if self.breaker_failures < 1 or self.walk_blocks < 1 or self.max_lookup_blocks < 1:
            raise ValueError("breaker_failures, walk_blocks, max_lookup_blocks must be >= 1")
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
        self._walk_script = self._redis.register_script(WALK)  # EVALSHA; loaded on NOSCRIPT
        self._cleanup: asyncio.Task[None] | None = None
        self.errors = 0  # failed calls (timeouts, connection errors), breaker refusals not

    # -- keys ----------------------------------------------------------------------------
    def block_key(self, block_hash: BlockHash) -> str:
        return f"{KEY_PREFIX}:{self.model}:{block_hash.hex()}"

    @property
    def epochs_key(self) -> str:
        return f"{KEY_PREFIX}:{self.model}:@epochs"

    @property
    def client(self) -> aioredis.Redis:
        """The Redis client, borrowed (the index owns and closes it)."""
        return self._redis

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
        node's own run with its tiers. Walked on the server, `walk_blocks` blocks per
        call, stopping at the first block nobody holds. None when Redis is unavailable
        (advisory: "no data")."""
        hashes = list(hashes)[:self.config.max_lookup_blocks]
        cap = self.config.max_cleanup_fields
        if self._cleanup is not None and not self._cleanup.done():
            cap = 0  # one cleanup at a time: nothing to collect now
        try:
            res, stale = await self._call("lookup", lambda: self._walk(hashes, nodes, cap))
        except IndexUnavailable as e:
            log.debug("index lookup: %s", e)
            return None
        self._clean_later(stale)
        return res

    async def _walk(self, hashes: list[BlockHash], nodes: set[str] | frozenset[str] | None,
                    max_stale: int) -> tuple[IndexLookup, list[StaleEntry]]:
        """One WALK call per stretch of `walk_blocks` blocks while every block of the
        stretch is held; the nodes whose run reaches a stretch's end go on into the next.
        Returns the lookup and at most `max_stale` stale entries, in the order met."""
        runs: dict[str, tuple[str, ...]] = {}
        stale: list[StaleEntry] = []
        allowed = "" if nodes is None else json.dumps(list(nodes))
        alive: list[str] = []
        i, step = 0, self.config.walk_blocks
        while i < len(hashes):
            keys = [self.block_key(h) for h in hashes[i:i + step]]
            reply = await self._walk_script(keys=[self.epochs_key, *keys], args=[
                "1" if i == 0 else "0", allowed, json.dumps(alive), max_stale - len(stale)])
            held, *lists = json.loads(reply)
            sigs, names, sig_of, found = (x or [] for x in lists)  # cjson: [] comes as {}
            stale += [(keys[p], f, e)
                      for p, f, e in zip(found[::3], found[1::3], found[2::3], strict=True)]
            tiers = [run_tiers(s) for s in sigs]
            for node, k in zip(names, sig_of, strict=True):
                runs[node] = runs[node] + tiers[k] if i else tiers[k]
            i += held
            if held < len(keys):
                break
            alive = [node for node, k in zip(names, sig_of, strict=True) if sigs[k][0] == held]
        return IndexLookup(i, runs), stale

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

    def _clean_later(self, stale: list[StaleEntry]) -> None:
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


def _current_nodes(row: dict[str, str], epochs: dict[str, str]) -> frozenset[str]:
    """Nodes with an entry of their registered epoch in one block's hash row."""
    nodes = set()
    for field, epoch in row.items():
        node = field.rpartition("@")[0]
        if node and epochs.get(node) == epoch:
            nodes.add(node)
    return frozenset(nodes)
