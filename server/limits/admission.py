"""Admission: which limits apply to a request (configured defaults, the key's own values, per-model limits), and
the x-ratelimit-* headers of an admitted one. The pipeline talks to this; the store behind it only counts."""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

from server.domain_keys import KEY_LIMIT_NAMES, ApiKey, KeyLimits
from server.errors import ServiceUnavailable
from server.limits.core import (
    Demand, LimitStore, LimitStoreUnavailable, Orphan, Reading, Reservation, ReservationIds, Scope, Spent,
    ratelimit_headers,
)
from server.limits.settings import LimitSettings, redacted
from server.limits.standing import standing

_logger = logging.getLogger(__name__)
T = TypeVar("T")

# A settlement the store did not take (Redis unreachable) is retried, first after this long, then twice as long each
# time up to the last figure, for up to SETTLE_RETRY_SECONDS (a restarted or paused Redis, not a lost one).
_FIRST_RETRY_SECONDS = 0.25
_LAST_RETRY_SECONDS = 10.0
SETTLE_RETRY_SECONDS = 600.0


_NO_LIMITS = KeyLimits()


def effective_limits(key: KeyLimits, defaults: KeyLimits) -> KeyLimits:
    """The key's own value for each dimension, else the configured default."""
    if defaults == _NO_LIMITS:
        return key
    return KeyLimits(**{
        name: value if (value := getattr(key, name)) is not None else getattr(defaults, name)
        for name in KEY_LIMIT_NAMES
    })


