"""Internal completions and events -> Anthropic Messages JSON objects (dicts ready for server/wire_json.py).

An answer from an Anthropic upstream is the upstream's own message or events (server/domain.py UpstreamObject),
passed on with only what the gateway owns put in: Portico's `id` and the model id the caller asked for (the
upstream's model name never reaches the caller). Thinking and redacted-thinking blocks with their signatures,
citations, `container`, server tools' blocks, pings and fields added later arrive as the upstream sent them. Other
answers are rendered from the internal events.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from server import wire_json
from server.domain import (
    Completion, Dialect, FinishReason, Finished, GenerationEvent, Json, ResponseHeader, Started, TextDelta,
    ToolCall, ToolCallDelta, ToolCallStart, UpstreamObject, Usage,
)

STOP_REASONS = {
    FinishReason.END_TURN: "end_turn",
    FinishReason.STOP_SEQUENCE: "stop_sequence",
    FinishReason.MAX_TOKENS: "max_tokens",
    FinishReason.TOOL_USE: "tool_use",
    FinishReason.REFUSAL: "refusal",
}


def usage_object(usage: Usage) -> dict:
    return {"input_tokens": usage.input_tokens, "output_tokens": usage.output_tokens}


def tool_input(call: ToolCall) -> dict:
    """A call's arguments as the `input` object. Models behind OpenAI-compatible servers sometimes write invalid
    JSON; it is kept (under "arguments") rather than dropped, so the caller can see what the model wrote."""
    try:
        value = wire_json.loads(call.arguments or "{}")
    except wire_json.JSONDecodeError:
        return {"arguments": call.arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def message(header: ResponseHeader, completion: Completion) -> dict:
    upstream = completion.upstream
    if upstream is not None and upstream.dialect is Dialect.ANTHROPIC:
        return {**upstream.payload, "id": header.id, "model": header.model}
    finish = completion.finish
    content: list[dict] = []
    if completion.text or not completion.tool_calls:  # Anthropic never answers with an empty text block beside calls
        content.append({"type": "text", "text": completion.text})
    content += [{"type": "tool_use", "id": c.id, "name": c.name, "input": tool_input(c)} for c in completion.tool_calls]
    return {
        "id": header.id,
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": header.model,
        "stop_reason": STOP_REASONS[finish.reason],
        "stop_sequence": finish.stop_sequence,
        "usage": usage_object(finish.usage),
    }


async def message_events(header: ResponseHeader, events: AsyncIterator[GenerationEvent]) -> AsyncIterator[dict]:
    """The event objects of a streamed message, in the order the Anthropic SDK expects; each has its `type`,
    which is also the SSE event name."""
    first = await anext(events)
    if isinstance(first, UpstreamObject) and first.dialect is Dialect.ANTHROPIC:
        async for event in _relayed_events(header, first, events):
            yield event
        return
    while isinstance(first, UpstreamObject):  # another dialect's: rendered from the internal events instead
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
    blocks = _Blocks()
    if not isinstance(first, Started):
        for out in blocks.feed(first):
            yield out
    async for event in events:
        for out in blocks.feed(event):
            yield out


async def _relayed_events(
    header: ResponseHeader, first: UpstreamObject, events: AsyncIterator[GenerationEvent]
) -> AsyncIterator[dict]:
    """Every event the upstream sent, in its order; message_start with the header's id and model."""
    yield _owned_event(header, first.payload)
    async for event in events:
        if isinstance(event, UpstreamObject):
            yield _owned_event(header, event.payload)


def _owned_event(header: ResponseHeader, event: Mapping[str, Json]) -> dict:
    if event.get("type") == "message_start" and isinstance(started := event.get("message"), Mapping):
        return {**event, "message": {**started, "id": header.id, "model": header.model}}
    return dict(event)


class _Blocks:
    """Content blocks are opened as their first event arrives (text, or one block per tool call) and closed when
    the next one opens, since the SDK expects one open block at a time."""

    def __init__(self) -> None:
        self._next = 0  # index of the next block
        self._open: int | None = None  # index of the open block
        self._text_open = False
        self._tool_blocks: dict[int, int] = {}  # tool call index -> block index

    def feed(self, event: GenerationEvent) -> list[dict]:
        if isinstance(event, TextDelta):
            out = [] if self._text_open else self._start({"type": "text", "text": ""}, text=True)
            delta = {"type": "text_delta", "text": event.text}
            return [*out, {"type": "content_block_delta", "index": self._open, "delta": delta}]
        if isinstance(event, ToolCallStart):
            out = self._start({"type": "tool_use", "id": event.id, "name": event.name, "input": {}}, text=False)
            self._tool_blocks[event.index] = self._open
            return out
        if isinstance(event, ToolCallDelta) and event.index in self._tool_blocks:
            delta = {"type": "input_json_delta", "partial_json": event.arguments}
            return [{"type": "content_block_delta", "index": self._tool_blocks[event.index], "delta": delta}]
        if isinstance(event, Finished):
            out = self._start({"type": "text", "text": ""}, text=True) if self._next == 0 else []
            return [
                *out,
                *self._stop(),
                {
                    "type": "message_delta",
                    "delta": {"stop_reason": STOP_REASONS[event.reason], "stop_sequence": event.stop_sequence},
                    # Cumulative totals: the SDK overwrites message_start's counts with these.
                    "usage": usage_object(event.usage),
                },
                {"type": "message_stop"},
            ]
        return []

    def _start(self, block: dict, *, text: bool) -> list[dict]:
        out = self._stop()
        self._open, self._text_open = self._next, text
        out.append({"type": "content_block_start", "index": self._next, "content_block": block})
        if self._next == 0:
            out.append({"type": "ping"})  # where Anthropic sends it: after the first block starts
        self._next += 1
        return out

    def _stop(self) -> list[dict]:
        if self._open is None:
            return []
        index, self._open, self._text_open = self._open, None, False
        return [{"type": "content_block_stop", "index": index}]
