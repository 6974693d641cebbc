"""The development image provider (`dev-image`): a stand-in, not an image model.

No image model ships on PyPI, so to give /v1/images/generations something real to return, this draws a
deterministic picture with Pillow: background, colours and shapes derived from a hash of the prompt (and the
image's index, so the n images of one request differ), with the start of the prompt written on it and a caption
saying what drew it. Same prompt, same options -> byte-identical files, which makes it useful in tests.
"""

from __future__ import annotations

import asyncio
import colorsys
import hashlib
import io
import os
import textwrap
from dataclasses import dataclass

from PIL import Image, ImageDraw, ImageFont

from server.domain_images import GeneratedImage, ImageAnswer, ImageFormat, ImageRequest
from server.observability import UpstreamRecorder
from server.observability.tracing import NO_SCOPE

ENGINE = "dev-image"  # what draws, for its generation span (gen_ai.request.model), as the embedded model's GGUF

REVISED_PROMPT = (
    "Drawn by Portico's development image provider (dev-image), not by an image model: "
    "a deterministic picture derived from a hash of the prompt."
)
_CAPTION = "portico dev-image - not an image model"
_PROMPT_EXCERPT_CHARS = 400  # prompts may be megabytes; only their start fits on a picture
_MAX_TEXT_LINES = 6
_JPEG_QUALITY = 95  # Pillow: above 95 only grows the file
_WEBP_QUALITY = 90


@dataclass(frozen=True, slots=True)
class _Bytes:
    """A deterministic stream of numbers read from a hash digest (stable across Python versions, unlike
    `random.Random`, so a prompt draws the same picture everywhere)."""

    digest: bytes

    def unit(self, i: int) -> float:
        return int.from_bytes(self.digest[2 * i : 2 * i + 2], "big") / 65535

    def pick(self, i: int, low: int, high: int) -> int:
        return low + round(self.unit(i) * (high - low))


class DevImageProvider:
    """Satisfies server.providers.images.ImageProvider. `recorder`: for a generation span, as the embedded model has
    (a trace otherwise showed admission, then nothing of where the drawing's time went, nor who answered)."""

    def __init__(self, recorder: UpstreamRecorder | None = None, *, drawings: int | None = None) -> None:
        self._recorder = recorder
        # Pictures drawn at once, by every request: one takes up to ~200 MB (3840x2160 WebP with alpha) while it is
        # drawn and encoded, and more at once than there are CPUs gains no speed, only memory (ten took over 1 GB).
        self._drawing = asyncio.Semaphore(drawings or os.cpu_count() or 1)

    async def generate(self, request: ImageRequest) -> ImageAnswer:
        with NO_SCOPE if self._recorder is None else self._recorder.generation(ENGINE, "generate_content"):
            # Hash a (possibly huge) prompt once; each image then derives its own numbers from this digest.
            prompt_digest = await asyncio.to_thread(lambda: hashlib.sha256(request.prompt.encode()).digest())
            # Drawing and encoding are CPU work: off the event loop, one thread per image (Pillow releases the GIL
            # while encoding, so images of one request are encoded in parallel), as many at once as `drawings`.
            return ImageAnswer(tuple(await asyncio.gather(*(self._draw(request, prompt_digest, i)
                                                            for i in range(request.n)))))

    async def _draw(self, request: ImageRequest, prompt_digest: bytes, index: int) -> GeneratedImage:
        async with self._drawing:
            return await asyncio.to_thread(render, request, prompt_digest, index)

    async def close(self) -> None:
        """Nothing to release: the provider holds no resources."""


