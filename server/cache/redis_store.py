"""The response cache in Redis (server/cache/stores.py has the interface and the in-process store). Its own module,
imported only when a Redis cache is configured: redis-py costs every server process ~7 MB of memory."""

from __future__ import annotations

import logging

from redis.exceptions import RedisError

from server.cache.stores import KEY_PREFIX
from server.limits.redis_pipe import RedisPipe

_logger = logging.getLogger(__name__)


class RedisStore:
    """GET and SET with PX (Redis expires entries itself), on the same kind of pipelined connection as the limits."""

    def __init__(self, url: str, *, timeout_seconds: float) -> None:
        self._pipe = RedisPipe(url, timeout=timeout_seconds)
        self._failing = False

    async def get(self, key: str) -> bytes | None:
        return await self._safely(("GET", KEY_PREFIX + key))

    async def put(self, key: str, value: bytes, ttl_seconds: float) -> None:
        await self._safely(("SET", KEY_PREFIX + key, value, "PX", max(1, int(ttl_seconds * 1000))))

    async def _safely(self, command: tuple) -> bytes | None:
        try:
            reply = await self._pipe.execute(*command)
        except (RedisError, OSError, TimeoutError) as exc:
            if not self._failing:
                _logger.warning("response cache: Redis does not answer (%s); answering without the cache",
                                type(exc).__name__)
            self._failing = True
            return None
        if self._failing:
            _logger.info("response cache: Redis answers again")
            self._failing = False
        return reply if isinstance(reply, bytes) else None

    async def close(self) -> None:
        await self._pipe.close()
