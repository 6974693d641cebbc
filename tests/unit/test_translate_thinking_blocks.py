"""Anthropic's signed thinking blocks for a chat caller, LiteLLM's `thinking_blocks` (docs/api.md, Upstream
providers): an answer's blocks reach the caller whole, and the caller's go back to Anthropic first in their
assistant message, so a tool loop keeps thinking on."""

from __future__ import annotations

import pytest

from server.cache import codec
from server.domain import Dialect, Thought, Turn
from server.domain_answers import (
    Completion, FinishReason, Finished, ReasoningDelta, TextDelta, ToolCallDelta, ToolCallStart, Usage,
)
from server.errors import InvalidRequest
from server.providers import Capabilities, unsupported
from server.providers.anthropic_http import AnthropicProvider
from server.translate import internal_to_openai as to_openai
from server.translate.anthropic_events_to_internal import AnthropicEventReader, message_events
from server.translate.internal_to_anthropic_request import anthropic_body, caller_param
from server.translate.openai_to_internal import chat_request
from tests.helpers import chat_body
from tests.unit.test_translate_reasoning import CHAT, THOUGHT_EVENTS as EVENTS, THOUGHT_MESSAGE as MESSAGE

# MESSAGE and EVENTS: an answer that thought (a signed block, a redacted one, then text), whole and streamed.
SIGNED = Thought("Oslo is cold in", "sig")
REDACTED = Thought(redacted="opaque")


def answer_parts(events) -> list:
    return [e for e in events if isinstance(e, (ReasoningDelta, Thought, TextDelta))]


def test_a_thinking_block_is_a_thought_when_it_ends_streamed_and_whole():
    reader = AnthropicEventReader()
    streamed = [event for payload in EVENTS for event in reader.feed(payload)]
    assert answer_parts(streamed) == [ReasoningDelta("Oslo is"), ReasoningDelta(" cold in"), SIGNED, REDACTED,
                                      TextDelta("Cold.")]
    assert answer_parts(message_events(MESSAGE)) == [ReasoningDelta("Oslo is cold in"), SIGNED, REDACTED,
                                                     TextDelta("Cold.")]


def test_a_reader_for_a_caller_of_anthropics_dialect_holds_no_blocks_text():
    """Such a caller gets the upstream's events whole: its stream kept each thinking block's text until the block
    ended (tens of kB with a large budget) only to make a Thought nobody read."""
    reader = AnthropicEventReader(thoughts=False)
    for payload in EVENTS[:4]:  # inside the first thinking block
        reader.feed(payload)
    assert reader._thinking is None
    streamed = [event for payload in EVENTS[4:] for event in reader.feed(payload)]
    assert answer_parts(streamed) == [TextDelta("Cold.")]  # no Thought of either block


def test_a_block_without_a_signature_is_no_thought_and_the_next_block_starts_afresh():
    """A compatible server's unsigned thinking cannot be given back to Anthropic: its text is reasoning only."""
    unsigned = [{**event, "delta": {"type": "signature_delta", "signature": ""}}
                if event.get("delta", {}).get("type") == "signature_delta" else event for event in EVENTS]
    reader = AnthropicEventReader()
    parts = answer_parts(event for payload in [*unsigned[:6], *EVENTS[1:6]] for event in reader.feed(payload))
    assert [p for p in parts if isinstance(p, Thought)] == [SIGNED]  # the second block's text alone
    assert answer_parts(message_events({**MESSAGE, "content": [{"type": "thinking", "thinking": "x"}]})) == [
        ReasoningDelta("x")]


def test_a_chat_completion_holds_the_blocks_as_thinking_blocks():
    finish = Finished(FinishReason.END_TURN, Usage(5, 20))
    answer = to_openai.chat_completion(CHAT, Completion("Cold.", finish, reasoning="Oslo is cold in",
                                                        thoughts=(SIGNED, REDACTED)))
    assert answer["choices"][0]["message"]["thinking_blocks"] == [
        {"type": "thinking", "thinking": "Oslo is cold in", "signature": "sig"},
        {"type": "redacted_thinking", "data": "opaque"}]
    plain = to_openai.chat_completion(CHAT, Completion("Cold.", finish, reasoning="Oslo is cold in"))
    assert "thinking_blocks" not in plain["choices"][0]["message"]


async def test_a_stream_sends_each_block_whole_when_it_ends():
    reader = AnthropicEventReader()

    async def events():
        for payload in EVENTS[1:]:  # after Started
            for event in reader.feed(payload):
                yield event

    deltas = [chunk["choices"][0]["delta"] async for chunk in to_openai.chat_chunks(CHAT, events(),
                                                                                    include_usage=False)]
    assert deltas[:6] == [
        {"role": "assistant", "content": None}, {"reasoning_content": "Oslo is"}, {"reasoning_content": " cold in"},
        {"thinking_blocks": [{"index": 0, "type": "thinking", "thinking": "Oslo is cold in", "signature": "sig"}]},
        {"thinking_blocks": [{"index": 1, "type": "redacted_thinking", "data": "opaque"}]}, {"content": "Cold."}]


def test_a_cached_answer_keeps_its_thinking_blocks():
    events = (ReasoningDelta("Oslo is"), SIGNED, REDACTED, TextDelta("Cold."),
              Finished(FinishReason.END_TURN, Usage(5, 20)))
    assert codec.decode(codec.encode(events, 1.0))[1] == events


