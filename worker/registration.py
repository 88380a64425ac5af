"""Worker registration in Redis: one hash per worker with a heartbeat TTL.

Key `splitserve:workers:<model>:<worker_id>` (see `worker_key`), fields as in
`WorkerRecord`; refreshed every heartbeat, expiring `ttl_s` after the last one, and
deleted on a clean stop. Redis is advisory: a failed heartbeat is logged and retried,
never fatal. The gateway reads these keys (gateway/registry.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Mapping

import redis.asyncio as aioredis

from kvtransfer.wire import deadline

log = logging.getLogger(__name__)

KEY_PREFIX = "splitserve:workers"


def worker_key(model: str, worker_id: str) -> str:
    return f"{KEY_PREFIX}:{model}:{worker_id}"


class RedisRegistrar:
    """Owns its Redis client; `run()` heartbeats until cancelled, `remove()` deletes."""

    def __init__(self, url: str, model: str, worker_id: str, fields: Mapping[str, str],
                 ttl_s: float, heartbeat_s: float, timeout_s: float) -> None:
        self._client = aioredis.Redis.from_url(url, socket_timeout=timeout_s,
                                               socket_connect_timeout=timeout_s)
        self._key = worker_key(model, worker_id)
        self._fields = dict(fields)
        self._ttl_ms = int(ttl_s * 1000)
        self._heartbeat_s = heartbeat_s
        self._timeout_s = timeout_s

    async def beat(self) -> bool:
        try:
            pipe = self._client.pipeline(transaction=True)
            # Mapping's key type is invariant; redis-py's stub wants its own union.
            pipe.hset(self._key, mapping=self._fields)  # type: ignore[arg-type]
            pipe.pexpire(self._key, self._ttl_ms)
            async with deadline(self._timeout_s * 2):  # (wait_for may swallow a cancel)
                await pipe.execute()
            return True
        except (OSError, TimeoutError, aioredis.RedisError) as e:
            log.warning("redis heartbeat for %s failed: %s", self._key, e)
            return False

    async def run(self) -> None:
        while True:
            await self.beat()
            await asyncio.sleep(self._heartbeat_s)

    async def remove(self) -> None:
        with contextlib.suppress(OSError, TimeoutError, aioredis.RedisError):
            await asyncio.wait_for(self._client.delete(self._key), self._timeout_s * 2)
        with contextlib.suppress(Exception):
            await self._client.aclose()
