"""MessageService over real gRPC stubs: typed unary, typed stream and the HttpBody RPC behind /v1/messages."""

from __future__ import annotations

import grpc
import orjson
import pytest

from tests.helpers import bearer, error_details, message_request, sse_frames, http_body


async def test_unary_message_has_text_block_and_usage(messages, secret):
    response = await messages.CreateMessage(message_request(max_tokens=5, temperature=0), metadata=bearer(secret))
    assert response.id.startswith("msg_") and response.type == "message" and response.role == "assistant"
    assert response.content[0].type == "text" and response.content[0].text
    assert response.stop_reason == "max_tokens"
    assert response.usage.output_tokens == 5 and response.usage.input_tokens > 5


async def test_x_api_key_and_system_blocks_are_accepted(messages, secret):
    request = message_request(system=[{"type": "text", "text": "Be brief."}], temperature=0.2, top_k=20)
    response = await messages.CreateMessage(request, metadata=(("x-api-key", secret),))
    assert response.content[0].text


@pytest.mark.parametrize("system", ["", []])
async def test_an_empty_system_prompt_is_no_system_prompt(messages, secret, system):
    # As on Anthropic's API: `system: ""` is the same request as no `system` (here, the embedded model keeps the
    # chat template's own default system prompt).
    plain = await messages.CreateMessage(message_request(max_tokens=6, temperature=0), metadata=bearer(secret))
    empty = await messages.CreateMessage(message_request(max_tokens=6, temperature=0, system=system),
                                         metadata=bearer(secret))
    assert empty.usage.input_tokens == plain.usage.input_tokens
    assert empty.content[0].text == plain.content[0].text


async def test_stop_sequence_is_reported(messages, secret):
    free = await messages.CreateMessage(message_request(max_tokens=12, temperature=0), metadata=bearer(secret))
    word = free.content[0].text.split()[1]
    stopped = await messages.CreateMessage(
        message_request(max_tokens=12, temperature=0, stop_sequences=[word]), metadata=bearer(secret)
    )
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", word)
    assert word not in stopped.content[0].text


async def test_typed_stream_events_come_in_order(messages, secret):
    events = [e async for e in messages.StreamMessage(message_request(max_tokens=4, temperature=0), metadata=bearer(secret))]
    types = [e.type for e in events]
    assert types[:3] == ["message_start", "content_block_start", "ping"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(types[3:-3]) == {"content_block_delta"}
    assert events[0].message.usage.input_tokens > 0
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 4


async def test_http_rpc_streams_sse_with_event_lines(messages, secret):
    bodies = [b async for b in messages.CreateMessageHttp(http_body(message_request(stream=True)), metadata=bearer(secret))]
    assert {b.content_type for b in bodies} == {"text/event-stream"}
    frames = sse_frames(bodies)
    assert frames[0].decode().startswith("event: message_start\ndata: {")
    assert frames[-1] == b'event: message_stop\ndata: {"type":"message_stop"}\n\n'


async def test_http_rpc_answers_json_when_not_streaming(messages, secret):
    bodies = [b async for b in messages.CreateMessageHttp(http_body(message_request()), metadata=bearer(secret))]
    body = orjson.loads(bodies[0].data)
    assert body["type"] == "message" and body["stop_sequence"] is None
    assert set(body["usage"]) == {"input_tokens", "output_tokens"}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_tokens": None}, "max_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
         "messages[0].content[0].type"),
        ({"temperature": 1.5}, "temperature"),
        ({"tool_choice": {"type": "any"}}, "tool_choice"),
    ],
)
async def test_invalid_values_are_400_with_param(messages, secret, fields, param):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await messages.CreateMessage(message_request(**fields), metadata=bearer(secret))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    detail = error_details(caught.value)
    assert (detail.http_status, detail.error.code, detail.error.param) == (400, "invalid_request", param)


async def test_family_a_model_names_the_chat_path_and_errors_carry_type_error(messages, secret):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await messages.CreateMessage(message_request(model="family-a-5.5"), metadata=bearer(secret))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    assert "/v1/chat/completions" in error_details(caught.value).error.message
    rest_body = dict(caught.value.trailing_metadata())["portico-error"]
    assert orjson.loads(rest_body)["type"] == "error"
