"""Internal completions and events -> OpenAI chat-completions JSON objects (dicts ready for orjson)."""

from __future__ import annotations

from collections.abc import AsyncIterator

from server.domain import (
    Completion, FinishReason, Finished, GenerationEvent, ResponseHeader, TextDelta, ToolCallDelta, ToolCallStart,
    Usage,
)

FINISH_REASONS = {
    FinishReason.END_TURN: "stop",
    FinishReason.STOP_SEQUENCE: "stop",
    FinishReason.MAX_TOKENS: "length",
    FinishReason.TOOL_USE: "tool_calls",
    FinishReason.REFUSAL: "content_filter",
}


def usage_object(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.input_tokens,
        "completion_tokens": usage.output_tokens,
        "total_tokens": usage.total_tokens,
    }


def chat_completion(header: ResponseHeader, completion: Completion) -> dict:
    message = {"role": "assistant", "content": completion.text, "refusal": None}
    if completion.tool_calls:
        message["content"] = completion.text or None  # as OpenAI answers a call without text
        message["tool_calls"] = [
            {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}
            for call in completion.tool_calls
        ]
    return {
        "id": header.id,
        "object": "chat.completion",
        "created": header.created,
        "model": header.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": FINISH_REASONS[completion.finish.reason],
            }
        ],
        "usage": usage_object(completion.finish.usage),
    }


async def chat_chunks(
    header: ResponseHeader, events: AsyncIterator[GenerationEvent], *, include_usage: bool
) -> AsyncIterator[dict]:
    """The chat.completion.chunk objects of a stream: role, content and tool-call deltas, finish, then usage if
    asked for."""
    base = {"id": header.id, "object": "chat.completion.chunk", "created": header.created, "model": header.model}
    if include_usage:
        base["usage"] = None  # as OpenAI does: every chunk but the last carries usage: null

    def chunk(delta: dict, finish_reason: str | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return {**base, "choices": [choice]}

    yield chunk({"role": "assistant", "content": ""})
    async for event in events:
        if isinstance(event, TextDelta):
            yield chunk({"content": event.text})
        elif isinstance(event, ToolCallStart):
            call = {"index": event.index, "id": event.id, "type": "function",
                    "function": {"name": event.name, "arguments": ""}}
            yield chunk({"tool_calls": [call]})
        elif isinstance(event, ToolCallDelta):
            yield chunk({"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]})
        elif isinstance(event, Finished):
            yield chunk({}, FINISH_REASONS[event.reason])
            if include_usage:
                yield {**base, "choices": [], "usage": usage_object(event.usage)}
