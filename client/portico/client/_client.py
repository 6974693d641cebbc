"""The clients: per call, the user's token, then the alias's models in order, each retried by the policy."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from portico.client._aliases import ModelAliases
from portico.client._errors import APIError
from portico.client._limiter import UserRateLimiter
from portico.client._policy import Plan, RetryPolicy
from portico.client._transports import (
    CHANNEL_OPTIONS, CHAT_COMPLETION, COUNT_MESSAGE_TOKENS, LIST_MODELS, MESSAGE, AsyncGrpcTransport,
    AsyncHttpTransport, GrpcTransport, HttpTransport, Operation, Reply, check_request_id, check_timeout, grpc_target,
)
from portico.v1 import chat_pb2, message_pb2, message_tokens_pb2, model_pb2


class Transport(Protocol):
    def call(self, operation: Operation, body: dict[str, Any], request_id: str | None = None) -> Reply: ...
    def close(self) -> None: ...


class AsyncTransport(Protocol):
    async def call(self, operation: Operation, body: dict[str, Any], request_id: str | None = None) -> Reply: ...
    async def close(self) -> None: ...


def _new_random() -> Callable[[], float]:
    return random.Random().random


def _body(fields: dict[str, Any], **required: Any) -> dict[str, Any]:
    return {**required, **fields}


def _unary(body: dict[str, Any]) -> None:
    """Checked in `call`, for any operation: over REST a stream would be generated in full and then be unreadable
    as one JSON answer; over gRPC the unary RPC ignores the field."""
    if body.get("stream"):
        raise ValueError("portico.client makes unary calls only; stream with the gRPC stubs or an SDK")


def _bind(body: dict[str, Any], model: str) -> dict[str, Any]:
    return {**body, "model": model} if model else body


@dataclass
class PorticoClient:
    """Blocking client. `model` arguments may be aliases (see ModelAliases); `user` picks the limiter's bucket
    (calls without one share the "" bucket). Responses are portico.v1 messages whichever transport is used."""

    transport: Transport
    aliases: ModelAliases = field(default_factory=ModelAliases)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    limiter: UserRateLimiter | None = None
    sleep: Callable[[float], None] = time.sleep
    random: Callable[[], float] = field(default_factory=_new_random)

    @classmethod
    def over_grpc(cls, target: str, api_key: str, *, timeout: float | None = 60.0,
                  credentials: grpc.ChannelCredentials | None = None, **options: Any) -> PorticoClient:
        """Native gRPC to `target` ("host:port", the gateway's one port; TLS with `credentials`)."""
        check_timeout(timeout)
        target = grpc_target(target)
        channel = (grpc.secure_channel(target, credentials, CHANNEL_OPTIONS) if credentials
                   else grpc.insecure_channel(target, CHANNEL_OPTIONS))
        return cls(GrpcTransport(channel, api_key, timeout), **options)

    @classmethod
    def over_rest(cls, base_url: str, api_key: str, *, timeout: float | None = 60.0, **options: Any) -> PorticoClient:
        """The REST API at `base_url` ("http://host:port") through httpx."""
        return cls(HttpTransport(base_url, api_key, timeout), **options)

    def chat_completion(self, model: str, messages: list[dict], *, user: str | None = None,
                        request_id: str | None = None, **fields: Any) -> chat_pb2.ChatCompletion:
        """ChatService.CreateChatCompletion / POST /v1/chat/completions; `fields` are wire fields (max_tokens=...)."""
        body = _body(fields, messages=messages)
        return self.call(CHAT_COMPLETION, body, model=model, user=user, request_id=request_id)

    def message(self, model: str, messages: list[dict], *, max_tokens: int, user: str | None = None,
                request_id: str | None = None, **fields: Any) -> message_pb2.Message:
        """MessageService.CreateMessage / POST /v1/messages."""
        body = _body(fields, messages=messages, max_tokens=max_tokens)
        return self.call(MESSAGE, body, model=model, user=user, request_id=request_id)

    def count_message_tokens(self, model: str, messages: list[dict], *, user: str | None = None,
                             request_id: str | None = None, **fields: Any) -> message_tokens_pb2.MessageTokensCount:
        """MessageService.CountMessageTokens / POST /v1/messages/count_tokens: the prompt's input tokens."""
        body = _body(fields, messages=messages)
        return self.call(COUNT_MESSAGE_TOKENS, body, model=model, user=user, request_id=request_id)

    def list_models(self, *, request_id: str | None = None) -> model_pb2.ListModelsResponse:
        return self.call(LIST_MODELS, {}, request_id=request_id)

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> PorticoClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def call(self, operation: Operation, body: dict[str, Any], *, model: str | None = None,
             user: str | None = None, request_id: str | None = None) -> Any:
        """Any unary RPC with these rules; `model` (an alias or id) is set into the body, fallbacks included;
        `request_id` (the caller's own, for tracing) is sent as x-request-id with every attempt."""
        return self.call_with_id(operation, body, model=model, user=user, request_id=request_id).message

    def call_with_id(self, operation: Operation, body: dict[str, Any], *, model: str | None = None,
                     user: str | None = None, request_id: str | None = None) -> Reply[Any]:
        """As `call`, with the id the gateway logged the answer under: `.message`, `.request_id`."""
        _unary(body)
        check_request_id(request_id)
        if self.limiter is not None and (wait := self.limiter.take(user or "")):
            self.sleep(wait)
        plan = Plan(self.aliases.models(model) if model else ("",), self.retry, self.random)
        while True:
            try:
                return self.transport.call(operation, _bind(body, plan.model), request_id)
            except APIError as error:
                wait = plan.failed(error)  # raises when the call is over
            if wait > 0:
                self.sleep(wait)


@dataclass
class AsyncPorticoClient:
    """The asyncio twin of PorticoClient; `sleep` is awaited."""

    transport: AsyncTransport
    aliases: ModelAliases = field(default_factory=ModelAliases)
    retry: RetryPolicy = field(default_factory=RetryPolicy)
    limiter: UserRateLimiter | None = None
    sleep: Callable[[float], Awaitable[None]] = asyncio.sleep
    random: Callable[[], float] = field(default_factory=_new_random)

    @classmethod
    def over_grpc(cls, target: str, api_key: str, *, timeout: float | None = 60.0,
                  credentials: grpc.ChannelCredentials | None = None, **options: Any) -> AsyncPorticoClient:
        return cls(AsyncGrpcTransport(target, api_key, timeout, credentials), **options)

    @classmethod
    def over_rest(cls, base_url: str, api_key: str, *, timeout: float | None = 60.0,
                  **options: Any) -> AsyncPorticoClient:
        return cls(AsyncHttpTransport(base_url, api_key, timeout), **options)

    async def chat_completion(self, model: str, messages: list[dict], *, user: str | None = None,
                              request_id: str | None = None, **fields: Any) -> chat_pb2.ChatCompletion:
        body = _body(fields, messages=messages)
        return await self.call(CHAT_COMPLETION, body, model=model, user=user, request_id=request_id)

    async def message(self, model: str, messages: list[dict], *, max_tokens: int, user: str | None = None,
                      request_id: str | None = None, **fields: Any) -> message_pb2.Message:
        body = _body(fields, messages=messages, max_tokens=max_tokens)
        return await self.call(MESSAGE, body, model=model, user=user, request_id=request_id)

    async def count_message_tokens(self, model: str, messages: list[dict], *, user: str | None = None,
                                   request_id: str | None = None,
                                   **fields: Any) -> message_tokens_pb2.MessageTokensCount:
        body = _body(fields, messages=messages)
        return await self.call(COUNT_MESSAGE_TOKENS, body, model=model, user=user, request_id=request_id)

    async def list_models(self, *, request_id: str | None = None) -> model_pb2.ListModelsResponse:
        return await self.call(LIST_MODELS, {}, request_id=request_id)

    async def close(self) -> None:
        await self.transport.close()

    async def __aenter__(self) -> AsyncPorticoClient:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def call(self, operation: Operation, body: dict[str, Any], *, model: str | None = None,
                   user: str | None = None, request_id: str | None = None) -> Any:
        return (await self.call_with_id(operation, body, model=model, user=user, request_id=request_id)).message

    async def call_with_id(self, operation: Operation, body: dict[str, Any], *, model: str | None = None,
                           user: str | None = None, request_id: str | None = None) -> Reply[Any]:
        _unary(body)
        check_request_id(request_id)
        if self.limiter is not None and (wait := self.limiter.take(user or "")):
            await self.sleep(wait)
        plan = Plan(self.aliases.models(model) if model else ("",), self.retry, self.random)
        while True:
            try:
                return await self.transport.call(operation, _bind(body, plan.model), request_id)
            except APIError as error:
                wait = plan.failed(error)
            if wait > 0:
                await self.sleep(wait)
