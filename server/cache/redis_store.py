"""The response cache in Redis (server/cache/stores.py has the interface and the in-process store). Its own module,
imported only when a Redis cache is configured: redis-py costs every server process ~7 MB of memory."""

from __future__ import annotations

import asyncio
import logging

from redis.exceptions import RedisError, ResponseError

from server.cache.stores import KEY_PREFIX
from server.limits.redis_pipe import RedisPipe

_logger = logging.getLogger(__name__)
# What a command does, for the log lines of its refusal and its end: (infinitive, gerund, third person).
_DOES = {"GET": ("look up", "looking up", "looks up"), "SET": ("store", "storing", "stores"),
         "DEL": ("drop", "dropping", "drops")}


class RedisStore:
    """GET and SET with PX (Redis expires entries itself), on the same kind of pipelined connection as the limits."""

    def __init__(self, url: str, *, timeout_seconds: float) -> None:
        self._pipe = RedisPipe(url, timeout=timeout_seconds)
        # The whole command, a new connection's set-up included (its connect, then its handshake, each had the
        # timeout: a Redis that stopped answering cost a lookup two of them once the first had closed the connection).
        self._timeout = timeout_seconds
        self._failing = False
        self._refused: set[str] = set()  # commands Redis answers with an error (SET when full: OOM), until one runs
        self._puts: set[asyncio.Task] = set()  # SETs and DELs held until done: the event loop keeps weak references

    async def get(self, key: str) -> bytes | None:
        return await self._safely(("GET", KEY_PREFIX + key), waited_on=True)

    async def put(self, key: str, value: bytes, ttl_seconds: float) -> None:
        """Sent, not waited for: the answer being stored goes on to its caller at once. Awaited, a Redis that does
        not answer held every miss's end back by a second timeout after the lookup's. The SET leaves on the shared
        connection before any later GET of this process, which Redis answers in order."""
        self._send(("SET", KEY_PREFIX + key, value, "PX", max(1, int(ttl_seconds * 1000))))

    async def delete(self, key: str) -> None:
        """Sent, not waited for, like a SET: after the SET of the same answer, before any later GET."""
        self._send(("DEL", KEY_PREFIX + key))

    def _send(self, command: tuple) -> None:
        task = asyncio.create_task(self._safely(command))
        self._puts.add(task)
        task.add_done_callback(self._puts.discard)

    async def _safely(self, command: tuple, waited_on: bool = False) -> bytes | None:
        """`waited_on`: a lookup, which a Redis that stopped answering misses at once (redis_pipe.Silence)."""
        try:
            async with asyncio.timeout(self._timeout):
                reply = await self._pipe.execute(*command, waited_on=waited_on)
        except ResponseError as exc:
            # An answer, not an outage: a full Redis (OOM under noeviction) or a read-only replica refuses each SET
            # while lookups run, which logged "does not answer", then "answers again", at every miss.
            self._answered()
            name = command[0]
            if name not in self._refused:
                self._refused.add(name)
                _logger.warning("response cache: Redis refuses to %s answers (%s); requests are answered without %s "
                                "until it does", _DOES[name][0], str(exc).splitlines()[0][:200], _DOES[name][1])
            return None
        except (RedisError, OSError, TimeoutError) as exc:
            if not self._failing:
                _logger.warning("response cache: Redis does not answer (%s); answering without the cache",
                                type(exc).__name__)
            self._failing = True
            return None
        self._answered()
        if command[0] in self._refused:
            self._refused.discard(command[0])
            _logger.info("response cache: Redis %s answers again", _DOES[command[0]][2])
        return reply if isinstance(reply, bytes) else None

    def _answered(self) -> None:
        if self._failing:
            _logger.info("response cache: Redis answers again")
            self._failing = False

    async def close(self) -> None:
        if self._puts:  # answers stored just before a stop: each waits at most the timeout
            await asyncio.gather(*self._puts, return_exceptions=True)
        await self._pipe.close()
