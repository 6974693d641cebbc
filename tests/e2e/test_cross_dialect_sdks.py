"""Across dialects through the whole stack (real Envoy, `portico serve`), read by the official SDKs: a chat completion
served by an Anthropic upstream and a message served by an OpenAI-compatible one, both the upstream double, which
plays answers an echo model would not give (docs/api.md, Upstream providers)."""

from __future__ import annotations

import re
import time

import anthropic
import httpx
import openai
import orjson
import pytest

from tests.e2e.conftest import upstream_gateway
from tests.e2e.test_caller_gone_unary import admin, rows
from tests.upstream_double import Cue
from tests.upstream_echo import sse
from tests.upstream_support import double_providers

HELLO = [{"role": "user", "content": "Weather in Oslo?"}]
TOOLS = [{"name": "weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    gpt, claude = double_providers(double.url)
    models = (f"  - {{id: chat-claude, endpoint: /v1/chat/completions, provider: {claude}}}\n"
              f"  - {{id: chat-gpt, endpoint: /v1/chat/completions, provider: {gpt}}}\n"
              f"  - {{id: messages-gpt, endpoint: /v1/messages, provider: {gpt}}}\n")
    with upstream_gateway(tmp_path_factory.mktemp("cross-dialect-gateway"), models) as gateway:
        yield gateway


@pytest.fixture(autouse=True)
def fresh(double):
    double.reset()


def access_line(gateway, request_id: str) -> dict:
    deadline = time.monotonic() + 5
    while not (lines := [line for line in gateway.log_path.read_text().splitlines()
                         if line.startswith('{"ts":') and orjson.loads(line)["request_id"] == request_id]):
        assert time.monotonic() < deadline, f"no access-log line for {request_id}"
        time.sleep(0.05)
    return orjson.loads(lines[0])


def chunk(delta: dict, finish_reason: str | None = None) -> bytes:
    return sse({"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "gpt-up",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})


def call_frames(*pieces: str) -> list[bytes]:
    """An OpenAI-compatible stream of one call to `weather` whose arguments arrive in these pieces."""
    start = {"index": 0, "id": "call_0", "type": "function", "function": {"name": "weather", "arguments": ""}}
    return [chunk({"role": "assistant", "content": None}), chunk({"tool_calls": [start]}),
            *[chunk({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}) for piece in pieces],
            chunk({}, "tool_calls"), b"data: [DONE]\n\n"]


def test_unparseable_streamed_arguments_end_the_stream_with_an_error_event(claude, gateway, double):
    """The anthropic SDK parses a tool_use block's input after each input_json_delta and raises a bare ValueError on
    text no continuation makes JSON: the stream must end with the dialect's error event before such a piece."""
    frames = call_frames('{"city": ', "Oslo}")
    double.cue(Cue(frames=frames), Cue(frames=frames))
    with (pytest.raises(anthropic.APIStatusError) as caught,
          claude.messages.stream(model="messages-gpt", max_tokens=50, tools=TOOLS, messages=HELLO) as stream):
        list(stream)
    assert caught.value.body["error"]["code"] == "upstream_error"
    assert "weather" in caught.value.body["error"]["message"]
    answer = httpx.post(f"{gateway.base_url}/v1/messages", headers={"x-api-key": gateway.secret}, timeout=30, json={
        "model": "messages-gpt", "max_tokens": 50, "tools": TOOLS, "messages": HELLO, "stream": True})
    raw = answer.text
    assert '"partial_json":"{\\"city\\": "' in raw and "Oslo}" not in raw  # the valid beginning went out, live
    assert raw.rstrip().split("\n\n")[-1].startswith("event: error\n")
    # The access log has the failure the caller got, not a plain 200.
    assert access_line(gateway, answer.headers["x-request-id"])["code"] == "upstream_error"


def test_arguments_that_are_not_an_object_end_the_stream_with_an_error_event(claude, double):
    double.cue(Cue(frames=call_frames('["Oslo"]')))
    with (pytest.raises(anthropic.APIStatusError, match="not a JSON object"),
          claude.messages.stream(model="messages-gpt", max_tokens=50, tools=TOOLS, messages=HELLO) as stream):
        stream.get_final_message()


def test_whitespace_before_streamed_arguments_reaches_the_sdk_as_a_valid_input(claude, double):
    """Whitespace alone is no JSON prefix the SDK accepts; before the object it means nothing and is left out."""
    double.cue(Cue(frames=call_frames(" \n", ' {"city":', ' "Oslo"} ')))
    with claude.messages.stream(model="messages-gpt", max_tokens=50, tools=TOOLS, messages=HELLO) as stream:
        final = stream.get_final_message()
    assert [(b.type, b.input) for b in final.content] == [("tool_use", {"city": "Oslo"})]


def test_unparseable_arguments_in_a_json_answer_are_kept_under_arguments(claude, double):
    call = {"id": "call_0", "type": "function", "function": {"name": "weather", "arguments": '{"city": Oslo}'}}
    double.cue(Cue(body={"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "gpt-up",
                         "choices": [{"index": 0, "finish_reason": "tool_calls",
                                      "message": {"role": "assistant", "content": None, "tool_calls": [call]}}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}}))
    message = claude.messages.create(model="messages-gpt", max_tokens=50, tools=TOOLS, messages=HELLO)
    assert [(b.type, b.input) for b in message.content] == [("tool_use", {"arguments": '{"city": Oslo}'})]



def one_call_json_and_streamed(claude, double, call: dict):
    """The Messages answer, JSON and then streamed, to an upstream answer of one tool call `call`."""
    double.cue(Cue(body={"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "gpt-up",
                         "choices": [{"index": 0, "finish_reason": "tool_calls",
                                      "message": {"role": "assistant", "content": None, "tool_calls": [call]}}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}}),
               Cue(frames=[chunk({"role": "assistant", "content": None}), chunk({"tool_calls": [{"index": 0, **call}]}),
                           chunk({}, "tool_calls"), b"data: [DONE]\n\n"]))
    message = claude.messages.create(model="messages-gpt", max_tokens=50, tools=TOOLS, messages=HELLO)
    with claude.messages.stream(model="messages-gpt", max_tokens=50, tools=TOOLS, messages=HELLO) as stream:
        streamed = stream.get_final_message()
    return message, streamed


@pytest.mark.parametrize("arguments", ["", " ", "\n"])
def test_a_call_without_arguments_has_the_same_empty_input_in_json_and_streamed(claude, double, arguments):
    """A call to a tool without parameters written as whitespace (some models write a newline): streamed, the
    whitespace is left out and the input is {}; the JSON answer's was {"arguments": " "}, which the SDK's tool runner
    passes to the tool as an argument it does not take."""
    call = {"id": "call_0", "type": "function", "function": {"name": "weather", "arguments": arguments}}
    message, streamed = one_call_json_and_streamed(claude, double, call)
    assert [(b.type, b.input) for b in message.content] == [(b.type, b.input) for b in streamed.content] == [
        ("tool_use", {})]


CONVERSATION = [  # for an OpenAI-compatible upstream: system, user, assistant, tool, tool, user (messages[0..5])
    {"role": "user", "content": "Weather in Oslo and Bergen?"},
    {"role": "assistant", "content": [
        {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}},
        {"type": "tool_use", "id": "toolu_2", "name": "weather", "input": {}}]},
    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"},
                                 {"type": "tool_result", "tool_use_id": "toolu_2", "content": "Rain"},
                                 {"type": "text", "text": "And tomorrow?"}]},
]


@pytest.mark.parametrize(("upstream_param", "caller_param"), [
    ("stop", "stop_sequences"), ("stop[1]", "stop_sequences[1]"), ("messages[0].content", "system"),
    ("messages[1].content", "messages[0]"), ("messages[4].content", "messages[2]"), ("messages[5]", "messages[2]"),
    ("tools[0].function.parameters.properties", "tools[0].input_schema.properties"),
    ("tools[0].function.name", "tools[0].name"), ("parallel_tool_calls", "tool_choice.disable_parallel_tool_use"),
    ("messages", "messages"), ("max_tokens", "max_tokens"), ("user", "metadata.user_id"), ("logprobs", None),
])
def test_an_openai_upstreams_param_reaches_a_messages_caller_as_the_field_it_sent(claude, double, upstream_param,
                                                                                   caller_param):
    """An upstream's 400 names a field of the body it received, which the gateway built from the caller's: the caller
    is told which of its own fields that was (null when none of them was), not a path into a body it never saw."""
    double.cue(Cue(status=400, body={"error": {"message": "Invalid value.", "type": "invalid_request_error",
                                               "param": upstream_param, "code": None}}))
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="messages-gpt", max_tokens=50, system="Be brief.", messages=CONVERSATION,
                               tools=TOOLS, tool_choice={"type": "auto", "disable_parallel_tool_use": True},
                               stop_sequences=["END", "STOP"], metadata={"user_id": "u-1"})
    assert [m["role"] for m in double.seen[-1].body["messages"]] == ["system", "user", "assistant", "tool", "tool",
                                                                     "user"]
    assert caught.value.body["error"]["param"] == caller_param
    assert caught.value.body["error"]["message"] == "Invalid value."


