"""Where a request goes next when an upstream fails: pure decisions over a model's deployments and its fallbacks,
no I/O. server/providers/router.py runs them.

A request walks a chain of models (the one asked for, then its `fallbacks`), each served by one or more
deployments. Within a model, a retryable failure before anything reached the caller moves at once to a deployment
not tried yet (weighted, preferring the fewest requests in flight); when every deployment has been tried, the ones
whose retries are left are tried again after their backoff (exponential with full jitter, the upstream's retry-after
winning when longer), within `retry.attempts` per deployment and `retry.total_seconds` since the model's first try.
Then the next model of the chain. A deployment out of service (passive health, server/providers/health.py) is not
tried, and a model none of whose deployments is in service is passed over at once.

Only failures marked `retryable` (server/providers/upstream_errors.py) move on, and only while nothing has reached
the caller: `Delivery` holds back a Started event (a prompt count, no content) and the upstream's own objects that
carry no content (a role chunk, message_start, ping) until the first content event, so an upstream that accepts a
request and then drops the stream is retried as if it had refused it. A refusal a fallback may serve
(`fallback_may_serve`: a prompt over the model's context window) moves at once to the next model of the chain,
without retries: every deployment of the model shares its window.
"""

from __future__ import annotations

import copy
import math
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from server.domain_answers import GenerationEvent, Started, UpstreamObject
from server.domain_models import RetrySettings
from server.errors import PorticoError, ServiceUnavailable, UpstreamMisconfigured

ONE_TRY = RetrySettings(attempts=1)  # providers that are not upstream servers (the embedded model): no retries


class OutOfService(ServiceUnavailable):
    """No deployment could be tried: the gateway refused the request itself, which therefore reached no model."""


def backoff_delay(settings: RetrySettings, attempt: int, error: PorticoError, elapsed: float,
                  draw: Callable[[], float]) -> float | None:
    """Seconds to wait before attempt `attempt + 1`, or None to give up with `error`.

    `draw` returns a number in [0, 1) (the jitter). A retry-after longer than the time left gives up at once: the
    caller then gets the upstream's answer with the hint, instead of a wait that cannot end in a retry.
    """
    if not error.retryable or attempt >= settings.attempts:
        return None
    delay = draw() * min(settings.max_backoff, settings.initial_backoff * 2 ** (attempt - 1))
    delay = max(delay, error.retry_after)
    if elapsed + delay >= settings.total_seconds:
        return None
    return delay


def pick(weights: Sequence[float], in_flight: Sequence[int], draw: Callable[[], float]) -> int:
    """Weighted random choice, each weight divided by (requests in flight per unit of its share + 1), its share
    being its weight over the mean weight: sequential requests follow the weights, and so do concurrent ones when
    the deployments are equally fast (each then has in flight what its share says), while one busier than its share
    (slower) gets fewer new ones. Envoy's least-request division, by requests in flight + 1, tends to sqrt(weight)
    shares as the load grows (9:1 became 3:1), and depended on the weights' scale (0.3:0.1 was not 3:1)."""
    mean = sum(w / len(weights) for w in weights)
    effective = [w / (n * (mean / w) + 1) if n else w for w, n in zip(weights, in_flight, strict=True)]
    point = draw() * sum(effective)
    for index, value in enumerate(effective):
        point -= value
        if point < 0:
            return index
    return len(effective) - 1


@dataclass(frozen=True, slots=True)
class Target:
    """A deployment as the planner sees it."""

    weight: float
    retry: RetrySettings


@dataclass(frozen=True, slots=True)
class Step:
    model: int  # index in the chain
    deployment: int  # index in that model's deployments
    wait: float  # seconds to wait before trying it


