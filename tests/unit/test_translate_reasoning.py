"""Reasoning across dialects (docs/api.md, Request bodies): chat's `reasoning_effort` becomes Anthropic's `thinking`
and back, and an upstream's thinking reaches the caller in its own dialect's member or block."""

from __future__ import annotations

import pytest

from server.cache import codec
from server.domain import Reasoning
from server.domain_answers import Completion, FinishReason, Finished, ReasoningDelta, ResponseHeader, TextDelta, Usage
from server.metering import Meter
from server.providers import Capabilities, unsupported
from server.providers.anthropic_http import AnthropicProvider
from server.translate import internal_to_anthropic as to_anthropic
from server.translate import internal_to_openai as to_openai
from server.translate.anthropic_events_to_internal import AnthropicEventReader, message_events
from server.translate.anthropic_to_internal import message_request
from server.translate.internal_to_anthropic_request import anthropic_body
from server.translate.internal_to_anthropic_request import caller_param as anthropic_caller_param
from server.translate.internal_to_openai_request import caller_param as openai_caller_param
from server.translate.internal_to_openai_request import openai_body
from server.translate.openai_chunks_to_internal import OpenAIChunkReader, completion_events
from server.translate.openai_to_internal import chat_request
from tests.helpers import chat_body, message_body


def chat(**fields):
    return chat_request(chat_body(**fields), default_max_tokens=1000).generation


def refusal(generation, capabilities=AnthropicProvider.capabilities):
    return unsupported(generation, capabilities)


@pytest.mark.parametrize(("effort", "budget"), [
    ("minimal", 1024), ("low", 1024), ("medium", 2048), ("high", 4096), ("xhigh", 8192), ("max", 16384)])
def test_reasoning_effort_is_a_thinking_budget_for_an_anthropic_upstream(effort, budget):
    generation = chat(reasoning_effort=effort, max_completion_tokens=20000)
    body = anthropic_body(generation, model="claude-up")
    assert body["thinking"] == {"type": "enabled", "budget_tokens": budget}
    assert body["max_tokens"] == 20000
    assert generation.reasoning == Reasoning(effort=effort, budget_tokens=budget)


def test_no_reasoning_effort_and_none_ask_for_no_thinking():
    for generation in (chat(), chat(reasoning_effort="none"), chat(reasoning_effort=None)):
        assert "thinking" not in anthropic_body(generation, model="claude-up")
        assert generation.reasoning is None


def test_without_a_token_limit_the_default_is_room_for_the_answer_after_the_budget():
    """Anthropic refuses a budget not under max_tokens: default_max_tokens (1000 here) is the answer's, on top."""
    generation = chat_request({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                               "reasoning_effort": "high"}, default_max_tokens=1000).generation
    assert anthropic_body(generation, model="claude-up")["max_tokens"] == 5096
    assert generation.most_output_tokens == 5096  # what the limits reserve
    assert generation.params.max_tokens == 1000  # what an OpenAI-compatible upstream is sent, as before
    assert openai_body(generation, model="gpt-up")["max_tokens"] == 1000
    plain = chat_request({"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
                         default_max_tokens=1000).generation
    assert plain.most_output_tokens == 1000


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_completion_tokens": 4096}, "max_completion_tokens"),
    ({"max_tokens": 100}, "max_tokens"),
    ({"temperature": 0.5}, "temperature"),
    ({"top_p": 0.9}, "top_p"),
    ({"top_k": 40}, "top_k"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
])
def test_what_anthropic_refuses_beside_thinking_is_a_400_naming_the_chat_field(fields, param):
    fields = {"max_tokens": 9000, "reasoning_effort": "high", **fields}
    generation = chat(**fields)
    error = refusal(generation)
    assert error is not None and error.param == param
    # The embedded model ignores reasoning_effort (it has no reasoning): the same request is no refusal there.
    assert unsupported(generation, Capabilities(tool_calls=True)) is None


def test_a_temperature_of_one_a_high_top_p_and_an_auto_tool_choice_go_with_thinking():
    generation = chat(max_tokens=9000, reasoning_effort="low", temperature=1, top_p=0.95, top_k=0,
                      tool_choice="auto", tools=[{"type": "function", "function": {"name": "f"}}])
    assert refusal(generation) is None
    assert anthropic_body(generation, model="claude-up")["thinking"]["budget_tokens"] == 1024


def test_reasoning_content_in_chat_history_is_left_out_for_anthropic():
    """Anthropic takes a thinking block back only with its signature, which a chat history does not have."""
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello.", "reasoning_content": "They greet me."},
                {"role": "user", "content": "Bye"}]
    body = anthropic_body(chat(messages=messages, reasoning_effort="low", max_tokens=5000), model="claude-up")
    assert body["messages"][1] == {"role": "assistant", "content": "Hello."}


