"""ChatService over real gRPC stubs: typed unary, typed stream and the HttpBody RPC behind /v1/chat/completions."""

from __future__ import annotations

import grpc
import orjson
import pytest

from tests.helpers import bearer, chat_request, error_details, sse_frames, http_body


async def test_unary_completion_has_text_and_real_usage(chat, secret):
    response = await chat.CreateChatCompletion(chat_request(max_tokens=6, temperature=0), metadata=bearer(secret))
    assert response.object == "chat.completion"
    assert response.id.startswith("chatcmpl-")
    assert response.model == "family-a-5.5"
    choice = response.choices[0]
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert response.usage.completion_tokens == 6
    assert response.usage.prompt_tokens > 5
    assert response.usage.total_tokens == response.usage.prompt_tokens + 6


async def test_max_completion_tokens_wins_over_max_tokens(chat, secret):
    request = chat_request(max_tokens=50, max_completion_tokens=3, temperature=0)
    response = await chat.CreateChatCompletion(request, metadata=bearer(secret))
    assert response.usage.completion_tokens == 3


async def test_stop_string_is_honoured_and_not_returned(chat, secret):
    base = chat_request(max_tokens=12, temperature=0, seed=1)
    free = await chat.CreateChatCompletion(base, metadata=bearer(secret))
    word = free.choices[0].message.content.split()[1]
    stopped = await chat.CreateChatCompletion(chat_request(max_tokens=12, temperature=0, seed=1, stop=[word]),
                                              metadata=bearer(secret))
    text = stopped.choices[0].message.content
    assert word not in text
    assert free.choices[0].message.content.startswith(text)
    assert stopped.choices[0].finish_reason == "stop"


async def test_typed_stream_carries_role_deltas_finish_and_usage(chat, secret):
    request = chat_request(max_tokens=5, stream=True, stream_options={"include_usage": True}, temperature=0)
    chunks = [c async for c in chat.StreamChatCompletion(request, metadata=bearer(secret))]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 5
    text = "".join(c.choices[0].delta.content for c in chunks if c.choices)
    assert text
    assert len({c.id for c in chunks}) == 1


async def test_http_rpc_answers_json_when_not_streaming(chat, secret):
    bodies = [b async for b in chat.CreateChatCompletionHttp(http_body(chat_request()), metadata=bearer(secret))]
    assert len(bodies) == 1 and bodies[0].content_type == "application/json"
    body = orjson.loads(bodies[0].data)
    assert isinstance(body["created"], int)
    assert body["choices"][0]["message"]["content"]
    assert set(body["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}


async def test_http_rpc_answers_sse_when_streaming(chat, secret):
    request = chat_request(stream=True, stream_options={"include_usage": True}, max_tokens=4)
    bodies = [b async for b in chat.CreateChatCompletionHttp(http_body(request), metadata=bearer(secret))]
    assert {b.content_type for b in bodies} == {"text/event-stream"}
    frames = sse_frames(bodies)
    assert frames[-1] == b"data: [DONE]\n\n"
    events = [orjson.loads(f.removeprefix(b"data: ")) for f in frames[:-1]]
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert events[-1]["usage"]["completion_tokens"] == 4 and events[-1]["choices"] == []
    assert all(e["usage"] is None for e in events[:-1])


async def test_content_as_list_of_text_parts(chat, secret):
    parts = [{"type": "text", "text": "Say"}, {"type": "text", "text": "hello."}]
    request = chat_request(messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": parts}])
    response = await chat.CreateChatCompletion(request, metadata=bearer(secret))
    assert response.choices[0].message.content


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content[0].type"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"n": 3}, "n"),
        ({"stop": ["a", ""]}, "stop[1]"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"model": ""}, "model"),
    ],
)
async def test_invalid_values_are_400_with_param(chat, secret, fields, param):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await chat.CreateChatCompletion(chat_request(**fields), metadata=bearer(secret))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    detail = error_details(caught.value)
    assert (detail.http_status, detail.error.code, detail.error.param) == (400, "invalid_request", param)
    assert detail.error.type == "invalid_request_error"


async def test_missing_and_wrong_keys_are_unauthenticated(chat, secret):
    for metadata in ((), bearer("pk-not-a-key"), (("authorization", secret),)):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await chat.CreateChatCompletion(chat_request(), metadata=metadata)
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert error_details(caught.value).error.code == "invalid_api_key"
        assert error_details(caught.value).error.param == ""


async def test_family_b_model_on_chat_names_the_messages_path(chat, secret):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await chat.CreateChatCompletion(chat_request(model="family-b-opus-4-7"), metadata=bearer(secret))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    detail = error_details(caught.value)
    assert (detail.error.code, detail.error.param) == ("model_not_found", "model")
    assert "/v1/messages" in detail.error.message


async def test_ungranted_model_looks_exactly_like_a_missing_one(chat, running):
    secret = (await running.store.create("only-5.4", all_models=False, models=["family-a-5.4"]))[1]
    errors = []
    for model in ("family-a-5.5", "no-such-model"):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await chat.CreateChatCompletion(chat_request(model=model), metadata=bearer(secret))
        detail = error_details(caught.value)
        errors.append((caught.value.code(), detail.error.code, detail.error.param,
                       detail.error.message.replace(model, "MODEL")))
    assert errors[0] == errors[1]
    assert errors[0][:3] == (grpc.StatusCode.NOT_FOUND, "model_not_found", "model")
    granted = await chat.CreateChatCompletion(chat_request(model="family-a-5.4"), metadata=bearer(secret))
    assert granted.model == "family-a-5.4"


def _non_finite(request, where: str, value: float):
    """`request` with `value` put at `where`, a field a typed caller can set to NaN or Infinity (JSON cannot)."""
    if where == "stop":
        request.stop.number_value = value
    elif where.startswith("logit_bias."):
        request.logit_bias[where.removeprefix("logit_bias.")] = value
    elif where.startswith("tools[0]."):
        request.tools.add(type="function").function.name = "f"
        request.tools[0].function.parameters.update({"type": "object", "properties": {"a": {"minimum": value}}})
    else:
        setattr(request, where, value)
    return request


@pytest.mark.parametrize(
    ("where", "value"),
    [("temperature", float("nan")), ("top_p", float("inf")), ("frequency_penalty", float("-inf")),
     ("logit_bias.5", float("nan")), ("stop", float("nan")),
     ("tools[0].function.parameters.properties.a.minimum", float("inf"))],
)
async def test_a_number_that_is_not_finite_is_a_400_naming_it(chat, secret, where, value):
    """A typed request can hold NaN or Infinity where JSON has no such number: a 400 naming the field (as REST's
    JSON refuses them), not a 500, nor `must be a number, got a string` about a number."""
    for rpc in (chat.CreateChatCompletion, chat.StreamChatCompletion):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            call = rpc(_non_finite(chat_request(), where, value), metadata=bearer(secret))
            await (call if rpc is chat.CreateChatCompletion else call.read())
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        detail = error_details(caught.value)
        assert (detail.http_status, detail.error.code, detail.error.param) == (400, "invalid_request", where)
        assert "finite" in detail.error.message and "string" not in detail.error.message