class Limiter:
    def __init__(self, store: LimitStore, settings: LimitSettings) -> None:
        self._store = store
        # A store whose operations never wait (the in-process one) decides within the caller's own step, where no
        # cancellation can reach it: it is called directly, without a task and a shield per call.
        self._immediate = store.immediate
        self._settings = settings
        self._store_down = False  # to log outages once, not once per request
        self._tasks: set[asyncio.Task] = set()
        self._draining = asyncio.Event()  # set by close(): settlements still retrying take their last try
        # Set (and replaced) when the store answers again after an outage: settlements waiting to retry go at once,
        # not at the end of a pause that may have grown to _LAST_RETRY_SECONDS, holding estimates and slots till then.
        self._store_back = asyncio.Event()
        # Settlements retrying while the store does not answer, and how many began to since none was: logged once
        # when the first begins and once when the last ends, not once each (as many as requests were running).
        self._retrying = self._retried = self._given_up = 0
        self._ids = ReservationIds()  # for the uncounted reservations of the open policy

    @property
    def store(self) -> LimitStore:
        return self._store

    def scopes(self, key: ApiKey, model_id: str) -> tuple[Scope, ...]:
        scopes = [Scope(key.id, f"key {key.id}", effective_limits(key.limits, self._settings.defaults))]
        if (per_model := self._settings.models.get(model_id)) is not None:
            scopes.append(Scope(f"{key.id}|{model_id}", f"key {key.id} on model {model_id}", per_model, "key_model"))
        return tuple(s for s in scopes if s.limits != _NO_LIMITS)

    async def standing(self, key: ApiKey) -> list[Reading]:
        """Where each of the key's limits stands now: its own scope, then its scope on each model it may use that has
        per-model limits (limits.models). Raises LimitStoreUnavailable when the store cannot answer."""
        models = ("", *(model_id for model_id in self._settings.models if key.may_use(model_id)))
        scopes = {scope.id: scope for model_id in models for scope in self.scopes(key, model_id)}
        return [reading for scope in scopes.values() for reading in standing(scope, await self._store.counts(scope.id))]

    async def reserve(self, key: ApiKey, model_id: str, tokens: int, cost: int = 0, *, may_cost: bool = False,
                      limit_field: str = "max_tokens") -> Reservation:
        """Reserve `tokens` and `cost` (micro-dollars, the most the request may cost; `may_cost`: a fallback with a
        price may answer it, whatever `cost`, so at no cost of its own it reserves one micro-dollar, which a budget
        with nothing left refuses; `limit_field`: the caller's field a too-large refusal names). Raises RateLimited
        when a limit or budget would be exceeded, ServiceUnavailable when the store cannot answer and the policy is
        fail-closed."""
        fallback_cost = may_cost and cost == 0
        demand = Demand(self.scopes(key, model_id), tokens, 1 if fallback_cost else cost, fallback_cost, limit_field)
        try:
            reservation = await self._reserve_uncancelled(demand)
        except LimitStoreUnavailable as exc:
            self._store_met(str(exc))
            if self._settings.on_store_error == "open":
                return Reservation(self._ids.new(), demand, time.time(), None, None, held=False)
            raise ServiceUnavailable(
                "Rate limits cannot be checked right now (the limit store is unreachable), so the request was not "
                "admitted. Please retry shortly.",
                retry_after=1.0,
            ) from exc
        self._store_met(None)
        return reservation

    async def check_store(self) -> bool:
        """Whether the store answers now (start-up, and the readiness check every second), logged as an admission's
        call is: requests alone left an outage without traffic unsaid, its end too, and so a second outage soon
        after had no line of its own. One line when an outage begins (the start-up one among them), one at its end.
        """
        answered = await self._store.ping()
        self._store_met(None if answered else f"the limit store {redacted(self._settings.store)} "
                                              f"{self._store.failure}")
        return answered

    def _store_met(self, failure: str | None) -> None:
        """What a call to the store met: None, an answer; else what failed ("the limit store ... did not answer")."""
        if failure is None:
            if self._store_down:
                _logger.warning("rate limits available again")
                self._store_down = False
                self._store_back.set()
                self._store_back = asyncio.Event()
        elif not self._store_down:
            self._store_down = True
            _logger.error("rate limits unavailable (%s); until it answers, requests are %s", failure,
                          "admitted without limits" if self._settings.on_store_error == "open" else
                          "refused with 503")

    async def _reserve_uncancelled(self, demand: Demand) -> Reservation:
        """A caller that goes away while the store is deciding must not leave a reservation behind: the decision
        runs to its end, and whatever it booked is released."""
        if self._immediate:
            return _run_now(self._store.reserve(demand))
        decision = self._spawn(self._decide(demand))
        try:
            return await asyncio.shield(decision)
        except asyncio.CancelledError:
            decision.add_done_callback(self._release_orphan)
            raise

    async def _decide(self, demand: Demand) -> Reservation:
        try:
            return await self._store.reserve(demand)
        except LimitStoreUnavailable as exc:
            # The request is refused (or admitted uncounted), but the store may book it all the same once it catches
            # up (a paused Redis runs what it was sent): undone as soon as the store takes that, as settlements are.
            if exc.unanswered is not None:
                self.release(exc.unanswered)
            raise

    def _release_orphan(self, decision: asyncio.Task[Reservation]) -> None:
        if not decision.cancelled() and decision.exception() is None:
            self.release(decision.result())

    def settle(self, reservation: Reservation, used_tokens: int, used_cost: int = 0,
               budgets_left: Callable[[list[tuple[Reading, int]]], None] | None = None) -> None:
        """Replace the reservation's estimates with what the request used. Never waits, so it cannot be interrupted:
        it runs on exit paths, often after the answer went out, in a task being cancelled because its caller left.
        `budgets_left` is told what is left of the request's budgets once the store took it (Reservation.budgets_left).
        """
        if not reservation.held:
            return
        report = None
        if budgets_left is not None and reservation.budgets:
            def report(spent: Spent) -> None:
                budgets_left(reservation.budgets_left(spent, time.time()))
        self._finish(functools.partial(self._store.settle, reservation, used_tokens, used_cost), report=report)

    def release(self, reservation: Reservation) -> None:
        """Undo the reservation: its request never reached a model (its caller left while it was being admitted,
        or the store's answer never came). Never waits, as `settle`."""
        if reservation.held:
            self._finish(functools.partial(self._store.release, reservation))

    def booked(self, reservation: Reservation) -> tuple | None:
        """What the next process to start needs to settle the reservation if this one dies first (LimitStore.booked),
        for the request's mark in the usage ledger's spool."""
        return self._store.booked(reservation) if reservation.held else None

    def settle_orphans(self, booked: Iterable[tuple[object, Callable[[], None]]]) -> None:
        """Settle the reservations of requests whose process died while they ran, as their ledger rows say they
        ended (one request, nothing used): read back from the dead process's spool (`booked`, each with what to call
        once the store took it, so that the spool keeps it for the next process until then). Never waits; each is
        retried as a settlement is."""
        orphans = []
        for value, settled in booked:
            if (orphan := Orphan.of(value)) is None:
                settled()  # a damaged line: nothing any process could settle
            else:
                orphans.append((orphan, settled))
        if orphans and not self._store.shared:  # booked in Redis before limits.store changed: none to settle here
            _logger.warning("%d rate-limit reservation(s) that a process which ended had booked in a shared limit "
                            "store are not settled: limits.store is in-process now", len(orphans))
            for _, settled in orphans:
                settled()
            return
        if orphans:
            _logger.warning("settling %d rate-limit reservation(s) of requests whose process ended (killed?) while "
                            "they ran: one request each, nothing used", len(orphans))
        for orphan, settled in orphans:
            self._finish(functools.partial(self._store.settle_orphan, orphan), settled)

    def _finish(self, attempt: Callable[[], Coroutine[Any, Any, Any]], settled: Callable[[], None] | None = None,
                report: Callable[[Any], None] | None = None) -> None:
        """At once for a store that does not wait; else in a task held here, retried until taken (`_until_taken`).
        `settled` is called once the store took it (not when it gave up: the estimates are still counted), `report`
        with what the store answered."""
        if self._immediate:
            result = _run_now(_logged(attempt()))
            if settled is not None:
                settled()
            if report is not None and result is not None:
                report(result)
        else:
            task = self._spawn(self._until_taken(attempt, kept=settled is not None, report=report))
            if settled is not None:
                task.add_done_callback(lambda done: not done.cancelled() and done.result() and settled())

    async def settled(self) -> None:
        """Wait for the settlements under way now (tests, diagnostics)."""
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _until_taken(self, attempt: Callable[[], Awaitable[Any]], *, kept: bool = False,
                           report: Callable[[Any], None] | None = None) -> bool:
        """Run `attempt` until the store takes it: a settlement lost would leave the reservation's estimates counted
        for good (tokens, spend), against the usage ledger. Retried with backoff for up to SETTLE_RETRY_SECONDS; a
        drain gives each its last try at once. Retrying is safe: the store ignores a second settlement. False when
        it gave up while the store did not answer (`kept`: the ledger's spool keeps it for the next process)."""
        delay, give_up = _FIRST_RETRY_SECONDS, time.monotonic() + SETTLE_RETRY_SECONDS
        tries = 0
        while True:
            tries += 1
            try:
                result = await attempt()
                if tries > 1:
                    self._retry_ended(given_up=False)
                if report is not None:
                    report(result)
                return True
            except LimitStoreUnavailable as exc:
                if tries == 1:
                    if not self._retrying:
                        _logger.warning("could not settle a rate-limit reservation (%s); retrying it and any "
                                        "others until the limit store answers", exc)
                    self._retrying += 1
                    self._retried += 1
                if self._draining.is_set() or time.monotonic() + delay > give_up:
                    if not self._given_up:
                        _logger.error("gave up settling a rate-limit reservation after %d tries (%s): %s", tries,
                                      exc, "left in the ledger's spool for the next process to start on this data "
                                      "dir" if kept else "its estimates stay counted")
                    self._retry_ended(given_up=True)
                    return False
            except Exception:  # noqa: BLE001 - a bug, not an outage: retrying cannot help
                _logger.exception("could not settle a rate-limit reservation")
                return True
            # The pause ends early when a drain begins or the store answers again.
            wake = (asyncio.ensure_future(self._draining.wait()), asyncio.ensure_future(self._store_back.wait()))
            try:
                await asyncio.wait(wake, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in wake:
                    waiter.cancel()
            delay = min(delay * 2, _LAST_RETRY_SECONDS)

    def _retry_ended(self, *, given_up: bool) -> None:
        self._retrying -= 1
        self._given_up += given_up
        if self._retrying:
            return
        if self._given_up:
            _logger.error("settled %d of %d rate-limit reservations that waited for the limit store; gave up %d",
                          self._retried - self._given_up, self._retried, self._given_up)
        else:
            _logger.info("settled %d rate-limit reservation%s that waited for the limit store", self._retried,
                         "" if self._retried == 1 else "s")
        self._retried = self._given_up = 0

    def _spawn(self, work: Awaitable[T]) -> asyncio.Task[T]:
        """A task held here until it ends: the event loop keeps only weak references to tasks, and these must finish
        even when whoever started them has been cancelled."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self) -> None:
        self._draining.set()  # settlements waiting to retry take their last try now
        await self.settled()
        await self._store.close()


def _run_now(work: Coroutine[Any, Any, T]) -> T:
    """The result of a coroutine that completes without waiting, run here and now: a cancellation cannot interrupt
    it, for it never gives the event loop a turn."""
    try:
        work.send(None)
    except StopIteration as done:
        return done.value
    work.close()
    raise RuntimeError("a limit store that declares itself immediate waited")


async def _logged(work: Awaitable[T]) -> T | None:
    """Settling fails quietly: the caller's answer is already decided (an immediate store does not fail to answer)."""
    try:
        return await work
    except Exception:  # noqa: BLE001
        _logger.exception("could not settle a rate-limit reservation")
        return None


def rate_limit_headers(reservation: Reservation, *, anthropic: bool = False) -> tuple[tuple[str, str], ...]:
    """x-ratelimit-{limit,remaining,reset}-{requests,tokens} for the tightest limit of each kind that applies (and
    anthropic-ratelimit-* for an Anthropic caller)."""
    headers: list[tuple[str, str]] = []
    for kind, tightest in (("requests", reservation.requests), ("tokens", reservation.tokens)):
        if tightest is not None:
            headers += ratelimit_headers(kind, tightest, at=reservation.at, anthropic=anthropic)
    return tuple(headers)


