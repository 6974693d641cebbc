"""Image providers turn an ImageRequest into encoded pictures, behind one narrow interface.

Kept apart from the text Provider (server/providers/__init__.py): a picture is one finished result, not a stream
of events, so the two interfaces share nothing but `close()`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from server.domain import Dialect
from server.domain_images import ImageAnswer, ImageRequest
from server.errors import InvalidRequest
from server.providers import Capabilities


@runtime_checkable
class ImageProvider(Protocol):
    async def generate(self, request: ImageRequest) -> ImageAnswer:
        """Answer with exactly `request.n` images. Raise a PorticoError on failure. Must not block the event loop."""
        ...

    async def close(self) -> None: ...


def image_unsupported(request: ImageRequest, capabilities: Capabilities) -> InvalidRequest | None:
    """Why a provider with `capabilities` cannot honour `request`, or None: members the gateway does not read reach
    only a provider of the caller's API (an OpenAI images upstream); dev-image would draw without them."""
    if request.unread and Dialect.OPENAI not in capabilities.dialects:
        return InvalidRequest(request.unread[0].message, param=request.unread[0].param)
    return None
