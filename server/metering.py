"""What a generation has used so far, metered as its events pass on their way to the caller: the pipeline settles
the request's reservation with it however the generation ends (finished, failed, cut short, its caller gone)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

from server.cutoff import Watch
from server.domain import Dialect, estimate_tokens
from server.domain_answers import (
    Finished, GenerationEvent, ReasoningDelta, Started, TextDelta, ToolCallDelta, ToolCallStart, UpstreamObject, Usage,
)
from server.errors import InternalError, PorticoError
from server.observability import RequestRecord


@dataclass(slots=True)
class Meter:
    """What a generation has used so far, to settle its reservation however it ends."""

    prompt_estimate: int
    most_output: int  # the request's token limit: a model cut short wrote no more than that
    started: bool = False
    input_tokens: int | None = None
    cached_input_tokens: int = 0  # of input_tokens, as the provider reported them when it started (Started)
    cache_write_tokens: int = 0
    cache_write_1h_tokens: int = 0
    deltas: int = 0
    chars: int = 0
    usage: Usage | None = None
    finished: Finished | None = None
    upstream: Dialect | None = None  # the dialect of the last upstream object: the upstream that answered

    def record(self, event: GenerationEvent) -> None:
        self.started = True  # an upstream object counts nothing, but says a model was reached
        if isinstance(event, UpstreamObject):
            self.upstream = event.dialect
        elif isinstance(event, Started):
            self.input_tokens = event.input_tokens
            self.cached_input_tokens, self.cache_write_tokens = event.cached_input_tokens, event.cache_write_tokens
            self.cache_write_1h_tokens = event.cache_write_1h_tokens
        elif isinstance(event, (TextDelta, ReasoningDelta)):  # thinking is generated, and billed, as output
            self.deltas += 1
            self.chars += len(event.text)
        elif isinstance(event, ToolCallDelta):
            self.chars += len(event.arguments)
        elif isinstance(event, Finished):
            self.usage = event.usage
            self.finished = event

    def usage_so_far(self) -> Usage:
        if self.usage is not None:
            return self.usage
        # Cut short: the provider never reported usage, so count what was sent (a delta is at least one token), up
        # to the token limit it ran under (four characters a token overcounts long unbroken text).
        output = min(self.most_output, max(self.deltas, estimate_tokens(self.chars)))
        if self.input_tokens is None:
            return Usage(self.prompt_estimate, output)
        # The prompt as the provider reported it, its cache reads and writes included: they are billed at their own
        # prices whether or not the answer was finished.
        return Usage(self.input_tokens, output, self.cached_input_tokens, self.cache_write_tokens,
                     self.cache_write_1h_tokens)


async def metered(
    events: AsyncIterator[GenerationEvent], meter: Meter, record: RequestRecord, watch: Watch
) -> AsyncIterator[GenerationEvent]:
    try:
        try:
            # A stopping server may cut the call while it waits on the provider (server/cutoff.py): between
            # `begin` and the next event; the cut's cancellation can only land there.
            watch.begin()
            try:
                async for event in events:
                    watch.waiting = False
                    meter.record(event)
                    if record.first_token_seconds is None and _content(event):  # one look per event after it
                        record.first_token()
                    yield event
                    watch.begin()
            except asyncio.CancelledError:
                watch.cancelled()
                raise
            watch.waiting = False
        finally:
            await events.aclose()  # aclosing's work, without its objects held by every open stream
    except Exception as exc:
        # Noted for a stream that fails after its first bytes, whose caller still gets a 200 with an error event.
        record.in_band_error = exc.kind.code if isinstance(exc, PorticoError) else InternalError.kind.code
        if isinstance(exc, PorticoError) and exc.usage_reported is not None and meter.usage is None:
            meter.usage = exc.usage_reported  # what the upstream counted before it broke off, not an estimate
        raise


def _content(event: GenerationEvent) -> bool:
    """Part of the answer reaches the caller: the first token is the first of these, whichever the answer begins with
    (an agent's turn is often only a tool call; a thinking model thinks before it writes)."""
    return isinstance(event, (TextDelta, ReasoningDelta, ToolCallStart, ToolCallDelta)) or (
        isinstance(event, UpstreamObject) and event.content)


async def started(events: AsyncIterator[GenerationEvent]) -> AsyncIterator[GenerationEvent]:
    """`events` once the first has come, so that a failure to start is raised here; none at all is an InternalError.
    The first is handed on, not kept by the caller: an open stream holds no event it has sent."""
    try:
        first = await anext(events)
    except StopAsyncIteration:
        raise InternalError("The provider ended without a result.") from None
    return _prepend(first, events)


async def _prepend(event: GenerationEvent, rest: AsyncIterator[GenerationEvent]) -> AsyncIterator[GenerationEvent]:
    yield event
    async for event in rest:  # rebinds the first: not held while the stream runs
        yield event
