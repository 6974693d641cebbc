"""Failures after the first streamed byte: HTTP callers already have a 200, so the error becomes an SSE event."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import aclosing

from server.errors import InternalError, PorticoError, error_object
from server.render import sse_event

_logger = logging.getLogger(__name__)


async def guard_stream(frames: AsyncIterator[bytes], *, anthropic: bool) -> AsyncIterator[bytes]:
    """Pass frames through; on failure end with the dialect's error event (OpenAI: a data-only event with an
    `error` member, which the openai SDK raises; Anthropic: `event: error`)."""
    try:
        async with aclosing(frames):
            async for frame in frames:
                yield frame
    except Exception as exc:  # noqa: BLE001 - the stream must end with an error event, whatever failed
        if not isinstance(exc, PorticoError):
            _logger.exception("stream failed")
            exc = InternalError("The server had an error while streaming the response.")
        if anthropic:
            yield sse_event({"type": "error", "error": error_object(exc)}, event="error")
        else:
            yield sse_event({"error": error_object(exc)})
