"""The one request pipeline every servicer goes through:

authenticate key -> resolve model (catalog, grants, path rule) -> admit (reserve against the limits) -> provider
-> settle the reservation with the real usage, as typed values. Servicers translate the wire request before calling
in and render what comes out; the x-ratelimit-* headers go out from here as initial metadata before the first
message, so Envoy turns them into HTTP headers (a unary twin's context sends them as trailing metadata instead,
services/dialect.py HeadersAtEnd). What the pipeline learns about a request (model, tokens, upstream
and first-token times) goes on the RPC's telemetry record, which the interceptor reports when the RPC ends.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager

from google.protobuf.message import Message

from server.cache import Lookup, ResponseCache
from server.calls import Call, CallContext, account, asking, note_finish, send_headers
from server.catalog import Catalog
from server.cutoff import Cutoff
from server.domain import Dialect, GenerationRequest, Json, Thought, ToolCall
from server.domain_answers import (
    Completion, Finished, GenerationEvent, ReasoningDelta, TextDelta, TokenCount, ToolCallDelta, ToolCallStart,
    UpstreamObject,
)
from server.domain_images import ImageAnswer, ImageRequest
from server.domain_keys import ApiKey
from server.domain_models import FREE, ModelEntry, Price
from server.errors import InternalError, InvalidRequest, PorticoError
from server.keys import Authenticator
from server.limits import Limiter, Reservation
from server.limits.core import Dimension, Reading
from server.metering import Meter, metered, started
from server.observability import Telemetry
from server.providers import (
    Provider, TokenCounter, capabilities_of, context_overflow, dialects_of, prompt_count, token_counter_of,
)
from server.providers.images import ImageProvider, image_unsupported
from server.providers.retry import OutOfService
from server.providers.router import Router, refusal_of, stream_of
from server.translate.values import body_and_model


def _limit_field(request: GenerationRequest, room: int) -> str:
    """The caller's field a request too large for a limit is told to lower. Without a token limit of its own, the
    room for a thinking budget is what made it large, and a limit must stay above the budget: only a lower effort
    helps; else the default limit did, which a caller who never sent max_tokens is told."""
    if request.token_limit_field or room:
        return request.token_limit_field or "reasoning_effort"
    return f"max_tokens (not sent, so the default of {request.params.max_tokens} applied)"


class Pipeline:
    def __init__(
        self,
        *,
        authenticator: Authenticator,
        catalog: Catalog,
        providers: Mapping[str, Provider | ImageProvider],
        limiter: Limiter,
        telemetry: Telemetry,
        cache: ResponseCache | None = None,
        cutoff: Cutoff | None = None,
    ) -> None:
        self._authenticator = authenticator
        self.cutoff = cutoff or Cutoff()  # cuts the model calls a stopping server cannot wait for
        self._cache = cache
        self._catalog = catalog
        self._providers = providers
        # Decided once: an isinstance check against a runtime Protocol inspects every member on every call.
        self._token_counters = {model_id: counter for model_id, provider in providers.items()
                                if (counter := token_counter_of(provider)) is not None}
        # The embedded model's counter also knows its context window, in the same tokens it counts.
        self._context_windows: dict[str, int] = {model_id: window for model_id, counter in self._token_counters.items()
                                                 if (window := getattr(counter, "context_size", None))}
        # Served by the embedded model alone (no fallback that could write more), an answer ends where the window
        # does: the most a request may use, whatever its max_tokens (an SDK's default may be far larger).
        self._answer_windows = {model_id for model_id in self._context_windows
                                if self._token_counters[model_id] is providers[model_id]}
        # Served by an Anthropic upstream (or falling back to one): a chat request's thinking budget is sent there on
        # top of its default limit (GenerationRequest.most_output_tokens), so reserved; other providers are not sent it.
        self._thinking_room = {model_id for model_id, provider in providers.items()
                               if Dialect.ANTHROPIC in dialects_of(provider)}
        self._limiter = limiter
        self._telemetry = telemetry

    @property
    def authenticator(self) -> Authenticator:
        return self._authenticator

    @property
    def catalog(self) -> Catalog:
        return self._catalog

    async def read_body(self, context: CallContext, data: bytes | Message, *,
                        allow_x_api_key: bool = False) -> tuple[dict[str, Json], str, ApiKey]:
        """A REST caller's raw body (parsed) or a typed request (as the same JSON), its `model` and the caller's key,
        found valid first: a caller without one hears that (401, whatever the body), and its body is never read,
        since reading 8 MB of tiny JSON values holds up every other caller for ~0.4 s."""
        key = await self._authenticator.authenticate(context.invocation_metadata() or (),
                                                     allow_x_api_key=allow_x_api_key)
        body, model_id = body_and_model(data)
        return body, model_id, key

    async def begin(self, context: CallContext, key: ApiKey, model_id: str, endpoint: str) -> Call:
        if not model_id:
            raise InvalidRequest("You must provide a model parameter.", param="model")
        model = self._catalog.resolve(key, model_id, endpoint)
        record = self._telemetry.current()
        record.model = model.id
        return Call(key=key, model=model, provider=self._providers[model.id], context=context, record=record)

    @asynccontextmanager
    async def stream(self, call: Call, request: GenerationRequest) -> AsyncIterator[AsyncIterator[GenerationEvent]]:
        """Admit the request, start generating and wait for the first event, so that a refusal or a failure to
        start is raised here, while the caller can still answer with an error status instead of a half-sent stream.

        A context manager rather than a generator, so that the reservation is settled however the block is left
        (end, error, a caller that went away): a generator that was never iterated would never run its cleanup.
        """
        provider = call.provider
        # Before admission: a request the model cannot honour costs nothing.
        if (refusal := refusal_of(provider, request)) is not None:
            raise refusal
        # A valid request from here on: its row is owed however it ends, also when its caller leaves while the
        # cache is asked or its prompt counted (under load, a while), as the access log and metrics count it.
        call.record.admitted = True
        lookup = await self._lookup(call, request)
        call.record.params = request.params
        call.record.output_type = "json" if request.output_format is not None else ""
        if lookup is not None and lookup.events is not None:
            async with self._replay(call, lookup) as events:
                yield events
            return
        counter = self._token_counters.get(call.model.id)
        prompt = await _prompt_tokens(counter, request)
        # Refused here, like a request over a limit (a ledger row, but no model asked and nothing reserved), rather
        # than by the provider, after the request was recorded as having reached a model. Not when the model has
        # fallbacks: one with a longer window may take it, after the embedded model refused it (the Router).
        window = self._context_windows.get(call.model.id)
        if window is not None and (overflow := context_overflow(prompt, window)):
            if not call.model.fallbacks:
                # A 400 for the body, like a bad parameter's: never a cache question (such a prompt is never stored),
                # so no x-portico-cache, access-log `cache` or lookup metric. Checked after the lookup so a hit pays
                # for no token count.
                call.record.cache = ""
                raise overflow
            # A fallback will serve it, counting it in its own tokens: reserved as for any upstream (the count here
            # is the embedded model's, and of a prompt too long to tokenize only a lower bound).
            prompt, counter = max(prompt, request.estimated_prompt_tokens()), None
        room = request.reasoning.room if request.reasoning is not None and call.model.id in self._thinking_room else 0
        most_output = request.params.max_tokens + room
        if call.model.id in self._answer_windows:
            most_output = min(most_output, window - prompt)
        meter = Meter(prompt_estimate=prompt, most_output=most_output)
        tokens = prompt + most_output
        # The most it may cost: every prompt token uncached, or written to the prompt cache where that costs more
        # (at most as many as its bytes, where not counted), and every token it may generate. Token limits reserve
        # the estimate instead, as OpenAI's do. At the model's own price: a fallback that answers instead is priced
        # at its own when settled (`_served_price`), for more than was reserved if it is dearer.
        cost = 0 if call.model.price.free else call.model.price.most(
            prompt if counter is not None else request.most_prompt_tokens(), most_output)
        billed = self._billed(call.model, cost)
        with self._telemetry.span(call.record, "admission", **{"portico.tokens_reserved": tokens}):
            reservation = await self._limiter.reserve(call.key, call.model.id, tokens, cost, may_cost=billed,
                                                      limit_field=_limit_field(request, room))
        self._handed_over(call, reservation)
        reached_model = True
        watch = self.cutoff.watch(billed=billed)
        try:
            answer = stream_of(provider, request, meter.record)
            if lookup is not None:
                answer = self._cache.recorded(lookup, answer)
            with watch:
                events = metered(answer, meter, call.record, watch)
                try:
                    whole = await started(events)
                    if not watch.caller_left:  # else nobody to send them to (grpc would refuse them)
                        await send_headers(call, reservation, lookup.header if lookup is not None else None)
                    watch.handed_over()  # the rest may be read by another task (services/streaming.py coalesced)
                    yield whole
                finally:
                    await events.aclose()  # aclosing's work, without its objects held by every open stream
        except OutOfService:
            # No deployment could be tried: like a refusal by a limit, a request that reached no model counts nothing.
            reached_model = False
            self._reached_no_model(call, reservation)
            raise
        finally:
            # Nothing here waits: a caller who closes on the last event cancels the RPC at its next wait, and would
            # be recorded as having gone away (Limiter.settle never waits).
            call.record.upstream_done()
            call.record.caller_left = watch.caller_left
            note_finish(call, meter)
            used = 0
            # A failure may carry what the upstream reported it used (a whole answer that says it failed): counted.
            if meter.started or meter.usage is not None:
                call.record.model_answered = True
                usage = meter.usage_so_far()
                used = usage.total_tokens
                account(call, self._served_price(call), usage.input_tokens, usage.output_tokens,
                         usage.cached_input_tokens, cache_write_tokens=usage.cache_write_tokens,
                         cache_write_1h_tokens=usage.cache_write_1h_tokens, web_searches=usage.web_searches)
            # Handed to its model (`_asking`), the request counts, as in the ledger, however it ended: an upstream
            # that failed, or a caller gone before the first token, may still have run it. It used what the model
            # reported or sent: nothing, when nothing came back.
            if reached_model:
                self._budgets_in_force(call.key.id, reservation)
                self._limiter.settle(reservation, used, call.record.cost_micros, self._budgets_left)

    async def _lookup(self, call: Call, request: GenerationRequest) -> Lookup | None:
        if self._cache is None or call.model.cache is None:
            return None
        lookup = await self._cache.lookup(call.model.id, call.model.endpoint, call.model.cache, call.key.id, request,
                                          call.context.invocation_metadata() or ())
        if lookup is not None:
            call.record.cache = "hit" if lookup.events is not None else "miss"
        return lookup

    async def forget_answer(self, call: Call, request: GenerationRequest) -> None:
        """The whole answer could not be given to its caller (services/dialect.py: a typed gRPC answer): an error,
        so never replayed from the cache either."""
        if self._cache is not None and call.model.cache is not None:
            await self._cache.forget(call.model.id, call.model.endpoint, call.model.cache, call.key.id, request)

    @asynccontextmanager
    async def _replay(self, call: Call, lookup: Lookup) -> AsyncIterator[AsyncIterator[GenerationEvent]]:
        """A cached answer counts as a request, and uses no tokens and costs nothing."""
        try:
            with self._telemetry.span(call.record, "admission", **{"portico.tokens_reserved": 0}):
                reservation = await self._limiter.reserve(call.key, call.model.id, 0, 0)
        except BaseException:
            call.record.cache = "miss"  # the refusal did not come from the cache (its header says so too)
            raise
        replayed = Meter(prompt_estimate=0, most_output=0)
        for event in lookup.events:
            replayed.record(event)
        note_finish(call, replayed)  # the caller is told how the cached answer ended, as it was first told
        try:
            await send_headers(call, reservation, lookup.header)
            yield _replayed(lookup.events)
        finally:
            account(call, FREE)  # a cached answer: nothing used, nothing to pay
            self._limiter.settle(reservation, 0, 0)

    async def complete(self, call: Call, request: GenerationRequest) -> Completion:
        """The whole answer. One whose caller left while its upstream generated it (server/cutoff.py) ran on to be
        counted, and ends as a cancelled request (499, as the caller's leaving made it) with what it used."""
        completion = None
        parts: list[str] = []
        reasoning: list[str] = []
        thoughts: list[Thought] = []
        calls: dict[int, tuple[ToolCallStart, list[str]]] = {}
        upstream: list[UpstreamObject] = []
        async with self.stream(call, request) as events:
            async for event in events:
                if isinstance(event, UpstreamObject):
                    upstream.append(event)
                elif isinstance(event, TextDelta):
                    parts.append(event.text)
                elif isinstance(event, ReasoningDelta):
                    reasoning.append(event.text)
                elif isinstance(event, ToolCallStart):
                    calls[event.index] = (event, [])
                elif isinstance(event, ToolCallDelta) and event.index in calls:
                    calls[event.index][1].append(event.arguments)
                elif isinstance(event, Finished):
                    tool_calls = tuple(ToolCall(start.id, start.name, "".join(arguments))
                                       for start, arguments in (calls[i] for i in sorted(calls)))
                    # A request that does not stream is answered with the upstream's one JSON object, if any.
                    whole = upstream[0] if len(upstream) == 1 and not request.stream else None
                    completion = Completion(text="".join(parts), finish=event, tool_calls=tool_calls, upstream=whole,
                                            reasoning="".join(reasoning), thoughts=tuple(thoughts))
                    break
                elif isinstance(event, Thought):
                    thoughts.append(event)
        if call.record.caller_left:  # nobody to answer: the interceptor records it as gone (499)
            raise asyncio.CancelledError
        if completion is None:
            raise InternalError("The provider ended without a result.")
        return completion

    async def count_tokens(self, call: Call, request: GenerationRequest) -> TokenCount:
        """How many input tokens `request`'s prompt is for its model, as its generation would take it: the embedded
        model's exact count (the one its context-window check and `usage.input_tokens` use), an upstream's own
        count where it has one (Anthropic's count_tokens), else the estimate that stands in for an upstream that
        reports no usage.

        Counting is free: it is admitted as one request with no tokens and no cost (requests per minute and per
        day, and a concurrency slot while it runs, so counts cannot flood the gateway), and is no model request
        (`record.admitted` stays false, as for GET /v1/models: no usage-ledger row, no spend)."""
        provider = call.provider
        # Refused before admission, as a generation would be: the same 400 naming the field.
        if (refusal := refusal_of(provider, request)) is not None:
            raise refusal
        counter = self._token_counters.get(call.model.id)
        local = None
        if counter is not None:
            # The embedded model's count, made before admission as /v1/messages makes it: a prompt that does not
            # fit is the same 400 and uses none of the key's requests (past the window the count is only a lower
            # bound, LlamaCppProvider.count_tokens).
            local = TokenCount(await _prompt_tokens(counter, request))
            window = self._context_windows.get(call.model.id)
            if window is not None and (overflow := context_overflow(local.input_tokens, window)) is not None:
                raise overflow
        with self._telemetry.span(call.record, "admission", **{"portico.tokens_reserved": 0}):
            reservation = await self._limiter.reserve(call.key, call.model.id, 0, 0)
        asked = True
        try:
            if local is not None:
                count = local
            else:
                if getattr(provider, "counts_upstream", False):
                    asking(call)  # an upstream attempt, for the access log and metrics as a message's
                count = await prompt_count(provider, request)
        except OutOfService:
            asked = False
            self._reached_no_model(call, reservation)  # no deployment could be asked, as in `stream`
            raise
        finally:
            call.record.upstream_done()
            if asked:  # one request, however it ended, and no tokens: the slot is free again
                self._limiter.settle(reservation, 0, 0)
        await send_headers(call, reservation)
        return count

    def _handed_over(self, call: Call, reservation: Reservation) -> None:
        """The model is asked now: marked in the usage ledger's spool with what its reservation booked, so that the
        next process writes its row and settles its reservation if this one dies before the request ends."""
        asking(call)
        if not isinstance(call.provider, Router):  # run bare: no Router counts its one attempt on its one deployment
            self._telemetry.deployment_attempt(call.model.id, call.record.deployment, None)
        call.record.booked = self._limiter.booked(reservation)
        self._telemetry.handed_over(call.record)

    def _reached_no_model(self, call: Call, reservation: Reservation) -> None:
        """Undoes `_asking` and the admission: no upstream attempt, no time in one (the ledger, access log and
        metrics), nothing held or counted."""
        call.record.upstream_attempts = 0
        call.record.upstream_started = None
        self._limiter.release(reservation)

    def _served_price(self, call: Call) -> Price:
        """The price of the model that answered, a fallback's when one did (configuration.md, Fallbacks): what the
        operator pays its upstream. Its record names it (`answered_by`), or nothing when it ran bare (one provider)."""
        served = self._catalog.get(call.record.answered_by)
        return served.price if served is not None else call.model.price

    def _billed(self, model: ModelEntry, cost: int) -> bool:
        """An upstream may bill the request: the model's own most `cost`, or a fallback with a price, which may answer
        instead (which model answers is not known here). So a budget with nothing left refuses a free model with
        such a fallback (Demand.fallback_cost), and a caller who leaves lets the exchange run on to be counted
        (server/cutoff.py Watch.billed), the free model's own too: counted at no cost."""
        return cost > 0 or any((fallback := self._catalog.get(model_id)) is not None and not fallback.price.free
                               for model_id in model.fallbacks)

    def _budgets_left(self, budgets_left: list[tuple[Reading, int]]) -> None:
        """The key's budgets as Prometheus gauges, once a request's settlement was taken."""
        for reading, left in budgets_left:
            if reading.scope.kind == "key":
                self._telemetry.budget_left(reading.scope.id, _budget_name(reading), left)

    def _budgets_in_force(self, key_id: str, reservation: Reservation) -> None:
        """A key whose budget gauges show a budget its request no longer had (removed meanwhile) loses that series."""
        if self._telemetry.shows_budgets(key_id):
            self._telemetry.budgets_in_force(
                key_id, {_budget_name(r) for r in reservation.budgets if r.scope.kind == "key"})

    async def generate_images(self, call: Call, request: ImageRequest) -> ImageAnswer:
        """Images are admitted as requests; they use no tokens. Images an upstream draws for a caller who left ran on
        to be counted (server/cutoff.py), as a non-streamed answer does in `complete`."""
        provider = call.provider
        if not isinstance(provider, ImageProvider):  # a catalog mistake: an image path served by a text provider
            raise InternalError(f"The model `{call.model.id}` has no image provider.")
        # Before admission, as for text: a request the model cannot honour costs nothing.
        if (refusal := image_unsupported(request, capabilities_of(provider))) is not None:
            raise refusal
        call.record.admitted = True
        call.record.output_type = "image"
        cost = call.model.price.cost(images=request.n)
        billed = self._billed(call.model, cost)
        with self._telemetry.span(call.record, "admission", **{"portico.tokens_reserved": 0}):
            reservation = await self._limiter.reserve(call.key, call.model.id, 0, cost, may_cost=billed)
        answer: ImageAnswer | None = None
        drawn = 0  # what the model drew: the images answered, or those of an answer that then failed
        self._handed_over(call, reservation)
        reached_model = True
        watch = self.cutoff.watch(billed=billed)
        try:
            with watch:
                answer = await watch.wait(provider.generate(request))
                drawn = len(answer.images)
        except OutOfService:  # reached no model, as in `stream`
            reached_model = False
            self._reached_no_model(call, reservation)
            raise
        except PorticoError as error:  # it used what the model reported, as a text answer that fails does
            drawn = error.images_drawn
            raise
        finally:
            call.record.upstream_done()
            call.record.caller_left = watch.caller_left
            if answer is not None or drawn:
                call.record.model_answered = True
                account(call, self._served_price(call), images=drawn)
            if reached_model:
                # One request, as in `stream`.
                self._budgets_in_force(call.key.id, reservation)
                self._limiter.settle(reservation, 0, call.record.cost_micros, self._budgets_left)
        if watch.caller_left:  # counted, with nobody to answer: the interceptor records it as gone (499)
            raise asyncio.CancelledError
        await send_headers(call, reservation)
        return answer


def _budget_name(reading: Reading) -> str:
    """A key's budget as the gauge's `budget` label names it."""
    return "day" if reading.dimension is Dimension.DAILY_SPEND else "month"


async def _replayed(events: Sequence[GenerationEvent]) -> AsyncIterator[GenerationEvent]:
    for event in events:
        yield event


async def _prompt_tokens(counter: TokenCounter | None, request: GenerationRequest) -> int:
    if counter is not None:
        return await asyncio.to_thread(counter.count_tokens, request.turns)
    return request.estimated_prompt_tokens()
