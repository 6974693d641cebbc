"""What every limit store shares: the demand a request makes, the reservation it holds, the store interface, and
the one verdict that turns a store's readings into a reservation or a RateLimited error.

A store only counts; it reports each limited dimension of each scope as a Reading, so the memory and Redis stores
cannot disagree about what a refusal says or which limit the x-ratelimit-* headers describe.
"""

from __future__ import annotations

import enum
import functools
import itertools
import math
import os
import secrets
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import date, datetime, timezone
from typing import TYPE_CHECKING, Protocol

from server.domain_keys import KeyLimits
from server.errors import RateLimited
from server.usage.money import usd_text

if TYPE_CHECKING:
    from server.limits.standing import Counts

WINDOW_SECONDS = 60.0  # requests and tokens per minute are counted over a rolling window of this length
DAY_SECONDS = 86_400  # daily quotas reset at UTC midnight (unix time has no leap seconds)
_EPOCH_ORDINAL = date(1970, 1, 1).toordinal()  # day 0 of day_of, as a proleptic Gregorian ordinal
CONCURRENCY_RETRY_SECONDS = 1.0  # a slot frees when some request ends, which nobody can predict: a nominal hint

Clock = Callable[[], float]  # unix seconds; injected so that tests can move time
# What a settlement leaves spent, per scope id: (the day's, the month's) micro-dollars of the reservation's UTC day
# and month, with what requests in flight hold; None where the store no longer holds that day or month.
Spent = dict[str, tuple[int | None, int | None]]


class Dimension(str, enum.Enum):
    """What is limited; the value is the KeyLimits field that sets it.

    The properties below are read several times per request for each limit: cached on the member after the first
    read (a plain attribute then), not recomputed through enum's descriptors every time.
    """

    REQUESTS_PER_MINUTE = "requests_per_minute"
    TOKENS_PER_MINUTE = "tokens_per_minute"
    CONCURRENT_REQUESTS = "concurrent_requests"
    DAILY_TOKENS = "daily_tokens"
    DAILY_REQUESTS = "daily_requests"
    DAILY_SPEND = "max_spend_day"  # budgets, in micro-dollars
    MONTHLY_SPEND = "max_spend_month"

    @functools.cached_property
    def label(self) -> str:
        return _LABELS.get(self.value) or self.value.replace("_", " ")

    @functools.cached_property
    def counts_spend(self) -> bool:
        return self in (Dimension.DAILY_SPEND, Dimension.MONTHLY_SPEND)

    @functools.cached_property
    def counts_tokens(self) -> bool:
        return self in (Dimension.TOKENS_PER_MINUTE, Dimension.DAILY_TOKENS)

    @functools.cached_property
    def header_kind(self) -> str | None:
        """Which x-ratelimit-*-{requests,tokens} headers describe this limit (none for concurrency)."""
        if self.counts_tokens:
            return "tokens"
        return None if self is Dimension.CONCURRENT_REQUESTS or self.counts_spend else "requests"


_LABELS = {"max_spend_day": "spend per UTC day", "max_spend_month": "spend per UTC calendar month"}


@dataclass(frozen=True, slots=True)
class Scope:
    """One set of counters: a key, or a key on one model."""

    id: str  # the counters' name in the store, e.g. "key_ab12" or "key_ab12|family-a-5.5"
    label: str  # how messages name it, e.g. "key key_ab12 on model family-a-5.5"
    limits: KeyLimits
    kind: str = "key"  # "key" or "key_model" (domain_keys.LIMIT_SCOPES): a bounded metric label

    def limit(self, dimension: Dimension) -> int | None:
        return getattr(self.limits, dimension._value_)  # `_value_`: a plain attribute; `.value` is a descriptor


@dataclass(frozen=True, slots=True)
class Demand:
    scopes: tuple[Scope, ...]
    tokens: int  # estimated: prompt tokens + the most the request may generate
    cost: int = 0  # the most the request may cost, in micro-dollars (for budgets)
    # Costing nothing itself, it may be answered by a fallback with a price, so its `cost` is one micro-dollar: a
    # budget with nothing left refuses it, as it would a request with a price (Limiter.reserve).
    fallback_cost: bool = False
    limit_field: str = "max_tokens"  # the caller's field that set the most it may generate, named in a refusal

    def limit(self, scope: Scope, dimension: Dimension) -> int | None:
        """The scope's limit that applies to this request: a request that costs nothing (a model without a price, a
        response-cache hit) is never refused by a budget, even one a dearer request than it reserved took over."""
        if dimension.counts_spend and self.cost == 0:
            return None
        return scope.limit(dimension)


