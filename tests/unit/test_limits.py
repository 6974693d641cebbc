"""Both limit stores (in-process and Redis) with an injected clock: rolling windows, token reconciliation, UTC
days, concurrency, refusals. Redis-only behaviour (leases, outages, several processes) is in test_limits_redis.py."""

from __future__ import annotations

import asyncio
import logging
import math
import secrets

import pytest

from server.limits import LimitSettings
from server.domain_keys import ApiKey, KeyLimits
from server.errors import RateLimited
from server.limits import Demand, Limiter, MemoryLimitStore, Scope, rate_limit_headers
from server.limits.core import ReservationIds
from server.limits.core import duration_text
from server.limits.redis import RedisLimitStore
from server.limits.standing import standing
from tests.limits_support import FakeClock, NOON


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["memory", "redis"])
async def store(request, clock):
    if request.param == "memory":
        store = MemoryLimitStore(clock)
    else:  # a fresh key prefix per test instead of flushing a shared database
        url = request.getfixturevalue("redis_server").url
        store = RedisLimitStore(url, clock=clock, prefix=f"test-{secrets.token_hex(4)}:")
    yield store
    await store.close()


def demand(tokens: int = 0, **limits) -> Demand:
    return Demand((Scope("k1", "key k1", KeyLimits(**limits)),), tokens)


async def refused(store, wanted: Demand) -> RateLimited:
    with pytest.raises(RateLimited) as caught:
        await store.reserve(wanted)
    return caught.value


async def test_requests_per_minute_is_a_rolling_window(store, clock):
    wanted = demand(requests_per_minute=3)
    for _ in range(3):
        await store.reserve(wanted)
        clock.advance(10)
    error = await refused(store, wanted)  # t=30: the first request leaves the window at t=60
    assert error.retry_after == pytest.approx(30)
    assert "requests per minute on key k1" in error.message and "limit 3" in error.message
    clock.advance(30)  # t=60: exactly 60 s after the first, which is no longer in the window
    await store.reserve(wanted)
    assert (await refused(store, wanted)).retry_after == pytest.approx(10)


async def test_a_refusal_counts_requests_in_plain_english(store):
    await store.reserve(demand(requests_per_minute=1))
    error = await refused(store, demand(requests_per_minute=1))
    assert "limit 1, used 1 request." in error.message


async def test_tokens_per_minute_are_reconciled_with_real_usage(store, clock):
    wanted = demand(tokens=600, tokens_per_minute=1000)
    first = await store.reserve(wanted)
    error = await refused(store, wanted)  # 600 reserved + 600 > 1000
    assert "tokens per minute" in error.message and "requested 600" in error.message
    await store.settle(first, 100)  # the request really used 100
    clock.advance(5)
    second = await store.reserve(demand(tokens=800, tokens_per_minute=1000))
    assert second.tokens.remaining == 100
    await store.settle(second, 800)  # all of it: nothing comes back when it ends
    error = await refused(store, demand(tokens=200, tokens_per_minute=1000))
    assert error.retry_after == pytest.approx(55)  # the first entry (100 tokens) frees enough at t=60


async def test_a_refusal_describes_its_limit_as_x_ratelimit_headers(store, clock):
    await store.settle(await store.reserve(demand(tokens=600, tokens_per_minute=1000)), 600)
    clock.advance(15)
    tokens = dict(ratelimit_trailer(await refused(store, demand(tokens=600, tokens_per_minute=1000))))
    assert tokens == {"x-ratelimit-limit-tokens": "1000", "x-ratelimit-remaining-tokens": "400",
                      "x-ratelimit-reset-tokens": "45s"}  # the 600 reserved at t=0 leave the window at t=60
    per_minute = Demand((Scope("k2", "key k2", KeyLimits(requests_per_minute=2)),), 0)
    for _ in range(2):
        await store.reserve(per_minute)
    requests = dict(ratelimit_trailer(await refused(store, per_minute)))
    assert (requests["x-ratelimit-limit-requests"], requests["x-ratelimit-remaining-requests"]) == ("2", "0")
    # Concurrency has no x-ratelimit header; a request that can never fit has no reset to wait for.
    one_at_a_time = Demand((Scope("k3", "key k3", KeyLimits(concurrent_requests=1)),), 0)
    await store.reserve(one_at_a_time)
    assert ratelimit_trailer(await refused(store, one_at_a_time)) == ()
    assert ratelimit_trailer(await refused(store, demand(tokens=2000, tokens_per_minute=1000))) == ()


