"""The one place that frames response bytes (JSON bodies, server-sent events) and decodes an upstream's SSE."""

from server.render.json import json_body
from server.render.sse import (
    DONE, anthropic_error_frame, anthropic_frames, openai_error_frame, openai_frames, sse_event,
)
from server.render.sse_decoder import SseDecoder, SseEvent

__all__ = [
    "DONE", "anthropic_error_frame", "anthropic_frames", "json_body", "openai_error_frame", "openai_frames",
    "SseDecoder", "SseEvent", "sse_event",
]