@dataclass(slots=True)
class Plan:
    """One request's walk over `chain` (per model, its deployments). `ready_in(model, deployment)` is how many
    seconds until passive health lets the deployment be tried (0: now); `cooling(model, deployment)` whether it is
    ejected until a trial (not retried: a request that waited for its cooldown would spend the trial on its own retry,
    doubling the cooldown); `in_flight(model, deployment)` how busy it is.

    `next(now)` says what to try (None: nothing is left); `failed(step, error, now)` records a failure of it, or
    raises the error when neither a retry nor a fallback may serve it. `give_up(now)` is the error to answer with
    when nothing is left: the failure that clears soonest (one without a retry-after may clear at once, unless
    passive health took its deployment out of service), with its retry-after; else, when every model asked refused
    the prompt as too long for it, the first such refusal (the model asked for's), or a 503 until a fallback passed
    over may take it.
    """

    chain: Sequence[Sequence[Target]]
    ready_in: Callable[[int, int], float]
    in_flight: Callable[[int, int], int]
    draw: Callable[[], float]
    cooling: Callable[[int, int], bool] = lambda model, deployment: False
    model: int = 0
    last_error: PorticoError | None = None
    _tries: list[int] = field(default_factory=list)
    _not_before: list[float] = field(default_factory=list)  # -inf: done with it; else when its retry may start
    _began: float | None = None
    _soonest: float = math.inf  # the earliest time a passed-over deployment comes back into service
    # (when it clears by its own hint, the failure, its model and deployment)
    _failures: list[tuple[float, PorticoError, int, int]] = field(default_factory=list)
    _refusal: PorticoError | None = None  # the first refusal a fallback may serve (context_length_exceeded)

    def __post_init__(self) -> None:
        self._enter(0)

    def next(self, now: float) -> Step | None:
        while self.model < len(self.chain):
            targets = self.chain[self.model]
            ready = [now + self.ready_in(self.model, d) for d in range(len(targets))]
            fresh = [d for d in range(len(targets)) if self._tries[d] == 0 and ready[d] == now]
            if fresh:
                return self._step(self._choose(fresh), 0.0, now)
            again = [(max(self._not_before[d], ready[d]), d) for d in range(len(targets))
                     if self._tries[d] and self._not_before[d] > -math.inf and not self.cooling(self.model, d)]
            if again:
                start, chosen = min(again)
                if self._began is not None and start - self._began < targets[chosen].retry.total_seconds:
                    return self._step(chosen, max(0.0, start - now), now)
            self._soonest = min([self._soonest, *(r for d, r in enumerate(ready) if self._tries[d] == 0)])
            self._enter(self.model + 1)
        return None

    def failed(self, step: Step, error: PorticoError, now: float) -> None:
        self.last_error = error
        if error.fallback_may_serve:  # no deployment of this model would take it: on to the next model
            self._refusal = self._refusal or error
            self._tries = [max(1, tries) for tries in self._tries]
            self._not_before = [-math.inf] * len(self._not_before)
            return
        if (isinstance(error, UpstreamMisconfigured) and not error.retryable
                or error.retryable and error.should_retry is False):
            # The deployment's own key, account or model name, or an upstream that said the same request would fail
            # again (`x-should-retry: false`): another deployment or fallback may serve it, this one would not.
            self._failures.append((now, error, step.model, step.deployment))
            self._not_before[step.deployment] = -math.inf
            return
        if not error.retryable:
            raise error
        self._failures.append((now + error.retry_after, error, step.model, step.deployment))
        d = step.deployment
        target = self.chain[step.model][d]
        elapsed = now - (self._began if self._began is not None else now)
        delay = backoff_delay(target.retry, self._tries[d], error, elapsed, self.draw)
        self._not_before[d] = -math.inf if delay is None else now + delay

    def refused(self, step: Step) -> None:
        """The deployment could not be had after all (another request took its one trial): not in this request."""
        self._tries[step.deployment] = max(1, self._tries[step.deployment])
        self._not_before[step.deployment] = -math.inf

    def give_up(self, now: float) -> PorticoError:
        if self._failures:
            # Not the last failure: a caller told "30 s" by the last deployment would wait that long when another
            # (or a fallback) said 2 s. The soonest time anything may work, a passed-over deployment's return too.
            # Its hint as its upstream gave it, not shortened by the walk's few seconds since (a later hint wastes no
            # retry), unless a passed-over deployment is back sooner.
            # A failure that took its deployment out of service (passive health) clears only when it is back.
            clears = []
            for when, error, model, deployment in self._failures:
                back = self.ready_in(model, deployment)
                clears.append((max(when, now + back), max(error.retry_after, back), error))
            _, hint, error = min(reversed(clears), key=lambda failure: failure[0])  # a tie: the latest
            wait = min(hint, max(0.0, self._soonest - now))
            if wait == error.retry_after:
                return error
            soonest = copy.copy(error)  # errors may be shared objects: never change one in place
            soonest.retry_after = wait
            return soonest
        if self._refusal is not None and self._soonest == math.inf:
            return self._refusal
        wait = max(1.0, math.ceil(self._soonest - now)) if self._soonest < math.inf else 1.0
        if self._refusal is not None:  # the model was asked (no OutOfService: that request reached no model)
            return ServiceUnavailable("The prompt is over the model's context window, and the fallbacks that may take "
                                      "it are out of service for now; try again after retry-after.", retry_after=wait)
        # Out of service after failing, or for as long as its upstream asked (retry-after): the message fits both.
        return OutOfService("Every deployment of the model (and of its fallbacks) is out of service for now; try "
                            "again after retry-after.", retry_after=wait)

    def _enter(self, model: int) -> None:
        self.model = model
        size = len(self.chain[model]) if model < len(self.chain) else 0
        self._tries, self._not_before, self._began = [0] * size, [0.0] * size, None

    def _choose(self, candidates: list[int]) -> int:
        if len(candidates) == 1:
            return candidates[0]
        targets = self.chain[self.model]
        chosen = pick([targets[d].weight for d in candidates], [self.in_flight(self.model, d) for d in candidates],
                      self.draw)
        return candidates[chosen]

    def _step(self, deployment: int, wait: float, now: float) -> Step:
        if self._began is None:
            self._began = now
        self._tries[deployment] += 1
        return Step(self.model, deployment, wait)


@dataclass(slots=True)
class Delivery:
    """Whether any event of an attempt reached the consumer; once one has, the attempt can no longer be replaced."""

    delivered: bool = False
    # Given the events still held when the attempt ends before its first content, because its caller left or it
    # failed: the upstream has taken the prompt, and bills what it reported, so the request is counted with it (a
    # later attempt's report, or its answer's usage, replaces it).
    unsent: Callable[[GenerationEvent], None] | None = None

    async def relay(self, events: AsyncIterator) -> AsyncIterator:
        held: list[GenerationEvent] = []
        try:
            async for event in events:
                if not self.delivered and _no_content(event):
                    held.append(event)
                    continue
                self.delivered = True
                while held:  # not `for`: its variable would hold the last of them while the stream runs
                    yield held.pop(0)
                yield event
        finally:
            if self.unsent is not None:
                while held:
                    self.unsent(held.pop(0))
            await events.aclose()  # aclosing's work, without its objects held by every open stream


def carries_answer(event: object) -> bool:
    """Part of the answer itself (text, a tool call, the end, images, a count): from it on, the attempt has answered."""
    return not _no_content(event)


def _no_content(event: object) -> bool:
    return isinstance(event, Started) or isinstance(event, UpstreamObject) and not event.content
