"""Anthropic's signed thinking blocks for a chat caller, LiteLLM's `thinking_blocks` (docs/api.md, Upstream
providers): an answer's blocks reach the caller whole."""

from __future__ import annotations

from server.cache import codec
from server.domain import (
    Completion, FinishReason, Finished, ReasoningDelta, ResponseHeader, TextDelta, Thought, ToolCallDelta,
    ToolCallStart, Usage,
)
from server.translate import internal_to_openai as to_openai
from server.translate.anthropic_events_to_internal import AnthropicEventReader, message_events

SIGNED = Thought("Oslo is cold in", "sig")
REDACTED = Thought(redacted="opaque")
MESSAGE = {
    "id": "msg_up", "type": "message", "role": "assistant", "model": "claude-up",
    "content": [{"type": "thinking", "thinking": "Oslo is cold in", "signature": "sig"},
                {"type": "redacted_thinking", "data": "opaque"},
                {"type": "text", "text": "Cold."}],
    "stop_reason": "end_turn", "stop_sequence": None, "usage": {"input_tokens": 5, "output_tokens": 20},
}
EVENTS = [
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


def answer_parts(events) -> list:
    return [e for e in events if isinstance(e, (ReasoningDelta, Thought, TextDelta))]


def test_a_thinking_block_is_a_thought_when_it_ends_streamed_and_whole():
    reader = AnthropicEventReader()
    streamed = [event for payload in EVENTS for event in reader.feed(payload)]
    assert answer_parts(streamed) == [ReasoningDelta("Oslo is"), ReasoningDelta(" cold in"), SIGNED, REDACTED,
                                      TextDelta("Cold.")]
    assert answer_parts(message_events(MESSAGE)) == [ReasoningDelta("Oslo is cold in"), SIGNED, REDACTED,
                                                     TextDelta("Cold.")]


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
        {"thinking_blocks": [{"type": "thinking", "thinking": "Oslo is cold in", "signature": "sig"}]},
        {"thinking_blocks": [{"type": "redacted_thinking", "data": "opaque"}]}, {"content": "Cold."}]


def test_a_cached_answer_keeps_its_thinking_blocks():
    events = (ReasoningDelta("Oslo is"), SIGNED, REDACTED, TextDelta("Cold."),
              Finished(FinishReason.END_TURN, Usage(5, 20)))
    assert codec.decode(codec.encode(events, 1.0))[1] == events


def test_tool_call_events_are_unchanged_beside_thoughts():
    call = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}}
    events = message_events({**MESSAGE, "content": [MESSAGE["content"][0], call], "stop_reason": "tool_use"})
    assert [e for e in events if isinstance(e, (Thought, ToolCallStart, ToolCallDelta))] == [
        SIGNED, ToolCallStart(0, "toolu_1", "weather"), ToolCallDelta(0, "{}")]
