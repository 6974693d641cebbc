"""OpenAI images/generations, both directions: the request -> an ImagePlan (validating every value it reads), and
generated images -> the response body the openai SDK's `images.generate` parses."""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass

from portico.v1 import image_pb2
from server.errors import InvalidRequest, RequestTooLarge
from server.domain import GeneratedImage, ImageFormat, ImageRequest

# Prompts of a few MiB must pass (Envoy admits 8 MiB bodies); the cap only turns absurd ones into a clear 413.
MAX_PROMPT_CHARS = 4 * 1024 * 1024
MAX_IMAGES = 10
SIZES = {
    "256x256": (256, 256),
    "512x512": (512, 512),
    "1024x1024": (1024, 1024),
    "1024x1536": (1024, 1536),  # WIDTHxHEIGHT: portrait
    "1536x1024": (1536, 1024),
    "auto": (1024, 1024),
}
RESPONSE_FORMATS = ("b64_json", "url")
QUALITIES = ("auto", "low", "medium", "high", "standard", "hd")
STYLES = ("vivid", "natural")
BACKGROUNDS = ("auto", "transparent", "opaque")
MODERATIONS = ("auto", "low")


@dataclass(frozen=True, slots=True)
class ImagePlan:
    generation: ImageRequest
    response_format: str  # "b64_json" or "url"


def image_request(request: image_pb2.CreateImageRequest, *, upstream_model: str) -> ImagePlan:
    prompt = request.prompt
    if not prompt.strip():
        raise InvalidRequest("`prompt` is required and must not be empty.", param="prompt")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise RequestTooLarge(f"`prompt` is longer than {MAX_PROMPT_CHARS} characters.", param="prompt")
    n = request.n if request.HasField("n") else 1
    if not 1 <= n <= MAX_IMAGES:
        raise InvalidRequest(f"`n` must be between 1 and {MAX_IMAGES}, got {n}.", param="n")
    width, height = SIZES[_choice(request.size, "size", tuple(SIZES), default="auto")]
    response_format = _choice(request.response_format, "response_format", RESPONSE_FORMATS, default="b64_json")
    output_format = ImageFormat(
        _choice(request.output_format, "output_format", tuple(f.value for f in ImageFormat), default="png")
    )
    quality = _choice(request.quality, "quality", QUALITIES, default="auto")
    style = _choice(request.style, "style", STYLES, default="vivid")
    background = _choice(request.background, "background", BACKGROUNDS, default="auto")
    if background == "transparent" and not output_format.supports_alpha:
        raise InvalidRequest(
            f"A transparent background needs output_format png or webp, not {output_format.value}.",
            param="background",
        )
    _choice(request.moderation, "moderation", MODERATIONS, default="auto")  # checked; there is nothing to moderate
    compression = request.output_compression if request.HasField("output_compression") else None
    if compression is not None and not 0 <= compression <= 100:
        raise InvalidRequest(f"`output_compression` must be between 0 and 100, got {compression}.",
                             param="output_compression")
    # Unknown JSON fields are dropped by the transcoder, so these two are declared only to refuse them: answering
    # a streaming request with one JSON body would break the caller's SSE parser.
    if request.HasField("stream") and request.stream:
        raise InvalidRequest("Streaming image generation is not supported: leave `stream` unset or false.",
                             param="stream")
    if request.HasField("partial_images") and request.partial_images != 0:
        raise InvalidRequest("`partial_images` needs streaming, which image generation here does not support.",
                             param="partial_images")
    return ImagePlan(
        generation=ImageRequest(
            model=upstream_model,
            prompt=prompt,
            n=n,
            width=width,
            height=height,
            output_format=output_format,
            transparent=background == "transparent",
            style=style,
            quality=quality,
            compression=compression,
            source=request,
        ),
        response_format=response_format,
    )


def images_response(
    created: int, plan: ImagePlan, images: Sequence[GeneratedImage], urls: Sequence[str] | None = None
) -> dict:
    """The JSON body: `url` items when links are given, else `b64_json`; optional members only when known."""
    data = []
    for i, image in enumerate(images):
        item = {"url": urls[i]} if urls is not None else {"b64_json": base64.b64encode(image.data).decode()}
        if image.revised_prompt:
            item["revised_prompt"] = image.revised_prompt
        data.append(item)
    generation = plan.generation
    return {
        "created": created,
        "data": data,
        "background": "transparent" if generation.transparent else "opaque",
        "output_format": generation.output_format.value,
        "size": f"{generation.width}x{generation.height}",
    }


def _choice(value: str, param: str, allowed: tuple[str, ...], *, default: str) -> str:
    """One of `allowed`; an empty string is an unset field (proto3 strings cannot tell the two apart)."""
    if not value:
        return default
    if value not in allowed:
        shown = value if len(value) <= 40 else value[:40] + "..."
        raise InvalidRequest(f"`{param}` must be one of {', '.join(allowed)}; got {shown!r}.", param=param)
    return value