async def test_a_request_that_can_never_fit_has_no_retry_hint(store):
    error = await refused(store, demand(tokens=2000, tokens_per_minute=1000))
    assert error.retry_after == 0
    assert error.message.startswith("Request too large for tokens per minute")


async def test_a_huge_request_no_limit_refuses_is_counted_and_the_counters_keep_working(store, clock):
    # The API takes max_tokens up to 2**63 - 1; without a token limit or a budget nothing refuses that, and Redis's
    # Lua numbers (doubles, written back as "1.2e+17") must not turn it into a 500 for this request or a later one.
    huge = demand(tokens=2**63 + 2, requests_per_minute=5)
    huge = Demand(huge.scopes, huge.tokens, cost=15 * huge.tokens)
    await store.settle(await store.reserve(huge), 7, 3)
    await store.settle(await store.reserve(huge), 2, 1)
    clock.advance(61)  # both leave the window: the next admission prunes them
    await store.settle(await store.reserve(demand(tokens=10, requests_per_minute=5)), 4)
    counts = await store.counts("k1")
    assert [(counts.day_requests, counts.day_tokens, counts.day_spend, counts.month_spend)] == [(3, 13, 4, 4)]
    assert [tokens for _, tokens in counts.window] == [4]
    # Over a limit, it is still the request too large it is, named by what it asked for.
    error = await refused(store, Demand((Scope("k2", "key k2", KeyLimits(tokens_per_minute=10)),), 2**63 + 2))
    assert "it may use up to 9223372036854775810 tokens" in error.message


async def test_a_request_that_costs_nothing_is_never_refused_by_a_budget(store):
    """A free model's request, or a response-cache hit (api.md, Budgets; configuration.md, Response cache), also once
    a request that cost more than it reserved took the key over its budget."""
    budget = demand(max_spend_day=1_000, max_spend_month=1_000)
    await store.settle(await store.reserve(Demand(budget.scopes, 0, cost=1_000)), 0, 1_500)  # over, by 500
    assert (await refused(store, Demand(budget.scopes, 0, cost=1))).dimension.counts_spend
    await store.settle(await store.reserve(budget), 0, 0)
    counts = await store.counts("k1")
    assert (counts.day_requests, counts.day_spend, counts.month_spend) == (2, 1_500, 1_500)


async def test_daily_quota_resets_at_utc_midnight(store, clock):
    clock.now = NOON + 12 * 3600 - 30  # 23:59:30 UTC
    wanted = demand(tokens=10, daily_requests=2, daily_tokens=1000)
    held = await store.reserve(wanted)
    await store.reserve(wanted)
    error = await refused(store, wanted)
    assert "daily requests" in error.message and error.retry_after == pytest.approx(30)
    await store.settle(held, 5)
    clock.advance(30)  # 00:00:00 UTC
    await store.reserve(wanted)
    await store.reserve(wanted)
    await refused(store, wanted)


async def test_a_refusal_for_longer_than_a_minute_asks_clients_not_to_retry_but_says_when(store, clock):
    # The anthropic SDK sleeps for any retry-after: hours until UTC midnight, with the caller hanging on it.
    clock.now = NOON + 12 * 3600 - 90  # 23:58:30 UTC
    wanted = demand(daily_requests=1)
    await store.reserve(wanted)
    headers = dict((await refused(store, wanted)).trailing_metadata())
    assert (headers["x-should-retry"], headers["retry-after"], headers["x-ratelimit-remaining-requests"]) == (
        "false", "90", "0")
    clock.advance(40)  # 50 s to midnight: a wait the SDKs may spend asleep, as they do for a per-minute limit
    assert "x-should-retry" not in dict((await refused(store, wanted)).trailing_metadata())
    per_minute = Demand((Scope("k2", "key k2", KeyLimits(requests_per_minute=1)),), 0)
    await store.reserve(per_minute)
    assert "x-should-retry" not in dict((await refused(store, per_minute)).trailing_metadata())