@dataclass(frozen=True, slots=True)
class Reading:
    """One limited dimension of one scope, as the store saw it while deciding.

    `used` includes this request's demand (what the counter holds after admission, or would hold). `wait` is, when
    used > limit, how long until enough frees up for the demand to fit (math.inf: it never fits); otherwise how long
    until the counter next goes down (the x-ratelimit-reset-* value).
    """

    scope: Scope
    dimension: Dimension
    limit: int
    used: int
    wait: float
    # Of `used`, what requests still in flight hold as their most (token limits, budgets): settled, most of it
    # usually comes back within seconds, long before the UTC day or month ends or their entries leave the minute.
    # Read for a refusing reading only (the stores leave it 0 otherwise: not worth its cost on every request).
    held: int = 0

    @property
    def over(self) -> bool:
        return self.used > self.limit

    @property
    def waits_for_requests_in_flight(self) -> bool:
        """The demand would fit if the requests in flight gave back what they hold: when they end, not at the reset."""
        return 0 < self.held and self.used - self.held <= self.limit and not math.isinf(self.wait)

    @property
    def retry_after(self) -> float:
        """How long the caller should wait: a nominal second when requests in flight hold what it needs (nobody can
        say when they end, as for a concurrency slot) unless the reset frees it sooner, else until enough frees up."""
        return min(CONCURRENCY_RETRY_SECONDS, self.wait) if self.waits_for_requests_in_flight else self.wait


@dataclass(frozen=True, slots=True)
class Standing:
    """The tightest limit of one kind (requests or tokens) after admission: the x-ratelimit-* header values."""

    limit: int
    remaining: int
    reset_seconds: float


@dataclass(frozen=True, slots=True)
class Reservation:
    id: str
    demand: Demand
    at: float  # clock time of admission: the rolling windows and the UTC day it was counted in
    requests: Standing | None  # None when no request limit applies
    tokens: Standing | None
    held: bool = True  # False: admitted without counting (the store was unreachable and the policy is fail-open)
    budgets: tuple[Reading, ...] = ()  # the budgets that apply, as read at admission (for the budget gauges)

    def budgets_left(self, spent: Spent, now: float) -> list[tuple[Reading, int]]:
        """What is left of each budget now that this request has ended, in micro-dollars: its limit less the spend
        the store counted once it settled (`spent`, requests that ended meanwhile and what those in flight hold
        included, as the limit status counts it; not what admission read, which missed every request admitted
        after it); nothing, not less, when a dearer fallback took it over. Not of a budget whose UTC day or month
        ended since: that spend says nothing of the new one."""
        left = []
        for r in self.budgets:
            daily = r.dimension is Dimension.DAILY_SPEND
            if (day_of(now) == day_of(self.at)) if daily else (month_of(now) == month_of(self.at)):
                day, month = spent.get(r.scope.id, (None, None))
                if (used := day if daily else month) is not None:
                    left.append((r, max(0, r.limit - used)))
        return left


@dataclass(frozen=True, slots=True)
class Orphan:
    """A reservation in a shared store whose process died before settling it, as its request's spool mark carried it
    (LimitStore.booked): enough for another process to settle it as the request's ledger row says it ended, one
    request with nothing used."""

    id: str
    at: float
    scope_ids: tuple[str, ...]
    tokens: int  # as booked
    cost: int

    @classmethod
    def of(cls, booked: object) -> Orphan | None:
        """From what `booked` returned, read back from a spool line; None for anything else (a damaged line)."""
        try:
            reservation_id, at, scope_ids, tokens, cost = booked  # type: ignore[misc]
            orphan = cls(str(reservation_id), float(at), tuple(str(s) for s in scope_ids), int(tokens), int(cost))
        except (TypeError, ValueError):
            return None
        return orphan if orphan.scope_ids and math.isfinite(orphan.at) else None


