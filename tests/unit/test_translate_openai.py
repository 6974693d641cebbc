"""OpenAI translators: request validation into internal values, and literal response/SSE transcripts."""

from __future__ import annotations

import pytest

from server.domain import Dialect, OutputFormat, Role, ToolCall, ToolChoice, ToolChoiceMode, ToolResult, ToolSpec, Turn
from server.domain_answers import Completion, FinishReason, Finished, ResponseHeader, Started, TextDelta, Usage
from server.errors import InvalidRequest
from server.render import DONE, sse_event
from server.translate import internal_to_openai as to_openai
from server.translate.openai_to_internal import chat_request
from tests.helpers import chat_body as request_pb

HEADER = ResponseHeader(id="chatcmpl-1", created=1700000000, model="family-a-5.5")


def plan(**fields):
    return chat_request(request_pb(**fields), default_max_tokens=99)


def test_defaults_and_roles():
    result = plan(max_tokens=None, messages=[
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ])
    turns = result.generation.turns
    assert turns == (
        Turn(Role.SYSTEM, "rules"),
        Turn(Role.USER, "a\nb"),
        Turn(Role.ASSISTANT, "", tool_calls=(ToolCall("c1", "f", "{}"),)),
        Turn(Role.USER, tool_results=(ToolResult("c1", "42"),)),
    )
    params = result.generation.params
    assert (params.max_tokens, params.temperature, params.top_p, params.stop) == (99, None, None, ())
    assert result.generation.source.dialect is Dialect.OPENAI
    assert (result.stream, result.include_usage) == (False, False)


def test_sampling_values_pass_through():
    result = plan(temperature=0, top_p=0.5, stop="END", seed=7, stream=True, stream_options={"include_usage": True})
    params = result.generation.params
    assert (params.temperature, params.top_p, params.stop, params.seed) == (0.0, 0.5, ("END",), 7)
    assert (result.stream, result.include_usage) == (True, True)


