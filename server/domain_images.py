"""The values of image generation: what a provider is asked to draw, and what it gives back. Apart from
server/domain.py (text generation's values), which they share nothing with but `Json`."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from server.domain import Json, Unread


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
    """What an image provider is asked to draw (with its own model)."""

    prompt: str
    n: int
    width: int
    height: int
    output_format: ImageFormat
    transparent: bool  # the background is left transparent (never with JPEG)
    style: str  # "vivid" or "natural"
    quality: str  # as requested ("auto", "low", ...); a provider may ignore it
    compression: int | None  # 0-100 for lossy formats; None: the provider's best quality
    # The caller's request body (parsed JSON, never edited), passed on whole to an OpenAI images upstream.
    source: Mapping[str, Json] | None = None
    # Its members the gateway does not read: only an upstream of the caller's API, which gets the body whole, can
    # honour them; elsewhere they are refused (server/pipeline.py), never silently dropped.
    unread: tuple[Unread, ...] = ()


@dataclass(frozen=True, slots=True)
class GeneratedImage:
    data: bytes  # the encoded file, in the requested format
    output_format: ImageFormat
    revised_prompt: str | None = None  # what the provider actually drew from, when it says
    transparent: bool | None = None  # the background the provider drew, when it says (None: as asked)


@dataclass(frozen=True, slots=True)
class ImageAnswer:
    """A provider's answer: its images, and what an upstream said of them all that the caller's answer repeats."""

    images: tuple[GeneratedImage, ...]
    quality: str | None = None  # the quality an upstream drew at (gpt-image models say low, medium or high)
    # An upstream's own `usage` object (gpt-image models' token counts), passed on as sent: images are priced per
    # image here, so it is never read.
    usage: Mapping[str, Json] | None = None
