"""Where cached answers live: this process's memory, or Redis (shared by every process and host using it).

A store never raises: a Redis that does not answer in time is a miss (and a put that did not happen), logged once
per outage, so the cache can make a request faster but never make it fail.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

from redis.exceptions import RedisError

from server.limits.redis_pipe import RedisPipe

_logger = logging.getLogger(__name__)

MEMORY_BYTES = 256 * 1024 * 1024  # the in-process store's whole size; least recently used answers go first
KEY_PREFIX = "portico:cache:"


class CacheStore(Protocol):
    async def get(self, key: str) -> bytes | None: ...

    async def put(self, key: str, value: bytes, ttl_seconds: float) -> None: ...

    async def close(self) -> None: ...


class MemoryStore:
    def __init__(self, max_bytes: int = MEMORY_BYTES, clock: Callable[[], float] = time.monotonic) -> None:
        self._entries: OrderedDict[str, tuple[float, bytes]] = OrderedDict()  # key -> (expiry, value)
        self._bytes = 0
        self._max_bytes = max_bytes
        self._clock = clock

    async def get(self, key: str) -> bytes | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry[0] <= self._clock():
            self._drop(key)
            return None
        self._entries.move_to_end(key)
        return entry[1]

    async def put(self, key: str, value: bytes, ttl_seconds: float) -> None:
        if len(value) > self._max_bytes:
            return
        self._drop(key)
        self._entries[key] = (self._clock() + ttl_seconds, value)
        self._bytes += len(value)
        while self._bytes > self._max_bytes:
            self._drop(next(iter(self._entries)))

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= len(entry[1])

    async def close(self) -> None:
        self._entries.clear()


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
