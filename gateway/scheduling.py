"""The live scheduling strategies as the gateway holds them (engine/strategies.py has
the format): replaced through the admin API, stored in Redis so that other gateways,
restarted gateways and the workers read the same versioned set, and polled so a
change made through another gateway applies here within `strategies_poll_s`.

Ownership: the store owns its Redis client and poll task, and calls `on_change` with
every newly adopted set (the admission queue, the version gauge). Without Redis the
set lives in this process only.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis

from engine.strategies import (
    EMPTY,
    StrategySet,
    load_strategies,
    parse,
    store_strategies,
    strategies_key,
)
from gateway.errors import InvalidRequest, ServiceUnavailable

log = logging.getLogger(__name__)


class StrategyStore:
    def __init__(self, redis_url: str | None, served_model_name: str, timeout_s: float,
                 poll_s: float, on_change: Callable[[StrategySet], None]) -> None:
        self.model = served_model_name
        self.poll_s = poll_s
        self.timeout_s = timeout_s
        self.on_change = on_change
        self.current = EMPTY
        self._redis = (aioredis.Redis.from_url(
            redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s,
            decode_responses=True) if redis_url else None)
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()  # a poll never adopts a read older than a POST

    async def start(self) -> None:
        """Adopts the stored set (if Redis answers) and starts polling."""
        if self._redis is None:
            return
        await self.refresh()
        self._task = asyncio.create_task(self._poll())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._redis is not None:
            with contextlib.suppress(Exception):
                await self._redis.aclose()

    async def replace(self, body: Any) -> StrategySet:
        """Validates `body` ({"scheduling": [...]}) whole, stores it with the next
        version and adopts it. InvalidRequest (400) with the reason; 503 when Redis
        does not take it (nothing changes then)."""
        try:
            new = parse(body)
        except ValueError as e:
            raise InvalidRequest(f"invalid scheduling strategies: {e}") from e
        async with self._lock:
            if self._redis is None:
                stored = StrategySet(self.current.version + 1, new.strategies)
            else:
                try:
                    stored = await asyncio.wait_for(
                        store_strategies(self._redis, self.model, new), self.timeout_s * 4)
                except (OSError, asyncio.TimeoutError, aioredis.RedisError) as e:
                    raise ServiceUnavailable(f"could not store the strategies in Redis: {e}",
                                             retry_after=1) from e
            self._adopt(stored)
        return stored

    async def refresh(self) -> None:
        """One poll: adopt a stored set of another version. A Redis that lost the key
        (restarted without persistence) gets ours back, version kept, unless another
        gateway was first."""
        assert self._redis is not None
        async with self._lock:
            try:
                stored = await asyncio.wait_for(load_strategies(self._redis, self.model),
                                                self.timeout_s * 4)
                if stored.version == 0 and self.current.version > 0:
                    await asyncio.wait_for(self._redis.set(
                        strategies_key(self.model), json.dumps(self.current.to_dict()),
                        nx=True), self.timeout_s * 4)
                    return
            except (OSError, asyncio.TimeoutError, aioredis.RedisError, ValueError) as e:
                log.warning("event=strategies_poll_failed model=%s error=%r (keeping "
                            "version %d)", self.model, e, self.current.version)
                return
            if stored.version != self.current.version:
                self._adopt(stored)

    def _adopt(self, s: StrategySet) -> None:
        self.current = s
        log.info("event=strategies_applied version=%d strategies=%d", s.version,
                 len(s.strategies))
        self.on_change(s)

    async def _poll(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            await self.refresh()
