"""Budgets (spend per UTC day and per UTC calendar month, in micro-dollars) in both limit stores, with an injected
clock: the worst case reserved, the real cost settled, refusals naming the budget and its reset."""

from __future__ import annotations

import math

import pytest

from server.domain_keys import KeyLimits
from server.errors import RateLimited
from server.limits import Demand, Scope
from server.limits.core import Dimension, month_of, until_month_end
from server.limits.standing import standing
from tests.limits_support import NOON
from tests.unit.test_limits import clock, store  # noqa: F401 - the same stores (memory, Redis) and clock


def demand(cost: int, **limits) -> Demand:
    return Demand((Scope("k1", "key k1", KeyLimits(**limits)),), tokens=10, cost=cost)


async def refused(store, wanted: Demand) -> RateLimited:
    with pytest.raises(RateLimited) as caught:
        await store.reserve(wanted)
    return caught.value


async def test_a_daily_budget_reserves_the_worst_case_and_settles_the_real_cost(store, clock):
    wanted = demand(4_000, max_spend_day=10_000)  # $0.01 a day; a request may cost up to $0.004
    for _ in range(2):
        await store.settle(await store.reserve(wanted), 10, 3_500)
    error = await refused(store, wanted)  # 7,000 spent + 4,000 > 10,000
    assert error.dimension is Dimension.DAILY_SPEND
    assert error.message.startswith("Budget reached for the spend per UTC day budget of key k1: limit $0.01, "
                                    "spent $0.007, this request may cost up to $0.004.")
    assert "resets at 2026-01-02 00:00 UTC" in error.message
    assert error.retry_after == pytest.approx(12 * 3600)
    clock.advance(1)  # still 12:00 (the day ends at the same minute)
    first = await store.reserve(demand(1_500, max_spend_day=10_000))  # 7,000 + 1,500 held
    second = await store.reserve(demand(1_500, max_spend_day=10_000))  # + 1,500: 10,000
    smaller = demand(3_000, max_spend_day=10_000)  # fits in what the two in flight hold, once they end
    assert (await refused(store, smaller)).retry_after == pytest.approx(1.0)
    await store.settle(first, 10, 500)  # each really cost $0.0005
    await store.settle(second, 10, 500)
    clock.advance(12 * 3600 - 1)  # UTC midnight: a new day's budget
    for _ in range(2):
        await store.settle(await store.reserve(wanted), 10, 1_000)
    for _ in range(2):  # 2,000 spent: two more worst cases fit (2,000 + 8,000), the third does not
        await store.settle(await store.reserve(wanted), 10, 1_000)
    await store.settle(await store.reserve(wanted), 10, 4_000)  # 4,000 spent + 4,000 held fits; now 8,000 spent
    await refused(store, wanted)
    clock.advance(86_400)  # the next UTC midnight: a new day's budget
    await store.reserve(wanted)


async def test_a_budget_held_by_requests_in_flight_asks_for_a_retry_soon_not_at_its_reset(store, clock):
    """The worst cases of requests still running made the next request a 'Budget reached' until UTC midnight, with
    x-should-retry: false, though their real cost, settled seconds later, left room for it."""
    for budget, label in (({"max_spend_day": 10_000}, "day"), ({"max_spend_month": 10_000}, "calendar month")):
        wanted = Demand((Scope(f"k-{label}", "key k1", KeyLimits(**budget)),), tokens=10, cost=6_000)
        running = await store.reserve(wanted)
        error = await refused(store, wanted)
        assert error.retry_after == pytest.approx(1.0) and "x-should-retry" not in dict(error.trailing_metadata())
        assert error.message == (f"Budget reached for the spend per UTC {label} budget of key k1: limit $0.01, spent "
                                 "$0.006 ($0.006 of it held by requests in flight until they end), this request may "
                                 "cost up to $0.006. Please retry after 1.0 seconds.")
        await store.settle(running, 10, 1_000)
        await store.settle(await store.reserve(wanted), 10, 4_000)  # 5,000 spent, nothing in flight
        assert "resets at" in (await refused(store, wanted)).message


async def test_a_released_request_costs_nothing(store):
    wanted = demand(6_000, max_spend_day=10_000)
    await store.release(await store.reserve(wanted))
    await store.reserve(wanted)


async def test_a_monthly_budget_resets_on_the_first_of_the_month(store, clock):
    wanted = demand(5_000, max_spend_month=10_000)
    for _ in range(2):
        await store.settle(await store.reserve(wanted), 10, 5_000)
    clock.advance(86_400)  # another day, the same month
    error = await refused(store, wanted)
    assert error.dimension is Dimension.MONTHLY_SPEND and "spend per UTC calendar month" in error.message
    assert "resets at 2026-02-01 00:00 UTC" in error.message
    assert error.retry_after == pytest.approx(until_month_end(clock.now))
    clock.advance(until_month_end(clock.now))
    await store.reserve(wanted)


