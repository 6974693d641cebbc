"""Each dialect served by each upstream kind, through the real gRPC server, against the upstream double's echo
models: what the upstream receives, what the caller gets back (text, tool calls, stop reasons, usage), and
Anthropic-specific faults."""

from __future__ import annotations

import re

import grpc
import orjson
import pytest

from tests.helpers import bearer, chat_request, error_details, message_request, sse_frames, http_body
from tests.passthrough_objects import CACHED_ANSWER_CUES
from tests.upstream_double import Cue
from tests.upstream_echo import sse
from tests.upstream_support import UPSTREAM_KEY, cross_dialect_models, upstream_server, window_tokens

WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}
CHAT_TOOL = {"type": "function", "function": {"name": "weather", "description": "Weather.", "parameters": WEATHER}}
MESSAGE_TOOL = {"name": "weather", "description": "Weather.", "input_schema": WEATHER}


@pytest.fixture(scope="module")
async def running(double, tmp_path_factory):
    models = cross_dialect_models(double.url, openai_model="gpt-up", anthropic_model="claude-up")
    async with upstream_server(tmp_path_factory.mktemp("dialects"), models) as server:
        yield server


async def test_chat_on_an_anthropic_upstream(chat, running, double, key):
    key_id, secret = key
    request = chat_request(model="chat-on-anthropic", max_tokens=50, stop=["nothing"],
                           messages=[{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hi there"}])
    response = await chat.CreateChatCompletion(request, metadata=bearer(secret))
    assert response.choices[0].message.content == "echo Hi there"
    assert response.choices[0].finish_reason == "stop"
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (4, 3)
    seen = double.seen[-1]
    assert seen.path == "/v1/messages"
    assert (seen.headers["x-api-key"], seen.headers["anthropic-version"]) == (UPSTREAM_KEY, "2023-06-01")
    assert "authorization" not in seen.headers
    assert seen.body == {"model": "claude-up", "max_tokens": 50, "system": "Be brief.", "stream": False,
                         "messages": [{"role": "user", "content": "Hi there"}], "stop_sequences": ["nothing"]}
    assert window_tokens(running, key_id) == 7


async def test_chat_tool_calls_from_an_anthropic_upstream(chat, key):
    request = chat_request(model="chat-on-anthropic", tools=[CHAT_TOOL], tool_choice="required",
                           messages=[{"role": "user", "content": "Oslo"}])
    response = await chat.CreateChatCompletion(request, metadata=bearer(key[1]))
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.HasField("content")
    (call,) = choice.message.tool_calls
    assert (call.id, call.type, call.function.name) == ("toolu_1", "function", "weather")
    assert orjson.loads(call.function.arguments) == {"echo": "Oslo"}


async def test_chat_streamed_from_an_anthropic_upstream(chat, double, key):
    request = chat_request(model="chat-on-anthropic", max_tokens=2, stream=True,
                           stream_options={"include_usage": True})
    frames = sse_frames([b async for b in chat.CreateChatCompletionHttp(http_body(request), metadata=bearer(key[1]))])
    assert double.seen[-1].body["stream"] is True
    chunks = [orjson.loads(f.removeprefix(b"data: ")) for f in frames[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == "echo Say"
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


async def test_messages_on_an_openai_upstream(messages, double, key):
    request = message_request(model="messages-on-openai", system="Be brief.", top_k=3,
                              messages=[{"role": "user", "content": "Oslo"}], tools=[MESSAGE_TOOL],
                              tool_choice={"type": "any"})
    response = await messages.CreateMessage(request, metadata=bearer(key[1]))
    assert response.stop_reason == "tool_use"
    (block,) = response.content
    assert (block.type, block.id, block.name) == ("tool_use", "call_1", "weather")
    assert dict(block.input) == {"echo": "Oslo"}
    assert double.seen[-1].body == {
        "model": "gpt-up",
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo"}],
        "tools": [{"type": "function", "function": {"name": "weather", "description": "Weather.",
                                                    "parameters": WEATHER}}],
        "tool_choice": "required", "max_tokens": 8, "stream": False}


async def test_messages_streamed_from_an_openai_upstream(messages, double, key):
    request = message_request(model="messages-on-openai", max_tokens=2, stream=True)
    frames = sse_frames([b async for b in messages.CreateMessageHttp(http_body(request), metadata=bearer(key[1]))])
    assert (double.seen[-1].body["stream"], double.seen[-1].body["stream_options"]) == (True, {"include_usage": True})
    events = [orjson.loads(f.split(b"data: ", 1)[1]) for f in frames]
    assert [e["type"] for e in events] == ["message_start", "content_block_start", "ping", "content_block_delta",
                                           "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    assert events[-2]["usage"] == {"input_tokens": 2, "output_tokens": 2}


async def test_messages_pass_through_to_an_anthropic_upstream(messages, double, key):
    request = message_request(model="messages-on-anthropic", max_tokens=40, stop_sequences=["world"],
                              metadata={"user_id": "u-7"}, messages=[{"role": "user", "content": "hello world"}])
    response = await messages.CreateMessage(request, metadata=bearer(key[1]))
    assert (response.content[0].text, response.stop_reason, response.stop_sequence) == (
        "echo hello", "stop_sequence", "world")
    assert double.seen[-1].body == {"model": "claude-up", "max_tokens": 40, "stop_sequences": ["world"],
                                    "metadata": {"user_id": "u-7"}, "stream": False,
                                    "messages": [{"role": "user", "content": "hello world"}]}


async def test_anthropic_overloaded_is_retried(messages, double, key):
    double.cue(Cue(529, {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}))
    response = await messages.CreateMessage(message_request(model="messages-on-anthropic"), metadata=bearer(key[1]))
    assert response.content[0].text == "echo Say hello." and len(double.seen) == 2


async def test_an_anthropic_error_in_a_200_answer_is_retried_or_passed_on(messages, double, key):
    overloaded = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}
    double.cue(Cue(body=overloaded))
    response = await messages.CreateMessage(message_request(model="messages-on-anthropic"), metadata=bearer(key[1]))
    assert response.content[0].text == "echo Say hello." and len(double.seen) == 2
    double.reset()
    double.cue(Cue(body={"type": "error", "error": {"type": "invalid_request_error", "message": "no"}}))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await messages.CreateMessage(message_request(model="messages-on-anthropic"), metadata=bearer(key[1]))
    assert (error_details(caught.value).http_status, len(double.seen)) == (400, 1)


async def test_an_anthropic_json_answer_cut_off_is_retried_and_one_not_a_message_is_a_502(messages, double, key):
    double.cue(Cue(drop_after=1))
    response = await messages.CreateMessage(message_request(model="messages-on-anthropic"), metadata=bearer(key[1]))
    assert response.content[0].text == "echo Say hello." and len(double.seen) == 2
    double.reset()
    double.cue(Cue(body={"type": "completion", "completion": "Hi"}))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await messages.CreateMessage(message_request(model="messages-on-anthropic"), metadata=bearer(key[1]))
    assert (error_details(caught.value).http_status, len(double.seen)) == (502, 1)


async def test_an_anthropic_error_event_mid_stream_becomes_our_error_event(messages, running, double, key):
    key_id, secret = key
    frames = [sse({"type": "message_start", "message": {"usage": {"input_tokens": 3, "output_tokens": 1}}},
                  "message_start"),
              sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                  "content_block_start"),
              sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hi"}},
                  "content_block_delta"),
              sse({"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}, "error")]
    double.cue(Cue(frames=frames))
    request = message_request(model="messages-on-anthropic", stream=True)
    bodies = sse_frames([b async for b in messages.CreateMessageHttp(http_body(request), metadata=bearer(secret))])
    assert bodies[-1].startswith(b"event: error\n")
    error = orjson.loads(bodies[-1].split(b"data: ", 1)[1])
    assert error["type"] == "error" and error["error"]["code"] == "service_unavailable"
    assert window_tokens(running, key_id) == 3 + 1  # the upstream's prompt count and one delta


async def test_an_anthropic_4xx_is_the_matching_error(messages, double, key):
    double.cue(Cue(400, {"type": "error", "error": {"type": "invalid_request_error",
                                                    "message": "messages.0.content: empty"}}))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await messages.CreateMessage(message_request(model="messages-on-anthropic"), metadata=bearer(key[1]))
    detail = error_details(caught.value)
    assert (caught.value.code(), detail.http_status, detail.error.message) == (
        grpc.StatusCode.INVALID_ARGUMENT, 400, "messages.0.content: empty")
    assert orjson.loads(dict(caught.value.trailing_metadata())["portico-error"])["type"] == "error"


async def test_json_output_is_refused_for_an_anthropic_upstream(chat, double, key):
    request = chat_request(model="chat-on-anthropic", response_format={"type": "json_object"})
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await chat.CreateChatCompletion(request, metadata=bearer(key[1]))
    assert error_details(caught.value).error.param == "response_format.type" and not double.seen


async def test_typed_streams_carry_tool_calls(chat, messages, key):
    request = chat_request(model="chat-on-anthropic", tools=[CHAT_TOOL], tool_choice="required", stream=True)
    chunks = [c async for c in chat.StreamChatCompletion(request, metadata=bearer(key[1]))]
    calls = [call for c in chunks if c.choices for call in c.choices[0].delta.tool_calls]
    assert (calls[0].id, calls[0].function.name) == ("toolu_1", "weather")
    assert orjson.loads("".join(call.function.arguments for call in calls)) == {"echo": "Say hello."}
    request = message_request(model="messages-on-openai", tools=[MESSAGE_TOOL], tool_choice={"type": "any"})
    events = [e async for e in messages.StreamMessage(request, metadata=bearer(key[1]))]
    start = next(e for e in events if e.type == "content_block_start")
    assert (start.content_block.type, start.content_block.name) == ("tool_use", "weather")
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert orjson.loads(partial) == {"echo": "Say hello."} and events[-2].delta.stop_reason == "tool_use"


async def test_typed_answers_carry_prompt_cache_counts(chat, messages, double, key):
    double.cue(*CACHED_ANSWER_CUES)  # a JSON answer, then a stream
    response = await chat.CreateChatCompletion(chat_request(model="chat-on-anthropic"), metadata=bearer(key[1]))
    assert (response.usage.prompt_tokens, response.usage.prompt_tokens_details.cached_tokens) == (2110, 2000)
    request = chat_request(model="chat-on-anthropic", stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in chat.StreamChatCompletion(request, metadata=bearer(key[1]))]
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.prompt_tokens_details.cached_tokens) == (2110, 2000)
    # An OpenAI-compatible upstream's own usage object reaches the caller, fields the message lacks left out.
    openai_usage = {"prompt_tokens": 1200, "completion_tokens": 1, "total_tokens": 1201,
                    "prompt_tokens_details": {"cached_tokens": 1024, "audio_tokens": 0}}
    whole = {"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "gpt-up", "usage": openai_usage,
             "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hi"}}]}
    double.cue(Cue(body=whole), Cue(body=whole))
    response = await chat.CreateChatCompletion(chat_request(model="chat-on-openai"), metadata=bearer(key[1]))
    assert response.usage.prompt_tokens_details.cached_tokens == 1024
    typed = await messages.CreateMessage(message_request(model="messages-on-openai"), metadata=bearer(key[1]))
    assert (typed.usage.input_tokens, typed.usage.cache_read_input_tokens) == (176, 1024)
    # Without a cache read there are no details, as in the REST answer.
    response = await chat.CreateChatCompletion(chat_request(model="chat-on-anthropic"), metadata=bearer(key[1]))
    assert not response.usage.HasField("prompt_tokens_details")


_MADE_UP_CALL = re.compile(r"call_[A-Za-z0-9]{24}")
_MADE_UP_TOOLU = re.compile(r"toolu_[A-Za-z0-9]{24}")


async def test_ids_made_up_for_an_openai_upstream_s_calls_without_one_differ_from_turn_to_turn(messages, double,
                                                                                               key):
    """An OpenAI-compatible server that sends tool calls without ids: the gateway named them `call_0`, `call_1`, ...
    afresh in each answer, so the next turn's request held `call_0` twice, which Anthropic's API (and the embedded
    model) refuse ('tool_use ids must be unique') and which mixes up whose result is whose. Ids now as OpenAI's."""
    chunk = {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "gpt-up"}
    call = {"index": 0, "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    whole = {"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "gpt-up",
             "usage": {"prompt_tokens": 5, "completion_tokens": 4},
             "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                 "role": "assistant", "content": None, "tool_calls": [
                     {k: v for k, v in call.items() if k != "index"}, {**call, "index": 1}]}}]}
    streamed = [sse({**chunk, "choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}),
                sse({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
                b"data: [DONE]\n\n"]
    double.cue(Cue(body=whole), Cue(body=whole), Cue(frames=streamed))
    request = message_request(model="messages-on-openai", tools=[MESSAGE_TOOL])
    ids = []
    for _ in range(2):
        answer = await messages.CreateMessage(request, metadata=bearer(key[1]))
        ids += [block.id for block in answer.content if block.type == "tool_use"]
    stream = message_request(model="messages-on-openai", tools=[MESSAGE_TOOL], stream=True)
    frames = sse_frames([b async for b in messages.CreateMessageHttp(http_body(stream), metadata=bearer(key[1]))])
    starts = [orjson.loads(f.split(b"data: ", 1)[1]) for f in frames if b"content_block_start" in f]
    ids += [s["content_block"]["id"] for s in starts if s["content_block"]["type"] == "tool_use"]
    assert len(ids) == 5 and len(set(ids)) == 5 and all(_MADE_UP_CALL.fullmatch(i) for i in ids), ids


async def test_ids_made_up_for_an_anthropic_upstream_s_blocks_without_one_differ_from_turn_to_turn(chat, double, key):
    """The same for an Anthropic-compatible server's tool_use blocks without an id: `toolu_0` in every answer."""
    whole = {"type": "message", "role": "assistant", "stop_reason": "tool_use", "usage": {
        "input_tokens": 5, "output_tokens": 4}, "content": [{"type": "tool_use", "name": "weather", "input": {}}]}
    double.cue(Cue(body=whole), Cue(body=whole))
    request = chat_request(model="chat-on-anthropic", tools=[CHAT_TOOL], messages=[{"role": "user", "content": "Oslo"}])
    ids = [(await chat.CreateChatCompletion(request, metadata=bearer(key[1]))).choices[0].message.tool_calls[0].id
           for _ in range(2)]
    assert ids[0] != ids[1] and all(_MADE_UP_TOOLU.fullmatch(i) for i in ids), ids


async def test_a_typed_stream_of_unparseable_arguments_ends_with_the_upstream_error(messages, running, double, key):
    key_id, secret = key
    chunk = {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "gpt-up"}
    call = {"index": 0, "id": "call_0", "type": "function", "function": {"name": "weather", "arguments": '{"city": '}}
    double.cue(Cue(frames=[sse({**chunk, "choices": [{"index": 0, "delta": {"tool_calls": [call]}}]}),
                           sse({**chunk, "choices": [{"index": 0, "delta": {"tool_calls": [
                               {"index": 0, "function": {"arguments": "Oslo}"}}]}}]}),
                           sse({**chunk, "choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}),
                           sse({**chunk, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}),
                           b"data: [DONE]\n\n"]))
    request = message_request(model="messages-on-openai", tools=[MESSAGE_TOOL])
    events = []
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        async for event in messages.StreamMessage(request, metadata=bearer(secret)):
            events.append(event)
    assert [e.delta.partial_json for e in events if e.type == "content_block_delta"] == ['{"city": ']
    detail = error_details(caught.value)
    assert (caught.value.code(), detail.http_status, detail.error.code) == (
        grpc.StatusCode.UNAVAILABLE, 502, "upstream_error")
    assert window_tokens(running, key_id) > 0  # the upstream did the work: it counts


async def test_an_anthropic_answer_without_usage_counts_its_prompt_and_text_as_openai_ones_do(messages, running,
                                                                                              double, key):
    """An Anthropic-compatible server that sends no usage settled 0 tokens (the prompt and the answer were free
    against token limits and budgets), where an OpenAI-compatible one is estimated: the prompt, and the answer at
    four characters a token."""
    key_id, secret = key
    double.cue(Cue(body={"type": "message", "role": "assistant", "stop_reason": "end_turn",
                         "content": [{"type": "text", "text": "Twelve chars"}]}))
    request = message_request(model="messages-on-anthropic", messages=[{"role": "user", "content": "Hi there"}])
    await messages.CreateMessage(request, metadata=bearer(secret))
    assert window_tokens(running, key_id) == 2 + 3  # "Hi there" (8 characters / 4); "Twelve chars" (12 / 4)
    frames = [sse({"type": "message_start", "message": {"type": "message", "role": "assistant", "content": []}},
                  "message_start"),
              sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                  "content_block_start"),
              sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Twelve chars"}},
                  "content_block_delta"),
              sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
              sse({"type": "message_delta", "delta": {"stop_reason": "end_turn"}}, "message_delta"),
              sse({"type": "message_stop"}, "message_stop")]
    double.cue(Cue(frames=frames))
    request = message_request(model="messages-on-anthropic", messages=[{"role": "user", "content": "Hi there"}],
                              stream=True)
    [b async for b in messages.CreateMessageHttp(http_body(request), metadata=bearer(secret))]
    assert window_tokens(running, key_id) == 2 * (2 + 3)


async def test_a_tool_stop_without_calls_reaches_typed_callers_of_the_other_dialect_as_a_plain_end(chat, messages,
                                                                                                   double, key):
    """`stop_reason: tool_use` with no tool_use block (some Anthropic-compatible bridges), and `finish_reason:
    tool_calls` with no call, reached gRPC callers as a turn that waits for tool results it has none of."""
    double.cue(Cue(body={"type": "message", "role": "assistant", "stop_reason": "tool_use",
                         "content": [{"type": "text", "text": "Checking."}],
                         "usage": {"input_tokens": 3, "output_tokens": 2}}))
    request = chat_request(model="chat-on-anthropic", tools=[CHAT_TOOL], messages=[{"role": "user", "content": "Oslo"}])
    choice = (await chat.CreateChatCompletion(request, metadata=bearer(key[1]))).choices[0]
    assert (choice.message.content, len(choice.message.tool_calls), choice.finish_reason) == ("Checking.", 0, "stop")
    double.cue(Cue(body={"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "gpt-up",
                         "choices": [{"index": 0, "finish_reason": "tool_calls",
                                      "message": {"role": "assistant", "content": "Checking."}}]}))
    request = message_request(model="messages-on-openai", tools=[MESSAGE_TOOL])
    response = await messages.CreateMessage(request, metadata=bearer(key[1]))
    assert ([b.type for b in response.content], response.stop_reason) == (["text"], "end_turn")
