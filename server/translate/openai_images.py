"""OpenAI images/generations, both directions: the request -> an ImagePlan (validating every value it reads), and
generated images -> the response body the openai SDK's `images.generate` parses; and what an upstream's answer
says of itself, for its attempt's span."""

from __future__ import annotations

import base64
import io
import re
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from PIL import ImageFile, JpegImagePlugin, PngImagePlugin, WebPImagePlugin

from server.domain import Json
from server.domain_answers import UpstreamAnswer
from server.domain_images import GeneratedImage, ImageAnswer, ImageFormat, ImageRequest
from server.errors import InvalidRequest, RequestTooLarge
from server.translate.field_rules import unknown_field
from server.translate.usage_counts import said_count
from server.translate.values import opt_bool, opt_int, opt_string, shown, upstream_label

# Prompts of a few MiB must pass (Envoy admits 8 MiB bodies); the cap only turns absurd ones into a clear 413.
MAX_PROMPT_CHARS = 4 * 1024 * 1024
MAX_IMAGES = 10
# `size`: the openai SDK's rule for gpt-image-2, which takes any WIDTHxHEIGHT within it (the older models' fixed
# sizes, dall-e-3's 1792x1024 included, keep it); dev-image draws them all. An upstream may refuse more (its model's
# own limits): it judges those itself.
AUTO_SIZE = (1024, 1024)
_SIZE = re.compile(r"([1-9][0-9]{0,4})x([1-9][0-9]{0,4})")
SIZE_STEP = 16  # both edges are multiples of it
MAX_EDGE = 3840
MAX_PIXELS = 3840 * 2160
MAX_ASPECT = 3  # the long edge at most three times the short one
RESPONSE_FORMATS = ("b64_json", "url")
QUALITIES = ("auto", "low", "medium", "high", "xhigh", "max", "standard", "hd")
STYLES = ("vivid", "natural")
BACKGROUNDS = ("auto", "transparent", "opaque")
MODERATIONS = ("auto", "low")
# Every member this module reads (and so type-checks); the rest go to an OpenAI images upstream only.
READ_FIELDS = frozenset({"model", "prompt", "n", "size", "response_format", "output_format", "quality", "style",
                         "background", "moderation", "user", "safety_identifier", "output_compression", "stream",
                         "partial_images"})

# Each format's own reader: the header alone, without Image.open's decompression-bomb refusal (see _pixel_size).
_HEADER_READERS: dict[ImageFormat, type[ImageFile.ImageFile]] = {
    ImageFormat.PNG: PngImagePlugin.PngImageFile,
    ImageFormat.JPEG: JpegImagePlugin.JpegImageFile,
    ImageFormat.WEBP: WebPImagePlugin.WebPImageFile,
}


@dataclass(frozen=True, slots=True)
class ImagePlan:
    generation: ImageRequest
    response_format: str  # "b64_json" or "url"


def image_request(body: Mapping[str, Json]) -> ImagePlan:
    """The request body (parsed JSON, read without editing: an OpenAI images upstream receives it whole)."""
    prompt = opt_string(body, "prompt") or ""
    if not prompt.strip():
        raise InvalidRequest("`prompt` is required and must not be empty.", param="prompt")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise RequestTooLarge(f"`prompt` is longer than {MAX_PROMPT_CHARS} characters.", param="prompt")
    n = opt_int(body, "n", 1, MAX_IMAGES)
    width, height = _size(body)
    response_format = _choice(body, "response_format", RESPONSE_FORMATS, default="b64_json")
    output_format = ImageFormat(
        _choice(body, "output_format", tuple(f.value for f in ImageFormat), default="png")
    )
    quality = _choice(body, "quality", QUALITIES, default="auto")
    style = _choice(body, "style", STYLES, default="vivid")
    background = _choice(body, "background", BACKGROUNDS, default="auto")
    if background == "transparent" and not output_format.supports_alpha:
        raise InvalidRequest(
            f"A transparent background needs output_format png or webp, not {output_format.value}.",
            param="background",
        )
    _choice(body, "moderation", MODERATIONS, default="auto")  # checked; there is nothing to moderate
    opt_string(body, "user")
    opt_string(body, "safety_identifier")
    compression = opt_int(body, "output_compression", 0, 100)
    # Answering a streaming request with one JSON body would break the caller's SSE parser.
    if opt_bool(body, "stream"):
        raise InvalidRequest("Streaming image generation is not supported: leave `stream` unset or false.",
                             param="stream")
    if opt_int(body, "partial_images", 0):
        raise InvalidRequest("`partial_images` needs streaming, which image generation here does not support.",
                             param="partial_images")
    return ImagePlan(
        generation=ImageRequest(
            prompt=prompt,
            n=n or 1,
            width=width,
            height=height,
            output_format=output_format,
            transparent=background == "transparent",
            style=style,
            quality=quality,
            compression=compression,
            source=body,
            unread=tuple(unknown_field(name) for name in body if name not in READ_FIELDS),
        ),
        response_format=response_format,
    )