class LimitExceeded(RateLimited):
    """A refusal by one of Portico's own limits (an upstream's 429 is a plain RateLimited)."""

    def __init__(self, message: str, *, dimension: Dimension, scope: Scope, retry_after: float = 0.0,
                 standing: Standing | None = None, never_fits: bool = False, at: float = 0.0) -> None:
        super().__init__(message, retry_after=retry_after, subject=f"{scope.label}: {dimension.label}")
        self.at = at  # clock time of the refusal: its standing's reset counts from then
        self.dimension = dimension
        self.scope = scope
        self.never_fits = never_fits  # its reservation alone is over the limit: no wait lets it through
        self.standing = standing  # the refusing limit as x-ratelimit-* values; None when they cannot say it

    def trailing_metadata(self, *, anthropic: bool = False) -> tuple[tuple[str, str], ...]:
        """Also the refusing limit's x-ratelimit-* headers, as OpenAI sends them on a 429 (and Anthropic's names
        for an Anthropic caller), so clients can wait for its reset (none for the concurrency limit). A request that
        could never fit says `x-should-retry: false` instead, which both official SDKs and Portico's client obey:
        retrying it only spends their retries."""
        if self.never_fits:
            return (("x-should-retry", "false"),)
        kind = self.dimension.header_kind
        if kind is None or self.standing is None:
            return super().trailing_metadata(anthropic=anthropic)
        own = ratelimit_headers(kind, self.standing, at=self.at, anthropic=anthropic)
        return (*super().trailing_metadata(anthropic=anthropic), *own)

    def metric_labels(self) -> dict[str, str]:
        return {"limit": self.dimension.value, "scope": self.scope.kind}


class LimitStoreUnavailable(Exception):
    """The store could not decide in time (e.g. Redis unreachable); the Limiter applies the configured policy.

    `unanswered`: a reservation the store may book all the same (Redis got the request, its answer did not come
    back in time, and a paused Redis runs it when it resumes); the Limiter releases it once the store takes that.
    """

    def __init__(self, message: str, unanswered: Reservation | None = None) -> None:
        super().__init__(message)
        self.unanswered = unanswered


class LimitStore(Protocol):
    # True if reserve, settle and release complete without ever waiting (no await that suspends): then no
    # cancellation can interrupt them, and the Limiter runs them at once instead of in a shielded task.
    immediate: bool
    # Its counts are shared with other processes, which can settle a reservation of one that died (`booked`).
    shared: bool

    async def reserve(self, demand: Demand) -> Reservation:
        """Count one request and `demand.tokens` in every scope, and take a concurrency slot, all or nothing.
        Raise RateLimited (naming the limit) if any limit would be exceeded; then nothing is counted."""
        ...

    async def settle(self, reservation: Reservation, used_tokens: int, used_cost: int = 0) -> Spent:
        """Replace the estimates with the tokens and cost really used and free the slot; what is spent then. A
        second call does nothing (and returns nothing)."""
        ...

    async def release(self, reservation: Reservation) -> None:
        """Undo the reservation entirely (the request never reached a model) and free the slot. Idempotent."""
        ...

    def booked(self, reservation: Reservation) -> tuple | None:
        """What another process needs to settle the reservation if this one dies before it does (Orphan): plain
        values for the usage ledger's spool. None from a store whose counts die with its process."""
        ...

    async def settle_orphan(self, orphan: Orphan) -> None:
        """Settle a dead process's reservation as one request with nothing used, and free its slot. A second call,
        or one for a reservation settled meanwhile, does nothing."""
        ...

    async def in_flight(self, scope_id: str) -> int:
        """Open reservations in a scope (for tests and diagnostics)."""
        ...

    async def counts(self, scope_id: str) -> Counts:
        """A scope's counters as they are now, read without booking anything (server/limits/standing.py)."""
        ...

    failure: str | None  # why the last ping failed ("refused the URL's password (...)"), for the log; never a secret
    credentials_refused: bool  # the last ping failed because the store refused the URL's password (or its lack)
    permission_denied: bool  # the last ping failed because the store does not let the URL's user run our commands

    async def ping(self) -> bool:
        """Whether the store answers now (readiness, start-up); never raises."""
        ...

    async def close(self) -> None: ...


class ReservationIds:
    """Reservation ids unique among every process that shares a store: a random prefix, then a count (cheaper than
    asking the OS for random bytes per request). Each store owns one; a forked child draws a prefix of its own, so it
    never repeats its parent's ids."""

    def __init__(self) -> None:
        self._pid = -1

    def new(self) -> str:
        if (pid := os.getpid()) != self._pid:
            self._pid, self._prefix, self._count = pid, secrets.token_hex(8), itertools.count()
        return f"{self._prefix}{next(self._count):x}"


