"""Scheduling strategies, live: a worker polls the strategies key its gateway writes
(engine/strategies.py) and hands each new version to the engine thread, which applies it
on its next scheduling step, with no restart. A (re)started worker reads the current
version before it turns ready. Redis is advisory: while it is unreachable or holds a
corrupt document, the last applied version stays in force and the failure is logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis

from engine.async_llm import AsyncLLM
from engine.llm_engine import LLMEngine
from engine.strategies import StrategySet, load_strategies

log = logging.getLogger(__name__)

POLL_S = 0.25  # a change applies within POLL_S + one Redis round trip + one step


class StrategyWatcher:
    """Owns its Redis client and its polling task (`start` / `close`)."""

    def __init__(self, redis_url: str, model: str, llm: AsyncLLM, timeout_s: float,
                 period_s: float = POLL_S) -> None:
        self._client = aioredis.Redis.from_url(redis_url, socket_timeout=timeout_s,
                                               socket_connect_timeout=timeout_s)
        self._model = model
        self._llm = llm
        self._timeout_s = timeout_s
        self._period_s = period_s
        self._task: asyncio.Task[None] | None = None
        self._failing = False
        self.version = 0  # the version applied

    async def poll(self) -> bool:
        """Reads the stored set once and applies it if its version is new. False when
        Redis could not be read (or held something invalid)."""
        try:
            got = await asyncio.wait_for(load_strategies(self._client, self._model),
                                         self._timeout_s * 2)
        except (OSError, TimeoutError, aioredis.RedisError, ValueError) as e:
            if not self._failing:  # once per outage, not every period
                log.warning("reading scheduling strategies failed (keeping version %d): %s",
                            self.version, e)
            self._failing = True
            return False
        if self._failing:
            log.info("scheduling strategies readable again")
            self._failing = False
        if got.version != self.version:
            await self._apply(got)
        return True

    async def first_read(self, budget_s: float = 5.0) -> bool:
        """At start-up, before the worker turns ready: polls until the stored set is read
        or `budget_s` has passed (a busy Redis or machine can miss one short timeout; a
        Redis that is down leaves the defaults, and the periodic poll catches up)."""
        end = asyncio.get_running_loop().time() + budget_s
        while not await self.poll():
            if asyncio.get_running_loop().time() + self._period_s >= end:
                return False
            await asyncio.sleep(self._period_s)
        return True

    async def _apply(self, strategies: StrategySet) -> None:
        def apply(engine: LLMEngine) -> None:
            engine.set_strategies(strategies)
        await self._llm.call(apply)  # on the engine thread, between two steps
        log.info("scheduling strategies version %d applied (%d strategies)",
                 strategies.version, len(strategies.strategies))
        self.version = strategies.version

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self._period_s)
            await self.poll()

    def start(self) -> None:
        self._task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        with contextlib.suppress(Exception):
            await self._client.aclose()