def images_response(created: int, plan: ImagePlan, answer: ImageAnswer, urls: Sequence[str] | None = None) -> dict:
    """The JSON body: `url` items when links are given, else `b64_json`; optional members only when known."""
    images = answer.images
    data = []
    for i, image in enumerate(images):
        item = {"url": urls[i]} if urls is not None else {"b64_json": base64.b64encode(image.data).decode()}
        if image.revised_prompt:
            item["revised_prompt"] = image.revised_prompt
        data.append(item)
    generation = plan.generation
    # What the images are, not what was asked: an upstream model may ignore output_format and size.
    output_format, (width, height) = generation.output_format, (generation.width, generation.height)
    transparent = generation.transparent
    if images:
        output_format, (width, height) = images[0].output_format, _pixel_size(images[0], (width, height))
        transparent = transparent if images[0].transparent is None else images[0].transparent
    body = {
        "created": created,
        "data": data,
        "background": "transparent" if transparent else "opaque",
        "output_format": output_format.value,
        "size": f"{width}x{height}",
    }
    # What an upstream said of its images, as OpenAI's answer has it: never made up for a provider that does not say.
    if answer.quality is not None:
        body["quality"] = answer.quality
    if answer.usage is not None:
        body["usage"] = answer.usage
    return body


def image_answer(answer: Mapping[str, Json]) -> UpstreamAnswer:
    """What an images answer says of itself: its id and model where it names them (OpenAI's names neither), and the
    usage gpt-image models report. Read for the span only (images are priced per image), so a count that is not one
    is left out rather than failing the answer."""
    usage = answer.get("usage")
    usage = usage if isinstance(usage, Mapping) else {}
    return UpstreamAnswer(upstream_label(answer.get("id"), 256), upstream_label(answer.get("model"), 256),
                          input_tokens=said_count(usage, "input_tokens"),
                          output_tokens=said_count(usage, "output_tokens"))


def _pixel_size(image: GeneratedImage, otherwise: tuple[int, int]) -> tuple[int, int]:
    """An image's width and height, read from its header (the pixels are not decoded). By its format's own reader:
    Image.open also guards against decompression bombs, refusing a header of more than ~179 million pixels with an
    error of its own, which made the answer for such an image (drawn and billed by an upstream) a 500."""
    try:
        with _HEADER_READERS[image.output_format](io.BytesIO(image.data)) as opened:
            return opened.size
    # What Image.open turns into "cannot identify image file": the provider already vouched for the format.
    except (OSError, ValueError, SyntaxError, IndexError, TypeError, EOFError, struct.error):
        return otherwise


def _size(body: Mapping[str, Json]) -> tuple[int, int]:
    """WIDTH and HEIGHT of `size`; absent, null, empty or `auto`: AUTO_SIZE, which dev-image draws."""
    value = opt_string(body, "size")
    if not value or value == "auto":
        return AUTO_SIZE
    if (match := _SIZE.fullmatch(value)) is not None:
        width, height = int(match[1]), int(match[2])
        if (width % SIZE_STEP == 0 and height % SIZE_STEP == 0 and max(width, height) <= MAX_EDGE
                and width * height <= MAX_PIXELS and max(width, height) <= MAX_ASPECT * min(width, height)):
            return width, height
    raise InvalidRequest(
        f"`size` must be auto or WIDTHxHEIGHT (1024x1536, say), both multiples of {SIZE_STEP}, at most {MAX_EDGE}, "
        f"{MAX_EDGE}x{MAX_PIXELS // MAX_EDGE} pixels in all, from 1:{MAX_ASPECT} to {MAX_ASPECT}:1; "
        f"got {shown(value)}.",
        param="size")


def _choice(body: Mapping[str, Json], param: str, allowed: tuple[str, ...], *, default: str) -> str:
    """One of `allowed`; absent, null or an empty string (a typed caller's unset field) is the default."""
    value = opt_string(body, param)
    if not value:
        return default
    if value not in allowed:
        raise InvalidRequest(f"`{param}` must be one of {', '.join(allowed)}; got {shown(value)}.", param=param)
    return value
