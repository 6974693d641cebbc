"""Prompt-cache reads reported by upstreams reach the internal Usage, so they are priced at `cached_input`."""

from __future__ import annotations

import pytest

from server.domain import Finished, Usage
from server.errors import UpstreamError
from server.translate.anthropic_events_to_internal import message_events
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
