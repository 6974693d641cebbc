"""Chat completions served by an Anthropic upstream and messages served by an OpenAI-compatible one: the body each
upstream receives, literal SSE transcripts re-framed from one dialect into the other, event by event, and whole
Anthropic answers read as the events of their streams."""

from __future__ import annotations

import orjson
import pytest

from server.domain import Thought
from server.domain_answers import (
    FinishReason, Finished, ReasoningDelta, ResponseHeader, Started, TextDelta, ToolCallDelta, ToolCallStart, Usage,
)
from server.errors import UpstreamError
from server.render import DONE, sse_event
from server.translate import internal_to_anthropic as to_anthropic
from server.translate import internal_to_openai as to_openai
from server.translate.anthropic_events_to_internal import AnthropicEventReader, message_events
from server.translate.anthropic_to_internal import message_request
from server.translate.internal_to_anthropic_request import anthropic_body
from server.translate.internal_to_openai_request import openai_body
from server.translate.openai_chunks_to_internal import OpenAIChunkReader
from server.translate.openai_to_internal import chat_request
from tests.helpers import chat_body as chat_pb
from tests.helpers import message_body as message_pb

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
CHAT_HISTORY = [
    {"role": "developer", "content": "Be brief."},
    {"role": "system", "content": "Use metric units."},
    {"role": "user", "content": "Weather in Oslo and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "4 C"},
    {"role": "tool", "tool_call_id": "call_2", "content": "19 C"},
    {"role": "user", "content": "And in Paris?"},
]
MESSAGES_HISTORY = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                      {"type": "tool_use", "id": "toolu_1", "name": "weather",
                                       "input": {"city": "Oslo"}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "no data",
                                  "is_error": True},
                                 {"type": "text", "text": "Try Paris."}]},
]


def test_a_chat_request_for_an_anthropic_upstream():
    request = chat_pb(messages=CHAT_HISTORY, max_completion_tokens=300, temperature=1.5, top_p=0.9, seed=3,
                      stop=["END", "##"], tools=[{"type": "function", "function": {
                          "name": "weather", "description": "Current weather.", "parameters": SCHEMA}}],
                      tool_choice="required", parallel_tool_calls=False)
    generation = chat_request(request, default_max_tokens=99).generation
    assert anthropic_body(generation, model="claude-up") == {
        "model": "claude-up", "max_tokens": 300, "system": "Be brief.\n\nUse metric units.",
        "messages": [
            {"role": "user", "content": "Weather in Oslo and Rome?"},
            {"role": "assistant", "content": [
                {"type": "tool_use", "id": "call_1", "name": "weather", "input": {"city": "Oslo"}},
                {"type": "tool_use", "id": "call_2", "name": "weather", "input": {"city": "Rome"}}]},
            {"role": "user", "content": [  # the two `tool` messages and the next user message: one user turn
                {"type": "tool_result", "tool_use_id": "call_1", "content": "4 C"},
                {"type": "tool_result", "tool_use_id": "call_2", "content": "19 C"},
                {"type": "text", "text": "And in Paris?"}]},
        ],
        "temperature": 1.0,  # Anthropic's maximum; seed has no Anthropic field
        "top_p": 0.9, "stop_sequences": ["END", "##"],
        "tools": [{"name": "weather", "description": "Current weather.", "input_schema": SCHEMA}],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stream": False,  # the caller waits for the whole answer: so does the gateway
    }


def test_a_named_tool_choice_and_a_plain_chat():
    tool = {"type": "function", "function": {"name": "weather", "parameters": SCHEMA}}
    named = chat_request(chat_pb(tools=[tool], tool_choice={"type": "function", "function": {"name": "weather"}}), default_max_tokens=99).generation
    assert anthropic_body(named, model="c")["tool_choice"] == {"type": "tool", "name": "weather"}
    plain = chat_request(chat_pb(max_tokens=None), default_max_tokens=99).generation
    assert anthropic_body(plain, model="c") == {
        "model": "c", "max_tokens": 99, "messages": [{"role": "user", "content": "Say hello."}], "stream": False}
    streamed = chat_request(chat_pb(stream=True, stream_options={"include_usage": True}),
                            default_max_tokens=99).generation
    assert anthropic_body(streamed, model="c")["stream"] is True


