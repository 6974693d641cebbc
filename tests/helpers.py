"""Small helpers shared by the test suites."""

from __future__ import annotations

import grpc
from google.protobuf import json_format
from google.rpc import status_pb2

from portico.v1 import chat_pb2, error_pb2


def chat_request(**fields) -> chat_pb2.CreateChatCompletionRequest:
    body = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8}
    body.update(fields)
    return json_format.ParseDict(body, chat_pb2.CreateChatCompletionRequest())


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


def message_request(**fields):
    from portico.v1 import message_pb2

    body = {"model": "family-b-sonnet-4-6", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hello."}]}
    body.update(fields)
    return json_format.ParseDict(body, message_pb2.CreateMessageRequest())


def sse_frames(bodies: list) -> list[bytes]:
    """The SSE events of a streamed HttpBody answer, one per item, each ending with its blank line. Events that
    were ready together may share an HttpBody message, so they are split here rather than counted by message."""
    data = b"".join(body.data for body in bodies)
    return [frame + b"\n\n" for frame in data.split(b"\n\n") if frame]
