"""Small helpers shared by the test suites."""

from __future__ import annotations

import asyncio
import time

import grpc
import orjson
from google.api import httpbody_pb2
from google.protobuf import json_format
from google.rpc import status_pb2

from portico.v1 import chat_pb2, error_pb2
from server.translate.values import proto_to_json


def chat_body(**fields) -> dict:
    """A chat-completions body as a REST caller sends it (the translators read parsed JSON)."""
    return {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
            **fields}


def chat_request(**fields) -> chat_pb2.CreateChatCompletionRequest:
    return json_format.ParseDict(chat_body(**fields), chat_pb2.CreateChatCompletionRequest())


def http_body(request) -> httpbody_pb2.HttpBody:
    """A typed request (or a dict) as the raw JSON body the REST RPCs take, as Envoy passes it on."""
    body = request if isinstance(request, dict) else proto_to_json(request)
    return httpbody_pb2.HttpBody(content_type="application/json", data=orjson.dumps(body))


# What a REST caller must never see: gRPC's own headers and the server's internal ones (Envoy's Lua filter strips them).
INTERNAL_HEADER_PREFIXES = ("grpc-", "portico-")


def internal_headers(names) -> list[str]:
    """The names among `names` (response headers, trailers) that leaked from inside the gateway."""
    return [name for name in names if name.lower().startswith(INTERNAL_HEADER_PREFIXES)]


def error_details(error: grpc.aio.AioRpcError) -> error_pb2.ErrorResponse:
    """The ErrorResponse a gRPC caller finds in the status details."""
    for name, value in error.trailing_metadata() or ():
        if name == "grpc-status-details-bin":
            status = status_pb2.Status.FromString(value)
            detail = error_pb2.ErrorResponse()
            assert status.details[0].Unpack(detail)
            return detail
    raise AssertionError(f"no status details in {error!r}")


def bearer(secret: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {secret}"),)


async def lookups_held_up(auth, secret: str, key, seconds: float) -> list[float]:
    """`auth` (an Authenticator) asked for the cached key `key` 20 times a second for `seconds`, each answer `key`:
    when (seconds into it) each lookup that took over half a second began."""
    slow: list[float] = []
    start = time.monotonic()
    while time.monotonic() < start + seconds:
        asked = time.monotonic()
        assert await auth.authenticate(bearer(secret)) == key
        if time.monotonic() - asked > 0.5:
            slow.append(round(asked - start, 1))
        await asyncio.sleep(0.05)
    return slow


def message_body(**fields) -> dict:
    return {"model": "family-b-sonnet-4-6", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hello."}],
            **fields}


def message_request(**fields):
    from portico.v1 import message_pb2

    return json_format.ParseDict(message_body(**fields), message_pb2.CreateMessageRequest())


def sse_frames(bodies: list) -> list[bytes]:
    """The SSE events of a streamed HttpBody answer, one per item, each ending with its blank line. Events that
    were ready together may share an HttpBody message, so they are split here rather than counted by message."""
    data = b"".join(body.data for body in bodies)
    return [frame + b"\n\n" for frame in data.split(b"\n\n") if frame]


def schema_and_functions(fields: int, repeat: int) -> tuple[dict, list[dict]]:
    """A structured-output `response_format` and legacy `functions` whose schemas have `fields` string properties,
    each described by a phrase said `repeat` times: parts of the prompt an upstream reads that the gateway does not."""
    properties = {f"field_{i}": {"type": "string", "description": "what the caller wants in it " * repeat}
                  for i in range(fields)}
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
        "type": "object", "properties": properties}}}
    return schema, [{"name": "lookup", "description": "finds things", "parameters": {
        "type": "object", "properties": properties}}]