async def test_retry_hints_are_plain_seconds_with_one_decimal(store, clock):
    clock.now = NOON - 6 * 3600 + 123.45  # 06:02:03.45 UTC: midnight is 64,676.55 s away
    wanted = demand(daily_requests=2)
    for _ in range(2):
        await store.reserve(wanted)
    # hours away: when it resets, too (as a budget's refusal says)
    assert (await refused(store, wanted)).message.endswith(
        "The quota resets at 2026-01-02 00:00 UTC; please retry after 64676.6 seconds.")
    wanted = Demand((Scope("k2", "key k2", KeyLimits(requests_per_minute=1)),), 0)
    await store.reserve(wanted)
    clock.advance(59.96)
    assert "Please retry after 0.1 seconds." in (await refused(store, wanted)).message  # rounded up, never 0.0


async def test_daily_tokens_count_real_usage(store, clock):
    wanted = demand(tokens=400, daily_tokens=1000)
    for _ in range(5):
        await store.settle(await store.reserve(wanted), 150)
        clock.advance(3600)
    # 750 used; 400 more does not fit until midnight (12 h after noon, minus the 5 h that passed).
    assert (await refused(store, wanted)).retry_after == pytest.approx(7 * 3600)


async def test_daily_tokens_held_by_requests_in_flight_ask_for_a_retry_soon_not_at_midnight(store, clock):
    """A request in flight reserves its most; the next one, refused while it runs, was told to retry at UTC midnight
    with x-should-retry: false (the SDKs gave up at once), though the tokens came back when the first one ended."""
    wanted = demand(tokens=600, daily_tokens=1000)
    running = await store.reserve(wanted)
    error = await refused(store, wanted)
    assert error.retry_after == pytest.approx(1.0) and "x-should-retry" not in dict(error.trailing_metadata())
    assert error.message == ("Rate limit reached for daily tokens on key k1: limit 1000, used 600 (600 of them held "
                             "by requests in flight until they end), requested 600 tokens. Please retry after 1.0 "
                             "seconds.")
    await store.settle(running, 50)
    await store.settle(await store.reserve(wanted), 400)  # 450 used: what in flight holds no longer
    error = await refused(store, wanted)  # 450 + 600 > 1000 with nothing in flight: midnight
    assert error.retry_after == pytest.approx(12 * 3600)
    assert dict(error.trailing_metadata())["x-should-retry"] == "false"


async def test_tokens_per_minute_held_by_requests_in_flight_ask_for_a_retry_soon_not_when_the_window_moves(store,
                                                                                                         clock):
    """A request in flight holds its most (prompt + max tokens) in the minute's window until it ends; the next one,
    refused meanwhile, was told to wait until that entry left the window (up to a minute, which the SDKs sleep),
    though it fit as soon as the first one ended and gave back what it did not use."""
    wanted = demand(tokens=600, tokens_per_minute=1000)
    running = await store.reserve(wanted)
    clock.advance(5)
    error = await refused(store, wanted)
    assert error.retry_after == pytest.approx(1.0)
    assert error.message == ("Rate limit reached for tokens per minute on key k1: limit 1000, used 600 (600 of them "
                             "held by requests in flight until they end), requested 600 tokens. Please retry after 1.0 "
                             "seconds.")
    assert dict(ratelimit_trailer(error))["x-ratelimit-reset-tokens"] == "1s"
    await store.settle(running, 50)
    await store.settle(await store.reserve(wanted), 600)  # 650 in the window, nothing in flight
    error = await refused(store, wanted)  # 1,250: both entries must leave, the second at t=65
    assert error.retry_after == pytest.approx(60) and "held" not in error.message


async def test_held_by_requests_in_flight_just_before_midnight_waits_for_midnight_not_a_second(store, clock):
    """In the last second of the UTC day, a refusal held up by requests in flight said to retry after a second,
    past the midnight that frees the whole quota sooner."""
    clock.advance(12 * 3600 - 0.25)  # 23:59:59.75 UTC
    wanted = demand(tokens=600, daily_tokens=1000)
    await store.reserve(wanted)
    error = await refused(store, wanted)
    assert error.retry_after == pytest.approx(0.25)
    assert dict(error.trailing_metadata())["retry-after-ms"] == "250"
    assert error.message.endswith("Please retry after 0.3 seconds.")
    clock.advance(0.25)
    await store.reserve(wanted)


