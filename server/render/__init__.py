"""The one place that frames response bytes: JSON bodies and server-sent events."""

from server.render.sse import DONE, sse_event

__all__ = ["DONE", "sse_event"]