CALL = {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
TOOL_LOOP = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": None, "reasoning_content": "Look it up.", "tool_calls": [CALL]},
             {"role": "tool", "tool_call_id": "toolu_1", "content": "-5C"}]


def test_a_tool_loop_continued_without_its_thinking_asks_anthropic_for_no_thinking():
    """Anthropic refuses thinking whose final assistant message has tool_use blocks but no thinking block first
    ("a final `assistant` message must start with a thinking block"), and a chat history holds no signed block to
    send back: that request of the loop is sent without thinking; the next user turn thinks again."""
    tools = [{"type": "function", "function": {"name": "weather"}}]
    body = anthropic_body(chat(messages=TOOL_LOOP, reasoning_effort="low", max_tokens=5000, tools=tools),
                          model="claude-up")
    assert "thinking" not in body and body["messages"][1]["content"][0]["type"] == "tool_use"
    later = [*TOOL_LOOP, {"role": "assistant", "content": "It is -5C."}, {"role": "user", "content": "And Bergen?"}]
    body = anthropic_body(chat(messages=later, reasoning_effort="low", max_tokens=5000, tools=tools),
                          model="claude-up")
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 1024}



def test_a_prefill_asks_anthropic_for_no_thinking():
    """A last assistant message is a prefill for Anthropic (docs/api.md), a final assistant message it refuses
    with thinking on unless it starts with a signed thinking block ("Expected `thinking` or `redacted_thinking`, but
    found `text`"): it is sent without thinking."""
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "It is"}]
    body = anthropic_body(chat(messages=messages, reasoning_effort="low", max_tokens=5000), model="claude-up")
    assert "thinking" not in body and body["messages"][-1] == {"role": "assistant", "content": "It is"}

# Answers: an Anthropic upstream's thinking reaches a chat caller as `reasoning_content`.
THOUGHT_MESSAGE = {
    "id": "msg_up", "type": "message", "role": "assistant", "model": "claude-up",
    "content": [{"type": "thinking", "thinking": "Oslo is cold in", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Cold."}],
    "stop_reason": "end_turn", "stop_sequence": None, "usage": {"input_tokens": 5, "output_tokens": 20},
}
THOUGHT_EVENTS = [
    {"type": "message_start", "message": {"usage": {"input_tokens": 5, "output_tokens": 1}}},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "Oslo is"}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": " cold in"}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "sig"}},
    {"type": "content_block_stop", "index": 0},
    {"type": "content_block_start", "index": 1, "content_block": {"type": "redacted_thinking", "data": "opaque"}},
    {"type": "content_block_stop", "index": 1},
    {"type": "content_block_start", "index": 2, "content_block": {"type": "text", "text": ""}},
    {"type": "content_block_delta", "index": 2, "delta": {"type": "text_delta", "text": "Cold."}},
    {"type": "content_block_stop", "index": 2},
    {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 20}},
    {"type": "message_stop"},
]
CHAT = ResponseHeader(id="chatcmpl-9", created=1700000000, model="chat-claude")


def test_anthropic_thinking_is_read_as_reasoning_deltas_streamed_and_whole():
    reader = AnthropicEventReader()
    streamed = [event for payload in THOUGHT_EVENTS for event in reader.feed(payload)]
    assert [e for e in streamed if isinstance(e, (ReasoningDelta, TextDelta))] == [
        ReasoningDelta("Oslo is"), ReasoningDelta(" cold in"), TextDelta("Cold.")]
    whole = message_events(THOUGHT_MESSAGE)
    assert [e for e in whole if isinstance(e, (ReasoningDelta, TextDelta))] == [
        ReasoningDelta("Oslo is cold in"), TextDelta("Cold.")]


def test_a_chat_completion_holds_the_reasoning_as_reasoning_content():
    finish = Finished(FinishReason.END_TURN, Usage(5, 20))
    answer = to_openai.chat_completion(CHAT, Completion(text="Cold.", finish=finish, reasoning="Oslo is cold in"))
    assert answer["choices"][0]["message"]["reasoning_content"] == "Oslo is cold in"
    assert answer["choices"][0]["message"]["content"] == "Cold."
    plain = to_openai.chat_completion(CHAT, Completion(text="Cold.", finish=finish))
    assert "reasoning_content" not in plain["choices"][0]["message"]