async def test_concurrency_slot_is_freed_by_settle_and_release_once(store):
    wanted = demand(concurrent_requests=1)
    held = await store.reserve(wanted)
    error = await refused(store, wanted)
    assert "concurrent requests" in error.message and error.retry_after > 0
    await store.settle(held, 0)
    await store.settle(held, 0)  # a second settle must not free a second slot
    again = await store.reserve(wanted)
    await refused(store, wanted)
    await store.release(again)
    await store.release(again)
    await store.reserve(wanted)
    await refused(store, wanted)


async def test_release_refunds_the_request_and_its_tokens(store):
    wanted = demand(tokens=500, requests_per_minute=1, tokens_per_minute=500, daily_requests=1)
    await store.release(await store.reserve(wanted))
    await store.reserve(wanted)


async def test_all_or_nothing_across_scopes(store):
    key = Scope("k1", "key k1", KeyLimits(requests_per_minute=2))
    on_model = Scope("k1|m", "key k1 on model m", KeyLimits(requests_per_minute=1))
    await store.reserve(Demand((key, on_model), 0))
    error = await refused(store, Demand((key, on_model), 0))
    assert "on model m" in error.message and error.subject.startswith("key k1 on model m")
    await store.reserve(Demand((key,), 0))  # the refusal above counted nothing in the key's own window
    await refused(store, Demand((key,), 0))


async def test_the_longest_wait_is_reported(store, clock):
    wanted = demand(requests_per_minute=1, daily_requests=1)
    await store.reserve(wanted)
    error = await refused(store, wanted)
    assert "daily requests" in error.message and error.retry_after == pytest.approx(12 * 3600)


async def test_standings_describe_the_tightest_limit(store, clock):
    first = await store.reserve(demand(tokens=100, requests_per_minute=10, daily_requests=5, tokens_per_minute=1000))
    assert (first.requests.limit, first.requests.remaining) == (5, 4)
    assert first.requests.reset_seconds == pytest.approx(12 * 3600)
    assert (first.tokens.limit, first.tokens.remaining) == (1000, 900)
    clock.advance(20)
    second = await store.reserve(demand(tokens=100, requests_per_minute=10, tokens_per_minute=1000))
    assert (second.requests.remaining, second.requests.reset_seconds) == (8, pytest.approx(40))
    headers = dict(rate_limit_headers(second))
    assert headers == {
        "x-ratelimit-limit-requests": "10", "x-ratelimit-remaining-requests": "8",
        "x-ratelimit-reset-requests": "40s", "x-ratelimit-limit-tokens": "1000",
        "x-ratelimit-remaining-tokens": "800", "x-ratelimit-reset-tokens": "40s",
    }
    assert rate_limit_headers(await store.reserve(demand(tokens=5))) == ()


async def test_concurrent_attempts_admit_exactly_the_limit(store):
    wanted = demand(requests_per_minute=50)
    results = await asyncio.gather(*(store.reserve(wanted) for _ in range(200)), return_exceptions=True)
    assert sum(not isinstance(r, Exception) for r in results) == 50
    assert all(isinstance(r, RateLimited) for r in results if isinstance(r, Exception))


def test_duration_text_matches_openai():
    assert [duration_text(s) for s in (0.02, 1, 12.5, 360, 7200.25, math.pi)] == [
        "20ms", "1s", "12.5s", "6m0s", "2h0m0.25s", "3.142s"]


def test_limiter_scopes_take_key_values_over_defaults_and_add_per_model_limits():
    settings = LimitSettings(defaults=KeyLimits(requests_per_minute=60, tokens_per_minute=1000),
                             models={"m": KeyLimits(concurrent_requests=2)})
    limiter = Limiter(MemoryLimitStore(), settings)
    key = ApiKey(id="k", name="n", all_models=True, models=frozenset(), limits=KeyLimits(requests_per_minute=5))
    assert limiter.scopes(key, "other") == (Scope("k", "key k", KeyLimits(5, 1000)),)
    per_model = Scope("k|m", "key k on model m", KeyLimits(concurrent_requests=2), "key_model")
    assert limiter.scopes(key, "m")[1] == per_model
    unlimited = Limiter(MemoryLimitStore(), LimitSettings())
    assert unlimited.scopes(ApiKey(id="k", name="n", all_models=True, models=frozenset()), "m") == ()