def render(request: ImageRequest, prompt_digest: bytes, index: int) -> GeneratedImage:
    seed = hashlib.shake_256(b"%s|%d|%s" % (prompt_digest, index, request.style.encode())).digest(256)
    numbers = _Bytes(seed)
    size = (request.width, request.height)
    saturation = (0.55, 0.95) if request.style != "natural" else (0.15, 0.4)
    base_hue = numbers.unit(0)

    def colour(i: int, alpha: int) -> tuple[int, int, int, int]:
        hue = (base_hue + numbers.unit(i) * 0.5) % 1.0
        sat = saturation[0] + numbers.unit(i + 1) * (saturation[1] - saturation[0])
        red, green, blue = colorsys.hsv_to_rgb(hue, sat, 0.45 + numbers.unit(i + 2) * 0.5)
        return round(red * 255), round(green * 255), round(blue * 255), alpha

    if request.transparent:
        image = Image.new("RGBA", size, (0, 0, 0, 0))
    else:
        image = _gradient(size, colour(1, 255)[:3], colour(4, 255)[:3])
    # On an opaque background shapes are translucent and blend; on a transparent one they stay solid.
    draw = ImageDraw.Draw(image, "RGBA")
    shape_alpha = 255 if request.transparent else 170
    for shape in range(numbers.pick(7, 5, 11)):
        at = 8 + shape * 6
        cx, cy = numbers.unit(at) * size[0], numbers.unit(at + 1) * size[1]
        radius = (0.06 + numbers.unit(at + 2) * 0.22) * min(size)
        box = (cx - radius, cy - radius, cx + radius, cy + radius)
        fill = colour(at + 3, shape_alpha)
        kind = numbers.pick(at + 5, 0, 2)
        if kind == 0:
            draw.ellipse(box, fill=fill)
        elif kind == 1:
            draw.rectangle(box, fill=fill)
        else:
            draw.regular_polygon((cx, cy, radius), n_sides=numbers.pick(at + 4, 3, 7), fill=fill)
    _write_text(draw, size, request.prompt)
    return GeneratedImage(
        data=_encode(image, request), output_format=request.output_format, revised_prompt=REVISED_PROMPT
    )


def _gradient(size: tuple[int, int], top: tuple[int, ...], bottom: tuple[int, ...]) -> Image.Image:
    mask = Image.linear_gradient("L").resize(size)
    return Image.composite(Image.new("RGB", size, bottom), Image.new("RGB", size, top), mask)


def _write_text(draw: ImageDraw.ImageDraw, size: tuple[int, int], prompt: str) -> None:
    width, height = size
    margin = max(6, width // 40)
    font_size = max(10, min(width, height) // 22)
    font = ImageFont.load_default(size=font_size)
    caption_font = ImageFont.load_default(size=max(9, font_size * 2 // 3))
    draw.text((margin, margin), _CAPTION, font=caption_font, fill=(255, 255, 255, 230),
              stroke_width=1, stroke_fill=(0, 0, 0, 200))

    excerpt = " ".join(prompt[:_PROMPT_EXCERPT_CHARS].split())
    if len(prompt) > _PROMPT_EXCERPT_CHARS:
        excerpt += " ..."
    chars_per_line = max(8, int((width - 2 * margin) / (font_size * 0.55)))
    lines = textwrap.wrap(excerpt, chars_per_line)
    if len(lines) > _MAX_TEXT_LINES:
        lines = [*lines[: _MAX_TEXT_LINES - 1], lines[_MAX_TEXT_LINES - 1][: chars_per_line - 4] + " ..."]
    line_height = font_size * 1.25
    top = height - margin - line_height * len(lines)
    if lines:
        draw.rectangle((0, top - margin / 2, width, height), fill=(0, 0, 0, 120))
    for i, line in enumerate(lines):
        draw.text((margin, top + i * line_height), line, font=font, fill=(255, 255, 255, 255))


def _encode(image: Image.Image, request: ImageRequest) -> bytes:
    out = io.BytesIO()
    if request.output_format is ImageFormat.PNG:
        image.save(out, "PNG")  # lossless: output_compression does not apply
    elif request.output_format is ImageFormat.JPEG:
        quality = _JPEG_QUALITY if request.compression is None else request.compression
        image.convert("RGB").save(out, "JPEG", quality=quality)
    else:
        quality = _WEBP_QUALITY if request.compression is None else request.compression
        image.save(out, "WEBP", quality=quality, method=2)  # method 2: ~2x faster than 4, same look
    return out.getvalue()
