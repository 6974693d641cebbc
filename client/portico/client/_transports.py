"""How one attempt reaches the gateway: the generated gRPC stubs, or the REST API through httpx.

Every transport takes an Operation and a request body (the wire JSON, as a dict), returns the typed response
message of portico.v1, and raises an APIError for any failure. REST answers are parsed into the same messages,
so callers get one type whichever transport they use.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote

import grpc
import httpx
from google.protobuf import json_format
from google.protobuf.message import Message

from portico.client._errors import (
    APIConnectionError, APIError, APITimeoutError, AuthenticationError, BadRequestError, error_from_grpc,
    error_from_http,
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


# The gateway's cap on request bodies and gRPC request messages (api.md, 413). Checked before sending: over the
# server's 16 MiB receive limit grpc answers a bare RESOURCE_EXHAUSTED, which reads as a 429 and would be retried.
MAX_REQUEST_BYTES = 8 * 1024 * 1024


def _request(operation: Operation, body: dict[str, Any]) -> Message:
    try:
        request = json_format.ParseDict(body, operation.request())
    except json_format.ParseError as error:
        raise BadRequestError(f"The request does not fit {operation.request.DESCRIPTOR.full_name}: {error}",
                              param=_param(str(error))) from None
    if (size := request.ByteSize()) > MAX_REQUEST_BYTES:
        raise BadRequestError(f"The request is too large: {size} bytes (limit 8 MiB, as for REST bodies).",
                              status=413, code="request_too_large")
    return request


def _param(message: str) -> str | None:
    """The field a protobuf ParseError is about, spelt as the gateway's `param` (messages[0].content)."""
    if unknown := re.search(r'has no field named "(\w+)" at "\w+\.?([^"]*)"', message):
        return f"{unknown[2]}.{unknown[1]}" if unknown[2] else unknown[1]
    if at := re.search(r" at \w+\.(\S+?)\.*$", message.strip()):
        return at[1]
    if named := re.match(r"Failed to parse (\w+) field", message):
        return named[1]
    return None


@dataclass(frozen=True)
class _RestCall:
    path: str
    params: list[tuple[str, str]]
    content: bytes | None