async def test_settle_completes_in_a_task_cancelled_again_while_settling(store):
    """The exit path of a request whose caller went away: settling must finish even if the task is cancelled once
    more meanwhile (the Redis store settles in a task the Limiter holds, the in-process one at once)."""
    limiter = Limiter(store, LimitSettings())
    key = ApiKey(id="k1", name="n", all_models=True, models=frozenset(), limits=KeyLimits(concurrent_requests=1))
    admitted = asyncio.Event()

    async def request() -> None:
        reservation = await limiter.reserve(key, "m", 10)
        try:
            admitted.set()
            await asyncio.sleep(3600)
        finally:
            limiter.settle(reservation, 5)

    task = asyncio.ensure_future(request())
    await admitted.wait()
    task.cancel()
    await asyncio.sleep(0)  # now in `finally`, settling
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if await store.in_flight("k1") == 0:
            break
        await asyncio.sleep(0.01)
    assert await store.in_flight("k1") == 0
    await limiter.reserve(key, "m", 10)  # the slot is free again


async def test_a_store_that_claims_to_decide_at_once_but_waits_is_a_bug_that_shows():
    class Waits(MemoryLimitStore):
        async def reserve(self, demand: Demand):
            await asyncio.sleep(0)
            return await super().reserve(demand)

    limiter = Limiter(Waits(), LimitSettings())
    key = ApiKey(id="k", name="n", all_models=True, models=frozenset(), limits=KeyLimits(requests_per_minute=1))
    with pytest.raises(RuntimeError, match="immediate"):
        await limiter.reserve(key, "m", 0)


def ratelimit_trailer(refusal) -> tuple[tuple[str, str], ...]:
    """The refusal's x-ratelimit-* trailing metadata (beside its retry hint)."""
    return tuple((name, value) for name, value in refusal.trailing_metadata() if name.startswith("x-ratelimit-"))


def test_reservation_ids_are_unique_per_store_and_per_process(monkeypatch):
    """No module state: each store draws its own prefix, and a forked child (another pid) draws a new one."""
    first, second = ReservationIds(), ReservationIds()
    ids = [first.new(), first.new(), second.new()]
    assert len(set(ids)) == 3 and ids[0][:16] == ids[1][:16] != ids[2][:16]
    monkeypatch.setattr("os.getpid", lambda: -42)
    assert first.new()[:16] != ids[0][:16]


async def test_every_store_answers_ping():
    assert await MemoryLimitStore().ping()


async def test_a_request_without_tokens_is_never_refused_by_a_spent_token_limit(store, clock):
    """A token count, an image, a cache hit reserve no tokens: a minute or a day whose tokens are spent (a request
    used more than it reserved) does not refuse them; request limits still do, and the headers say what is left."""
    limits = dict(tokens_per_minute=100, daily_tokens=100, requests_per_minute=3)
    await store.settle(await store.reserve(demand(tokens=50, **limits)), 300)  # used 300 of 100
    assert (await refused(store, demand(tokens=1, **limits))).message.startswith("Rate limit reached for daily tokens")
    free = await store.reserve(demand(**limits))
    assert (free.tokens.remaining, free.requests.remaining) == (0, 1)
    await store.settle(free, 0)
    await store.reserve(demand(**limits))
    assert "requests per minute" in (await refused(store, demand(**limits))).message


async def test_a_wall_clock_stepped_back_does_not_hold_the_in_process_window_for_an_hour():
    """NTP stepped the host's clock back an hour: a key at its per-minute limit was refused for that hour (retry-after
    3599 s on a per-minute limit), its window entries being "in the future". The window now runs on a monotonic
    clock; days and months stay on the wall clock (UTC midnight)."""
    wall, steady = FakeClock(NOON), FakeClock(1000.0)
    store = MemoryLimitStore(wall, monotonic=steady)
    wanted = demand(requests_per_minute=2)
    for _ in range(2):
        await store.settle(await store.reserve(wanted), 0)
    assert (await refused(store, wanted)).retry_after == pytest.approx(60)
    wall.now -= 3600  # the step back
    wall.advance(61)
    steady.advance(61)  # a minute later
    await store.reserve(wanted)
    standing = await store.counts("k1")
    assert [at for at, _ in standing.window] == [wall.now]  # in wall time, for the LimitService's reset times
    await store.close()


