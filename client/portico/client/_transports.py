"""How one attempt reaches the gateway: the generated gRPC stubs, or the REST API through httpx.

Every transport takes an Operation and a request body (the wire JSON, as a dict), returns the typed response
message of portico.v1, and raises an APIError for any failure. REST answers are parsed into the same messages,
so callers get one type whichever transport they use.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
from google.protobuf import json_format
from google.protobuf.message import Message

from portico.client._errors import (
    APIConnectionError, APIError, APITimeoutError, BadRequestError, error_from_grpc, error_from_http,
)
from portico.v1 import (
    chat_pb2, chat_service_pb2_grpc, message_pb2, message_service_pb2_grpc, model_pb2, model_service_pb2_grpc,
)


@dataclass(frozen=True)
class Operation:
    stub: type  # the generated *Stub class
    method: str
    request: type[Message]
    response: type[Message]
    http_method: str
    path: str


CHAT_COMPLETION = Operation(chat_service_pb2_grpc.ChatServiceStub, "CreateChatCompletion",
                            chat_pb2.CreateChatCompletionRequest, chat_pb2.ChatCompletion, "POST", "/v1/chat/completions")
MESSAGE = Operation(message_service_pb2_grpc.MessageServiceStub, "CreateMessage",
                    message_pb2.CreateMessageRequest, message_pb2.Message, "POST", "/v1/messages")
LIST_MODELS = Operation(model_service_pb2_grpc.ModelServiceStub, "ListModels",
                        model_pb2.ListModelsRequest, model_pb2.ListModelsResponse, "GET", "/v1/models")


def _request(operation: Operation, body: dict[str, Any]) -> Message:
    try:
        return json_format.ParseDict(body, operation.request())
    except json_format.ParseError as error:
        raise BadRequestError(f"The request does not fit {operation.request.DESCRIPTOR.full_name}: {error}") from None


def _response(operation: Operation, response: httpx.Response) -> Message:
    if response.is_error:
        raise error_from_http(response.status_code, response.content, response.headers)
    try:
        return json_format.ParseDict(response.json(), operation.response(), ignore_unknown_fields=True)
    except (ValueError, json_format.ParseError) as error:
        raise APIError(f"Unreadable answer from {response.url}: {error}", status=response.status_code) from None


def _auth(api_key: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),)


def _http_error(error: httpx.TransportError, method: str) -> APIConnectionError:
    """A read timeout on a POST means the request went out and may be running: APITimeoutError, never retried."""
    kind = APITimeoutError if isinstance(error, httpx.ReadTimeout) and method == "POST" else APIConnectionError
    return kind(f"{type(error).__name__}: {error or 'no answer'}")


@dataclass
class GrpcTransport:
    """Blocking calls over a grpc.Channel (e.g. grpc.insecure_channel("127.0.0.1:8080")); owns the channel."""

    channel: grpc.Channel
    api_key: str
    timeout: float | None = 60.0
    _stubs: dict[type, Any] = field(default_factory=dict, init=False, repr=False)

    def call(self, operation: Operation, body: dict[str, Any]) -> Message:
        request = _request(operation, body)
        stub = self._stubs.get(operation.stub) or self._stubs.setdefault(operation.stub, operation.stub(self.channel))
        try:
            return getattr(stub, operation.method)(request, metadata=_auth(self.api_key), timeout=self.timeout)
        except grpc.RpcError as error:
            raise error_from_grpc(error) from None

    def close(self) -> None:
        self.channel.close()


@dataclass
class AsyncGrpcTransport:
    """grpc.aio calls to `target` (TLS with `credentials`); the channel opens on first use, in the caller's loop."""

    target: str
    api_key: str
    timeout: float | None = 60.0
    credentials: grpc.ChannelCredentials | None = None
    _channel: grpc.aio.Channel | None = field(default=None, init=False, repr=False)
    _stubs: dict[type, Any] = field(default_factory=dict, init=False, repr=False)

    async def call(self, operation: Operation, body: dict[str, Any]) -> Message:
        request = _request(operation, body)
        if self._channel is None:
            self._channel = (grpc.aio.secure_channel(self.target, self.credentials) if self.credentials
                             else grpc.aio.insecure_channel(self.target))
        stub = self._stubs.get(operation.stub) or self._stubs.setdefault(operation.stub, operation.stub(self._channel))
        try:
            return await getattr(stub, operation.method)(request, metadata=_auth(self.api_key), timeout=self.timeout)
        except grpc.RpcError as error:
            raise error_from_grpc(error) from None

    async def close(self) -> None:
        if self._channel is not None:
            await self._channel.close()
            self._channel, self._stubs = None, {}


@dataclass
class HttpTransport:
    """Blocking REST calls with httpx to `base_url` (e.g. "http://127.0.0.1:8080"); owns its httpx.Client."""

    base_url: str
    api_key: str
    timeout: float | None = 60.0
    http: httpx.Client | None = None

    def __post_init__(self) -> None:
        self.http = self.http or httpx.Client(timeout=self.timeout)

    def call(self, operation: Operation, body: dict[str, Any]) -> Message:
        try:
            response = self.http.request(
                operation.http_method, self.base_url.rstrip("/") + operation.path,
                json=body if operation.http_method == "POST" else None, headers=dict(_auth(self.api_key)))
        except httpx.TransportError as error:
            raise _http_error(error, operation.http_method) from error
        return _response(operation, response)

    def close(self) -> None:
        self.http.close()


@dataclass
class AsyncHttpTransport:
    """REST calls with httpx.AsyncClient; owns it."""

    base_url: str
    api_key: str
    timeout: float | None = 60.0
    http: httpx.AsyncClient | None = None

    def __post_init__(self) -> None:
        self.http = self.http or httpx.AsyncClient(timeout=self.timeout)

    async def call(self, operation: Operation, body: dict[str, Any]) -> Message:
        try:
            response = await self.http.request(
                operation.http_method, self.base_url.rstrip("/") + operation.path,
                json=body if operation.http_method == "POST" else None, headers=dict(_auth(self.api_key)))
        except httpx.TransportError as error:
            raise _http_error(error, operation.http_method) from error
        return _response(operation, response)

    async def close(self) -> None:
        await self.http.aclose()
