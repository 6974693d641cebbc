"""The Redis limit store: counters shared by every server process (and host) that uses the same Redis.

Decisions run as Lua scripts (server/limits/redis_scripts.py), atomic in Redis, sent over one pipelined connection
per process (server/limits/redis_pipe.py). Concurrency slots are leases: each process renews the slots it holds every
lease/3 seconds, so the slots of a process that crashed (and can never settle) run out within `lease_seconds`. Every
Redis call has a short deadline; when Redis cannot answer in time the store raises LimitStoreUnavailable and the
Limiter applies the configured fail-open or fail-closed policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import Iterable

from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from server.limits.core import (
    CONCURRENCY_RETRY_SECONDS, DAY_SECONDS, WINDOW_SECONDS, Clock, Demand, Dimension, LimitStoreUnavailable,
    Orphan, Reading, Reservation, ReservationIds, Spent, day_of, month_of, until_month_end, verdict, within_a_minute,
)
from server.limits.redis_pipe import Dispatch, RedisPipe, Refusing, Script
from server.limits.redis_scripts import PING, RENEW, RESERVE, SETTLE
from server.limits.settings import redacted
from server.limits.standing import Counts

_logger = logging.getLogger(__name__)

_DIMENSIONS = tuple(Dimension)  # the scripts' dimension indexes
_DAY_TTL = 2 * DAY_SECONDS  # a day's counters outlive it a little, for late settlements
_RECORD_TTL = 2 * DAY_SECONDS  # how long an unsettled reservation can still be settled
_MONTH_TTL = 33 * DAY_SECONDS  # a month's spend outlives it a little, for late settlements
# Redis could not answer, or answered that it cannot serve now (not: any other error, a bug, raised as such).
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError, Refusing)
# The scripts' numbers are Lua doubles, exact only up to 2**53 and handed back to Redis as "1.2e+17" (which INCRBY
# refuses) past 17 digits; the API takes max_tokens up to 2**63 - 1. A request books at most this many tokens, or
# one more than its largest token limit, and at most _MOST_COST micro-dollars (budgets are at most 10**15): still
# over every limit it is over, so no verdict changes; only what nothing limits is booked for less than it asked.
_MOST_TOKENS = 2**32
_MOST_COST = 2**50


def _booked(demand: Demand, tokens: int, cost: int) -> tuple[int, int]:
    if tokens > _MOST_TOKENS:  # rare: only then are the limits read
        largest = max((scope.limit(d) or 0 for scope in demand.scopes for d in _DIMENSIONS if d.counts_tokens),
                      default=0)
        tokens = min(tokens, max(_MOST_TOKENS, largest + 1))
    return tokens, min(cost, _MOST_COST)


def _window_wait(dimension: Dimension, wait: float) -> float:
    if dimension is Dimension.REQUESTS_PER_MINUTE or dimension is Dimension.TOKENS_PER_MINUTE:
        return within_a_minute(wait)  # the hosts' entries, by their clocks
    return wait


class RedisLimitStore:
    immediate = False  # every decision is a round trip to Redis
    shared = True

    def __init__(
        self,
        url: str,
        *,
        clock: Clock = time.time,
        lease_seconds: float = 30.0,
        timeout_seconds: float = 0.5,
        prefix: str = "portico:limits:",
    ) -> None:
        self._url = redacted(url)
        self.failure: str | None = None  # why the last ping failed, for the log (LimitStore.failure)
        self.credentials_refused = False
        self.permission_denied = False
        self._clock = clock
        self._lease = lease_seconds
        self._prefix = prefix
        self._deadline = timeout_seconds * 3  # connect + a retried command, with room to spare
        self._slots_ttl = math.ceil(lease_seconds * 2)  # a slots set's expiry, as the reserve script sets it
        # Every call of this process shares one connection (commands pipelined, replies in order). One retry, on
        # connection errors only: the connection may be stale after Redis restarted. Timeouts are not retried, so a
        # Redis that does not answer costs one timeout.
        self._redis = RedisPipe(url, timeout=timeout_seconds)
        self._reserve_script = Script(RESERVE)
        self._settle_script = Script(SETTLE)
        self._renew_script = Script(RENEW)
        self._ping_script = Script(PING)
        self._held: dict[str, Reservation] = {}  # this process's open reservations, whose leases it renews
        self._ids = ReservationIds()
        self._renewer: asyncio.Task | None = None

    def _scope_keys(self, scope_id: str, at: float) -> list[str]:
        base = f"{self._prefix}{scope_id}:"
        return [base + "win", base + "wtok", base + "wsum", self._slots_key(scope_id), f"{base}day:{day_of(at)}",
                f"{base}month:{month_of(at)}"]

    def _slots_key(self, scope_id: str) -> str:
        return f"{self._prefix}{scope_id}:slots"

    def _record_key(self, reservation_id: str) -> str:
        return f"{self._prefix}reservation:{reservation_id}"

    async def _run(self, script: Script, keys: list[str], args: list, dispatch: Dispatch | None = None,
                   waited_on: bool = False) -> list:
        try:
            async with asyncio.timeout(self._deadline):
                return await self._redis.run(script, keys, args, dispatch, waited_on)
        except _UNREACHABLE as exc:
            raise self._unavailable(exc) from exc

    def _unavailable(self, exc: Exception) -> LimitStoreUnavailable:
        return LimitStoreUnavailable(f"the limit store {self._url} {_why(exc)}")

    async def reserve(self, demand: Demand) -> Reservation:
        now = self._clock()
        reservation_id = self._ids.new()
        if not demand.scopes:
            return verdict(demand, (), at=now, reservation_id=reservation_id)
        keys = [self._record_key(reservation_id)]
        tokens, cost = _booked(demand, demand.tokens, demand.cost)
        args: list = [now, tokens, reservation_id, self._lease, WINDOW_SECONDS, _DAY_TTL, _RECORD_TTL,
                      CONCURRENCY_RETRY_SECONDS, cost, until_month_end(now), _MONTH_TTL]
        for scope in demand.scopes:
            keys += self._scope_keys(scope.id, now)
            args += [demand.limit(scope, d) or 0 for d in _DIMENSIONS]
        dispatch = Dispatch()
        try:
            # Waited on by its request: while Redis is silent, refused at once but once a second (redis_pipe.Silence).
            reply = await self._run(self._reserve_script, keys, args, dispatch, waited_on=True)
        except LimitStoreUnavailable as exc:
            if dispatch.sent:  # Redis may book it yet (a paused one, when it resumes): the Limiter undoes it then
                exc.unanswered = Reservation(reservation_id, demand, now, None, None)
            raise
        if reply[0] == -1:  # run twice (resent after a broken connection): the first run's booking is undone
            raise LimitStoreUnavailable(f"the limit store {self._url} had decided this reservation before",
                                        Reservation(reservation_id, demand, now, None, None))
        readings = [
            Reading(demand.scopes[int(s)], _DIMENSIONS[int(d)], int(limit), int(used),
                    _window_wait(_DIMENSIONS[int(d)], float(wait)), int(held))
            for s, d, limit, used, wait, held in zip(*[iter(reply[1:])] * 6)
        ]
        reservation = verdict(demand, readings, at=now, reservation_id=reservation_id)  # raises when refused
        self._held[reservation.id] = reservation
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.create_task(self._renew_leases())
        return reservation

    async def settle(self, reservation: Reservation, used_tokens: int, used_cost: int = 0) -> Spent:
        return await self._finish(reservation, used_tokens, used_cost, refund=False)

    async def release(self, reservation: Reservation) -> None:
        await self._finish(reservation, 0, 0, refund=True)

    async def _finish(self, reservation: Reservation, used_tokens: int, used_cost: int, *, refund: bool) -> Spent:
        # Its lease is renewed no more: the request is over, even if Redis does not take this now. Not a reason to
        # skip the script, which a retry after a timeout needs (it ignores a reservation settled already).
        self._held.pop(reservation.id, None)
        if (booked := self.booked(reservation)) is None:
            return {}  # nothing was counted
        reservation_id, at, scope_ids, tokens, cost = booked
        used_tokens, used_cost = _booked(reservation.demand, used_tokens, used_cost)
        return await self._settle(reservation_id, at, scope_ids, (used_tokens, tokens), (used_cost, cost),
                                  refund=refund)

    def booked(self, reservation: Reservation) -> tuple | None:
        if not reservation.demand.scopes:
            return None
        tokens, cost = _booked(reservation.demand, reservation.demand.tokens, reservation.demand.cost)
        return reservation.id, reservation.at, [scope.id for scope in reservation.demand.scopes], tokens, cost

    async def settle_orphan(self, orphan: Orphan) -> None:
        await self._settle(orphan.id, orphan.at, orphan.scope_ids, (0, orphan.tokens), (0, orphan.cost),
                           refund=False)

    async def _settle(self, reservation_id: str, at: float, scope_ids: Iterable[str], tokens: tuple[int, int],
                      cost: tuple[int, int], *, refund: bool) -> Spent:
        """`tokens` and `cost`: (used, as booked)."""
        scope_ids = list(scope_ids)
        keys = [self._record_key(reservation_id)]
        for scope_id in scope_ids:
            keys += self._scope_keys(scope_id, at)
        window_ttl = int(WINDOW_SECONDS + self._lease) + 1
        args = [reservation_id, tokens[0], tokens[1], int(refund), window_ttl, cost[0], cost[1], _RECORD_TTL]
        reply = await self._run(self._settle_script, keys, args)
        if not isinstance(reply, list):  # settled before: nothing changed
            return {}
        spends = [None if int(v) < 0 else int(v) for v in reply[1:]]
        return {scope_id: (spends[2 * i], spends[2 * i + 1]) for i, scope_id in enumerate(scope_ids)}

    async def _renew_leases(self) -> None:
        """Every lease/3 seconds, push the lease of every slot this process holds, and the expiry of the sets
        holding them: admission gives a set two leases to live, and a request may run for longer (its slot was lost
        with the set, and the limit let an extra request in). A slot whose lease ran out while Redis did not answer,
        or that a Redis restarted without its data lost, is booked again (the RENEW script: only while its
        reservation is unsettled). So a renewal Redis missed is tried again within a second, and so is one after a
        new connection (readiness pings every second), which a restart between two renewals makes: its slots are
        back about a second after Redis answers, not a third of a lease later. A process that stops renewing still
        frees its slots within a lease: admission prunes expired leases."""
        tick = min(1.0, self._lease / 3)
        due = time.monotonic() + self._lease / 3
        renewed_on = self._redis.connections
        failing = False  # logged once when renewals begin to fail and once when one is taken again, not each tick
        while True:
            await asyncio.sleep(tick)
            if not self._held or (time.monotonic() < due and self._redis.connections == renewed_on):
                continue
            renewed_on = self._redis.connections
            due = time.monotonic() + self._lease / 3
            expiry = self._clock() + self._lease
            keys: list[str] = []
            args: list = [expiry, self._slots_ttl]
            for reservation in list(self._held.values()):
                keys.append(self._record_key(reservation.id))
                keys += [self._slots_key(scope.id) for scope in reservation.demand.scopes]
                args += [reservation.id, len(reservation.demand.scopes)]
            try:
                async with asyncio.timeout(self._deadline):
                    await self._redis.run(self._renew_script, keys, args)
            except _UNREACHABLE as exc:
                if not failing:
                    _logger.warning("could not renew concurrency leases in %s: %s; retried every %gs until it "
                                    "answers", self._url, type(exc).__name__, tick)
                failing = True
                due = time.monotonic()
            else:
                if failing:
                    _logger.info("concurrency leases in %s renewed again", self._url)
                failing = False

    async def ping(self) -> bool:
        """Whether Redis takes a write from a script, as admissions need: a replica, or a Redis out of memory,
        answers PING but cannot count, nor can an ACL user not allowed scripts (NOPERM: @write does not grant them)."""
        try:
            async with asyncio.timeout(self._deadline):
                answered = await self._redis.run(self._ping_script, [f"{self._prefix}ping"], []) == 1
        except _UNREACHABLE as exc:
            self.failure = _why(exc)
            code = str(exc).split(" ", 1)[0] if isinstance(exc, Refusing) else ""
            self.credentials_refused = isinstance(exc, AuthenticationError) or code in ("NOAUTH", "WRONGPASS")
            self.permission_denied = code == "NOPERM"
            return False
        self.failure = None if answered else "did not take a write"
        self.credentials_refused = self.permission_denied = False
        return answered

    async def counts(self, scope_id: str) -> Counts:
        """Read-only (nothing pruned or booked), so it needs no script: the window's entries and their tokens, the
        unexpired slots and today's totals."""
        now = self._clock()
        win, wtok, _, slots, day, month = self._scope_keys(scope_id, now)
        try:
            async with asyncio.timeout(self._deadline):
                entries, in_flight, today, this_month = await self._redis.execute_many([
                    ("ZRANGEBYSCORE", win, f"({now - WINDOW_SECONDS}", "+inf", "WITHSCORES"),
                    ("ZCOUNT", slots, f"({now}", "+inf"),
                    ("HMGET", day, "requests", "tokens", "spend"),
                    ("HGET", month, "spend"),
                ])
                ids = entries[0::2]
                tokens = await self._redis.execute("HMGET", wtok, *ids) if ids else []
        except _UNREACHABLE as exc:
            raise self._unavailable(exc) from exc
        window = tuple((float(at), int(t or 0)) for at, t in zip(entries[1::2], tokens))
        return Counts(now, window, int(in_flight), int(today[0] or 0), int(today[1] or 0), int(today[2] or 0),
                      int(this_month or 0))

    async def in_flight(self, scope_id: str) -> int:
        """Unexpired slots in a scope (for tests and diagnostics)."""
        return await self._redis.execute("ZCOUNT", self._slots_key(scope_id), f"({self._clock()}", "+inf")

    async def close(self) -> None:
        if self._renewer is not None:
            self._renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._renewer
        await self._redis.close()


def _why(exc: Exception) -> str:
    """What went wrong, for the log: a password refused or missing apart from a Redis that is down, never the
    password itself (redis-py's and Redis's words name none)."""
    if isinstance(exc, AuthenticationError):  # WRONGPASS, or a password given to a Redis that has none
        return f"refused the URL's password ({exc})"
    if isinstance(exc, Refusing):  # its error code only: the rest may quote a script
        code = str(exc).split(" ", 1)[0]
        if code == "NOAUTH":
            return "requires a password, which the URL does not give (NOAUTH)"
        if code == "NOPERM":  # the user's ACL: the limits need scripts (EVALSHA, EVAL) that write its keys
            return "does not let the URL's user run the limits' commands (NOPERM: its ACL must allow scripts and " \
                   "their writes)"
        return f"cannot serve now: {code}"
    if isinstance(exc, RedisConnectionError) and str(exc):  # redis-py's words name the host, never the password:
        return f"cannot be connected to: {str(exc)[:300]}"  # refused, reset, a certificate not trusted, ...
    return f"did not answer: {type(exc).__name__}"
