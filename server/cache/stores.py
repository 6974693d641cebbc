"""Where cached answers live: this process's memory, or Redis (redis_store.py: shared by every process and host
using it).

A store never raises: a Redis that does not answer in time is a miss (and a put that did not happen), logged once
per outage, so the cache can make a request faster but never make it fail.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol

MEMORY_BYTES = 256 * 1024 * 1024  # the in-process store's whole size; least recently used answers go first
KEY_PREFIX = "portico:cache:"


class CacheStore(Protocol):
    async def get(self, key: str) -> bytes | None: ...

    async def put(self, key: str, value: bytes, ttl_seconds: float) -> None: ...

    async def delete(self, key: str) -> None: ...

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

    async def delete(self, key: str) -> None:
        self._drop(key)

    def _drop(self, key: str) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self._bytes -= len(entry[1])

    async def close(self) -> None:
        self._entries.clear()