def test_the_end_user_id_reaches_the_upstream_in_its_dialect(oai, claude, double):
    """Anthropic's `metadata.user_id` and OpenAI's `user` (or its successor `safety_identifier`) name the caller's
    end user for the upstream's abuse monitoring: the same field in the other dialect, never dropped."""
    claude.messages.create(model="messages-gpt", max_tokens=5, messages=HELLO, metadata={"user_id": "u-42"})
    assert double.seen[-1].body["user"] == "u-42"
    claude.messages.create(model="messages-gpt", max_tokens=5, messages=HELLO)
    assert "user" not in double.seen[-1].body
    oai.chat.completions.create(model="chat-claude", messages=HELLO, user="u-7", safety_identifier="s-7")
    assert double.seen[-1].body["metadata"] == {"user_id": "u-7"}
    oai.chat.completions.create(model="chat-claude", messages=HELLO, safety_identifier="s-7")
    assert double.seen[-1].body["metadata"] == {"user_id": "s-7"}
    oai.chat.completions.create(model="chat-claude", messages=HELLO, metadata={"team": "a"})
    assert "metadata" not in double.seen[-1].body


def test_a_safety_identifier_openai_s_api_refuses_is_refused_not_sent_to_anthropic(oai, double):
    """A `safety_identifier` over OpenAI's 64 characters is the caller's API's 400 on a model behind Anthropic too
    (which would take it as a `metadata.user_id` of up to 256), as on the embedded model: never sent upstream."""
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-claude", messages=HELLO, safety_identifier="s" * 65)
    assert caught.value.param == "safety_identifier" and not double.seen


def test_metadata_openai_s_api_refuses_is_refused_not_dropped_on_the_way_to_anthropic(oai, double):
    """Chat `metadata` has no Anthropic field and is left out, but more than OpenAI's API takes (17 pairs) is the
    caller's API's 400 there too, as on the embedded model, not an answer OpenAI would have refused."""
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-claude", messages=HELLO, metadata={f"k{i}": "v" for i in range(17)})
    assert caught.value.param == "metadata" and not double.seen


