"""Image providers turn an ImageRequest into encoded pictures, behind one narrow interface.

Kept apart from the text Provider (server/providers/__init__.py): a picture is one finished result, not a stream
of events, so the two interfaces share nothing but `close()`.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from server.domain_images import GeneratedImage, ImageRequest


@runtime_checkable
class ImageProvider(Protocol):
    async def generate(self, request: ImageRequest) -> list[GeneratedImage]:
        """Return exactly `request.n` images. Raise a PorticoError on failure. Must not block the event loop."""
        ...

    async def close(self) -> None: ...
