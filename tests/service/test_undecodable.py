"""gRPC request bytes that do not decode (corrupt wire format, Values nested past the decoder's limit) are a 400
naming the field, answered by the interceptor: logged and counted like any bad request, never grpc's UNKNOWN/500."""

from __future__ import annotations

import grpc
import pytest
from google.protobuf import struct_pb2

from portico.v1 import chat_pb2
from tests.helpers import bearer, chat_request, error_details

METHOD = "/portico.v1.ChatService/CreateChatCompletion"


def _raw_call(channel: grpc.aio.Channel):
    return channel.unary_unary(METHOD, request_serializer=lambda raw: raw,
                               response_deserializer=chat_pb2.ChatCompletion.FromString)


def _nested(depth: int) -> struct_pb2.Value:
    value = struct_pb2.Value(string_value="bottom")
    for _ in range(depth):
        outer = struct_pb2.Value()
        outer.struct_value.fields["a"].CopyFrom(value)
        value = outer
    return value


def _samples(running) -> list[tuple[str, int, float]]:
    registry = running.telemetry.metrics.registry
    return [(s.labels.get("code"), s.labels.get("status"), s.value)
            for metric in registry.collect() if metric.name == "portico_requests"
            for s in metric.samples if s.name == "portico_requests_total"]


def _count(running, code: str) -> float:
    return sum(value for label, _, value in _samples(running) if label == code)


async def _refusal(channel, secret, raw: bytes) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _raw_call(channel)(raw, metadata=bearer(secret))
    return caught.value


async def test_corrupt_wire_format_is_400_naming_the_field(channel, secret, running):
    before = _count(running, "invalid_request")
    valid = chat_request(max_tokens=4).SerializeToString()
    corrupt = valid + bytes([2 << 3 | 2, 3]) + b"\xff\xff\xff"  # a second `messages` entry that is not a message
    error = await _refusal(channel, secret, corrupt)
    detail = error_details(error)
    assert (error.code(), detail.http_status, detail.error.code) == (grpc.StatusCode.INVALID_ARGUMENT, 400,
                                                                     "invalid_request")
    assert detail.error.param == "messages[1]"
    assert _count(running, "invalid_request") == before + 1  # metrics (and the access log) saw it


async def test_values_nested_past_the_decoders_limit_are_400(channel, secret):
    request = chat_request(max_tokens=4)
    request.tool_choice.CopyFrom(_nested(60))  # each JSON level is two messages: 120 > the decoder's 100
    error = await _refusal(channel, secret, request.SerializeToString())
    detail = error_details(error)
    assert (error.code(), detail.http_status, detail.error.param) == (grpc.StatusCode.INVALID_ARGUMENT, 400,
                                                                      "tool_choice")
    assert "nested too deeply" in detail.error.message
