"""Prompt-cache reads reported by upstreams reach the internal Usage, so they are priced at `cached_input`."""

from __future__ import annotations

from server.domain import Finished, Usage
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
