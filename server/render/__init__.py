"""The one place that frames response bytes: JSON bodies and server-sent events."""

from server.render.json import json_body
from server.render.sse import (
    DONE, anthropic_error_frame, anthropic_frames, openai_error_frame, openai_frames, sse_event,
)

__all__ = [
    "DONE", "anthropic_error_frame", "anthropic_frames", "json_body", "openai_error_frame", "openai_frames",
    "sse_event",
]