async def test_streamed_reasoning_is_reasoning_content_deltas_before_the_content():
    async def events():
        for event in message_events(THOUGHT_MESSAGE)[1:]:  # after Started
            yield event

    deltas = [chunk["choices"][0]["delta"] async for chunk in to_openai.chat_chunks(CHAT, events(),
                                                                                    include_usage=False)]
    # content null before the reasoning, as DeepSeek says it (a tool call may follow: the JSON answer's null)
    assert deltas[:5] == [{"role": "assistant", "content": None}, {"reasoning_content": "Oslo is cold in"},
                          {"thinking_blocks": [{"index": 0, "type": "thinking", "thinking": "Oslo is cold in",
                                                "signature": "sig"}]},
                          {"thinking_blocks": [{"index": 1, "type": "redacted_thinking", "data": "opaque"}]},
                          {"content": "Cold."}]


def test_a_cached_answer_keeps_its_reasoning():
    events = (ReasoningDelta("Oslo is"), TextDelta("Cold."), Finished(FinishReason.END_TURN, Usage(5, 20)))
    assert codec.decode(codec.encode(events, 1.0))[1] == events


def test_reasoning_counts_as_generated_content():
    meter = Meter(prompt_estimate=1, most_output=100)
    meter.record(ReasoningDelta("x" * 40))
    assert meter.usage_so_far().output_tokens == 10


def test_the_typed_answers_hold_the_reasoning_too():
    """The typed RPCs' messages are made from the same dicts, and chat.proto declares `reasoning_content`."""
    from google.protobuf import json_format

    from portico.v1 import chat_pb2

    finish = Finished(FinishReason.END_TURN, Usage(5, 20))
    answer = to_openai.chat_completion(CHAT, Completion(text="Cold.", finish=finish, reasoning="Oslo is cold in"))
    typed = json_format.ParseDict(answer, chat_pb2.ChatCompletion(), ignore_unknown_fields=True)
    assert typed.choices[0].message.reasoning_content == "Oslo is cold in"


# Requests: Messages' `thinking` reaches an OpenAI-compatible upstream as `reasoning_effort`.
def message(**fields):
    return message_request(message_body(**fields)).generation


@pytest.mark.parametrize(("budget", "effort"), [
    (1024, "low"), (2047, "low"), (2048, "medium"), (4095, "medium"), (4096, "high"), (30000, "high")])
def test_a_thinking_budget_is_a_reasoning_effort_for_an_openai_upstream(budget, effort):
    generation = message(max_tokens=40000, thinking={"type": "enabled", "budget_tokens": budget})
    assert openai_body(generation, model="gpt-up")["reasoning_effort"] == effort
    assert openai_body(generation, model="gpt-up")["max_tokens"] == 40000
    assert generation.reasoning == Reasoning(effort=effort, budget_tokens=budget)


def test_disabled_and_adaptive_thinking_send_no_effort():
    """Adaptive thinking leaves the depth to the model: the server's own default, as no effort says."""
    disabled = message(thinking={"type": "disabled"})
    assert "reasoning_effort" not in openai_body(disabled, model="gpt-up") and disabled.reasoning is None
    adaptive = message(thinking={"type": "adaptive"})
    assert "reasoning_effort" not in openai_body(adaptive, model="gpt-up") and adaptive.reasoning == Reasoning()
    assert message().reasoning is None


@pytest.mark.parametrize("thinking", [{"type": "enabled", "budget_tokens": 2048}, {"type": "adaptive"}])
def test_thinking_whose_display_is_omitted_reasons_but_shows_no_thinking(thinking):
    """Anthropic's `display: "omitted"` returns the thinking without its text: the caller asked not to be shown it."""
    omitted = message(max_tokens=5000, thinking={**thinking, "display": "omitted"})
    assert omitted.reasoning.shown is False
    assert openai_body(omitted, model="gpt-up").get("reasoning_effort") == ("medium" if "budget_tokens" in thinking
                                                                           else None)
    assert message(max_tokens=5000, thinking={**thinking, "display": "summarized"}).reasoning.shown is True


def test_an_anthropic_upstream_gets_the_callers_thinking_as_it_came():
    generation = message(max_tokens=5000, thinking={"type": "enabled", "budget_tokens": 2048})
    body = anthropic_body(generation, model="claude-up")
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 2048} and body["max_tokens"] == 5000
    assert "reasoning_effort" not in body


def test_an_openai_upstreams_error_about_the_effort_names_thinking():
    generation = message(max_tokens=5000, thinking={"type": "enabled", "budget_tokens": 2048})
    assert openai_caller_param(generation, "reasoning_effort") == "thinking"
    chat_generation = chat(reasoning_effort="high", max_tokens=5000)
    assert anthropic_caller_param(chat_generation, "thinking.budget_tokens: Input should be ...") == "reasoning_effort"


# Answers: an OpenAI-compatible upstream's reasoning reaches a Messages caller who asked for thinking.
MESSAGE = ResponseHeader(id="msg_9", created=1700000000, model="messages-gpt")


