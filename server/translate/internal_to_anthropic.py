"""Internal completions and events -> Anthropic Messages JSON objects (dicts ready for orjson)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from server.domain import Completion, FinishReason, Finished, GenerationEvent, ResponseHeader, Started, TextDelta, Usage

_STOP_REASONS = {
    FinishReason.END_TURN: "end_turn",
    FinishReason.STOP_SEQUENCE: "stop_sequence",
    FinishReason.MAX_TOKENS: "max_tokens",
}


def usage_object(usage: Usage) -> dict:
    return {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}


def message(header: ResponseHeader, completion: Completion) -> dict:
    finish = completion.finish
    return {
        "id": header.id,
        "type": "message",
        "role": "assistant",
        "content": [{"type": "text", "text": completion.text}],
        "model": header.model,
        "stop_reason": _STOP_REASONS[finish.reason],
        "stop_sequence": finish.stop_sequence,
        "usage": usage_object(finish.usage),
    }


async def message_events(header: ResponseHeader, events: AsyncIterator[GenerationEvent]) -> AsyncIterator[dict]:
    """The event objects of a streamed message, in the order the Anthropic SDK expects; each has its `type`,
    which is also the SSE event name."""
    first = await anext(events)
    input_tokens = first.input_tokens if isinstance(first, Started) else 0
    yield {
        "type": "message_start",
        "message": {
            "id": header.id, "type": "message", "role": "assistant", "content": [], "model": header.model,
            "stop_reason": None, "stop_sequence": None,
            "usage": {"input_tokens": input_tokens, "output_tokens": 0},
        },
    }
    yield {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    yield {"type": "ping"}
    pending = () if isinstance(first, Started) else (first,)
    async for event in _chain(pending, events):
        if isinstance(event, TextDelta):
            yield {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": event.text}}
        elif isinstance(event, Finished):
            yield {"type": "content_block_stop", "index": 0}
            yield {
                "type": "message_delta",
                "delta": {"stop_reason": _STOP_REASONS[event.reason], "stop_sequence": event.stop_sequence},
                # Cumulative totals: the SDK overwrites message_start's counts with these.
                "usage": usage_object(event.usage),
            }
            yield {"type": "message_stop"}


async def _chain(pending: tuple[GenerationEvent, ...], rest: AsyncIterator[GenerationEvent]):
    for event in pending:
        yield event
    async for event in rest:
        yield event
