"""The shared base of the text-generation servicers: each dialect endpoint has a typed unary RPC, a typed stream
RPC and two HTTP-body RPCs (REST through Envoy: one JSON body, or SSE bytes; the unary one for bodies that do not
stream), all over the same pipeline.

An endpoint is an adapter of a few small pieces: how a request becomes a plan (`plan`), whether a same-dialect
upstream's answer keeps its own id (`keeps_upstream_id`), how a whole answer becomes a JSON object (`answer`), how
events become the dialect's stream objects (`stream_objects`) and how those are framed as SSE (`frames`,
`error_frame`, from server/render). Everything else is here, once.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import ClassVar, Protocol

from google.api import httpbody_pb2
from google.protobuf import json_format
from google.protobuf.message import Message

from server.domain import Endpoint, GenerationRequest
from server.domain_answers import Completion, Finished, GenerationEvent, ResponseHeader
from server.errors import PorticoError, UpstreamError
from server.observability.record import RequestRecord
from server.calls import Call
from server.pipeline import Pipeline
from server.render import json_body
from server.services.streaming import coalesced, guard_stream


class Plan(Protocol):
    """What a translator makes of a request: the generation, and whether the caller reads it as a stream."""

    @property
    def generation(self) -> GenerationRequest: ...

    @property
    def stream(self) -> bool: ...


class HeadersAtEnd:
    """A unary twin's call context: the pipeline's response headers (x-ratelimit-*) go out as trailing metadata,
    with the batch that ends the RPC, not in an initial-metadata batch of their own, which costs a round trip
    through grpc-core (~0.05 ms of CPU per request). Envoy's Lua filter moves them up into the HTTP headers: the
    transcoder holds a unary answer's headers until its trailers anyway. An error keeps them (interceptor.abort)."""

    __slots__ = ("_context",)

    def __init__(self, context) -> None:
        self._context = context

    def invocation_metadata(self):
        return self._context.invocation_metadata()

    async def send_initial_metadata(self, initial_metadata) -> None:
        self._context.set_trailing_metadata(initial_metadata)


