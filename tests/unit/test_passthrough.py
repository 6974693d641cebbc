"""Same dialect in and out: the upstream's own answer objects reach the caller unchanged but for what the gateway
owns (id, created, the caller's model id), JSON and streamed, while other answers are still rendered from the
internal events; and the retry wrappers hold back upstream objects without content."""

from __future__ import annotations

import pytest

from server.domain import Dialect, ToolCall
from server.domain_answers import (
    Completion, FinishReason, Finished, ResponseHeader, Started, TextDelta, ToolCallDelta, ToolCallStart,
    UpstreamObject, Usage,
)
from server.errors import UpstreamError
from server.providers.retry import Delivery
from server.translate import internal_to_anthropic as to_anthropic
from server.translate import internal_to_openai as to_openai
from server.translate.anthropic_events_to_internal import AnthropicEventReader, message_events
from server.translate.anthropic_events_to_internal import carries_content as anthropic_content
from server.translate.openai_chunks_to_internal import OpenAIChunkReader, completion_events
from server.translate.openai_chunks_to_internal import carries_content as openai_content
from tests.passthrough_objects import CHUNKS, COMPLETION, LOGPROBS, MESSAGE, THINKING, UPSTREAM_MODEL, chunk

CHAT_HEADER = ResponseHeader(id="chatcmpl-portico", created=1700000000, model="family-a-5.5")
MESSAGE_HEADER = ResponseHeader(id="msg_portico", created=1700000000, model="family-b-opus-4-8")

def without(obj: dict, *names: str) -> dict:
    return {k: v for k, v in obj.items() if k not in names}


def whole(dialect: Dialect, answer: dict, events: list) -> Completion:
    """What Pipeline.complete collects from a provider's events for a JSON answer."""
    finished = events[-1]
    calls = {e.index: e for e in events if isinstance(e, ToolCallStart)}
    tool_calls = tuple(ToolCall(c.id, c.name, "".join(d.arguments for d in events
                                                         if isinstance(d, ToolCallDelta) and d.index == i))
                       for i, c in calls.items())
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    return Completion(text, finished, tool_calls, upstream=UpstreamObject(dialect, answer))


async def aiter(items):
    for item in items:
        yield item


async def collect(iterator) -> list:
    return [item async for item in iterator]


def test_an_openai_answer_arrives_unchanged_but_for_what_the_gateway_owns():
    completion = whole(Dialect.OPENAI, COMPLETION, completion_events(COMPLETION, prompt_estimate=1))
    answer = to_openai.chat_completion(CHAT_HEADER, completion)
    assert answer == {**COMPLETION, "id": "chatcmpl-portico", "created": 1700000000, "model": "family-a-5.5"}
    assert list(answer) == list(COMPLETION)  # in the upstream's order
    assert COMPLETION["model"] == UPSTREAM_MODEL  # the upstream's object itself is not edited