def day_of(at: float) -> int:
    return int(at // DAY_SECONDS)


def until_midnight(at: float) -> float:
    return (day_of(at) + 1) * DAY_SECONDS - at


def within_a_minute(wait: float) -> float:
    """A per-minute window's wait: its entries leave at most a minute after they were booked. One booked by a host
    whose clock runs a little ahead of this one's (NTP keeps them milliseconds apart, never exactly together) reads
    here as leaving a little later: a refusal then said retry-after 61 and, being over a minute, `x-should-retry:
    false`, so both SDKs raised a per-minute refusal at once instead of waiting for it. `inf` (it never fits) stays."""
    return wait if math.isinf(wait) else min(wait, WINDOW_SECONDS)


def month_of(at: float) -> int:
    """Months since January 1970, UTC: budgets per month reset on the first of each month at 00:00 UTC. Read from
    the UTC day, not the instant: fromtimestamp rounds to the microsecond, which put a month's last half microsecond
    in the next month while its day was still the old one."""
    when = date.fromordinal(_EPOCH_ORDINAL + day_of(at))
    return (when.year - 1970) * 12 + when.month - 1


def until_month_end(at: float) -> float:
    year, month = divmod(month_of(at) + 1, 12)
    return datetime(1970 + year, month + 1, 1, tzinfo=timezone.utc).timestamp() - at


def verdict(demand: Demand, readings: Iterable[Reading], *, at: float, reservation_id: str) -> Reservation:
    """The reservation the readings allow, or RateLimited naming the limit that keeps the caller waiting longest."""
    readings = list(readings)
    # A request that adds no tokens (a token count, an image, a cache hit) is not refused by a token limit that
    # others spent; the Redis script decides the same (redis_scripts.RESERVE).
    refusals = [r for r in readings if r.over and (demand.tokens > 0 or not r.dimension.counts_tokens)]
    if refusals:
        raise _refusal(max(refusals, key=lambda r: r.retry_after), demand, at)
    requests = [r for r in readings if r.dimension.header_kind == "requests"]
    tokens = [r for r in readings if r.dimension.header_kind == "tokens"]
    budgets = tuple(r for r in readings if r.dimension.counts_spend)
    return Reservation(reservation_id, demand, at, _tightest(requests), _tightest(tokens), budgets=budgets)


def _tightest(readings: list[Reading]) -> Standing | None:
    if not readings:
        return None
    tightest = min(readings, key=lambda r: (r.limit - r.used, -r.wait))
    return Standing(tightest.limit, max(0, tightest.limit - tightest.used), max(0.0, tightest.wait))


_DAILY = (Dimension.DAILY_TOKENS, Dimension.DAILY_REQUESTS)


def _refusal(reading: Reading, demand: Demand, at: float) -> LimitExceeded:
    if reading.dimension.counts_spend:
        return _budget_refusal(reading, demand, at)
    where = f"{reading.dimension.label} on {reading.scope.label}"
    if math.isinf(reading.wait):
        # Retrying cannot help, so there is no retry hint.
        return LimitExceeded(
            f"Request too large for {where}: it may use up to {demand.tokens} tokens (prompt + max tokens) but "
            f"the limit is {reading.limit}. Lower {demand.limit_field} or shorten the prompt.",
            dimension=reading.dimension, scope=reading.scope, never_fits=True,
        )
    wait = max(reading.retry_after, 0.001)
    if reading.dimension.counts_tokens:
        counts = f"used {reading.used - demand.tokens}{_in_flight(reading, str)}, requested {demand.tokens} tokens"
    else:
        before = reading.used - 1
        counts = f"used {before} request{'' if before == 1 else 's'}"
    used_before = reading.used - (demand.tokens if reading.dimension.counts_tokens else 1)
    when = f"Please retry after {_tenths(wait)} seconds."
    if reading.dimension in _DAILY and not reading.waits_for_requests_in_flight:  # hours away: say when, as budgets do
        when = f"The quota resets at {_utc_minute(at + wait)}; please retry after {_tenths(wait)} seconds."
    return LimitExceeded(
        f"Rate limit reached for {where}: limit {reading.limit}, {counts}. {when}",
        retry_after=wait, dimension=reading.dimension, scope=reading.scope,
        standing=Standing(reading.limit, max(0, reading.limit - used_before), wait), at=at,
    )


def _utc_minute(at: float) -> str:
    return datetime.fromtimestamp(round(at), timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def _tenths(seconds: float) -> str:
    """Seconds as plain decimals with one decimal, rounded up so a hint never says 0.0 (and never 6.72e+04)."""
    return f"{math.ceil(seconds * 10 - 1e-9) / 10:.1f}"  # - 1e-9: a float a hair over 30.0 still says 30.0


def _budget_refusal(reading: Reading, demand: Demand, at: float) -> LimitExceeded:
    """Budgets are named in dollars, with the moment they reset."""
    where = f"the {reading.dimension.label} budget of {reading.scope.label}"
    if math.isinf(reading.wait):
        # A request with no tokens reserved is an image request: its cost is its images.
        most, fix = (("its images at the model's price", "Ask for fewer images") if not demand.tokens else
                     ("prompt + max tokens at the model's prices", f"Lower {demand.limit_field} or shorten the prompt"))
        return LimitExceeded(
            f"Request too large for {where}: it may cost up to {usd_text(demand.cost)} ({most}) but the budget is "
            f"{usd_text(reading.limit)}. {fix}.",
            dimension=reading.dimension, scope=reading.scope, never_fits=True,
        )
    wait = max(reading.retry_after, 0.001)
    spent = f"spent {usd_text(reading.used - demand.cost)}{_in_flight(reading, usd_text)}"
    if reading.waits_for_requests_in_flight:
        when = f"Please retry after {_tenths(wait)} seconds."
    else:
        seconds = math.ceil(wait)
        when = (f"The budget resets at {_utc_minute(at + wait)}; please retry after {seconds} "
                f"second{'' if seconds == 1 else 's'}.")
    asks = ("a fallback with a price may answer this request" if demand.fallback_cost else
            f"this request may cost up to {usd_text(demand.cost)}")
    return LimitExceeded(
        f"Budget reached for {where}: limit {usd_text(reading.limit)}, {spent}, {asks}. {when}",
        retry_after=wait, dimension=reading.dimension, scope=reading.scope,
    )


def _in_flight(reading: Reading, text: Callable[[int], str]) -> str:
    """What of the count requests in flight hold, when that is what the caller waits for."""
    if not reading.waits_for_requests_in_flight:
        return ""
    of = "of it" if reading.dimension.counts_spend else "of them"
    return f" ({text(reading.held)} {of} held by requests in flight until they end)"


def ratelimit_headers(kind: str, standing: Standing, *, at: float, anthropic: bool = False) -> list[tuple[str, str]]:
    """The x-ratelimit-{limit,remaining,reset}-{kind} headers of one limit, as it stood at `at` (clock time); for an
    Anthropic caller also Anthropic's own anthropic-ratelimit-{kind}-{limit,remaining,reset}, which its SDK's users
    read (the reset as an RFC 3339 time: the same moment, rounded up to the second)."""
    headers = [
        (f"x-ratelimit-limit-{kind}", str(standing.limit)),
        (f"x-ratelimit-remaining-{kind}", str(standing.remaining)),
        (f"x-ratelimit-reset-{kind}", duration_text(standing.reset_seconds)),
    ]
    if anthropic:
        headers += [
            (f"anthropic-ratelimit-{kind}-limit", str(standing.limit)),
            (f"anthropic-ratelimit-{kind}-remaining", str(standing.remaining)),
            (f"anthropic-ratelimit-{kind}-reset", reset_time_text(at + max(0.0, standing.reset_seconds))),
        ]
    return headers


def reset_time_text(moment: float) -> str:
    """A reset moment (clock time) rounded up to the second, in RFC 3339 UTC. The moment, not the time the answer is
    written plus the reset: every answer then names one window's end, and a daily reset is midnight, never 00:00:01.
    - 1e-3: the same moment read by two requests differs by float noise, which must not round to the next second."""
    return datetime.fromtimestamp(math.ceil(moment - 1e-3), timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def duration_text(seconds: float) -> str:
    """OpenAI's reset format (Go durations): "250ms", "12.5s", "6m0s", "2h0m0s"."""
    ms = max(0, round(seconds * 1000))
    if ms < 1000:
        return f"{ms}ms"
    hours, rest = divmod(ms, 3_600_000)
    minutes, rest = divmod(rest, 60_000)
    text = f"{rest / 1000:.3f}".rstrip("0").rstrip(".") + "s"
    if hours:
        return f"{hours}h{minutes}m{text}"
    return f"{minutes}m{text}" if minutes else text
