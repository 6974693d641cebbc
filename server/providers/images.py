"""Image providers turn an ImageRequest into encoded pictures, behind one narrow interface.

Kept apart from the text Provider (server/providers/__init__.py): a picture is one finished result, not a stream
of events, so the two interfaces share nothing but `close()`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol, runtime_checkable


class ImageFormat(str, enum.Enum):
    PNG = "png"
    JPEG = "jpeg"
    WEBP = "webp"

    @property
    def content_type(self) -> str:
        return f"image/{self.value}"

    @property
    def supports_alpha(self) -> bool:
        return self is not ImageFormat.JPEG


@dataclass(frozen=True, slots=True)
class ImageRequest:
    """What an image provider is asked to draw. `model` is the provider's own model name."""

    model: str
    prompt: str
    n: int
    width: int
    height: int
    output_format: ImageFormat
    transparent: bool  # the background is left transparent (never with JPEG)
    style: str  # "vivid" or "natural"
    quality: str  # as requested ("auto", "low", ...); a provider may ignore it
    compression: int | None  # 0-100 for lossy formats; None: the provider's best quality
    source: object | None = None  # the caller's CreateImageRequest, passed on whole to an OpenAI images upstream


@dataclass(frozen=True, slots=True)
class GeneratedImage:
    data: bytes  # the encoded file, in the requested format
    output_format: ImageFormat
    revised_prompt: str | None = None  # what the provider actually drew from, when it says


@runtime_checkable
class ImageProvider(Protocol):
    async def generate(self, request: ImageRequest) -> list[GeneratedImage]:
        """Return exactly `request.n` images. Raise a PorticoError on failure. Must not block the event loop."""
        ...

    async def close(self) -> None: ...