def test_an_openai_answer_without_usage_gets_the_settled_counts():
    answer = without(COMPLETION, "usage")
    completion = whole(Dialect.OPENAI, answer, completion_events(answer, prompt_estimate=7))
    assert to_openai.chat_completion(CHAT_HEADER, completion)["usage"] == {
        "prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}  # 17 characters


def test_an_anthropic_answer_arrives_unchanged_but_for_what_the_gateway_owns():
    completion = whole(Dialect.ANTHROPIC, MESSAGE, message_events(MESSAGE))
    answer = to_anthropic.message(MESSAGE_HEADER, completion)
    assert answer == {**MESSAGE, "id": "msg_portico", "model": "family-b-opus-4-8"}
    assert answer["content"][0] == THINKING


def test_across_dialects_answers_are_rendered_from_the_events():
    completion = whole(Dialect.ANTHROPIC, MESSAGE, message_events(MESSAGE))
    chat = to_openai.chat_completion(CHAT_HEADER, completion)
    assert chat["choices"][0] == {"index": 0, "logprobs": None, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": "Checking.", "refusal": None, "tool_calls": [
            {"id": "toolu_1", "type": "function",
             "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}}]}}
    assert "system_fingerprint" not in chat and chat["model"] == "family-a-5.5"
    completion = whole(Dialect.OPENAI, COMPLETION, completion_events(COMPLETION, prompt_estimate=1))
    message = to_anthropic.message(MESSAGE_HEADER, completion)
    assert [block["type"] for block in message["content"]] == ["text", "tool_use"]
    assert message["model"] == "family-b-opus-4-8" and UPSTREAM_MODEL not in str(message)


def openai_stream(chunks: list[dict]) -> list:
    """The events OpenAIProvider yields for these chunks."""
    reader = OpenAIChunkReader(prompt_estimate=3)
    events: list = []
    for item in chunks:
        events += [UpstreamObject(Dialect.OPENAI, item, openai_content(item)), *reader.feed(item)]
    return [*events, reader.end()]


def owned_chunk(item: dict) -> dict:
    return {**item, "id": "chatcmpl-portico", "created": 1700000000, "model": "family-a-5.5"}


async def test_an_openai_stream_is_relayed_chunk_by_chunk_with_usage_when_asked():
    chunks = await collect(to_openai.chat_chunks(CHAT_HEADER, aiter(openai_stream(CHUNKS)), include_usage=True))
    assert chunks == [owned_chunk(c) for c in CHUNKS]  # the upstream's role chunk, not a second one of ours
    assert chunks[1]["choices"][0]["logprobs"] == LOGPROBS and chunks[0]["system_fingerprint"] == "fp_0123"


async def test_a_caller_who_did_not_ask_for_usage_gets_none():
    chunks = await collect(to_openai.chat_chunks(CHAT_HEADER, aiter(openai_stream(CHUNKS)), include_usage=False))
    assert chunks == [without(owned_chunk(c), "usage") for c in CHUNKS[:-1]]


async def test_usage_the_upstream_did_not_stream_is_made_from_the_settled_counts():
    chunks = [without(c, "usage") for c in CHUNKS[:-1]]
    out = await collect(to_openai.chat_chunks(CHAT_HEADER, aiter(openai_stream(chunks)), include_usage=True))
    assert out[:-1] == [owned_chunk(c) for c in chunks]
    assert out[-1] == {"id": "chatcmpl-portico", "object": "chat.completion.chunk", "created": 1700000000,
                       "model": "family-a-5.5", "choices": [],
                       "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def event(kind: str, **fields) -> dict:
    return {"type": kind, **fields}


EVENTS = [
    event("message_start", message={**MESSAGE, "content": [], "stop_reason": None,
                                    "usage": {"input_tokens": 20, "output_tokens": 1}}),
    event("content_block_start", index=0, content_block={"type": "thinking", "thinking": "", "signature": ""}),
    event("ping"),
    event("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": "The user wants"}),
    event("content_block_delta", index=0, delta={"type": "signature_delta", "signature": "EqQBCkYIARgCKkA="}),
    event("content_block_stop", index=0),
    event("content_block_start", index=1, content_block={"type": "redacted_thinking", "data": "EmwKAhgBEgy3"}),
    event("content_block_stop", index=1),
    event("content_block_start", index=2, content_block={"type": "text", "text": "", "citations": []}),
    event("content_block_delta", index=2, delta={"type": "citations_delta", "citation": {
        "type": "char_location", "cited_text": "Oslo", "document_index": 0}}),
    event("content_block_delta", index=2, delta={"type": "text_delta", "text": "Checking."}),
    event("content_block_stop", index=2),
    event("content_block_start", index=3, content_block={"type": "tool_use", "id": "toolu_1", "name": "weather",
                                                         "input": {}}),
    event("content_block_delta", index=3, delta={"type": "input_json_delta", "partial_json": "{\"city\":\"Oslo\"}"}),
    event("content_block_stop", index=3),
    event("message_delta", delta={"stop_reason": "tool_use", "stop_sequence": None, "container": None},
          usage={"output_tokens": 12}),
    event("message_stop"),
]


def anthropic_stream(events: list[dict]) -> list:
    """The events AnthropicProvider yields for these upstream events."""
    reader = AnthropicEventReader()
    out: list = []
    for item in events:
        out += [UpstreamObject(Dialect.ANTHROPIC, item, anthropic_content(item)), *reader.feed(item)]
    return out


async def test_an_anthropic_stream_is_relayed_event_by_event():
    out = await collect(to_anthropic.message_events(MESSAGE_HEADER, aiter(anthropic_stream(EVENTS))))
    started = {**EVENTS[0]["message"], "id": "msg_portico", "model": "family-b-opus-4-8"}
    assert out == [{**EVENTS[0], "message": started}, *EVENTS[1:]]
    assert "claude-upstream" not in str(out)


async def test_across_dialects_streams_are_rendered_from_the_events():
    chunks = await collect(to_openai.chat_chunks(CHAT_HEADER, aiter(anthropic_stream(EVENTS)), include_usage=True))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}  # before reasoning
    # The thinking's text is the chat caller's reasoning_content; each block, signed or redacted, comes whole once
    # it ended, as LiteLLM's thinking_blocks.
    assert [c["choices"][0]["delta"] for c in chunks[1:5]] == [
        {"reasoning_content": "The user wants"},
        {"thinking_blocks": [{"index": 0, "type": "thinking", "thinking": "The user wants",
                              "signature": "EqQBCkYIARgCKkA="}]},
        {"thinking_blocks": [{"index": 1, "type": "redacted_thinking", "data": "EmwKAhgBEgy3"}]},
        {"content": "Checking."}]
    assert all(c["model"] == "family-a-5.5" and "system_fingerprint" not in c for c in chunks)
    assert chunks[-1]["usage"] == {"prompt_tokens": 20, "completion_tokens": 12, "total_tokens": 32}
    events = await collect(to_anthropic.message_events(MESSAGE_HEADER, aiter(openai_stream(CHUNKS))))
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "ping", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert events[0]["message"]["id"] == "msg_portico" and "gpt-upstream" not in str(events)


@pytest.mark.parametrize(("item", "content"), [
    (CHUNKS[0], False), (CHUNKS[1], True), (CHUNKS[2], True), (CHUNKS[4], False), (CHUNKS[5], False),
    (chunk({"reasoning_content": "Hmm."}), True), (chunk({"refusal": "No."}), True),
])
def test_which_openai_chunks_carry_content(item, content):
    assert openai_content(item) is content


@pytest.mark.parametrize(("index", "content"), [(0, False), (1, False), (2, False), (3, True), (5, False),
                                                (6, True), (8, False), (12, True), (15, False), (16, False)])
def test_which_anthropic_events_carry_content(index, content):
    assert anthropic_content(EVENTS[index]) is content


async def test_upstream_objects_without_content_are_held_back_until_content():
    delivery = Delivery()
    head = [UpstreamObject(Dialect.ANTHROPIC, EVENTS[0]), Started(20), UpstreamObject(Dialect.ANTHROPIC, EVENTS[1]),
            UpstreamObject(Dialect.ANTHROPIC, EVENTS[2])]

    async def cut_before_content():
        for item in head:
            yield item
        raise UpstreamError("cut", retry_reason="other")

    relayed = []
    with pytest.raises(UpstreamError):
        async for item in delivery.relay(cut_before_content()):
            relayed.append(item)
    assert relayed == [] and not delivery.delivered  # so the attempt may be replaced
    thinking = UpstreamObject(Dialect.ANTHROPIC, EVENTS[3], content=True)
    delivery = Delivery()
    relayed = await collect(delivery.relay(aiter([*head, thinking, TextDelta("x")])))
    assert relayed == [*head, thinking, TextDelta("x")] and delivery.delivered


def test_a_finished_event_ends_each_relayed_stream():
    events = anthropic_stream(EVENTS)
    assert isinstance(events[-1], Finished) and events[-1].reason is FinishReason.TOOL_USE
    assert events[-1].usage == Usage(20, 12)