async def test_a_wall_clock_stepped_back_over_midnight_refunds_no_daily_quota():
    """NTP stepped the clock back from 00:30 to 23:30 UTC: the in-process store took it for a new day and zeroed the
    day's counters, and zeroed them again at the second midnight, so the half hour's requests were never counted."""
    after_midnight = NOON + 12.5 * 3600
    wall, steady = FakeClock(after_midnight), FakeClock(1000.0)
    store = MemoryLimitStore(wall, monotonic=steady)
    wanted = demand(daily_requests=3)
    for _ in range(2):
        await store.settle(await store.reserve(wanted), 0)
    wall.now -= 3600
    await store.reserve(wanted)
    assert "daily requests" in (await refused(store, wanted)).message
    wall.now = after_midnight + 60
    assert (await store.counts("k1")).day_requests == 3
    await store.close()


async def test_a_request_admitted_after_a_step_back_over_midnight_is_settled_into_its_day():
    """Its arrival time says yesterday, but it was counted in today's counters: settling it must correct those (the
    estimate stayed counted, and held as in flight, for the rest of the day)."""
    wall, steady = FakeClock(NOON + 12.5 * 3600), FakeClock(1000.0)
    store = MemoryLimitStore(wall, monotonic=steady)
    await store.settle(await store.reserve(demand(100, daily_tokens=1000)), 10)
    wall.now -= 3600
    await store.settle(await store.reserve(demand(100, daily_tokens=1000)), 10)
    assert (await store.counts("k1")).day_tokens == 20
    assert store._scopes["k1"].day_held_tokens == 0
    await store.close()


async def test_an_in_process_store_says_it_cannot_settle_what_a_shared_one_booked(caplog):
    """A spool left by a process that used Redis, read after limits.store was changed to the in-process store: it
    logged "settling 1 ... reservation(s)", though nothing was (or could be) settled."""
    limiter = Limiter(MemoryLimitStore(), LimitSettings())
    let_go: list[int] = []
    with caplog.at_level(logging.WARNING, logger="server.limits.admission"):
        limiter.settle_orphans([(["r", 1.5, ["key_a"], 90, 4], lambda: let_go.append(1))])
    assert let_go == [1]  # nothing any process of this configuration could settle: the spool lets it go
    assert "not settled: limits.store is in-process now" in caplog.text and "settling" not in caplog.text


async def test_after_a_step_back_over_midnight_the_in_process_store_says_when_its_day_really_resets():
    """NTP stepped the clock back from 00:30 to 23:30 UTC. The store keeps counting the day it had reached (above), so
    its counters reset at the next midnight but one; its refusal said "retry after 1800 s" (x-ratelimit-reset 30m0s,
    the LimitService's reset_seconds the same), and at that midnight the caller was refused again, for a whole day."""
    wall, steady = FakeClock(NOON + 12.5 * 3600), FakeClock(1000.0)  # 00:30 UTC on 2 January
    store = MemoryLimitStore(wall, monotonic=steady)
    scope = Scope("k1", "key k1", KeyLimits(daily_requests=2, max_spend_day=10, max_spend_month=100))
    wanted = Demand((scope,), 0, cost=5)
    for _ in range(2):
        await store.settle(await store.reserve(wanted), 0, 5)
    wall.now -= 3600  # 23:30 on 1 January
    error = await refused(store, wanted)
    day_end = NOON + 36 * 3600 - wall.now  # 3 January 00:00: when the counters of 2 January reset
    assert error.retry_after == pytest.approx(day_end)
    readings = {r.dimension.value: r.wait for r in standing(scope, await store.counts("k1"))}
    assert readings["daily_requests"] == readings["max_spend_day"] == pytest.approx(day_end)
    assert readings["max_spend_month"] == pytest.approx(NOON + 30.5 * 86_400 - wall.now)  # 1 February
    wall.now += error.retry_after
    steady.advance(error.retry_after)
    await store.reserve(wanted)  # admitted when it said
    await store.close()
