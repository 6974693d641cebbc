"""ChatService: OpenAI-dialect chat completions."""

from __future__ import annotations

import secrets
import time
from collections.abc import AsyncIterator

import grpc
import orjson
from google.api import httpbody_pb2
from google.protobuf import json_format

from portico.v1 import chat_pb2, chat_service_pb2_grpc
from server.domain import ResponseHeader
from server.pipeline import Call, Pipeline
from server.render import DONE, sse_event
from server.services.streaming import coalesced, guard_stream
from server.translate import internal_to_openai as to_openai
from server.translate.openai_to_internal import ChatPlan, chat_request

ENDPOINT = "/v1/chat/completions"


class ChatServicer(chat_service_pb2_grpc.ChatServiceServicer):
    def __init__(self, pipeline: Pipeline, *, default_max_tokens: int) -> None:
        self._pipeline = pipeline
        self._default_max_tokens = default_max_tokens

    def _prepare(self, request, context, *, always_stream: bool = False) -> tuple[Call, ChatPlan, ResponseHeader]:
        call = self._pipeline.begin(context, request.model, ENDPOINT)
        plan = chat_request(request, upstream_model=call.model.id, default_max_tokens=self._default_max_tokens,
                            always_stream=always_stream)
        header = ResponseHeader(
            id=f"chatcmpl-{secrets.token_urlsafe(18)}", created=int(time.time()), model=request.model
        )
        return call, plan, header

    async def CreateChatCompletion(self, request, context: grpc.aio.ServicerContext) -> chat_pb2.ChatCompletion:
        call, plan, header = self._prepare(request, context)
        completion = await self._pipeline.complete(call, plan.generation)
        return json_format.ParseDict(to_openai.chat_completion(header, completion), chat_pb2.ChatCompletion(),
                                     ignore_unknown_fields=True)

    async def StreamChatCompletion(self, request, context) -> AsyncIterator[chat_pb2.ChatCompletionChunk]:
        call, plan, header = self._prepare(request, context, always_stream=True)
        async with self._pipeline.stream(call, plan.generation) as events:
            async for chunk in to_openai.chat_chunks(header, events, include_usage=plan.include_usage):
                yield json_format.ParseDict(chunk, chat_pb2.ChatCompletionChunk(), ignore_unknown_fields=True)

    async def CreateChatCompletionHttp(self, request, context) -> AsyncIterator[httpbody_pb2.HttpBody]:
        call, plan, header = self._prepare(request, context)
        if not plan.stream:
            completion = await self._pipeline.complete(call, plan.generation)
            body = orjson.dumps(to_openai.chat_completion(header, completion))
            yield httpbody_pb2.HttpBody(content_type="application/json", data=body)
            return
        async with self._pipeline.stream(call, plan.generation) as events:
            chunks = to_openai.chat_chunks(header, events, include_usage=plan.include_usage)
            async for frame in coalesced(guard_stream(_sse_frames(chunks), anthropic=False)):
                yield httpbody_pb2.HttpBody(content_type="text/event-stream", data=frame)


async def _sse_frames(chunks: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        yield sse_event(chunk)
    yield DONE
