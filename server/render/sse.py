"""Server-sent event framing (https://html.spec.whatwg.org/multipage/server-sent-events.html), per dialect.

OpenAI streams are data-only events ended by `data: [DONE]`, and an error after the first byte is a data-only event
with an `error` member (which the openai SDK raises). Anthropic streams name each event after its `type`, and end a
failed stream with `event: error`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping

from server import wire_json
from server.domain import Json

DONE = b"data: [DONE]\n\n"


def sse_event(payload: Mapping[str, Json], event: str | None = None) -> bytes:
    """One event. Compact JSON never holds a raw newline, so a single `data:` line is always enough."""
    data = b"data: " + wire_json.dumps(payload) + b"\n\n"
    return data if event is None else b"event: " + event.encode() + b"\n" + data


async def openai_frames(chunks: AsyncIterator[Mapping[str, Json]]) -> AsyncIterator[bytes]:
    async for chunk in chunks:
        yield sse_event(chunk)
    yield DONE


async def anthropic_frames(events: AsyncIterator[Mapping[str, Json]]) -> AsyncIterator[bytes]:
    async for event in events:
        yield sse_event(event, event["type"])


def openai_error_frame(error: Mapping[str, Json]) -> bytes:
    """`error`: the error object ({"message", "type", "param", "code"})."""
    return sse_event({"error": error})


def anthropic_error_frame(error: Mapping[str, Json]) -> bytes:
    return sse_event({"type": "error", "error": error}, event="error")
