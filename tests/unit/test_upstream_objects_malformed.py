"""Upstream answers that are JSON but not the API (a number where text belongs, a list where usage belongs) are the
upstream's fault: 502 `upstream_error`, never a 500 `internal_error` with a traceback (api.md: "answered with something
that is not its API")."""

from __future__ import annotations

import pytest

from server.domain_answers import TextDelta, ToolCallDelta
from server.errors import UpstreamError
from server.translate.anthropic_events_to_internal import AnthropicEventReader, message_events
from server.translate.anthropic_events_to_internal import carries_content as anthropic_carries_content
from server.translate.openai_chunks_to_internal import OpenAIChunkReader, completion_events
from server.translate.openai_chunks_to_internal import carries_content as openai_carries_content

BAD_CHUNKS = [
    {"choices": [{"index": 0, "delta": {"content": 7}}]},
    {"choices": [{"index": 0, "delta": {"content": ["x"]}}]},
    {"choices": [{"index": 0, "delta": "hello"}]},
    {"choices": ["x"]},
    {"choices": 5},
    {"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": 5}}]}}]},
    {"choices": [{"index": 0, "delta": {"tool_calls": ["x"]}}]},
    {"choices": [{"index": 0, "delta": {}, "finish_reason": ["stop"]}]},
    {"choices": [], "usage": {"prompt_tokens": "many", "completion_tokens": 1}},
    {"choices": [], "usage": {"prompt_tokens": {"n": 1}}},
    {"choices": [], "usage": {"prompt_tokens": -1, "completion_tokens": 1}},  # a negative count broke the metrics
    {"choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": -3}},
    {"choices": [], "usage": {"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": -1}}},
]

BAD_EVENTS = [
    {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": 7}},
    {"type": "content_block_delta", "index": "first", "delta": {"type": "text_delta", "text": "hi"}},
    {"type": "content_block_delta", "index": 0, "delta": "hi"},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ["hi"]}},
    {"type": "message_start", "message": {"usage": {"input_tokens": "many"}}},
    {"type": "message_delta", "delta": {"stop_reason": ["end_turn"]}, "usage": {}},
    {"type": "message_delta", "delta": {}, "usage": {"output_tokens": [1]}},
    {"type": "message_delta", "delta": {}, "usage": {"output_tokens": -1}},
    {"type": "message_start", "message": {"usage": {"input_tokens": -5}}},
    {"type": "message_start", "message": {"usage": {"input_tokens": 5, "cache_read_input_tokens": -1}}},
    # The type names a same-dialect caller's `event:` line: a line break would forge SSE lines of the upstream's own.
    {"type": 'ping\ndata: {"type": "message_stop"}\n\nevent: ping'},
    {"type": "ping\r"},
]


@pytest.mark.parametrize("chunk", BAD_CHUNKS)
def test_a_chunk_that_is_not_a_chat_completion_chunk_is_an_upstream_error(chunk):
    reader = OpenAIChunkReader(prompt_estimate=3)
    with pytest.raises(UpstreamError):
        openai_carries_content(chunk)
        events = reader.feed(chunk)
        _assert_well_typed(events)  # reached only if feed took it: then what it made must be well typed


@pytest.mark.parametrize("event", BAD_EVENTS)
def test_an_event_that_is_not_a_messages_event_is_an_upstream_error(event):
    reader = AnthropicEventReader()
    reader.feed({"type": "message_start", "message": {"usage": {"input_tokens": 1}}})
    with pytest.raises(UpstreamError):
        anthropic_carries_content(event)
        _assert_well_typed(reader.feed(event))


def test_whole_answers_with_wrong_types_are_upstream_errors():
    with pytest.raises(UpstreamError):
        completion_events({"choices": [{"index": 0, "message": {"content": "hi"}, "finish_reason": "stop"}],
                           "usage": {"prompt_tokens": "x"}}, prompt_estimate=1)
    with pytest.raises(UpstreamError):
        message_events({"type": "message", "content": [{"type": "text", "text": 5}], "stop_reason": "end_turn"})


def test_well_formed_chunks_still_read():
    reader = OpenAIChunkReader(prompt_estimate=3)
    events = reader.feed({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}],
                          "usage": {"prompt_tokens": 2, "completion_tokens": 1}})
    assert events == [TextDelta("hi")] and reader.end().usage.input_tokens == 2


def _assert_well_typed(events) -> None:
    for event in events:
        if isinstance(event, TextDelta) and not isinstance(event.text, str):
            raise AssertionError(f"passed on as text: {event.text!r}")
        if isinstance(event, ToolCallDelta) and not isinstance(event.arguments, str):
            raise AssertionError(f"passed on as arguments: {event.arguments!r}")