# Requests: a chat caller's assistant message gives its thinking blocks back.
TOOLS = [{"type": "function", "function": {"name": "weather"}}]
CALL = {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": "{}"}}
BLOCKS = [{"type": "thinking", "thinking": "Look it up.", "signature": "c2ln"},
          {"type": "redacted_thinking", "data": "b3BhcXVl"}]
LOOP = [{"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL], "thinking_blocks": BLOCKS},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "-5C"}]


def chat(messages, **fields):
    return chat_request(chat_body(messages=messages, max_tokens=5000, **fields), default_max_tokens=1000).generation


def test_an_assistant_messages_thinking_blocks_are_its_thoughts():
    generation = chat(LOOP, tools=TOOLS)
    assert generation.turns[1].thoughts == (Thought("Look it up.", "c2ln"), Thought(redacted="b3BhcXVl"))
    assert chat([*LOOP[:1], {**LOOP[1], "thinking_blocks": None}, LOOP[2]], tools=TOOLS).turns[1].thoughts == ()


def test_a_tool_loop_with_its_signed_block_first_keeps_thinking_on():
    body = anthropic_body(chat(LOOP, tools=TOOLS, reasoning_effort="low"), model="claude-up")
    assert body["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    assert body["messages"][1]["content"] == [
        {"type": "thinking", "thinking": "Look it up.", "signature": "c2ln"},
        {"type": "redacted_thinking", "data": "b3BhcXVl"},
        {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}}]
    without = [LOOP[0], {key: value for key, value in LOOP[1].items() if key != "thinking_blocks"}, LOOP[2]]
    assert "thinking" not in anthropic_body(chat(without, tools=TOOLS, reasoning_effort="low"), model="claude-up")


def test_blocks_before_text_and_a_prefill_that_starts_with_one():
    messages = [{"role": "user", "content": "Weather?"},
                {"role": "assistant", "content": "It is", "thinking_blocks": BLOCKS[1:]}]
    body = anthropic_body(chat(messages, reasoning_effort="low"), model="claude-up")
    assert body["messages"][1]["content"] == [{"type": "redacted_thinking", "data": "b3BhcXVl"},
                                              {"type": "text", "text": "It is"}]
    assert "thinking" in body
    # Thinking alone (content ""): no empty text block, which Anthropic refuses.
    alone = anthropic_body(chat([messages[0], {**messages[1], "content": ""}, {"role": "user", "content": "And?"}]),
                           model="claude-up")
    assert alone["messages"][1]["content"] == [{"type": "redacted_thinking", "data": "b3BhcXVl"}]


def test_anthropics_400_about_a_block_names_the_callers_thinking_block():
    generation = chat(LOOP, tools=TOOLS, reasoning_effort="low")
    assert caller_param(generation, "messages.1.content.1: Invalid `data` in `redacted_thinking` block") == (
        "messages[1].thinking_blocks[1]")
    assert caller_param(generation, "messages.1.content.2.input: bad") == "messages[1]"


def loop_with(blocks):
    return [LOOP[0], {**LOOP[1], "thinking_blocks": blocks}, LOOP[2]]


@pytest.mark.parametrize(("blocks", "param"), [
    ("think", "messages[1].thinking_blocks"),
    (["think"], "messages[1].thinking_blocks[0]"),
    ([{"type": 5}], "messages[1].thinking_blocks[0].type"),
    ([{"type": "thinking", "thinking": "x", "signature": 5}], "messages[1].thinking_blocks[0].signature"),
    ([{"type": "redacted_thinking", "data": ["x"]}], "messages[1].thinking_blocks[0].data"),
])
def test_a_thinking_block_of_the_wrong_json_type_is_a_400_naming_it(blocks, param):
    with pytest.raises(InvalidRequest) as caught:
        chat(loop_with(blocks), tools=TOOLS)
    assert caught.value.param == param


@pytest.mark.parametrize(("blocks", "param"), [
    ([{"type": "text", "text": "x"}], "messages[1].thinking_blocks[0].type"),
    ([{"thinking": "x", "signature": "s"}], "messages[1].thinking_blocks[0].type"),
    ([BLOCKS[0], {"type": "thinking", "thinking": "x"}], "messages[1].thinking_blocks[1].signature"),
    ([{"type": "thinking", "thinking": "x", "signature": ""}], "messages[1].thinking_blocks[0].signature"),
    ([{"type": "thinking", "signature": "s"}], "messages[1].thinking_blocks[0].thinking"),
    ([{"type": "redacted_thinking"}], "messages[1].thinking_blocks[0].data"),
])
def test_a_block_anthropic_cannot_take_back_is_refused_for_anthropic_only(blocks, param):
    """Unsigned blocks (LiteLLM's of other providers) pass to an OpenAI-compatible upstream with the body, and the
    embedded model ignores them; Anthropic would refuse them, so its upstream's requests are a 400 naming them."""
    generation = chat(loop_with(blocks), tools=TOOLS)
    refused = unsupported(generation, AnthropicProvider.capabilities)
    assert refused is not None and refused.param == param
    assert unsupported(generation, Capabilities(tool_calls=True)) is None
    assert unsupported(generation, Capabilities(tool_calls=True, dialects=frozenset({Dialect.OPENAI}))) is None


def test_thoughts_are_only_an_assistants():
    """Another role's `thinking_blocks` is not read (as LiteLLM ignores it): no thoughts, no 400."""
    generation = chat([{"role": "user", "content": "Hi", "thinking_blocks": "x"}])
    assert generation.turns[0] == Turn(generation.turns[0].role, "Hi")


def test_tool_call_events_are_unchanged_beside_thoughts():
    call = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}}
    events = message_events({**MESSAGE, "content": [MESSAGE["content"][0], call], "stop_reason": "tool_use"})
    assert [e for e in events if isinstance(e, (Thought, ToolCallStart, ToolCallDelta))] == [
        SIGNED, ToolCallStart(0, "toolu_1", "weather"), ToolCallDelta(0, "{}")]