def test_an_empty_assistant_message_is_left_out_for_an_anthropic_upstream():
    """A chat assistant message with empty content and no tool calls went as an empty text block, which Anthropic
    refuses with a 400; it says nothing, so it is left out (the user turns around it merge into one)."""
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""},
               {"role": "user", "content": "Still there?"}]
    generation = chat_request(chat_pb(messages=history), default_max_tokens=99).generation
    assert anthropic_body(generation, model="c")["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "Still there?"}]}]


def test_a_messages_request_for_an_openai_upstream():
    request = message_pb(system=[{"type": "text", "text": "Be brief."}], messages=MESSAGES_HISTORY, max_tokens=200,
                         temperature=0.2, top_k=40, stop_sequences=["END"],
                         tools=[{"name": "weather", "input_schema": SCHEMA}],
                         tool_choice={"type": "tool", "name": "weather"})
    generation = message_request(request).generation
    assert openai_body(generation, model="gpt-up") == {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": [
                {"id": "toolu_1", "type": "function",
                 "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: no data"},  # is_error
            {"role": "user", "content": "Try Paris."},
        ],
        "temperature": 0.2, "stop": ["END"],  # top_k has no OpenAI field
        "tools": [{"type": "function", "function": {"name": "weather", "description": "", "parameters": SCHEMA}}],
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "max_tokens": 200, "model": "gpt-up", "stream": False,  # and no stream_options, which need `stream`
    }
    streamed = message_request(message_pb(stream=True)).generation
    body = openai_body(streamed, model="gpt-up")
    assert (body["stream"], body["stream_options"]) == (True, {"include_usage": True})


