"""The in-process limit store: exact counters for one server process (the default).

Rolling windows are logs of (time, tokens) entries, oldest first, with running totals, so a decision costs
O(expired entries) and only a refusal walks the log to work out its retry time. Every method runs without awaiting,
so each decision is atomic on the event loop.

With a `state_path` (the data dir's `limits-daily.json`, set by server/app.py) the day's and month's counters
(daily quotas, spend budgets) outlive a restart: they are written there every couple of seconds while they change,
and on close, and read back at start. The rolling one-minute windows and concurrency slots are not: they end with the
process anyway.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from pathlib import Path
from collections import deque
from dataclasses import dataclass, field

from server.limits.core import (
    CONCURRENCY_RETRY_SECONDS, DAY_SECONDS, WINDOW_SECONDS, Clock, Demand, Dimension, Orphan, Reading, Reservation,
    ReservationIds, Scope, Spent, day_of, month_of, until_midnight, until_month_end, verdict,
)
from server.limits.daily_file import load_daily, save_daily
from server.limits.standing import Counts

_logger = logging.getLogger(__name__)


_DIMENSIONS = tuple(Dimension)  # iterating over a tuple is much cheaper than over the Enum class


@dataclass(eq=False, slots=True)  # eq=False: entries are found by identity, never by value
class _Entry:
    at: float  # on the monotonic clock: a wall clock stepped back would keep the entry in the window that long
    tokens: int
    day: int  # the day and month its scope counted it in (not its arrival's: the wall clock may have stepped back)
    month: int
    running: bool = True  # its request has not ended: `tokens` is still its reservation's most


@dataclass(slots=True)
class _Counters:
    """One scope's counters."""

    window: deque[_Entry] = field(default_factory=deque)
    window_tokens: int = 0
    window_held_tokens: int = 0  # of window_tokens, what entries of requests still running hold (Reading.held)
    in_flight: int = 0
    day: int = 0
    day_requests: int = 0
    day_tokens: int = 0
    day_spend: int = 0  # micro-dollars
    month: int = 0
    month_spend: int = 0
    # What open reservations counted in day_tokens, day_spend and month_spend hold as their most (Reading.held).
    day_held_tokens: int = 0
    day_held_spend: int = 0
    month_held_spend: int = 0

    def catch_up(self, now: float, tick: float) -> None:
        """Drop entries that left the window (`tick`: monotonic time) and start a new day's quota at UTC midnight
        (`now`: wall time; a new month's budget on the first of the month)."""
        while self.window and self.window[0].at <= tick - WINDOW_SECONDS:
            entry = self.window.popleft()
            self.window_tokens -= entry.tokens
            if entry.running:
                self.window_held_tokens -= entry.tokens
        # A wall clock stepped back over midnight (NTP) is no new day: zeroing the counters would refund it. Counters
        # of a day later than that (saved under a clock that was wrong by days) start afresh, not stay for days.
        if (today := day_of(now)) > self.day or today < self.day - 1:
            self.day, self.day_requests, self.day_tokens, self.day_spend = today, 0, 0, 0
            self.day_held_tokens = self.day_held_spend = 0
            if (month := month_of(now)) != self.month:
                self.month, self.month_spend, self.month_held_spend = month, 0, 0

    def idle(self, now: float, tick: float) -> bool:
        """Counting nothing any more, caught up: the same as new counters."""
        self.catch_up(now, tick)
        return not (self.window or self.in_flight or self.day_requests or self.day_tokens or self.day_spend
                    or self.month_spend)

    def in_window(self, entry: _Entry, tick: float) -> bool:
        return entry.at > tick - WINDOW_SECONDS  # catch_up has dropped every entry older than that

    def read(self, scope: Scope, demand: Demand, now: float, tick: float) -> list[Reading]:
        readings = []
        for dimension in _DIMENSIONS:
            if (limit := demand.limit(scope, dimension)) is not None:
                used, wait = self._would_be(dimension, limit, demand, now, tick)
                held = self._held(dimension) if used > limit else 0  # only a refusal reads it
                readings.append(Reading(scope, dimension, limit, used, wait, held))
        return readings

    def _would_be(self, dimension: Dimension, limit: int, demand: Demand, now: float,
                  tick: float) -> tuple[int, float]:
        tokens, cost = demand.tokens, demand.cost
        if dimension is Dimension.DAILY_SPEND:
            return self.day_spend + cost, math.inf if cost > limit else self.until_reset(now)
        if dimension is Dimension.MONTHLY_SPEND:
            return self.month_spend + cost, math.inf if cost > limit else self.until_reset(now, monthly=True)
        if dimension is Dimension.REQUESTS_PER_MINUTE:
            used = len(self.window) + 1
            return used, self._window_wait(used - limit, lambda e: 1, tick)
        if dimension is Dimension.TOKENS_PER_MINUTE:
            used = self.window_tokens + tokens
            if not used:  # no tokens counted: none to go down (and no entries to walk)
                return used, 0.0
            return used, math.inf if tokens > limit else self._window_wait(used - limit, lambda e: e.tokens, tick)
        if dimension is Dimension.CONCURRENT_REQUESTS:
            return self.in_flight + 1, CONCURRENCY_RETRY_SECONDS
        if dimension is Dimension.DAILY_REQUESTS:
            return self.day_requests + 1, self.until_reset(now)
        used = self.day_tokens + tokens
        return used, math.inf if tokens > limit else self.until_reset(now)

    def until_reset(self, now: float, *, monthly: bool = False) -> float:
        """Until catch_up starts the day's (month's) counters afresh: at the end of the day they count, today's but
        after a wall clock stepped back over midnight, which leaves them on the day it had reached (its refusals said
        to retry at the clock's midnight, and were refused there again for a whole day)."""
        start = max(now, self.day * DAY_SECONDS)
        return start - now + (until_month_end(start) if monthly else until_midnight(start))

    def _held(self, dimension: Dimension) -> int:
        if dimension is Dimension.TOKENS_PER_MINUTE:
            return self.window_held_tokens
        if dimension is Dimension.DAILY_TOKENS:
            return self.day_held_tokens
        if dimension is Dimension.DAILY_SPEND:
            return self.day_held_spend
        return self.month_held_spend if dimension is Dimension.MONTHLY_SPEND else 0

    def _window_wait(self, excess: int, weight, tick: float) -> float:
        """Seconds until entries worth `excess` have left the window; with no excess, until the count next goes
        down (the reset time of an admitted request): when the oldest entry that counts leaves (an entry without
        tokens frees no tokens), else when its own, not in the window yet, does."""
        freed, excess = 0, max(excess, 1)
        for entry in self.window:
            freed += weight(entry)
            if freed >= excess:
                return entry.at + WINDOW_SECONDS - tick
        return WINDOW_SECONDS