def test_sampling_anthropic_s_api_refuses_beside_thinking_is_refused_not_sent_to_openai(claude, double):
    """A temperature other than 1 while thinking is on is the caller's API's 400 on a model behind an
    OpenAI-compatible server too (where `thinking` becomes `reasoning_effort`), as on the embedded model."""
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="messages-gpt", max_tokens=2000, messages=HELLO,
                               thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"temperature": 0.2})
    assert caught.value.body["error"]["param"] == "temperature" and not double.seen


def test_more_tools_than_openai_s_api_takes_are_refused_not_sent_to_anthropic(oai, double):
    tools = [{"type": "function", "function": {"name": f"tool_{i}"}} for i in range(129)]
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-claude", messages=HELLO, tools=tools)
    assert caught.value.param == "tools" and not double.seen


def test_top_logprobs_without_logprobs_is_refused_not_dropped_on_the_way_to_anthropic(oai, double):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-claude", messages=HELLO, top_logprobs=3)
    assert caught.value.param == "top_logprobs" and not double.seen


def test_tool_call_ids_anthropic_refuses_reach_it_valid_and_still_matched(oai, double):
    """Some models (Kimi's, behind OpenAI-compatible servers) name their calls `functions.weather:0`; a conversation
    carried over to a model behind Anthropic, which takes ids of [a-zA-Z0-9_-] only, must still pair each result
    with its call, and two calls that differ only where a character was replaced must stay apart."""
    calls = [{"id": f"functions.weather:{i}", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
             for i in range(2)] + [{"id": "call_ok-1", "type": "function",
                                    "function": {"name": "weather", "arguments": "{}"}}]
    oai.chat.completions.create(model="chat-claude", tools=[{"type": "function", "function": {"name": "weather"}}],
                                messages=[*HELLO, {"role": "assistant", "content": None, "tool_calls": calls},
                                          *[{"role": "tool", "tool_call_id": c["id"], "content": "Sunny"}
                                            for c in reversed(calls)]])
    sent = double.seen[-1].body["messages"]
    uses = [block["id"] for block in sent[1]["content"]]
    results = [block["tool_use_id"] for block in sent[2]["content"]]
    assert all(re.fullmatch(r"[a-zA-Z0-9_-]+", i) for i in uses) and len(set(uses)) == 3
    assert results == uses[::-1]
    assert uses[2] == "call_ok-1"  # a valid id is sent as it is


CHAT_CONVERSATION = [  # for an Anthropic upstream: system; user (messages.0), assistant (1), tool + tool + user (2)
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Oslo and Bergen?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": f"call_{i}", "type": "function", "function": {"name": "weather", "arguments": "{}"}} for i in range(2)]},
    {"role": "tool", "tool_call_id": "call_0", "content": "Sunny"},
    {"role": "tool", "tool_call_id": "call_1", "content": "Rain"},
    {"role": "user", "content": "And tomorrow?"},
]


@pytest.mark.parametrize(("message", "caller_param"), [
    ("messages.1.content.0.tool_use.id: String should match pattern '^[a-zA-Z0-9_-]+$'", "messages[2]"),
    ("messages.2.content.1: unexpected `tool_use_id` found in `tool_result` blocks: call_1.", "messages[4]"),
    ("messages.2.content.2.text.text: Field required", "messages[5]"),
    ("messages.0: all messages must have non-empty content", "messages[1]"),
    ("messages: roles must alternate between \"user\" and \"assistant\"", "messages"),
    ("system: text content blocks must be non-empty", "messages[0]"),
    ("max_tokens: 100000 > 64000, which is the maximum allowed number of output tokens", "max_completion_tokens"),
    ("stop_sequences.1: each stop sequence must contain non-whitespace", "stop[1]"),
    ("temperature: Input should be less than or equal to 1", "temperature"),
    ("tools.0.custom.input_schema.type: Input should be 'object'", "tools[0].function.parameters.type"),
    ("tools.0.name: String should match pattern '^[a-zA-Z0-9_-]{1,128}$'", "tools[0].function.name"),
    ("tool_choice.disable_parallel_tool_use: Input should be a valid boolean", "parallel_tool_calls"),
    ("metadata.user_id: String should have at most 256 characters", "user"),
    ("Your credit balance is too low.", None),
])
def test_an_anthropic_upstreams_field_path_reaches_a_chat_caller_as_the_param_it_sent(oai, double, message,
                                                                                      caller_param):
    """Anthropic's 400s have no `param`: their message starts with the path of the field in the body the gateway
    built (`messages.2.content.1: ...`). A chat caller is told, as `param`, which of its own fields that was."""
    double.cue(Cue(status=400, body={"type": "error", "error": {"type": "invalid_request_error", "message": message}}))
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-claude", messages=CHAT_CONVERSATION, max_completion_tokens=50,
                                    tools=[{"type": "function", "function": {"name": "weather"}}], stop=["END", "X"],
                                    parallel_tool_calls=False, user="u-1")
    assert [len(m["content"]) for m in double.seen[-1].body["messages"]] == [27, 2, 3]
    assert caught.value.body["param"] == caller_param
    assert caught.value.body["message"] == message


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_that_ends_with_stop_is_a_tool_use_turn(claude, double, stream):
    """OpenAI and vLLM end a call the request forced (tool_choice required, or a named function) with
    finish_reason "stop": a Messages caller must still get stop_reason tool_use, or the anthropic SDK's tool runner
    takes the turn as final and never runs the call."""
    call = {"id": "call_0", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    if stream:
        double.cue(Cue(frames=[*call_frames('{"city": "Oslo"}')[:-2], chunk({}, "stop"), b"data: [DONE]\n\n"]))
    else:
        double.cue(Cue(body={"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "gpt-up",
                             "choices": [{"index": 0, "finish_reason": "stop", "message": {
                                 "role": "assistant", "content": None, "tool_calls": [call]}}],
                             "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}))
    tool_choice = {"type": "tool", "name": "weather"}
    if stream:
        with claude.messages.stream(model="messages-gpt", max_tokens=50, tools=TOOLS, tool_choice=tool_choice,
                                    messages=HELLO) as answer:
            message = answer.get_final_message()
    else:
        message = claude.messages.create(model="messages-gpt", max_tokens=50, tools=TOOLS, tool_choice=tool_choice,
                                         messages=HELLO)
    assert [(b.type, b.input) for b in message.content] == [("tool_use", {"city": "Oslo"})]
    assert (message.stop_reason, message.stop_sequence) == ("tool_use", None)


@pytest.mark.parametrize("empty", ["", [], [{"type": "thinking", "thinking": "Hm.", "signature": "c2ln"}]])
def test_an_empty_last_assistant_turn_reaches_an_openai_upstream_as_no_message(claude, double, empty):
    """Anthropic's API takes an empty last assistant message (a prefill of nothing); OpenAI's refuses an assistant
    message with neither content nor tool calls, which is what the upstream was sent (`"content": null`)."""
    claude.messages.create(model="messages-gpt", max_tokens=5, messages=[*HELLO, {"role": "assistant", "content": empty}])
    assert double.seen[-1].body["messages"] == HELLO


def test_an_assistant_turn_of_thinking_alone_reaches_an_openai_upstream_as_no_message(claude, double):
    """An answer cut off while it thought (`max_tokens`) holds thinking alone; sent back before the next question,
    it reached the upstream as an assistant message of null content and no tool calls, which OpenAI's API refuses."""
    thought = {"role": "assistant", "content": [{"type": "thinking", "thinking": "Hm.", "signature": "c2ln"}]}
    again = {"role": "user", "content": "And tomorrow?"}
    claude.messages.create(model="messages-gpt", max_tokens=5, messages=[*HELLO, thought, again])
    assert double.seen[-1].body["messages"] == [*HELLO, again]


def test_a_tool_name_that_comes_after_the_calls_first_piece_reaches_the_sdk(claude, double):
    """Some OpenAI-compatible servers open a call with its id and an empty name and send the name in the next piece
    (the openai SDK joins a call's pieces, name included): the tool_use block's name is the one the upstream sent,
    never "", which the SDK's tool runner would find no tool for. A second call, named at once, keeps its place."""
    first = {"index": 0, "id": "call_0", "type": "function", "function": {"name": "", "arguments": ""}}
    second = {"index": 1, "id": "call_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    frames = [chunk({"role": "assistant", "content": None}), chunk({"tool_calls": [first]}),
              chunk({"tool_calls": [{"index": 0, "function": {"name": "weather"}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"city": "Oslo"}'}}]}),
              chunk({"tool_calls": [second]}), chunk({}, "tool_calls"), b"data: [DONE]\n\n"]
    double.cue(Cue(frames=frames))
    with claude.messages.stream(model="messages-gpt", max_tokens=50, tools=TOOLS, messages=HELLO) as stream:
        final = stream.get_final_message()
    assert [(b.id, b.name, b.input) for b in final.content] == [
        ("call_0", "weather", {"city": "Oslo"}), ("call_1", "weather", {})]


def test_an_answer_whose_content_is_a_list_of_parts_reaches_the_sdk_as_its_text_json_and_streamed(claude, double):
    """Mistral's reasoning models (Magistral) answer `content` as a list of parts, a `thinking` one and then `text`,
    in a JSON answer and in each streamed delta: the caller gets the text, whether it streamed or not (the JSON
    answer was a 502 'not a chat completion' while its stream was read)."""
    thinking = {"type": "thinking", "thinking": [{"type": "text", "text": "The capital..."}]}
    double.cue(Cue(body={"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "gpt-up",
                         "choices": [{"index": 0, "finish_reason": "stop", "message": {
                             "role": "assistant", "content": [thinking, {"type": "text", "text": "Paris."}]}}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}}),
               Cue(frames=[chunk({"role": "assistant", "content": [thinking]}),
                           chunk({"content": [{"type": "text", "text": "Paris."}]}), chunk({}, "stop"),
                           b"data: [DONE]\n\n"]))
    message = claude.messages.create(model="messages-gpt", max_tokens=50, messages=HELLO)
    with claude.messages.stream(model="messages-gpt", max_tokens=50, messages=HELLO) as stream:
        streamed = stream.get_final_message()
    assert [(b.type, b.text) for b in message.content] == [(b.type, b.text) for b in streamed.content] == [
        ("text", "Paris.")]
    assert message.stop_reason == streamed.stop_reason == "end_turn"


@pytest.mark.parametrize(("finish_reason", "stop_reason"), [
    ("stop", "end_turn"), ("length", "max_tokens"), ("content_filter", "refusal"),
    ("model_length", "model_context_window_exceeded"),  # Mistral's: the model's context window filled
])
def test_each_finish_reason_reaches_a_messages_caller_as_its_stop_reason_json_and_streamed(claude, double,
                                                                                          finish_reason, stop_reason):
    """An answer cut off where the model's context window filled (Mistral's `model_length`) reached the caller as
    end_turn, a complete answer, so an agent loop took it as final instead of seeing it cut short."""
    double.cue(Cue(body={"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "gpt-up",
                         "choices": [{"index": 0, "finish_reason": finish_reason,
                                      "message": {"role": "assistant", "content": "It is"}}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}),
               Cue(frames=[chunk({"role": "assistant", "content": ""}), chunk({"content": "It is"}),
                           chunk({}, finish_reason), b"data: [DONE]\n\n"]))
    message = claude.messages.create(model="messages-gpt", max_tokens=50, messages=HELLO)
    with claude.messages.stream(model="messages-gpt", max_tokens=50, messages=HELLO) as stream:
        streamed = stream.get_final_message()
    assert message.stop_reason == streamed.stop_reason == stop_reason
    assert message.content[0].text == streamed.content[0].text == "It is"


def test_parallel_calls_an_upstream_numbers_alike_reach_the_sdk_as_separate_tool_use_blocks(claude, double):
    """Ollama streams every call of a parallel batch with `index` 0, each with its own id and whole arguments
    (ollama/ollama#15457): read as one call, its arguments ran on into `{...}{...}`, which no JSON object begins,
    and the stream ended with a 502 error event where the same answer unstreamed had two calls."""
    calls = [{"index": 0, "id": f"call_{city}", "type": "function",
              "function": {"name": "weather", "arguments": orjson.dumps({"city": city}).decode()}}
             for city in ("Oslo", "Bergen")]
    double.cue(Cue(frames=[chunk({"role": "assistant", "content": ""}), *[chunk({"tool_calls": [c]}) for c in calls],
                           chunk({}, "tool_calls"), b"data: [DONE]\n\n"]))
    with claude.messages.stream(model="messages-gpt", max_tokens=50, tools=TOOLS, messages=HELLO) as stream:
        final = stream.get_final_message()
    assert [(b.id, b.input) for b in final.content] == [("call_Oslo", {"city": "Oslo"}),
                                                        ("call_Bergen", {"city": "Bergen"})]
    assert final.stop_reason == "tool_use"


@pytest.mark.parametrize("finish_reason", ["abort", "error"])
def test_a_generation_the_upstream_says_failed_reaches_callers_as_an_upstream_error(claude, oai, gateway, double,
                                                                                   finish_reason):
    """vLLM ends a request its engine gave up (shut down, paused, scaled in) with `finish_reason: abort`, Mistral a
    failed one with `error`, both in a 200 ending in [DONE] (vllm-project/vllm#57082): a Messages caller got the text
    so far as a complete answer, `stop_reason: end_turn`. Each caller now gets a 502 `upstream_error` (streamed: the
    error event after what was sent), and the ledger counts the tokens the upstream reported."""
    usage = {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12}
    answer = {"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "gpt-up", "usage": usage,
              "choices": [{"index": 0, "finish_reason": finish_reason,
                           "message": {"role": "assistant", "content": "The answer is"}}]}
    frames = [chunk({"role": "assistant", "content": ""}), chunk({"content": "The answer is"}),
              chunk({}, finish_reason), sse({"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1,
                                             "model": "gpt-up", "choices": [], "usage": usage}), b"data: [DONE]\n\n"]
    double.cue(Cue(body=answer), Cue(frames=frames), Cue(body=answer), Cue(frames=frames))
    with pytest.raises(anthropic.APIStatusError) as caught:
        claude.messages.with_raw_response.create(model="messages-gpt", max_tokens=50, messages=HELLO)
    assert caught.value.status_code == 502 and caught.value.body["error"]["code"] == "upstream_error"
    assert f"`{finish_reason}`" in caught.value.body["error"]["message"]
    line = access_line(gateway, caught.value.response.headers["x-request-id"])
    assert (line["code"], line["input_tokens"], line["output_tokens"]) == ("upstream_error", 9, 3)
    with (pytest.raises(anthropic.APIStatusError, match=f"`{finish_reason}`") as caught,
          claude.messages.stream(model="messages-gpt", max_tokens=50, messages=HELLO) as stream):
        stream.get_final_message()
    line = access_line(gateway, caught.value.response.headers["x-request-id"])
    assert (line["code"], line["input_tokens"], line["output_tokens"]) == ("upstream_error", 9, 3)
    with pytest.raises(openai.APIStatusError) as caught:
        oai.chat.completions.create(model="chat-gpt", max_tokens=50, messages=HELLO)
    assert caught.value.status_code == 502 and f"`{finish_reason}`" in caught.value.message
    with pytest.raises(openai.APIError, match=f"`{finish_reason}`"):
        list(oai.chat.completions.create(model="chat-gpt", max_tokens=50, messages=HELLO, stream=True))


def test_arguments_sent_as_an_object_reach_the_sdk_as_the_calls_input_json_and_streamed(claude, double):
    """TGI (huggingface/text-generation-inference#2136) and builds of llama.cpp's server (ggml-org/llama.cpp#20198)
    send a call's `arguments` as the JSON object itself rather than its text: the caller got a 502 'not a chat
    completion chunk', JSON and streamed, for an answer that says plainly what the model called."""
    call = {"id": "call_0", "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}}
    message, streamed = one_call_json_and_streamed(claude, double, call)
    assert [(b.type, b.name, b.input) for b in message.content] == [(b.type, b.name, b.input) for b in streamed.content]
    assert [(b.name, b.input) for b in streamed.content] == [("weather", {"city": "Oslo"})]
    assert message.stop_reason == streamed.stop_reason == "tool_use"


def test_calls_gemini_streams_without_an_index_reach_the_sdk_whole(claude, double):
    """Gemini's OpenAI compatibility streams calls without `index`, may split a call's arguments over pieces that
    name no call, and sends a call's thought signature in a piece of its own (open-webui/computer#224): each such
    piece was read as another call without a name, and the stream ended in a 502 error event (the first call's
    arguments cut off) or a tool_use block with an empty name."""
    signature = {"google": {"thought_signature": "c2ln"}}
    first = {"id": "function-call-1", "type": "function", "extra_content": signature,
             "function": {"name": "weather", "arguments": '{"city": '}}
    second = {"id": "function-call-2", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
    double.cue(Cue(frames=[chunk({"role": "assistant", "tool_calls": [first]}),
                           chunk({"tool_calls": [{"function": {"arguments": '"Oslo"}'}}]}),
                           chunk({"tool_calls": [{"extra_content": signature}]}), chunk({"tool_calls": [second]}),
                           chunk({}, "stop"), b"data: [DONE]\n\n"]))
    with claude.messages.stream(model="messages-gpt", max_tokens=50, tools=TOOLS, messages=HELLO) as stream:
        final = stream.get_final_message()
    assert [(b.id, b.name, b.input) for b in final.content] == [
        ("function-call-1", "weather", {"city": "Oslo"}), ("function-call-2", "weather", {})]
    assert final.stop_reason == "tool_use"


def anthropic_frames(start_usage: dict, delta_usage: dict | None, text: str = "It is sunny in Oslo today.",
                     thinking: str = "") -> list:
    """An Anthropic stream of a thinking block (when `thinking`) and a text block, with these usages in message_start
    and message_delta (None: none)."""
    message = {"id": "msg_up", "type": "message", "role": "assistant", "model": "claude-up", "content": [],
               "stop_reason": None, "stop_sequence": None, "usage": start_usage}
    blocks = [({"type": "thinking", "thinking": ""}, {"type": "thinking_delta", "thinking": thinking})]
    blocks = blocks if thinking else []
    blocks.append(({"type": "text", "text": ""}, {"type": "text_delta", "text": text}))
    delta = {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}}
    return [sse({"type": "message_start", "message": message}, "message_start"),
            *[frame for index, (block, piece) in enumerate(blocks) for frame in (
                sse({"type": "content_block_start", "index": index, "content_block": block}, "content_block_start"),
                sse({"type": "content_block_delta", "index": index, "delta": piece}, "content_block_delta"),
                sse({"type": "content_block_stop", "index": index}, "content_block_stop"))],
            sse({**delta, **({"usage": delta_usage} if delta_usage is not None else {})}, "message_delta"),
            sse({"type": "message_stop"}, "message_stop")]


def streamed_usage(oai) -> tuple[str, openai.types.CompletionUsage, str]:
    """A chat caller's streamed answer from chat-claude: its text, usage and request id."""
    with oai.chat.completions.with_streaming_response.create(
            model="chat-claude", messages=HELLO, max_tokens=50, stream=True,
            stream_options={"include_usage": True}) as response:
        chunks = list(response.parse())
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, chunks[-1].usage, response.headers["x-request-id"]


def test_a_prompt_count_a_compatible_server_zeroes_in_message_delta_is_counted_as_message_start_said(oai, gateway,
                                                                                                     double):
    """SGLang's Anthropic-compatible endpoint reports the prompt in message_start and sends `input_tokens: 0` in
    message_delta (sgl-project/sglang#20830; envoyproxy/ai-gateway#1631 met the same): the 0 replaced the count, so
    a chat caller read `prompt_tokens: 0` and the ledger counted a free prompt. Anthropic's delta counts are
    cumulative, never below message_start's."""
    double.cue(Cue(frames=anthropic_frames({"input_tokens": 25, "output_tokens": 1},
                                           {"input_tokens": 0, "output_tokens": 7})))
    text, usage, request_id = streamed_usage(oai)
    assert text == "It is sunny in Oslo today."
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (25, 7, 32)
    line = access_line(gateway, request_id)
    assert (line["input_tokens"], line["output_tokens"]) == (25, 7)


def test_an_answer_whose_message_delta_has_no_usage_is_counted_at_four_characters_a_token(oai, gateway, double):
    """MiniMax's Anthropic-compatible API sends message_delta without `usage` (earendil-works/pi#6567), its
    message_start saying `output_tokens: 0`: that start value was taken as the answer's count, so a chat caller read
    `completion_tokens: 0` and the ledger counted the answer free. An answer whose count never came is estimated
    (four characters a token), as any upstream's that reports none: its thinking too, which the model generated."""
    thinking, text = "The user asks about Oslo.", "It is sunny in Oslo today, with a light breeze from the west."
    double.cue(Cue(frames=anthropic_frames({"input_tokens": 10, "output_tokens": 0}, None, text, thinking)))
    answer, usage, request_id = streamed_usage(oai)
    estimate = -(-len(thinking + text) // 4)
    assert answer == text and (usage.prompt_tokens, usage.completion_tokens) == (10, estimate)
    line = access_line(gateway, request_id)
    assert (line["input_tokens"], line["output_tokens"]) == (10, estimate)


def weather_choice(oai, stream: bool):
    """The chat caller's answer (its first choice) to HELLO on the Anthropic upstream's model, with the weather tool:
    the SDK's streaming helper's final completion, or the JSON answer."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": TOOLS[0]["input_schema"]}}]
    if stream:
        with oai.chat.completions.stream(model="chat-claude", messages=HELLO, max_tokens=50, tools=tools) as events:
            return events.get_final_completion().choices[0]
    return oai.chat.completions.create(model="chat-claude", messages=HELLO, max_tokens=50, tools=tools).choices[0]


@pytest.mark.parametrize("stream", [False, True])
def test_calls_a_compatible_server_ends_with_end_turn_reach_a_chat_caller_as_tool_calls(oai, double, stream):
    """Anthropic-compatible bridges in front of other models end a turn that called a tool with `end_turn` (as
    can1357/oh-my-pi#12224 and Joouis/agent-maestro#258 fixed in theirs): a chat caller got the calls with
    `finish_reason: stop`, and a loop that runs tools on `tool_calls` stopped with the calls unrun. As an
    OpenAI-compatible answer with calls that ends with `stop` reaches a Messages caller as `tool_use`."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}}
    message = {"id": "msg_up", "type": "message", "role": "assistant", "model": "claude-up", "stop_sequence": None,
               "content": [{"type": "text", "text": "Checking."}, call], "stop_reason": "end_turn",
               "usage": {"input_tokens": 10, "output_tokens": 5}}
    frames = [sse({"type": "message_start", "message": {**message, "content": [], "stop_reason": None}},
                  "message_start"), *anthropic_frames({}, None, "Checking.")[1:4],
              sse({"type": "content_block_start", "index": 1, "content_block": {**call, "input": {}}},
                  "content_block_start"),
              sse({"type": "content_block_delta", "index": 1,
                   "delta": {"type": "input_json_delta", "partial_json": '{"city": "Oslo"}'}}, "content_block_delta"),
              sse({"type": "content_block_stop", "index": 1}, "content_block_stop"),
              sse({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                   "usage": {"output_tokens": 5}}, "message_delta"), sse({"type": "message_stop"}, "message_stop")]
    double.cue(Cue(frames=frames) if stream else Cue(body=message))
    choice = weather_choice(oai, stream)
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("weather", '{"city": "Oslo"}' if stream else '{"city":"Oslo"}')]
    assert choice.finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_use_stop_without_calls_reaches_a_chat_caller_as_stop(oai, double, stream):
    """Some Anthropic-compatible bridges end an answer with `stop_reason: tool_use` and no `tool_use` block: a chat
    caller got `finish_reason: tool_calls` with no `tool_calls`, and a loop that runs the calls on `tool_calls` found
    none to run (the openai SDK's own examples index `message.tool_calls`, None here). What was said is the answer."""
    message = {"id": "msg_up", "type": "message", "role": "assistant", "model": "claude-up", "stop_sequence": None,
               "content": [{"type": "text", "text": "Checking."}], "stop_reason": "tool_use",
               "usage": {"input_tokens": 10, "output_tokens": 5}}
    frames = [*anthropic_frames({"input_tokens": 10, "output_tokens": 1}, {"output_tokens": 5}, "Checking.")[:-2],
              sse({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                   "usage": {"output_tokens": 5}}, "message_delta"), sse({"type": "message_stop"}, "message_stop")]
    double.cue(Cue(frames=frames) if stream else Cue(body=message))
    choice = weather_choice(oai, stream)
    assert (choice.message.content, choice.message.tool_calls) == ("Checking.", None)
    assert choice.finish_reason == "stop"


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_calls_finish_without_calls_reaches_a_messages_caller_as_end_turn(claude, double, stream):
    """The reverse: an OpenAI-compatible answer ending `finish_reason: tool_calls` with no call reached a Messages
    caller as `stop_reason: tool_use` with no `tool_use` block, which the anthropic SDK's tool runner answers with a
    next request of no tool results."""
    double.cue(Cue(frames=[chunk({"role": "assistant", "content": ""}), chunk({"content": "Checking."}),
                           chunk({}, "tool_calls"), b"data: [DONE]\n\n"]) if stream else
               Cue(body={"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "gpt-up",
                         "choices": [{"index": 0, "finish_reason": "tool_calls",
                                      "message": {"role": "assistant", "content": "Checking.", "tool_calls": []}}],
                         "usage": {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}}))
    if stream:
        with claude.messages.stream(model="messages-gpt", max_tokens=50, tools=TOOLS, messages=HELLO) as answer:
            message = answer.get_final_message()
    else:
        message = claude.messages.create(model="messages-gpt", max_tokens=50, tools=TOOLS, messages=HELLO)
    assert [(b.type, b.text) for b in message.content] == [("text", "Checking.")]
    assert message.stop_reason == "end_turn"


@pytest.mark.parametrize("stream", [False, True])
def test_a_tool_use_block_with_members_null_or_missing_reaches_a_chat_caller_as_a_call_it_can_answer(oai, double,
                                                                                                   stream):
    """An Anthropic-compatible server's tool_use block with `id` or `input` null, or no `id`: a chat caller got the
    call with the id "None" or "" (which Anthropic refuses in the tool result sent back) and, in a JSON answer,
    `arguments` "null" (json.loads gives None, not the object a tool is called with; streamed, the same call's were
    "{}"). Such a call is given an id of its own, as an OpenAI-compatible server's call without one is."""
    blocks = [{"type": "tool_use", "id": None, "name": "weather", "input": None},
              {"type": "tool_use", "name": "weather", "input": {"city": "Oslo"}}]
    message = {"id": "msg_up", "type": "message", "role": "assistant", "model": "claude-up", "stop_sequence": None,
               "content": blocks, "stop_reason": "tool_use", "usage": {"input_tokens": 10, "output_tokens": 5}}
    frames = [sse({"type": "message_start", "message": {**message, "content": [], "stop_reason": None}},
                  "message_start"),
              *[frame for index, block in enumerate(blocks) for frame in (
                  sse({"type": "content_block_start", "index": index, "content_block": {**block, "input": {}}},
                      "content_block_start"),
                  sse({"type": "content_block_delta", "index": index, "delta": {
                      "type": "input_json_delta", "partial_json": orjson.dumps(block["input"] or {}).decode()}},
                      "content_block_delta"),
                  sse({"type": "content_block_stop", "index": index}, "content_block_stop"))],
              sse({"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
                   "usage": {"output_tokens": 5}}, "message_delta"), sse({"type": "message_stop"}, "message_stop")]
    double.cue(Cue(frames=frames) if stream else Cue(body=message))
    choice = weather_choice(oai, stream)
    calls = choice.message.tool_calls
    assert [(c.function.name, orjson.loads(c.function.arguments)) for c in calls] == [
        ("weather", {}), ("weather", {"city": "Oslo"})]
    assert all(re.fullmatch(r"[a-zA-Z0-9_-]+", c.id) for c in calls) and len({c.id for c in calls}) == 2
    assert choice.finish_reason == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_counts_an_openai_usage_leaves_out_are_estimated_as_when_it_sends_no_usage(claude, gateway, double, stream):
    """Some OpenAI-compatible servers send `usage: {}` (or counts of null) on every chunk, or a usage without one of
    its counts: what was left out was counted 0, so the caller read `output_tokens: 0` and the ledger counted the
    answer (or the prompt) free, where a server that sends no usage at all is estimated (docs/api.md)."""
    def counts(usage: dict | None) -> tuple[int, int]:
        extra = {} if usage is None else {"usage": usage}
        if stream:
            def piece(delta: dict, reason: str | None = None) -> bytes:
                return sse({"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "gpt-up",
                            "choices": [{"index": 0, "delta": delta, "finish_reason": reason}], **extra})
            double.cue(Cue(frames=[piece({"role": "assistant", "content": ""}), piece({"content": "It is sunny."}),
                                   piece({}, "stop"), b"data: [DONE]\n\n"]))
            with claude.messages.with_streaming_response.create(model="messages-gpt", max_tokens=50, messages=HELLO,
                                                                stream=True) as response:
                final = [e for e in response.parse() if e.type == "message_delta"][-1].usage
                request_id = response.headers["x-request-id"]
        else:
            double.cue(Cue(body={"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "gpt-up",
                                 "choices": [{"index": 0, "finish_reason": "stop",
                                              "message": {"role": "assistant", "content": "It is sunny."}}], **extra}))
            response = claude.messages.with_raw_response.create(model="messages-gpt", max_tokens=50, messages=HELLO)
            final, request_id = response.parse().usage, response.headers["x-request-id"]
        line = access_line(gateway, request_id)
        assert (line["input_tokens"], line["output_tokens"]) == (final.input_tokens, final.output_tokens)
        return final.input_tokens, final.output_tokens

    prompt, answer = counts(None)
    assert prompt > 0 and answer > 0
    assert counts({}) == counts({"prompt_tokens": None, "completion_tokens": None}) == (prompt, answer)
    assert counts({"prompt_tokens": 9}) == (9, answer)
    assert counts({"completion_tokens": 4, "total_tokens": 4}) == (prompt, 4)


def completion(usage: dict) -> dict:
    return {"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "gpt-up", "usage": usage,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": "Sunny."}, "finish_reason": "stop"}]}


def anthropic_message(usage: dict) -> dict:
    return {"id": "msg_up", "type": "message", "role": "assistant", "model": "claude-up", "stop_reason": "end_turn",
            "content": [{"type": "text", "text": "Sunny."}], "usage": usage}


@pytest.mark.parametrize("model, answer", [
    ("chat-gpt", completion({"prompt_tokens": -5, "completion_tokens": 3})),
    ("chat-claude", anthropic_message({"input_tokens": 10, "output_tokens": 2.5})),
    ("messages-gpt", completion({"prompt_tokens": 10, "completion_tokens": "3"})),
], ids=["openai-passthrough", "anthropic-upstream", "messages-from-openai"])
def test_an_answer_whose_usage_is_no_token_count_is_not_retried_by_the_sdks(gateway, double, model, answer):
    """The upstream finished and billed the answer, but its usage is not a count Portico can settle limits with: a
    502. Its server counts so every time, so each of the SDKs' two default retries was billed again for the same 502;
    now it says `x-should-retry: false`, and the upstream is asked once."""
    double.cue(*[Cue(body=answer)] * 3)
    with pytest.raises((openai.APIStatusError, anthropic.APIStatusError)) as caught:
        if model.startswith("messages"):
            anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.secret).messages.create(
                model=model, max_tokens=20, messages=HELLO)
        else:
            openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.secret).chat.completions.create(
                model=model, messages=HELLO, max_tokens=20)
    assert caught.value.status_code == 502 and "not a token count" in caught.value.message
    assert caught.value.response.headers.get("x-should-retry") == "false"
    assert len(double.seen) == 1


NO_FINISH = [{"index": 0, "message": {"role": "assistant", "content": "Sunny."}}]


@pytest.mark.parametrize("model, answer", [
    ("chat-gpt", {**completion({"prompt_tokens": 100, "completion_tokens": 50}), "choices": NO_FINISH}),
    ("chat-gpt", {**completion({"prompt_tokens": 100, "completion_tokens": 50}), "choices": "none"}),
    ("messages-gpt", {**completion({"prompt_tokens": 100, "completion_tokens": 50}), "choices": NO_FINISH}),
    ("chat-claude", {**anthropic_message({"input_tokens": 100, "output_tokens": 50}), "content": "Sunny."}),
], ids=["no-finish-reason", "choices-not-a-list", "messages-from-openai", "anthropic-content-not-a-list"])
def test_a_malformed_answer_counts_the_usage_it_reports(gateway, double, model, answer):
    """A 200 answer Portico cannot use (a 502) that reports its usage: the upstream billed those tokens, so the
    ledger row counts them, as a stream that breaks off after its usage; it counted none."""
    double.cue(Cue(body=answer))
    out = gateway.cli("keys", "create", "--name", f"malformed-{model}", "--all-models").stdout
    key_id, secret = out.split()[2], out.split()[-1]
    with pytest.raises((openai.APIStatusError, anthropic.APIStatusError)) as caught:
        if model.startswith("messages"):
            anthropic.Anthropic(base_url=gateway.base_url, api_key=secret, max_retries=0).messages.create(
                model=model, max_tokens=20, messages=HELLO)
        else:
            openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=secret, max_retries=0).chat.completions.create(
                model=model, messages=HELLO, max_tokens=20)
    assert caught.value.status_code == 502
    (row,) = rows(gateway, key_id, admin(gateway))
    assert (row["status"], row["input_tokens"], row["output_tokens"]) == (502, 100, 50), row