def test_a_messages_request_for_an_anthropic_upstream_passes_through_whole():
    body = {"max_tokens": 64, "messages": [{"role": "user", "content": [
                {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}],
            "system": "Be brief.", "metadata": {"user_id": "u-1"}, "thinking": {"type": "enabled", "budget_tokens": 32},
            "top_k": 5, "service_tier": "auto", "stream": False}
    generation = message_request(message_pb(**body)).generation
    assert anthropic_body(generation, model="claude-up") == {**body, "model": "claude-up", "stream": False}
    generation = message_request(message_pb(**{**body, "stream": True})).generation
    assert anthropic_body(generation, model="claude-up") == {**body, "model": "claude-up", "stream": True}
    generation = message_request(message_pb(**{k: v for k, v in body.items() if k != "stream"})).generation
    assert anthropic_body(generation, model="claude-up")["stream"] is False  # absent: not streamed


def anthropic_events(transcript: str) -> list[dict]:
    return [orjson.loads(block.split("data: ", 1)[1]) for block in transcript.strip().split("\n\n")]


ANTHROPIC_TOOL_USE = """\
event: message_start
data: {"type":"message_start","message":{"id":"msg_1","type":"message","role":"assistant","content":[],"model":"claude","stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":12,"cache_read_input_tokens":100,"output_tokens":1}}}

event: content_block_start
data: {"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":""}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"thinking_delta","thinking":"Oslo..."}}

event: content_block_stop
data: {"type":"content_block_stop","index":0}

event: content_block_start
data: {"type":"content_block_start","index":1,"content_block":{"type":"text","text":""}}

event: ping
data: {"type": "ping"}

event: content_block_delta
data: {"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":"Checking."}}

event: content_block_stop
data: {"type":"content_block_stop","index":1}

event: content_block_start
data: {"type":"content_block_start","index":2,"content_block":{"type":"tool_use","id":"toolu_1","name":"weather","input":{}}}

event: content_block_delta
data: {"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"{\\"city\\": "}}

event: content_block_delta
data: {"type":"content_block_delta","index":2,"delta":{"type":"input_json_delta","partial_json":"\\"Oslo\\"}"}}

event: content_block_stop
data: {"type":"content_block_stop","index":2}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"tool_use","stop_sequence":null},"usage":{"output_tokens":30}}

event: message_stop
data: {"type":"message_stop"}
"""
ANTHROPIC_STOP_SEQUENCE = """\
event: message_start
data: {"type":"message_start","message":{"usage":{"input_tokens":5,"output_tokens":1}}}

event: content_block_start
data: {"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}

event: content_block_delta
data: {"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"1, 2"}}

event: message_delta
data: {"type":"message_delta","delta":{"stop_reason":"stop_sequence","stop_sequence":"3"},"usage":{"output_tokens":4}}

event: message_stop
data: {"type":"message_stop"}
"""


@pytest.mark.parametrize(
    ("transcript", "events"),
    [
        (ANTHROPIC_TOOL_USE, [Started(112, 100), ReasoningDelta("Oslo..."), TextDelta("Checking."),
                              ToolCallStart(0, "toolu_1", "weather"),
                              ToolCallDelta(0, '{"city": '), ToolCallDelta(0, '"Oslo"}'),
                              Finished(FinishReason.TOOL_USE, Usage(112, 30, 100), None, "tool_use")]),
        (ANTHROPIC_STOP_SEQUENCE, [Started(5), TextDelta("1, 2"),
                                   Finished(FinishReason.STOP_SEQUENCE, Usage(5, 4), "3", "stop_sequence")]),
    ],
)
def test_anthropic_transcripts(transcript, events):
    reader = AnthropicEventReader()
    assert [e for event in anthropic_events(transcript) for e in reader.feed(event)] == events
    reader.end()


def test_an_anthropic_stream_cut_before_message_stop_is_an_upstream_error():
    reader = AnthropicEventReader()
    for event in anthropic_events(ANTHROPIC_STOP_SEQUENCE)[:3]:
        reader.feed(event)
    with pytest.raises(UpstreamError):
        reader.end()


ANTHROPIC_TOOL_USE_MESSAGE = {
    "id": "msg_1", "type": "message", "role": "assistant", "model": "claude",
    "content": [{"type": "thinking", "thinking": "Oslo...", "signature": "x"},
                {"type": "text", "text": "Checking."},
                {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}}],
    "stop_reason": "tool_use", "stop_sequence": None,
    "usage": {"input_tokens": 12, "cache_read_input_tokens": 100, "output_tokens": 30}}
ANTHROPIC_STOP_SEQUENCE_MESSAGE = {
    "type": "message", "role": "assistant", "content": [{"type": "text", "text": "1, 2"}],
    "stop_reason": "stop_sequence", "stop_sequence": "3", "usage": {"input_tokens": 5, "output_tokens": 4}}


@pytest.mark.parametrize(
    ("message", "events"),
    [
        (ANTHROPIC_TOOL_USE_MESSAGE, [Started(112, 100), ReasoningDelta("Oslo..."), Thought("Oslo...", "x"),
                                      TextDelta("Checking."),
                                      ToolCallStart(0, "toolu_1", "weather"),
                                      ToolCallDelta(0, '{"city":"Oslo"}'),
                                      Finished(FinishReason.TOOL_USE, Usage(112, 30, 100), None, "tool_use")]),
        (ANTHROPIC_STOP_SEQUENCE_MESSAGE, [Started(5), TextDelta("1, 2"),
                                           Finished(FinishReason.STOP_SEQUENCE, Usage(5, 4), "3", "stop_sequence")]),
    ],
)
def test_a_whole_anthropic_message_gives_the_events_of_its_stream(message, events):
    assert message_events(message) == events


def test_a_tool_use_without_input_and_a_message_without_content():
    message = {"type": "message", "content": [{"type": "tool_use", "id": "t", "name": "now", "input": {}}],
               "stop_reason": "tool_use", "usage": {"input_tokens": 3, "output_tokens": 2}}
    assert message_events(message)[1:3] == [ToolCallStart(0, "t", "now"), ToolCallDelta(0, "{}")]
    empty = {"type": "message", "content": [], "stop_reason": "max_tokens", "usage": {"input_tokens": 3}}
    assert message_events(empty) == [Started(3),
                                     Finished(FinishReason.MAX_TOKENS, Usage(3, 0), upstream_reason="max_tokens")]


@pytest.mark.parametrize("answer", [{"type": "completion", "completion": "Hi"}, {"type": "message"},
                                    {"type": "message", "content": ["Hi"]}])
def test_json_that_is_not_a_message_is_an_upstream_error(answer):
    with pytest.raises(UpstreamError):
        message_events(answer)


async def _replay(events):
    for event in events:
        yield event


HEADER = ResponseHeader(id="chatcmpl-9", created=1700000000, model="family-a-5.5")


async def test_an_anthropic_tool_stream_reframed_as_chat_chunks():
    reader = AnthropicEventReader()
    internal = [e for event in anthropic_events(ANTHROPIC_TOOL_USE) for e in reader.feed(event)]
    chunks = [sse_event(c) async for c in to_openai.chat_chunks(HEADER, _replay(internal), include_usage=True)]
    head = '"id":"chatcmpl-9","object":"chat.completion.chunk","created":1700000000,"model":"family-a-5.5"'
    tail = '"logprobs":null,"finish_reason":null}]}\n\n'
    assert b"".join([*chunks, DONE]).decode() == (
        f'data: {{{head},"usage":null,"choices":[{{"index":0,"delta":{{"role":"assistant","content":null}},{tail}'
        f'data: {{{head},"usage":null,"choices":[{{"index":0,"delta":{{"reasoning_content":"Oslo..."}},{tail}'
        f'data: {{{head},"usage":null,"choices":[{{"index":0,"delta":{{"content":"Checking."}},{tail}'
        f'data: {{{head},"usage":null,"choices":[{{"index":0,"delta":{{"tool_calls":[{{"index":0,"id":"toolu_1",'
        f'"type":"function","function":{{"name":"weather","arguments":""}}}}]}},{tail}'
        f'data: {{{head},"usage":null,"choices":[{{"index":0,"delta":{{"tool_calls":[{{"index":0,'
        f'"function":{{"arguments":"{{\\"city\\": "}}}}]}},{tail}'
        f'data: {{{head},"usage":null,"choices":[{{"index":0,"delta":{{"tool_calls":[{{"index":0,'
        f'"function":{{"arguments":"\\"Oslo\\"}}"}}}}]}},{tail}'
        f'data: {{{head},"usage":null,"choices":[{{"index":0,"delta":{{}},"logprobs":null,'
        '"finish_reason":"tool_calls"}]}\n\n'
        f'data: {{{head},"usage":{{"prompt_tokens":112,"completion_tokens":30,"total_tokens":142,'
        f'"prompt_tokens_details":{{"cached_tokens":100}}}},"choices":[]}}\n\n'
        "data: [DONE]\n\n"
    )


OPENAI_TOOL_STREAM = """\
data: {"choices":[{"index":0,"delta":{"role":"assistant","content":"On it."}}]}

data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"call_7","type":"function","function":{"name":"weather","arguments":"{\\"city\\":"}}]}}]}

data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"\\"Oslo\\"}"}}]}}]}

data: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}

data: {"choices":[],"usage":{"prompt_tokens":40,"completion_tokens":9,"total_tokens":49}}

data: [DONE]
"""


async def test_an_openai_tool_stream_reframed_as_anthropic_events():
    reader = OpenAIChunkReader(prompt_estimate=1)
    chunks = [orjson.loads(b.removeprefix("data: ")) for b in OPENAI_TOOL_STREAM.strip().split("\n\n")[:-1]]
    internal = [e for chunk in chunks for e in reader.feed(chunk)] + [reader.end()]
    header = ResponseHeader(id="msg_9", created=1700000000, model="family-b-opus-4-8")
    frames = [sse_event(e, e["type"]) async for e in to_anthropic.message_events(header, _replay(internal))]
    assert b"".join(frames).decode() == (
        'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_9","type":"message",'
        '"role":"assistant","content":[],"model":"family-b-opus-4-8","stop_reason":null,"stop_sequence":null,'
        '"usage":{"input_tokens":0,"output_tokens":0}}}\n\n'
        'event: content_block_start\ndata: {"type":"content_block_start","index":0,'
        '"content_block":{"type":"text","text":""}}\n\n'
        'event: ping\ndata: {"type":"ping"}\n\n'
        'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        '"delta":{"type":"text_delta","text":"On it."}}\n\n'
        'event: content_block_stop\ndata: {"type":"content_block_stop","index":0}\n\n'
        'event: content_block_start\ndata: {"type":"content_block_start","index":1,'
        '"content_block":{"type":"tool_use","id":"call_7","name":"weather","input":{}}}\n\n'
        'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,'
        '"delta":{"type":"input_json_delta","partial_json":"{\\"city\\":"}}\n\n'
        'event: content_block_delta\ndata: {"type":"content_block_delta","index":1,'
        '"delta":{"type":"input_json_delta","partial_json":"\\"Oslo\\"}"}}\n\n'
        'event: content_block_stop\ndata: {"type":"content_block_stop","index":1}\n\n'
        'event: message_delta\ndata: {"type":"message_delta","delta":{"stop_reason":"tool_use",'
        '"stop_sequence":null},"usage":{"input_tokens":40,"output_tokens":9}}\n\n'
        'event: message_stop\ndata: {"type":"message_stop"}\n\n'
    )
