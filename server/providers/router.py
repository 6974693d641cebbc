"""The one runner of retries, deployments and fallbacks, for text streams and image calls alike.

A model's provider, as the pipeline sees it, is a `Router` over a chain of `Route`s: the model itself, then each of
its `fallbacks`, each with its deployments' own providers (the upstream clients, not wrapped in anything). The
pure `Plan` (server/providers/retry.py) decides what to try next; the router tries it in `_attempt`, the one place
an upstream attempt starts and ends (health, requests in flight, per-deployment metrics), and relays its events
while nothing has reached the caller, so that a retryable failure can still be replaced by the next try.

The caller's limits stay with the model it asked for: the pipeline reserves and settles for that one, with what was
used, whichever model or deployment answered, at the price of the model that answered (a fallback's, when one did).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from server.domain import GenerationRequest
from server.domain_answers import Finished, GenerationEvent, TokenCount
from server.domain_images import ImageAnswer, ImageRequest
from server.domain_models import RetrySettings
from server.errors import InvalidRequest, OutOfResources, PorticoError, RateLimited, ServiceUnavailable, UpstreamTimeout
from server.observability import UpstreamRecorder
from server.providers import (
    Capabilities, PromptCounter, Provider, capabilities_of, prompt_count, token_counter_of, unsupported,
)
from server.providers.health import Admission, Board
from server.providers.images import ImageProvider, image_unsupported
from server.providers.retry import Delivery, Plan, Step, Target, carries_answer
from server.providers.retry_log import RetryLog


@dataclass(frozen=True, slots=True)
class DeploymentRoute:
    name: str
    weight: float
    provider: Provider | ImageProvider
    retry: RetrySettings
    health_slot: int | None = None  # its slot on the health board; None: not watched (a model's only deployment)


@dataclass(frozen=True, slots=True)
class Route:
    model_id: str
    deployments: tuple[DeploymentRoute, ...]

    @property
    def capabilities(self) -> Capabilities:
        """What at least one deployment can honour (a request is sent only to those that can)."""
        caps = [capabilities_of(d.provider) for d in self.deployments]
        return Capabilities(tool_calls=any(c.tool_calls for c in caps), json_output=any(c.json_output for c in caps),
                            dialects=frozenset().union(*(c.dialects for c in caps)))


class Router:
    def __init__(self, chain: Sequence[Route], *, board: Board, recorder: UpstreamRecorder | None = None,
                 rng: random.Random | None = None, caller_left: Callable[[], bool] = lambda: False,
                 in_flight: dict[tuple[str, str], int] | None = None, retry_log: RetryLog | None = None) -> None:
        """`chain`: the model itself first, then its fallbacks. `caller_left`: the request being run lost its caller,
        and only its attempt under way runs on (server/cutoff.py Cutoff.caller_left). `in_flight`: the attempts
        running on each deployment in this process, shared by every Router (a model's fallback is another's own).
        `retry_log`: where retries and fallbacks are logged, shared by every Router for the same reason."""
        self._chain = tuple(chain)
        self._caller_left = caller_left
        self._board = board
        self._recorder = recorder
        self._draw = (rng or random.Random()).random
        # (model id, deployment): attempts running in this process, this model's requests and those falling back to it
        self._in_flight = in_flight if in_flight is not None else {}
        self._retry_log = retry_log or RetryLog()
        self.capabilities = self._chain[0].capabilities
        # The APIs a request may be sent in, by its own deployments or its fallbacks'.
        self.chain_dialects = frozenset().union(*(route.capabilities.dialects for route in self._chain))
        own = {capabilities_of(d.provider) for d in self._chain[0].deployments}
        self._own_alike = own.pop() if len(own) == 1 else None  # what each of its own deployments can, if the same
        # The reservation counts the prompt as the model's first deployment would (the embedded model counts exactly).
        self.token_counter = token_counter_of(self._chain[0].deployments[0].provider)
        # What a plan over the whole chain is made of, made once: most requests may go to every deployment, and a
        # stream holds its plan (and these, were they its own) while it runs.
        self._whole_chain = self._plan_inputs(self._chain)

    @property
    def chain(self) -> tuple[Route, ...]:
        return self._chain

    def stream(self, request: GenerationRequest, unsent: Callable[[GenerationEvent], None] | None = None
               ) -> AsyncIterator[GenerationEvent]:
        """`unsent`: given what an attempt held back when its caller left before the first content (Delivery)."""
        return self._run(self._able(request), lambda provider: provider.stream(request), unsent=unsent)

    async def generate(self, request: ImageRequest) -> ImageAnswer:
        chain = self._able_to(lambda provider: image_unsupported(request, capabilities_of(provider)) is None)
        return await self._one(chain, lambda provider: provider.generate(request))

    @property
    def counts_upstream(self) -> bool:
        """Its own deployments count prompts upstream (Anthropic's): a count is then an upstream request."""
        return any(isinstance(d.provider, PromptCounter) for d in self._chain[0].deployments)

    async def count_prompt(self, request: GenerationRequest) -> TokenCount:
        """A model whose deployments count prompts upstream (Anthropic's) is asked as for a generation: the same
        deployments, retries and fallbacks (a fallback counts as it would take the prompt). Any other is counted
        here, without an upstream attempt."""
        if not self.counts_upstream:
            return await prompt_count(self._chain[0].deployments[0].provider, request)
        return await self._one(self._able(request), lambda provider: prompt_count(provider, request),
                               local=lambda provider: not isinstance(provider, PromptCounter))

    @property
    def own_providers(self) -> tuple[Provider | ImageProvider, ...]:
        """The providers of the model's own deployments: every fallback is some other model's own."""
        return tuple(deployment.provider for deployment in self._chain[0].deployments)

    async def close(self) -> None:
        for provider in self.own_providers:
            await provider.close()

    def refusal(self, request: GenerationRequest) -> InvalidRequest | None:
        """Why none of the model's own deployments can honour `request` (the first one's reason), or None when one
        can. Each is judged alone: the union of their capabilities would refuse a field only the embedded model
        honours as soon as an upstream of the other dialect sits beside it."""
        if self._own_alike is not None:  # one check, not one per deployment: this runs on every request
            return unsupported(request, self._own_alike)
        refusals = [unsupported(request, capabilities_of(d.provider)) for d in self._chain[0].deployments]
        return None if None in refusals else refusals[0]

    def _able(self, request: GenerationRequest) -> Sequence[Route]:
        return self._able_to(lambda provider: unsupported(request, capabilities_of(provider)) is None)

    def _able_to(self, honours: Callable[[object], bool]) -> Sequence[Route]:
        """The chain with, on each route, only the deployments whose provider `honours` the request (the pipeline
        has already refused a request the model's own cannot; a fallback none of whose deployments can is skipped):
        the chain itself when every deployment does."""
        chain = []
        whole = True
        for route in self._chain:
            able = tuple(d for d in route.deployments if honours(d.provider))
            if len(able) == len(route.deployments):
                chain.append(route)
            else:
                whole = False
                if able:
                    chain.append(Route(route.model_id, able))
        return self._chain if whole else chain

    def _plan_inputs(self, chain: Sequence[Route]) -> dict:
        """Plan's arguments for a walk over `chain`."""
        return dict(chain=[[Target(d.weight, d.retry) for d in route.deployments] for route in chain],
                    ready_in=lambda m, d: self._ready_in(chain[m].deployments[d]),
                    cooling=lambda m, d: self._cooling(chain[m].deployments[d]),
                    in_flight=lambda m, d: self._in_flight.get((chain[m].model_id, chain[m].deployments[d].name), 0),
                    draw=self._draw)

    async def _one(self, chain: Sequence[Route], ask: Callable,
                   local: Callable[[object], bool] | None = None) -> object:
        """The one result (images, a token count) of `ask(provider)` on the first deployment that gives it."""
        async with aclosing(self._run(chain, lambda provider: _once(ask(provider)), local)) as results:
            async for result in results:
                return result
        raise AssertionError("an attempt ends with a result or an error")

    async def _run(self, chain: Sequence[Route], start: Callable, local: Callable[[object], bool] | None = None,
                   unsent: Callable[[GenerationEvent], None] | None = None) -> AsyncIterator:
        """`local(provider)`: it answers without asking its upstream (an estimated count), so that answer is no
        attempt: no metrics, and nothing said of the deployment's health (a trial is decided by its upstream)."""
        loop = asyncio.get_running_loop()
        plan = Plan(**(self._whole_chain if chain is self._chain else self._plan_inputs(chain)))
        failed: tuple[Step, PorticoError] | None = None
        model = 0  # the chain's model tried last
        while (step := plan.next(loop.time())) is not None:
            route, deployment = chain[step.model], chain[step.model].deployments[step.deployment]
            if step.wait:  # before the move is counted: a caller gone during the wait leaves no attempt made
                await asyncio.sleep(step.wait)
            if failed is not None:
                self._moving_on(chain, failed, step)
            elif step.model != model and self._recorder is not None:  # none of its deployments was in service
                self._recorder.fallback(self._chain[0].model_id, route.model_id, after_attempt=False)
            model = step.model
            if local is not None and local(deployment.provider):
                async with aclosing(start(deployment.provider)) as events:
                    async for event in events:
                        yield event
                return
            admission = Admission.ADMITTED
            if deployment.health_slot is not None and not (admission := self._board.acquire(deployment.health_slot)):
                plan.refused(step)  # another request holds its one trial
                continue
            delivery = Delivery(unsent=unsent)
            try:
                events = delivery.relay(self._attempt(route, deployment, start, trial=admission is Admission.TRIAL))
                try:
                    async for event in events:
                        yield event
                finally:
                    await events.aclose()  # aclosing's work, without its objects held by every open stream
                return
            except PorticoError as error:
                if delivery.delivered or self._caller_left():  # nobody would get another try's answer
                    raise
                plan.failed(step, error, loop.time())  # raises a failure that another try would meet too
                failed = (step, error)
        raise plan.give_up(loop.time())

    async def _attempt(self, route: Route, deployment: DeploymentRoute, start: Callable, *,
                       trial: bool = False) -> AsyncIterator:
        """One upstream attempt on one deployment of one model: where it starts and ends. `trial`: it decides an
        ejected deployment's return, which its first content makes (health.answering)."""
        key = (route.model_id, deployment.name)
        if self._recorder is not None:
            self._recorder.deployment(route.model_id, deployment.name)  # names the attempt's span (traces)
        self._in_flight[key] = self._in_flight.get(key, 0) + 1
        # When it was sent, on the board's clock: an outcome of a request sent before an ejection says nothing new.
        sent = self._board.clock() if deployment.health_slot is not None else 0.0
        outcome: PorticoError | None = None
        finished = False  # a Finished event (or an image call's images) came
        try:
            events = start(deployment.provider)
            try:
                async for event in events:
                    # The answer is whole (a caller reading a JSON answer stops here, closing the stream): a
                    # Finished event, an image call's images or a token count.
                    finished = finished or isinstance(event, (Finished, ImageAnswer, TokenCount))
                    if trial and carries_answer(event):
                        trial = False
                        self._board.answering(deployment.health_slot)
                    yield event
            finally:
                await events.aclose()  # aclosing's work, without its objects held by every open stream
        except PorticoError as error:
            outcome = error
            raise
        finally:
            self._in_flight[key] -= 1
            unhealthy = outcome is not None and _says_unhealthy(outcome)
            if self._recorder is not None:
                self._recorder.deployment_attempt(route.model_id, deployment.name,
                                                  _failure_reason(outcome) if unhealthy else None)
            if deployment.health_slot is not None:
                self._report(deployment.health_slot, outcome if unhealthy else None, finished, sent)

    def _report(self, slot: int, outcome: PorticoError | None, finished: bool, sent: float) -> None:
        """`outcome`: a failure that speaks of the deployment, else None. `sent`: when the attempt began."""
        if finished:
            self._board.succeeded(slot, sent)
        elif outcome is not None:
            retry_after = outcome.retry_after if isinstance(outcome, (RateLimited, ServiceUnavailable)) else 0.0
            self._board.failed(slot, retry_after, sent)
        else:
            self._board.released(slot)

    def _ready_in(self, deployment: DeploymentRoute) -> float:
        if deployment.health_slot is None:
            return 0.0
        return self._board.ready_in(deployment.health_slot)

    def _cooling(self, deployment: DeploymentRoute) -> bool:
        return deployment.health_slot is not None and self._board.cooling(deployment.health_slot)

    def _moving_on(self, chain: Sequence[Route], failed: tuple[Step, PorticoError], step: Step) -> None:
        before, error = failed
        model_id = chain[before.model].model_id
        if step.model == before.model:
            self._retry_log.warning("%s/%s failed (%s); trying %s/%s", model_id, chain[before.model].deployments[
                before.deployment].name, _why(error), model_id, chain[step.model].deployments[step.deployment].name)
            if self._recorder is not None:
                self._recorder.retry(model_id, error.retry_reason or "other")
        else:
            fallback = chain[step.model].model_id
            self._retry_log.warning("%s failed (%s); falling back to %s", model_id, _why(error), fallback)
            if self._recorder is not None:
                self._recorder.fallback(self._chain[0].model_id, fallback)


def _why(error: PorticoError) -> str:
    """A failed attempt for the log: its code and reason (`service_unavailable, 503`), never its message, which
    passes on the upstream's own words, and those may quote the prompt (operations.md, Logs). A refusal a fallback may
    serve says its own code (`context_length_exceeded`)."""
    if error.retry_reason:
        return f"{error.kind.code}, {error.retry_reason}"
    return error.code if error.fallback_may_serve else error.kind.code


def stream_of(provider: Provider, request: GenerationRequest,
              unsent: Callable[[GenerationEvent], None]) -> AsyncIterator[GenerationEvent]:
    """`provider.stream(request)`; a Router's also gives `unsent` what it held back from a caller who left."""
    if isinstance(provider, Router):
        return provider.stream(request, unsent)
    return provider.stream(request)


def refusal_of(provider: object, request: GenerationRequest) -> InvalidRequest | None:
    """Why `provider` cannot honour `request`, or None; a Router can when one of its model's deployments can."""
    if isinstance(provider, Router):
        return provider.refusal(request)
    return unsupported(request, capabilities_of(provider))


def _says_unhealthy(error: PorticoError) -> bool:
    """Failures that speak of the deployment, not of the caller's request: those another try may not meet, an
    upstream that timed out, 5xx answers, and a rate limit with a retry-after (which takes the deployment out for
    that long) even when `retry.on_status` does not retry it; not the gateway's own want of connections."""
    if isinstance(error, OutOfResources) or not error.judges_deployment:
        return False
    return (error.retryable or isinstance(error, UpstreamTimeout) or error.kind.http_status >= 500
            or isinstance(error, RateLimited) and error.retry_after > 0)


def _failure_reason(error: PorticoError) -> str:
    if error.retry_reason:
        return error.retry_reason
    if isinstance(error, RateLimited):  # an upstream's 429 with retry-after that `retry.on_status` passes on
        return "429"
    return "timeout" if isinstance(error, UpstreamTimeout) else "other"


async def _once(result) -> AsyncIterator:
    yield await result