def reasoning_chunk(text: str, member: str = "reasoning_content") -> dict:
    return {"choices": [{"index": 0, "delta": {member: text}}]}


CALL = {"index": 0, "id": "call_a", "type": "function", "function": {"name": "weather", "arguments": '{"city":"Oslo"}'}}
REASONING_CHUNKS = [
    {"choices": [{"index": 0, "delta": {"role": "assistant", "content": None}}]},
    reasoning_chunk("Oslo is"), reasoning_chunk(" cold", "reasoning"),
    {"choices": [{"index": 0, "delta": {"content": "Cold."}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": [CALL]}}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}],
     "usage": {"prompt_tokens": 5, "completion_tokens": 9, "total_tokens": 14}},
]


def test_reasoning_content_and_reasoning_are_read_as_reasoning_deltas():
    reader = OpenAIChunkReader(prompt_estimate=1)
    events = [event for chunk in REASONING_CHUNKS for event in reader.feed(chunk)]
    assert events[:3] == [ReasoningDelta("Oslo is"), ReasoningDelta(" cold"), TextDelta("Cold.")]
    whole = {"choices": [{"index": 0, "finish_reason": "stop", "message": {
        "role": "assistant", "content": "Cold.", "reasoning_content": "Oslo is cold"}}]}
    events = completion_events(whole, prompt_estimate=1)
    assert events[:2] == [ReasoningDelta("Oslo is cold"), TextDelta("Cold.")]
    assert events[-1].usage.output_tokens == 5  # estimated from both: 17 characters


def test_a_message_has_a_thinking_block_before_the_text_when_thinking_was_asked_for():
    finish = Finished(FinishReason.END_TURN, Usage(5, 20))
    completion = Completion(text="Cold.", finish=finish, reasoning="Oslo is cold")
    assert to_anthropic.message(MESSAGE, completion, thinking=True)["content"] == [
        {"type": "thinking", "thinking": "Oslo is cold", "signature": ""}, {"type": "text", "text": "Cold."}]
    assert to_anthropic.message(MESSAGE, completion, thinking=False)["content"] == [{"type": "text", "text": "Cold."}]


async def reframed_as_messages(chunks: list[dict], *, thinking: bool) -> list[dict]:
    reader = OpenAIChunkReader(prompt_estimate=1)

    async def events():
        for chunk in chunks:
            for event in reader.feed(chunk):
                yield event
        yield reader.end()

    return [event async for event in to_anthropic.message_events(MESSAGE, events(), thinking=thinking)]


async def test_streamed_reasoning_is_a_thinking_block_and_the_next_blocks_follow_it():
    out = await reframed_as_messages(REASONING_CHUNKS, thinking=True)
    assert [(e["type"], e.get("index")) for e in out[1:-2]] == [
        ("content_block_start", 0), ("ping", None), ("content_block_delta", 0), ("content_block_delta", 0),
        ("content_block_stop", 0), ("content_block_start", 1), ("content_block_delta", 1), ("content_block_stop", 1),
        ("content_block_start", 2), ("content_block_delta", 2), ("content_block_stop", 2)]
    assert out[1]["content_block"] == {"type": "thinking", "thinking": "", "signature": ""}
    assert [e["delta"] for e in out[3:5]] == [{"type": "thinking_delta", "thinking": "Oslo is"},
                                              {"type": "thinking_delta", "thinking": " cold"}]
    assert out[9]["content_block"]["type"] == "tool_use"
    plain = await reframed_as_messages(REASONING_CHUNKS, thinking=False)
    assert [e["content_block"]["type"] for e in plain if e["type"] == "content_block_start"] == ["text", "tool_use"]


async def test_an_answer_of_reasoning_alone_is_its_thinking_block_alone_json_and_streamed():
    """Cut while thinking, Anthropic answers the thinking block alone; an empty text block beside it was Portico's
    own, and one Anthropic refuses when the caller gives the turn back."""
    chunks = [reasoning_chunk("Hm."), {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}]
    out = await reframed_as_messages(chunks, thinking=True)
    assert [e["content_block"]["type"] for e in out if e["type"] == "content_block_start"] == ["thinking"]
    completion = Completion(text="", finish=Finished(FinishReason.MAX_TOKENS, Usage(1, 1)), reasoning="Hm.")
    assert [b["type"] for b in to_anthropic.message(MESSAGE, completion, thinking=True)["content"]] == ["thinking"]
    # Without thinking shown, an answer of nothing keeps its one empty text block, JSON and streamed.
    assert to_anthropic.message(MESSAGE, completion)["content"] == [{"type": "text", "text": ""}]
    out = await reframed_as_messages(chunks, thinking=False)
    assert [e["content_block"] for e in out if e["type"] == "content_block_start"] == [{"type": "text", "text": ""}]
