"""The development image provider: the requested size and format, decoded back with Pillow; deterministic."""

from __future__ import annotations

import io

import pytest
from PIL import Image

from server.providers.dev_image import REVISED_PROMPT, DevImageProvider
from server.domain_images import ImageFormat, ImageRequest
from server.providers.images import ImageProvider


def request(**changes) -> ImageRequest:
    fields = dict(prompt="a lighthouse at dusk", n=1, width=256, height=256,
                  output_format=ImageFormat.PNG, transparent=False, style="vivid", quality="auto", compression=None)
    return ImageRequest(**{**fields, **changes})


def decode(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def test_is_an_image_provider():
    assert isinstance(DevImageProvider(), ImageProvider)


@pytest.mark.parametrize(
    ("output_format", "width", "height", "transparent", "pillow_format", "mode"),
    [
        (ImageFormat.PNG, 256, 256, False, "PNG", "RGB"),
        (ImageFormat.PNG, 512, 512, True, "PNG", "RGBA"),
        (ImageFormat.JPEG, 1024, 1536, False, "JPEG", "RGB"),
        (ImageFormat.WEBP, 1536, 1024, False, "WEBP", "RGB"),
        (ImageFormat.WEBP, 256, 256, True, "WEBP", "RGBA"),
    ],
)
async def test_size_format_and_transparency(output_format, width, height, transparent, pillow_format, mode):
    images = (await DevImageProvider().generate(
        request(output_format=output_format, width=width, height=height, transparent=transparent)
    )).images
    assert len(images) == 1 and images[0].output_format is output_format
    image = decode(images[0].data)
    assert (image.format, image.size, image.mode) == (pillow_format, (width, height), mode)
    if transparent:
        assert image.getchannel("A").getextrema()[0] == 0  # some of the background is left see-through


async def test_same_prompt_same_bytes_and_other_prompts_differ():
    provider = DevImageProvider()
    first = (await provider.generate(request(n=3))).images
    again = (await provider.generate(request(n=3))).images
    other = (await provider.generate(request(n=3, prompt="a lighthouse at dawn"))).images
    assert [i.data for i in first] == [i.data for i in again]
    assert len({i.data for i in first}) == 3  # the n images of one request differ from each other
    assert not {i.data for i in first} & {i.data for i in other}


async def test_says_it_is_not_a_model():
    (image,) = (await DevImageProvider().generate(request())).images
    assert image.revised_prompt == REVISED_PROMPT and "not by an image model" in REVISED_PROMPT


async def test_compression_makes_lossy_files_smaller():
    provider = DevImageProvider()
    (best,) = (await provider.generate(request(output_format=ImageFormat.JPEG, width=512, height=512))).images
    (small,) = (await provider.generate(request(output_format=ImageFormat.JPEG, width=512, height=512,
                                                 compression=10))).images
    assert len(small.data) < len(best.data)


async def test_megabyte_prompt():
    (image,) = (await DevImageProvider().generate(request(prompt="word " * 210_000))).images
    assert decode(image.data).size == (256, 256)


async def test_at_most_as_many_pictures_are_drawn_at_once_as_it_is_given(monkeypatch):
    """A 3840x2160 picture takes some 100-200 MB while it is drawn and encoded: ten at once (one request's n) took
    over 1 GB. Drawings beyond the CPUs' count gain no speed (Pillow works on one core per picture), only memory."""
    import threading
    import time

    from server.providers import dev_image

    running, most, lock = 0, 0, threading.Lock()

    def render(*args):
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.02)
        with lock:
            running -= 1
        return "drawn"

    monkeypatch.setattr(dev_image, "render", render)
    answer = await DevImageProvider(drawings=2).generate(request(n=10))
    assert answer.images == ("drawn",) * 10 and most == 2
