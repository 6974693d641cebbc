"""MessageService: Anthropic-dialect messages."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator

import orjson
from google.api import httpbody_pb2
from google.protobuf import json_format

from portico.v1 import message_pb2, message_service_pb2_grpc
from server.domain import ResponseHeader
from server.pipeline import Call, Pipeline
from server.render import sse_event
from server.services.streaming import coalesced, guard_stream
from server.translate import internal_to_anthropic as to_anthropic
from server.translate.anthropic_to_internal import MessagePlan, message_request

ENDPOINT = "/v1/messages"


class MessageServicer(message_service_pb2_grpc.MessageServiceServicer):
    def __init__(self, pipeline: Pipeline) -> None:
        self._pipeline = pipeline

    def _prepare(self, request, context, *, always_stream: bool = False) -> tuple[Call, MessagePlan, ResponseHeader]:
        call = self._pipeline.begin(context, request.model, ENDPOINT, allow_x_api_key=True)
        plan = message_request(request, upstream_model=call.model.id, always_stream=always_stream)
        header = ResponseHeader(id=f"msg_{secrets.token_urlsafe(18)}", created=int(time.time()), model=request.model)
        return call, plan, header

    async def CreateMessage(self, request, context) -> message_pb2.Message:
        call, plan, header = self._prepare(request, context)
        completion = await self._pipeline.complete(call, plan.generation)
        return json_format.ParseDict(to_anthropic.message(header, completion), message_pb2.Message(),
                                     ignore_unknown_fields=True)

    async def StreamMessage(self, request, context) -> AsyncIterator[message_pb2.MessageStreamEvent]:
        call, plan, header = self._prepare(request, context, always_stream=True)
        async with self._pipeline.stream(call, plan.generation) as events:
            async for event in to_anthropic.message_events(header, events):
                yield json_format.ParseDict(event, message_pb2.MessageStreamEvent(), ignore_unknown_fields=True)

    async def CreateMessageHttp(self, request, context) -> AsyncIterator[httpbody_pb2.HttpBody]:
        call, plan, header = self._prepare(request, context)
        if not plan.stream:
            completion = await self._pipeline.complete(call, plan.generation)
            body = orjson.dumps(to_anthropic.message(header, completion))
            yield httpbody_pb2.HttpBody(content_type="application/json", data=body)
            return
        async with self._pipeline.stream(call, plan.generation) as events:
            frames = (sse_event(event, event["type"]) async for event in to_anthropic.message_events(header, events))
            async for frame in coalesced(guard_stream(frames, anthropic=True)):
                yield httpbody_pb2.HttpBody(content_type="text/event-stream", data=frame)
