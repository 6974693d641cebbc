"""Where a key's limits stand now (LimitService, the console's key page), read from both stores without booking."""

from __future__ import annotations

from server.config import LimitSettings
from server.domain_keys import ApiKey, KeyLimits
from server.limits import Limiter
from tests.unit.test_limits import clock, store  # noqa: F401 - the same two stores and clock as the limits tests

KEY = ApiKey("key_s", "standing", all_models=True, models=frozenset(),
             limits=KeyLimits(requests_per_minute=10, tokens_per_minute=1000, daily_requests=50))
SETTINGS = LimitSettings(defaults=KeyLimits(concurrent_requests=4),
                         models={"family-a-5.4": KeyLimits(requests_per_minute=3)})


def by_name(readings) -> dict[tuple[str, str], tuple[int, int, float]]:
    return {(r.dimension.value, r.scope.id.partition("|")[2]): (r.limit, r.used, round(r.wait, 3)) for r in readings}


async def test_reports_use_and_resets_without_counting_anything(store, clock):  # noqa: F811
    limiter = Limiter(store, SETTINGS)
    idle = by_name(await limiter.standing(KEY))
    assert idle == {
        ("requests_per_minute", ""): (10, 0, 0.0), ("tokens_per_minute", ""): (1000, 0, 0.0),
        ("concurrent_requests", ""): (4, 0, 0.0), ("daily_requests", ""): (50, 0, 0.0),
        ("requests_per_minute", "family-a-5.4"): (3, 0, 0.0),
    }
    first = await limiter.reserve(KEY, "family-a-5.4", 100)
    limiter.settle(first, 40)
    await limiter.settled()
    clock.now += 20
    held = await limiter.reserve(KEY, "family-a-5.5", 200)  # still in flight
    clock.now += 10
    now = by_name(await limiter.standing(KEY))
    assert now[("requests_per_minute", "")] == (10, 2, 30.0)  # the first request leaves the window in 30 s
    assert now[("tokens_per_minute", "")] == (1000, 240, 30.0)  # settled tokens + the open reservation
    assert now[("concurrent_requests", "")] == (4, 1, 0.0)
    assert now[("daily_requests", "")][:2] == (50, 2) and 0 < now[("daily_requests", "")][2] <= 86_400
    assert now[("requests_per_minute", "family-a-5.4")] == (3, 1, 30.0)
    assert by_name(await limiter.standing(KEY)) == now  # reading twice counts nothing
    limiter.settle(held, 10)
    await limiter.settled()
    clock.now += 61
    later = by_name(await limiter.standing(KEY))
    assert later[("requests_per_minute", "")] == (10, 0, 0.0) and later[("concurrent_requests", "")] == (4, 0, 0.0)
    assert later[("daily_requests", "")][:2] == (50, 2)


async def test_a_per_model_limit_is_in_force_only_on_a_key_granted_that_model(store):  # noqa: F811
    """A key granted only family-a-5.5 was shown family-a-5.4's per-model limit, which it can never meet."""
    narrow = ApiKey("key_n", "narrow", all_models=False, models=frozenset({"family-a-5.5"}))
    limiter = Limiter(store, SETTINGS)
    assert {model for _, model in by_name(await limiter.standing(narrow))} == {""}
    granted = ApiKey("key_g", "granted", all_models=False, models=frozenset({"family-a-5.4"}))
    assert ("requests_per_minute", "family-a-5.4") in by_name(await limiter.standing(granted))


async def test_tokens_per_minute_reset_when_tokens_leave_not_a_request_that_used_none(store, clock):  # noqa: F811
    """A token count, an image or a failed request has its place in the minute's window with no tokens: the status
    said the key's tokens per minute went down when it left (with none used: 'reset in 60 s'), and the next answer's
    x-ratelimit-reset-tokens said so too, though nothing frees then."""
    limiter = Limiter(store, LimitSettings())
    key = ApiKey("key_t", "tokens", all_models=True, models=frozenset(), limits=KeyLimits(tokens_per_minute=1000))
    counted = await limiter.reserve(key, "family-a-5.5", 0)  # a token count: one request, no tokens
    assert counted.tokens.reset_seconds == 0.0  # no tokens counted: none to free
    limiter.settle(counted, 0)
    await limiter.settled()
    clock.now += 10
    assert by_name(await limiter.standing(key))[("tokens_per_minute", "")] == (1000, 0, 0.0)  # nothing to go down
    answered = await limiter.reserve(key, "family-a-5.5", 100)
    assert answered.tokens.reset_seconds == 60.0  # its own tokens, the only ones in the window, leave in a minute
    limiter.settle(answered, 40)
    await limiter.settled()
    clock.now += 5
    assert by_name(await limiter.standing(key))[("tokens_per_minute", "")] == (1000, 40, 55.0)
    again = await limiter.reserve(key, "family-a-5.5", 100)
    assert again.tokens.reset_seconds == 55.0  # the answer's 40 tokens leave first, not the count before it
