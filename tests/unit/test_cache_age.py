"""A caller's `Cache-Control: max-age` against the wall clock the answer was stored by (the real in-process store)."""

from __future__ import annotations

from types import SimpleNamespace

from server.cache import ResponseCache
from server.cache.stores import MemoryStore
from server.domain_answers import Finished, FinishReason, Usage
from server.domain_models import CacheSettings
from tests.limits_support import FakeClock, NOON

SETTINGS = CacheSettings()
REQUEST = SimpleNamespace(source=SimpleNamespace(body={"messages": [{"role": "user", "content": "hi"}]}), stream=False,
                          params=SimpleNamespace(max_tokens=16))


async def _store(cache: ResponseCache) -> None:
    lookup = await cache.lookup("m", "/v1/chat/completions", SETTINGS, "key_a", REQUEST, ())
    async for _ in cache.recorded(lookup, _answer()):
        pass


async def _answer():
    yield Finished(FinishReason.END_TURN, Usage(1, 1))


async def _hit(cache: ResponseCache, max_age: int) -> bool:
    control = (("cache-control", f"max-age={max_age}"),)
    return (await cache.lookup("m", "/v1/chat/completions", SETTINGS, "key_a", REQUEST, control)).events is not None


async def test_an_answer_stored_before_the_clock_stepped_back_is_not_taken_for_a_fresh_one():
    """NTP stepped the clock back an hour: an answer stored 50 minutes earlier reads as stored 10 minutes from now, an
    age below any max-age, so a caller asking for one no older than 60 s got it. Stored farther from now than max-age
    either way, an answer's age is not known to be within it."""
    wall = FakeClock(NOON)
    cache = ResponseCache(MemoryStore(), clock=wall)
    await _store(cache)
    wall.advance(30)
    assert await _hit(cache, 60)
    assert not await _hit(cache, 10)
    wall.now += 20 * 60 - 3600  # 20 minutes later, then an hour back: stored 30 minutes "from now"
    assert not await _hit(cache, 60)
    assert await _hit(cache, 3600)  # within the hour either way
    assert (await cache.lookup("m", "/v1/chat/completions", SETTINGS, "key_a", REQUEST, ())).events is not None
    await cache.close()