@dataclass(slots=True)
class _Held:
    reservation: Reservation
    entries: dict[str, _Entry]  # scope id -> this reservation's entry in that scope's window


class MemoryLimitStore:
    immediate = True  # no method awaits anything
    shared = False
    failure = None  # it always answers
    credentials_refused = permission_denied = False

    def __init__(self, clock: Clock = time.time, *, monotonic: Clock | None = None, state_path: Path | None = None,
                 save_every_s: float = 2.0) -> None:
        self._clock = clock  # days and months
        # The rolling windows: the monotonic clock, unless a test injected its own wall clock and no other.
        self._monotonic = monotonic or (time.monotonic if clock is time.time else clock)
        self._scopes: dict[str, _Counters] = {}
        self._held: dict[str, _Held] = {}
        self._ids = ReservationIds()
        self._state_path = state_path
        self._save_every_s = save_every_s
        self._saver: asyncio.Task | None = None
        self._save_failing = False
        if state_path is not None:
            for scope_id, (day, requests, tokens, spend, month, month_spend) in load_daily(state_path).items():
                self._scopes[scope_id] = _Counters(day=day, day_requests=requests, day_tokens=tokens,
                                                   day_spend=spend, month=month, month_spend=month_spend)

    def _counters(self, scope_id: str, now: float, tick: float) -> _Counters:
        counters = self._scopes.get(scope_id)
        if counters is None:  # not setdefault: that would build new counters (and a datetime) on every call
            counters = self._scopes[scope_id] = _Counters(day=day_of(now), month=month_of(now))
        counters.catch_up(now, tick)
        return counters

    async def reserve(self, demand: Demand) -> Reservation:
        now, tick = self._clock(), self._monotonic()
        readings = [r for s in demand.scopes for r in self._counters(s.id, now, tick).read(s, demand, now, tick)]
        reservation = verdict(demand, readings, at=now, reservation_id=self._ids.new())
        entries = {}
        for scope in demand.scopes:
            counters = self._scopes[scope.id]
            entry = entries[scope.id] = _Entry(tick, demand.tokens, counters.day, counters.month)
            counters.window.append(entry)
            counters.window_tokens += demand.tokens
            counters.window_held_tokens += demand.tokens
            counters.in_flight += 1
            counters.day_requests += 1
            counters.day_tokens += demand.tokens
            counters.day_spend += demand.cost
            counters.month_spend += demand.cost
            counters.day_held_tokens += demand.tokens
            counters.day_held_spend += demand.cost
            counters.month_held_spend += demand.cost
        self._held[reservation.id] = _Held(reservation, entries)
        if self._state_path is not None and self._saver is None:
            self._saver = asyncio.get_running_loop().create_task(self._save_while_running())
        return reservation

    async def _save_while_running(self) -> None:
        saved: dict | None = None
        while True:
            await asyncio.sleep(self._save_every_s)
            self._forget_idle()
            if (rows := self._daily_rows()) != saved and self._save(rows):
                saved = rows  # else tried again at the next pass, also when no request comes meanwhile

    def _forget_idle(self) -> None:
        """Drop the counters of scopes that count nothing any more (made again on first use), as Redis expires idle
        ones: else every key that ever made a request stayed, in memory and in the file saved and read back."""
        now, tick = self._clock(), self._monotonic()
        for scope_id in [scope_id for scope_id, counters in self._scopes.items() if counters.idle(now, tick)]:
            del self._scopes[scope_id]

    def _save(self, rows: dict[str, tuple[int, int, int, int, int, int]]) -> bool:
        """Logged once when saving starts failing (a full disk) and once when it works again."""
        try:
            save_daily(self._state_path, rows)
        except OSError as exc:
            if not self._save_failing:
                _logger.error("daily limit counters cannot be saved to %s (%s); tried again every %gs, a restart "
                              "meanwhile refunds today's quotas since the last save", self._state_path, exc,
                              self._save_every_s)
                self._save_failing = True
            return False
        if self._save_failing:
            _logger.warning("daily limit counters saved to %s again", self._state_path)
            self._save_failing = False
        return True

    def _daily_rows(self) -> dict[str, tuple[int, int, int, int, int, int]]:
        """Without what requests still running hold: read back after a crash, each counts as its usage-ledger row
        (written from its spool mark) says it ended, one request with nothing used."""
        return {scope_id: (c.day, c.day_requests, c.day_tokens - c.day_held_tokens, c.day_spend - c.day_held_spend,
                           c.month, c.month_spend - c.month_held_spend)
                for scope_id, c in self._scopes.items()}

    async def settle(self, reservation: Reservation, used_tokens: int, used_cost: int = 0) -> Spent:
        return self._finish(reservation, used_tokens, used_cost, refund=False)

    async def release(self, reservation: Reservation) -> None:
        self._finish(reservation, 0, 0, refund=True)

    def _finish(self, reservation: Reservation, used_tokens: int, used_cost: int, *, refund: bool) -> Spent:
        held = self._held.pop(reservation.id, None)
        spent: Spent = {}
        if held is None:
            return spent
        now, tick = self._clock(), self._monotonic()
        change = used_tokens - reservation.demand.tokens
        cost_change = used_cost - reservation.demand.cost
        for scope_id, entry in held.entries.items():
            counters = self._counters(scope_id, now, tick)
            counters.in_flight -= 1
            entry.running = False
            if counters.in_window(entry, tick):
                if refund:
                    counters.window.remove(entry)
                else:
                    entry.tokens = used_tokens
                counters.window_tokens += change
                counters.window_held_tokens -= reservation.demand.tokens
            # Corrections go to the day the request was counted in; after UTC midnight that day is gone.
            same_day = counters.day == entry.day
            if same_day:
                counters.day_tokens += change
                counters.day_requests -= 1 if refund else 0
                counters.day_spend += cost_change
                counters.day_held_tokens -= reservation.demand.tokens
                counters.day_held_spend -= reservation.demand.cost
            same_month = same_day or counters.month == entry.month  # the same day is the same month
            if same_month:
                counters.month_spend += cost_change
                counters.month_held_spend -= reservation.demand.cost
            spent[scope_id] = (counters.day_spend if same_day else None, counters.month_spend if same_month else None)
        return spent

    def booked(self, reservation: Reservation) -> None:
        return None  # its counts die with it, but the day's and month's, saved without what running requests hold

    async def settle_orphan(self, orphan: Orphan) -> None:
        pass  # never booked here: a store of another kind's, from before the configuration changed

    async def counts(self, scope_id: str) -> Counts:
        now, tick = self._clock(), self._monotonic()
        counters = self._counters(scope_id, now, tick)
        window = tuple((entry.at + now - tick, entry.tokens) for entry in counters.window)  # in wall time
        return Counts(now, window, counters.in_flight, counters.day_requests, counters.day_tokens,
                      counters.day_spend, counters.month_spend, counters.until_reset(now),
                      counters.until_reset(now, monthly=True))

    async def in_flight(self, scope_id: str) -> int:
        """Open reservations in a scope (for tests and diagnostics)."""
        counters = self._scopes.get(scope_id)
        return counters.in_flight if counters else 0

    async def ping(self) -> bool:
        return True  # in this process: it always answers

    async def close(self) -> None:
        if self._saver is not None:
            self._saver.cancel()
            await asyncio.gather(self._saver, return_exceptions=True)
        if self._state_path is not None:
            self._forget_idle()
            self._save(self._daily_rows())