class DialectServicer:
    endpoint: ClassVar[Endpoint]
    id_prefix: ClassVar[str]  # of the response ids: "chatcmpl-", "msg_"
    allow_x_api_key: ClassVar[bool] = False  # the Anthropic SDK sends its key as x-api-key
    response_type: ClassVar[type[Message]]  # of the typed unary RPC
    event_type: ClassVar[type[Message]]  # of the typed stream RPC

    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline

    # The adapter's pieces.

    def plan(self, body: dict, call: Call, *, stream: bool | None) -> Plan:
        """`body`: the request as JSON (a REST caller's raw body parsed, or a typed request turned into it).
        `stream`: whether the RPC streams (the typed ones, whatever `stream` says), None where the body decides."""
        raise NotImplementedError

    def keeps_upstream_id(self, plan: Plan) -> bool:
        """Whether a same-dialect upstream's answer keeps its own id (ResponseHeader.upstream_id)."""
        return False

    def answer(self, header: ResponseHeader, completion: Completion, plan: Plan) -> dict:
        raise NotImplementedError

    def stream_objects(
        self, header: ResponseHeader, events: AsyncIterator[GenerationEvent], plan: Plan
    ) -> AsyncIterator[dict]:
        raise NotImplementedError

    def frames(self, objects: AsyncIterator[dict]) -> AsyncIterator[bytes]:
        raise NotImplementedError

    def typed(self, payload: dict) -> dict:
        """An answer or event object as the typed RPCs' messages can hold it (`_typed` leaves out what they lack)."""
        return payload

    def error_frame(self, error: PorticoError) -> bytes:
        """The event that ends a stream which failed after its first byte."""
        raise NotImplementedError

    # The four RPCs of every dialect (typed unary, typed stream, HTTP body, its unary twin): an adapter binds its
    # RPC names to these.

    async def unary(self, request: Message, context) -> Message:
        call, plan, header = await self._prepare(request, context, stream=False)
        completion = await self._pipeline.complete(call, plan.generation)
        try:
            return _typed(self.typed(self.answer(header, completion, plan)), self.response_type())
        except UpstreamError:  # kept whole by the response cache, it would be this 502 again until it expired
            await self._pipeline.forget_answer(call, plan.generation)
            raise

    async def typed_stream(self, request: Message, context) -> AsyncIterator[Message]:
        call, plan, header = await self._prepare(request, context, stream=True)
        async with self._pipeline.stream(call, plan.generation) as events:
            # Each payload is its own message, so none is known to be the last before the stream ends; the answer is
            # whole once its Finished event is read, whose payloads follow at once: a caller who closes on the last
            # one (grpc then drops this generator at its yield) had the whole answer, as for `http_body`'s mark.
            async with aclosing(_marked_at_finish(events, call.record)) as marked:
                async for payload in self.stream_objects(header, marked, plan):
                    yield _typed(self.typed(payload), self.event_type())

    async def http_body(self, request: httpbody_pb2.HttpBody, context) -> AsyncIterator[httpbody_pb2.HttpBody]:
        call, plan, header = await self._prepare(request.data, context)
        if not plan.stream:
            yield await self._json_answer(call, plan, header)
            return
        # Closed with this generator (the caller went away), so the stream settles at once, not in a task the event
        # loop's finalizer hook schedules later.
        messages = self._sse(call, plan, header)
        try:
            async for data in messages:
                yield httpbody_pb2.HttpBody(content_type="text/event-stream", data=data)
        finally:
            await messages.aclose()  # aclosing's work, without its objects held by every open stream

    async def http_unary(self, request: httpbody_pb2.HttpBody, context) -> httpbody_pb2.HttpBody:
        """`http_body` in one message, for bodies Envoy found not to stream; one that does all the same (a
        `"stream"` key spelt with escapes, which Envoy's scan does not read) gets its events in one SSE body."""
        call, plan, header = await self._prepare(request.data, HeadersAtEnd(context))
        if not plan.stream:
            return await self._json_answer(call, plan, header)
        async with aclosing(self._sse(call, plan, header)) as messages:
            data = b"".join([frames async for frames in messages])
        return httpbody_pb2.HttpBody(content_type="text/event-stream", data=data)

    async def _json_answer(self, call: Call, plan: Plan, header: ResponseHeader) -> httpbody_pb2.HttpBody:
        completion = await self._pipeline.complete(call, plan.generation)
        return httpbody_pb2.HttpBody(content_type="application/json",
                                     data=json_body(self.answer(header, completion, plan)))

    async def _sse(self, call: Call, plan: Plan, header: ResponseHeader) -> AsyncIterator[bytes]:
        async with self._pipeline.stream(call, plan.generation) as events:
            frames = self.frames(self.stream_objects(header, events, plan))
            # Closed here: a caller who leaves while a message is being sent closes this generator at its `yield`;
            # the read-ahead task must stop before `events` is closed, or closing it races the task (a 500, not a
            # 499). The last message marks the answer whole: a caller who closes on it while grpc still writes it,
            # or cleans up after it, was answered (a 200, not a 499).
            messages = coalesced(guard_stream(frames, self.error_frame, call.record), last=call.record.mark_answered)
            try:
                async for data in messages:
                    yield data
            finally:
                await messages.aclose()  # aclosing's work, without its objects held by every open stream

    async def _prepare(
        self, data: bytes | Message, context, *, stream: bool | None = None
    ) -> tuple[Call, Plan, ResponseHeader]:
        """`data`: a REST caller's raw body, or a typed request."""
        body, model, key = await self._pipeline.read_body(context, data, allow_x_api_key=self.allow_x_api_key)
        call = await self._pipeline.begin(context, key, model, self.endpoint)
        plan = self.plan(body, call, stream=stream)
        header = ResponseHeader(id=f"{self.id_prefix}{secrets.token_urlsafe(18)}", created=int(time.time()),
                                model=model, upstream_id=self.keeps_upstream_id(plan))
        call.record.response_id = "" if header.upstream_id else header.id  # the upstream's id, unknown until it answers
        return call, plan, header


def _typed(payload: dict, message: Message) -> Message:
    """An answer object as the typed RPC's message. Fields the message lacks are left out; a value of the wrong type
    can only be an upstream's, passed through as it sent it (Portico's own values fit), so it is the upstream's
    failure (502), not a bug of ours (500). REST callers get such a value as it came."""
    try:
        return json_format.ParseDict(payload, message, ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise UpstreamError(f"The upstream's answer does not fit the typed {message.DESCRIPTOR.name}: a field has a "
                            "value of the wrong type for its API.") from exc


async def _marked_at_finish(events: AsyncIterator[GenerationEvent],
                            record: RequestRecord) -> AsyncIterator[GenerationEvent]:
    async for event in events:
        if isinstance(event, Finished):
            record.mark_answered()
        yield event
