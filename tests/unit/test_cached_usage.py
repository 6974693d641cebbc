"""Prompt-cache reads reported by upstreams reach the internal Usage, so they are priced at `cached_input`."""

from __future__ import annotations

import pytest

from server.domain_answers import Finished, Started, Usage
from server.errors import UpstreamError
from server.translate.anthropic_events_to_internal import AnthropicEventReader, message_events
from server.translate.openai_chunks_to_internal import completion_events


def finished(events) -> Finished:
    return next(e for e in events if isinstance(e, Finished))


def test_openai_cached_tokens_are_part_of_the_prompt():
    completion = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                               "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": 1200, "completion_tokens": 5,
                            "prompt_tokens_details": {"cached_tokens": 1024}}}
    assert finished(completion_events(completion, prompt_estimate=1)).usage == Usage(1200, 5, 1024)


def test_anthropic_cache_reads_are_cached_input_and_every_prompt_token_counts():
    message = {"type": "message", "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
               "usage": {"input_tokens": 10, "cache_creation_input_tokens": 100, "cache_read_input_tokens": 2000,
                         "output_tokens": 7}}
    assert finished(message_events(message)).usage == Usage(2110, 7, 2000, cache_write_tokens=100)


def one_hour_events(usage: dict, delta_usage: dict) -> list[dict]:
    return [{"type": "message_start", "message": {"id": "msg_1", "type": "message", "role": "assistant",
                                                  "content": [], "usage": usage}},
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "hi"}},
            {"type": "content_block_stop", "index": 0},
            {"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": delta_usage},
            {"type": "message_stop"}]


def test_anthropic_one_hour_cache_writes_are_told_apart():
    """Anthropic's `cache_creation` splits the written tokens by TTL, which it bills at 1.25x (5 minutes) and 2x
    (an hour) the input price: the hour's part reaches Usage, from a JSON answer and from a stream."""
    usage = {"input_tokens": 10, "cache_creation_input_tokens": 100, "cache_read_input_tokens": 2000,
             "cache_creation": {"ephemeral_5m_input_tokens": 30, "ephemeral_1h_input_tokens": 70}, "output_tokens": 7}
    message = {"type": "message", "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
               "usage": usage}
    want = Usage(2110, 7, 2000, cache_write_tokens=100, cache_write_1h_tokens=70)
    assert finished(message_events(message)).usage == want
    reader = AnthropicEventReader()
    events = [out for event in one_hour_events({**usage, "output_tokens": 1}, {"output_tokens": 7})
              for out in reader.feed(event)]
    assert events[0] == Started(2110, 2000, 100, 70)  # a stream cut short is settled with these
    assert finished(events).usage == want
    # Newer APIs repeat the counts in message_delta; some compatible servers send them only there.
    reader = AnthropicEventReader()
    events = [out for event in one_hour_events({"input_tokens": 0, "output_tokens": 0}, usage)
              for out in reader.feed(event)]
    assert finished(events).usage == want
    # Without the breakdown (older API versions, compatible servers), every write is at cache_write's price.
    assert finished(message_events({**message, "usage": {**usage, "cache_creation": None}})).usage == \
        Usage(2110, 7, 2000, cache_write_tokens=100)
    # An hour's part above the writes it is part of is capped at them.
    bigger = {**usage, "cache_creation": {"ephemeral_1h_input_tokens": 500}}
    assert finished(message_events({**message, "usage": bigger})).usage.cache_write_1h_tokens == 100


@pytest.mark.parametrize("count", [-1000, "abc", 1e30, 1.5, True])
def test_an_anthropic_one_hour_count_that_is_no_token_count_is_an_upstream_error(count):
    message = {"type": "message", "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
               "usage": {"input_tokens": 10, "output_tokens": 7, "cache_creation_input_tokens": 5,
                         "cache_creation": {"ephemeral_1h_input_tokens": count}}}
    with pytest.raises(UpstreamError, match="usage"):
        message_events(message)


def test_anthropic_web_searches_reach_usage():
    """`usage.server_tool_use.web_search_requests`, billed per search: from a JSON answer, and from a stream's
    message_delta (the final count), so a request's searches are priced at `price.web_search`."""
    usage = {"input_tokens": 10, "output_tokens": 7, "server_tool_use": {"web_search_requests": 2}}
    message = {"type": "message", "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
               "usage": usage}
    assert finished(message_events(message)).usage == Usage(10, 7, web_searches=2)
    reader = AnthropicEventReader()
    events = [out for event in one_hour_events({"input_tokens": 10, "output_tokens": 1}, usage)
              for out in reader.feed(event)]
    assert finished(events).usage == Usage(10, 7, web_searches=2)
    for count in (-1, "abc", 1.5, 10**7):
        with pytest.raises(UpstreamError, match="usage"):
            message_events({**message, "usage": {**usage, "server_tool_use": {"web_search_requests": count}}})


BAD_COUNTS = [-1000, "abc", 1e30, 2**31, 1.5, True, [], {}]


@pytest.mark.parametrize("count", BAD_COUNTS)
def test_an_openai_usage_that_is_no_token_count_is_an_upstream_error(count):
    """A negative count was settled as is (the key's minute window went below zero: quota handed back), and a
    Prometheus counter then raised (a bare UNKNOWN to the caller); "abc" was a 500; 1e30 filled the window and broke
    the daily file. Such usage is not the API: a 502, not retried, settled from what was sent."""
    completion = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                               "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": 12, "completion_tokens": 5}}
    for place in ("prompt_tokens", "completion_tokens"):
        with pytest.raises(UpstreamError, match="usage") as caught:
            completion_events({**completion, "usage": {**completion["usage"], place: count}}, prompt_estimate=1)
        assert not caught.value.retryable
    with pytest.raises(UpstreamError, match="usage"):
        completion_events({**completion, "usage": {**completion["usage"],
                                                   "prompt_tokens_details": {"cached_tokens": count}}},
                          prompt_estimate=1)


@pytest.mark.parametrize("count", BAD_COUNTS)
def test_an_anthropic_usage_that_is_no_token_count_is_an_upstream_error(count):
    message = {"type": "message", "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn",
               "usage": {"input_tokens": 10, "output_tokens": 7}}
    for place in ("input_tokens", "output_tokens", "cache_read_input_tokens", "cache_creation_input_tokens"):
        with pytest.raises(UpstreamError, match="usage"):
            message_events({**message, "usage": {**message["usage"], place: count}})


def test_a_usage_that_says_more_was_cached_than_prompted_is_capped_at_the_prompt():
    completion = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"},
                               "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": 5, "completion_tokens": 3, "prompt_tokens_details": {"cached_tokens": 50}}}
    assert finished(completion_events(completion, prompt_estimate=1)).usage == Usage(5, 3, 5)
    completion["usage"] = {"prompt_tokens": 5, "completion_tokens": 3, "prompt_tokens_details": None}
    assert finished(completion_events(completion, prompt_estimate=1)).usage == Usage(5, 3, 0)
