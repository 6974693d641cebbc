"""gRPC request bytes that do not decode (corrupt wire format, Values nested past the decoder's limit) are a 400
naming the field, answered by the interceptor: logged and counted like any bad request, never grpc's UNKNOWN/500."""

from __future__ import annotations

import grpc
import orjson
import pytest
from google.api import httpbody_pb2
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


MIB = 1024 * 1024


def _too_large(error: grpc.aio.AioRpcError) -> tuple:
    detail = error_details(error)
    return error.code(), detail.http_status, detail.error.code, detail.error.param


async def test_a_typed_request_over_8_mib_is_413_like_a_rest_body(chat, secret, running):
    """The REST cap (Envoy's 8 MiB) holds for gRPC callers too: INVALID_ARGUMENT with the 413 error object, before
    the request is read, rather than a 9 MiB prompt reaching the pipeline."""
    before = _count(running, "request_too_large")
    huge = chat_request(messages=[{"role": "user", "content": "a" * (8 * MIB)}])
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await chat.CreateChatCompletion(huge, metadata=bearer(secret))
    assert _too_large(caught.value) == (grpc.StatusCode.INVALID_ARGUMENT, 413, "request_too_large", "")
    assert "8 MiB" in caught.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [_ async for _ in chat.StreamChatCompletion(huge, metadata=bearer(secret))]
    assert _too_large(caught.value) == (grpc.StatusCode.INVALID_ARGUMENT, 413, "request_too_large", "")
    assert _count(running, "request_too_large") == before + 2


async def test_the_rest_binding_caps_the_body_not_its_envelope(chat, secret):
    """CreateChatCompletionHttp called natively: a body over 8 MiB is a 413; one of exactly 8 MiB (what Envoy lets
    through to it) is read, although the HttpBody around it is a few bytes more."""
    body = orjson.dumps({"model": "family-a-5.5", "max_tokens": 1,
                         "messages": [{"role": "user", "content": "Hi"}]})
    exact = httpbody_pb2.HttpBody(content_type="application/json", data=body + b" " * (8 * MIB - len(body)))
    answers = [answer async for answer in chat.CreateChatCompletionHttp(exact, metadata=bearer(secret))]
    assert orjson.loads(b"".join(answer.data for answer in answers))["usage"]["completion_tokens"] == 1
    over = httpbody_pb2.HttpBody(content_type="application/json", data=exact.data + b" ")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [_ async for _ in chat.CreateChatCompletionHttp(over, metadata=bearer(secret))]
    assert _too_large(caught.value) == (grpc.StatusCode.INVALID_ARGUMENT, 413, "request_too_large", "")


@pytest.mark.parametrize(("message", "param"), [
    (b"\x0a\x04us\xffr", "messages[1].role"),  # a string field of the message
    (b"\x0a\x04user\x12\x05\x1a\x03h\xed\xa0", "messages[1].content"),  # a Value's string: a lone surrogate, as
    # protobufjs encodes one (a JS string cut inside an emoji)
    (b"\x0a\x04user\x12\x13\x32\x11\x0a\x0f\x2a\x0d\x0a\x0b\x0a\x04text\x12\x03\x1a\x01\xff",
     "messages[1].content[0].text"),  # inside a list of parts: the JSON path, not the Value's own fields
])
async def test_a_string_that_is_not_utf8_is_named_by_its_path(channel, secret, message, param):
    """A gRPC caller whose library sends a string that is not UTF-8 (protobufjs writes a lone surrogate as its
    three bytes; C++ only logs it) was told `messages[1] is not a valid protobuf encoding`, as if the stub were
    broken: the 400 names the string itself, as REST names a body's bad value, and says what is wrong with it."""
    raw = chat_request(max_tokens=4).SerializeToString() + bytes([2 << 3 | 2, len(message)]) + message
    detail = error_details(await _refusal(channel, secret, raw))
    assert (detail.http_status, detail.error.param) == (400, param)
    assert detail.error.message == f"The request could not be decoded: {param} is not valid UTF-8."