async def test_a_request_settled_after_midnight_corrects_its_month_but_not_the_new_day(store, clock):
    """Counted on one UTC day, settled on the next of the same month: the month's spend gets the real cost, and the
    new day's budget starts empty."""
    wanted = demand(6_000, max_spend_day=10_000, max_spend_month=10_000)
    held = await store.reserve(wanted)
    clock.advance(12 * 3600)  # UTC midnight passes while it runs (NOON + 12 h: January 2nd)
    await store.settle(held, 10, 1_000)  # it really cost $0.001: 5,000 of the month's worst case come back
    later = await store.reserve(demand(6_000, max_spend_day=10_000, max_spend_month=10_000))  # 1,000 + 6,000 fit
    await store.settle(later, 10, 6_000)
    error = await refused(store, demand(4_000, max_spend_day=10_000, max_spend_month=10_000))  # 7,000 + 4,000
    assert error.dimension is Dimension.MONTHLY_SPEND


async def test_an_exhausted_budget_asks_clients_not_to_retry_until_it_resets(store):
    await store.settle(await store.reserve(demand(9_000, max_spend_day=10_000)), 10, 9_000)
    error = await refused(store, demand(2_000, max_spend_day=10_000))
    headers = dict(error.trailing_metadata())
    assert headers["x-should-retry"] == "false" and int(headers["retry-after"]) == 12 * 3600  # noon to midnight
    assert not [name for name in headers if name.startswith("x-ratelimit-")]


async def test_a_request_that_could_never_fit_its_budget_has_no_retry_hint(store):
    error = await refused(store, demand(20_000, max_spend_day=10_000))
    assert error.message.startswith("Request too large for the spend per UTC day budget of key k1: it may cost up "
                                    "to $0.02 (prompt + max tokens at the model's prices)")
    assert error.message.endswith("Lower max_tokens or shorten the prompt.") and error.retry_after == 0
    images = Demand((Scope("k1", "key k1", KeyLimits(max_spend_day=10_000)),), tokens=0, cost=40_000)
    error = await refused(store, images)  # an image request reserves no tokens: its cost is its images
    assert "up to $0.04 (its images at the model's price)" in error.message
    assert error.message.endswith("Ask for fewer images.") and "max_tokens" not in error.message


def test_months_are_utc_calendar_months():
    assert month_of(NOON) == (2026 - 1970) * 12
    assert math.isclose(until_month_end(NOON), (31 - 1) * 86_400 + 12 * 3600)
    assert month_of(1_772_323_200.0) == month_of(NOON) + 2  # 2026-03-01 00:00 UTC


async def test_the_last_instant_of_a_month_belongs_to_that_month(store, clock):
    """A clock reading within half a microsecond of a month's end was rounded to the microsecond, into the next
    month: the request was booked on the next month's budget while its day was still the old one, and a refusal then
    said to retry after a whole month."""
    first_of_february = 1_769_904_000.0  # 2026-02-01 00:00 UTC
    clock.now = math.nextafter(first_of_february, 0)  # 2026-01-31 23:59:59.99999976
    wanted = demand(6_000, max_spend_month=10_000)
    await store.settle(await store.reserve(wanted), 10, 6_000)
    error = await refused(store, wanted)
    assert "resets at 2026-02-01 00:00 UTC" in error.message and error.retry_after < 0.01
    assert error.message.endswith("please retry after 1 second.")  # not "1 seconds"
    clock.now = first_of_february
    await store.reserve(wanted)  # February's budget is whole


async def test_what_is_left_after_a_request_that_ran_past_midnight_is_not_put_on_the_new_day(store, clock):
    """portico_budget_remaining_microdollars is what admission read minus the real cost. A request admitted before
    UTC midnight and ended after it set the day's gauge to the old day's remainder (nearly none), which the new day's
    budget, whole, did not have: low-budget alerts fired after midnight."""
    wanted = demand(3_000, max_spend_day=10_000, max_spend_month=50_000)
    await store.settle(await store.reserve(demand(6_000, max_spend_day=10_000, max_spend_month=50_000)), 10, 6_000)
    clock.advance(12 * 3600 - 1)  # 23:59:59 UTC on January 1st
    running = await store.reserve(wanted)
    clock.advance(2)  # it ends on January 2nd: the same month, a new day
    spent = await store.settle(running, 10, 2_000)
    assert {r.dimension: left for r, left in running.budgets_left(spent, clock.now)} == {
        Dimension.MONTHLY_SPEND: 42_000}


async def test_what_is_left_counts_what_requests_admitted_after_it_spent_meanwhile(store, clock):
    """portico_budget_remaining_microdollars: a long request ended last set it to what its admission read less its
    own cost, as if a request admitted while it ran, and ended before it, had spent nothing ($0.009 left, not
    $0.0065)."""
    wanted = demand(3_000, max_spend_day=10_000)
    long = await store.reserve(wanted)
    short = await store.reserve(wanted)
    await store.settle(short, 10, 2_500)
    spent = await store.settle(long, 10, 1_000)
    assert {r.dimension: left for r, left in long.budgets_left(spent, clock.now)} == {Dimension.DAILY_SPEND: 6_500}
    assert await store.settle(long, 10, 1_000) == {}  # settled once: nothing to say the second time


async def test_standing_reads_the_spend_of_the_day_and_month(store):
    wanted = demand(4_000, max_spend_day=10_000, max_spend_month=50_000)
    await store.settle(await store.reserve(wanted), 10, 1_500)
    readings = {r.dimension: r for r in standing(wanted.scopes[0], await store.counts("k1"))}
    assert (readings[Dimension.DAILY_SPEND].used, readings[Dimension.MONTHLY_SPEND].used) == (1_500, 1_500)
    assert readings[Dimension.MONTHLY_SPEND].wait == pytest.approx(until_month_end(NOON))