def _rest_call(operation: Operation, body: dict[str, Any]) -> _RestCall:
    """The REST form of a call: the route's `{field}`s filled from the body; the other fields as the query string of
    a GET or DELETE (lists repeated; checked against the request message first), else as the JSON body, encoded
    here so that a value JSON cannot hold is a BadRequestError, as over gRPC."""
    fields = dict(body)
    path = re.sub(r"\{(\w+)\}", lambda m: quote(str(fields.pop(m[1], "")), safe=""), operation.path)
    if operation.http_method in ("GET", "DELETE"):
        _request(operation, body)  # checked as over gRPC: the gateway skips a query parameter it does not know
        params = [(name, _query_value(item)) for name, value in fields.items() if value is not None
                  for item in (value if isinstance(value, (list, tuple)) else [value])]
        return _RestCall(path, params, None)
    try:
        content = json.dumps(fields, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except (TypeError, ValueError) as error:
        raise BadRequestError(f"The request cannot be sent as JSON: {error}") from None
    return _RestCall(path, [], content)


def _query_value(value: Any) -> str:
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def _response(operation: Operation, response: httpx.Response) -> Message:
    if response.is_error:
        raise error_from_http(response.status_code, response.content, response.headers)
    try:
        return json_format.ParseDict(response.json(), operation.response(), ignore_unknown_fields=True)
    except (ValueError, json_format.ParseError) as error:
        raise APIError(f"Unreadable answer from {response.url}: {error}", status=response.status_code) from None


def _auth(api_key: str | None) -> tuple[tuple[str, str], ...]:
    """The key's header. A key that cannot be a header value gets here the 401 the gateway gives a key that is not
    printable ASCII (grpc would refuse it as INTERNAL, httpx as a protocol error: both retried to no end); no key
    sends no header, which the gateway answers with its 401 "You didn't provide an API key"."""
    if not api_key:
        return ()
    if not _KEY.fullmatch(api_key):
        raise AuthenticationError("The API key holds a space, a line break or a character outside printable ASCII "
                                  "(a key read from a file with its newline?): it is not a key Portico made.")
    return (("authorization", f"Bearer {api_key}"),)


_KEY = re.compile(r"[\x21-\x7e]+")

# grpc waits 1 s after a failed connection, then 1.6-fold longer up to 120 s, and fails calls fast meanwhile: a
# gateway restarted after a few seconds' outage would refuse every retry for seconds more. A channel this package
# makes reconnects at least every half second (the policy's default base), so retries find the gateway back.
# It also receives what the gateway sends (up to 64 MiB: base64 images), not grpc's default 4 MiB, over which grpc
# fails the call with RESOURCE_EXHAUSTED: a 429 to the policy, so the images were generated again and again.
CHANNEL_OPTIONS = (("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500),
                   ("grpc.max_receive_message_length", 64 * 1024 * 1024))
_CLOSED = "Cannot send a request, as the client has been closed."


def check_timeout(timeout: float | None) -> None:
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be a number of seconds above 0, or None for no timeout; got {timeout!r}")


def grpc_target(target: str) -> str:
    """A gRPC target is "host:port" (or a gRPC URI such as dns:///host:port), never an http(s) URL."""
    if re.match(r"https?://", target):
        raise ValueError(f"a gRPC target is host:port, not a URL: {target!r} (REST callers: over_rest)")
    return target


def rest_base_url(url: str) -> str:
    if not re.match(r"https?://", url):
        raise ValueError(f"the REST base URL must start with http:// or https://, got {url!r}")
    return url.rstrip("/")


def _headers(api_key: str | None, operation: Operation) -> dict[str, str]:
    json_body = {} if operation.http_method in ("GET", "DELETE") else {"content-type": "application/json"}
    return {**dict(_auth(api_key)), **json_body}


def _http_error(error: httpx.TransportError, method: str) -> APIConnectionError:
    """A read timeout on a POST means the request went out and may be running: APITimeoutError, never retried."""
    if isinstance(error, httpx.ReadTimeout) and method == "POST":  # httpx's timeouts have no message of their own
        return APITimeoutError(f"No answer within the client's timeout ({type(error).__name__}).")
    return APIConnectionError(f"{type(error).__name__}: {str(error) or 'no answer'}")


@dataclass
class GrpcTransport:
    """Blocking calls over a grpc.Channel (e.g. grpc.insecure_channel("127.0.0.1:8080")); owns the channel."""

    channel: grpc.Channel
    api_key: str
    timeout: float | None = 60.0
    _stubs: dict[type, Any] = field(default_factory=dict, init=False, repr=False)
    _closed: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        check_timeout(self.timeout)

    def call(self, operation: Operation, body: dict[str, Any]) -> Message:
        if self._closed:
            raise RuntimeError(_CLOSED)  # grpc itself crashes the process making a stub on a closed channel
        request = _request(operation, body)
        metadata = _auth(self.api_key)
        stub = self._stubs.get(operation.stub) or self._stubs.setdefault(operation.stub, operation.stub(self.channel))
        try:
            return getattr(stub, operation.method)(request, metadata=metadata, timeout=self.timeout)
        except grpc.RpcError as error:
            raise error_from_grpc(error) from None

    def close(self) -> None:
        self._closed = True
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
    _closed: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        grpc_target(self.target)
        check_timeout(self.timeout)

    async def call(self, operation: Operation, body: dict[str, Any]) -> Message:
        request = _request(operation, body)
        metadata = _auth(self.api_key)
        if self._closed:
            raise RuntimeError(_CLOSED)  # as the other transports: a closed client stays closed
        if self._channel is None:
            self._channel = (grpc.aio.secure_channel(self.target, self.credentials, CHANNEL_OPTIONS)
                             if self.credentials else grpc.aio.insecure_channel(self.target, CHANNEL_OPTIONS))
        stub = self._stubs.get(operation.stub) or self._stubs.setdefault(operation.stub, operation.stub(self._channel))
        try:
            return await getattr(stub, operation.method)(request, metadata=metadata, timeout=self.timeout)
        except grpc.RpcError as error:
            raise error_from_grpc(error) from None

    async def close(self) -> None:
        self._closed = True
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
        self.base_url = rest_base_url(self.base_url)
        check_timeout(self.timeout)
        self.http = self.http or httpx.Client(timeout=self.timeout)

    def call(self, operation: Operation, body: dict[str, Any]) -> Message:
        rest, headers = _rest_call(operation, body), _headers(self.api_key, operation)
        try:
            response = self.http.request(operation.http_method, self.base_url + rest.path, params=rest.params,
                                         content=rest.content, headers=headers)
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
        self.base_url = rest_base_url(self.base_url)
        check_timeout(self.timeout)
        self.http = self.http or httpx.AsyncClient(timeout=self.timeout)

    async def call(self, operation: Operation, body: dict[str, Any]) -> Message:
        rest, headers = _rest_call(operation, body), _headers(self.api_key, operation)
        try:
            response = await self.http.request(operation.http_method, self.base_url + rest.path,
                                               params=rest.params, content=rest.content, headers=headers)
        except httpx.TransportError as error:
            raise _http_error(error, operation.http_method) from error
        return _response(operation, response)

    async def close(self) -> None:
        await self.http.aclose()