def test_tools_choice_and_json_output_are_typed_for_the_capability_check():
    weather = {"type": "function", "function": {"name": "weather", "description": "Weather in a city.",
                                                "parameters": {"type": "object", "properties": {
                                                    "city": {"type": "string", "maxLength": 40}}}}}
    generation = plan(tools=[weather], tool_choice={"type": "function", "function": {"name": "weather"}},
                      parallel_tool_calls=False, response_format={"type": "json_object"}).generation
    assert generation.tools == (ToolSpec("weather", "Weather in a city.", {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 40}}}),)
    assert type(generation.tools[0].parameters["properties"]["city"]["maxLength"]) is int
    assert generation.tool_choice == ToolChoice(ToolChoiceMode.TOOL, name="weather", parallel=False)
    assert generation.output_format == OutputFormat()  # any JSON object
    assert plan(tools=[weather], tool_choice="required").generation.tool_choice.needs_tool_calls
    assert plan(parallel_tool_calls=False).generation.tool_choice == ToolChoice(parallel=False)
    assert plan().generation.tool_choice is None and plan().generation.output_format is None
    later = plan(response_format={"type": "structural_tag", "structures": []}).generation  # for its own dialect only
    assert later.output_format is None and [u.param for u in later.source.unread] == ["response_format.type"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"stop": [""]}, "stop[0]"),
        ({"stop": 5}, "stop"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"response_format": {"type": 7}}, "response_format.type"),
        ({"response_format": {}}, "response_format.type"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),  # not in tools
        ({"tools": [{"type": 7}]}, "tools[0].type"),
        ({"tools": [{"type": "function", "function": {"name": "f", "strict": "yes"}}]}, "tools[0].function.strict"),
        ({"logit_bias": {"5": "x"}}, "logit_bias.5"),
        ({"metadata": {"x": {}}}, "metadata.x"),  # OpenAI's metadata maps strings to strings
        ({"metadata": {"x": 1}}, "metadata.x"),
        ({"metadata": {"x": None}}, "metadata.x"),  # a null value was a 500
        ({"tool_choice": {"type": "function", "function": {"name": 5}}}, "tool_choice.function.name"),
        ({"messages": [{"role": "user", "content": "hi", "name": 5}]}, "messages[0].name"),
        ({"messages": [{"role": "user", "content": [{"type": None}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "assistant", "content": [{"type": "refusal"}]}]}, "messages[0].content[0].refusal"),
        ({"temperature": "1"}, "temperature"),
        ({"user": 5}, "user"),
        ({"messages": [{"role": "user", "content": "hi"}, 7]}, "messages[1]"),
        ({"messages": [{"role": "tool", "content": "4"}]}, "messages[0].tool_call_id"),
        ({"top_logprobs": 21}, "top_logprobs"), ({"top_logprobs": -1}, "top_logprobs"),  # api.md: 0–20
        ({"min_p": 1.5}, "min_p"), ({"min_p": -0.1}, "min_p"),  # 0–1
        ({"messages": [{"role": "user", "content": 3}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text"),
    ],
)
def test_rejections_name_the_param(fields, param):
    with pytest.raises(InvalidRequest) as caught:
        plan(**fields)
    assert caught.value.param == param


def test_an_unknown_role_is_left_to_the_upstream_and_refused_elsewhere_naming_every_role_taken():
    embedded, other = plan(messages=[{"role": "robot", "content": "hi"}]).generation.source.unread
    assert embedded.param == other.param == "messages[0].role"
    assert (embedded.embedded, embedded.other_dialect) == (True, False)
    assert (other.embedded, other.other_dialect) == (False, True)
    named = embedded.message.split("supported: ")[1].rstrip(".").split(", ")
    assert "function" in named  # the deprecated function calling's results are read, so it is one of them
    # An Anthropic upstream refuses the deprecated function calling: its refusal does not name it.
    assert other.message.split("supported: ")[1].rstrip(".").split(", ") == [r for r in named if r != "function"]
    with pytest.raises(InvalidRequest) as caught:  # a role is still a string
        plan(messages=[{"role": 5, "content": "hi"}])
    assert caught.value.param == "messages[0].role"
    for role in named:
        plan(messages=[{"role": "user", "content": "hi"}, {"role": role, "content": "x", "name": "f",
                                                           "tool_call_id": "c1"}])


def test_completion_object():
    completion = Completion("Hi.", Finished(FinishReason.STOP_SEQUENCE, Usage(3, 2), stop_sequence="\n"))
    assert to_openai.chat_completion(HEADER, completion) == {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 1700000000, "model": "family-a-5.5",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hi.", "refusal": None},
                     "logprobs": None, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }


async def _events(*events):
    for event in events:
        yield event


async def test_sse_transcript_with_usage():
    events = _events(Started(3), TextDelta("Hi"), TextDelta("!"), Finished(FinishReason.MAX_TOKENS, Usage(3, 2)))
    frames = [sse_event(c) async for c in to_openai.chat_chunks(HEADER, events, include_usage=True)] + [DONE]
    head = b'"id":"chatcmpl-1","object":"chat.completion.chunk","created":1700000000,"model":"family-a-5.5"'
    assert frames == [
        b'data: {' + head + b',"usage":null,"choices":[{"index":0,"delta":{"role":"assistant","content":""},'
        b'"logprobs":null,"finish_reason":null}]}\n\n',
        b'data: {' + head + b',"usage":null,"choices":[{"index":0,"delta":{"content":"Hi"},'
        b'"logprobs":null,"finish_reason":null}]}\n\n',
        b'data: {' + head + b',"usage":null,"choices":[{"index":0,"delta":{"content":"!"},'
        b'"logprobs":null,"finish_reason":null}]}\n\n',
        b'data: {' + head + b',"usage":null,"choices":[{"index":0,"delta":{},'
        b'"logprobs":null,"finish_reason":"length"}]}\n\n',
        b'data: {' + head + b',"usage":{"prompt_tokens":3,"completion_tokens":2,"total_tokens":5},'
        b'"choices":[]}\n\n',
        b"data: [DONE]\n\n",
    ]


def test_a_deprecated_function_call_is_read_as_the_call_its_function_message_answers():
    """The embedded model reads a `function` message as the result of a call named by the function: the assistant's
    `function_call` before it is that call, written out for the model as any tool call is, not left out."""
    turns = plan(messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "function_call": {"name": "weather", "arguments": '{"city": "Oslo"}'}},
        {"role": "function", "name": "weather", "content": "Sunny"},
    ]).generation.turns
    assert turns[1:] == (Turn(Role.ASSISTANT, "", tool_calls=(ToolCall("weather", "weather", '{"city": "Oslo"}'),)),
                         Turn(Role.USER, tool_results=(ToolResult("weather", "Sunny"),)))
