"""Server-sent event framing (https://html.spec.whatwg.org/multipage/server-sent-events.html)."""

from __future__ import annotations

import orjson

DONE = b"data: [DONE]\n\n"


def sse_event(payload: dict, event: str | None = None) -> bytes:
    """One event. orjson never emits raw newlines, so a single `data:` line is always enough."""
    data = b"data: " + orjson.dumps(payload) + b"\n\n"
    return data if event is None else b"event: " + event.encode() + b"\n" + data
