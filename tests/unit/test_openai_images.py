"""The images translator: every accepted value, every refusal with its `param`, and the response body shape."""

from __future__ import annotations

import base64

import pytest

from server.errors import InvalidRequest, RequestTooLarge
from server.domain_images import GeneratedImage, ImageAnswer, ImageFormat
from server.translate.openai_images import image_request, images_response


def plan_for(**fields):
    body = {"model": "family-a-image-2", "prompt": "a lighthouse at dusk", **fields}
    return image_request(body)


def test_defaults():
    plan = plan_for()
    request = plan.generation
    assert plan.response_format == "b64_json"
    assert (request.n, request.width, request.height) == (1, 1024, 1024)
    assert request.output_format is ImageFormat.PNG
    assert (request.transparent, request.style, request.quality, request.compression) == (False, "vivid", "auto", None)


@pytest.mark.parametrize(
    ("fields", "attribute", "expected"),
    [
        ({"size": "256x256"}, "width", 256),
        ({"size": "1024x1536"}, "height", 1536),
        ({"size": "1536x1024"}, "width", 1536),
        ({"size": "1792x1024"}, "width", 1792),  # dall-e-3's landscape and portrait sizes, for its upstreams
        ({"size": "1024x1792"}, "height", 1792),
        ({"size": "auto"}, "width", 1024),
        ({"size": "1536x864"}, "height", 864),  # gpt-image-2 takes any size within the rule (the openai SDK's)
        ({"size": "3840x2160"}, "width", 3840),
        ({"size": "48x144"}, "height", 144),  # 1:3
        ({"quality": "xhigh"}, "quality", "xhigh"),
        ({"quality": "max"}, "quality", "max"),
        ({"n": 10}, "n", 10),
        ({"output_format": "jpeg"}, "output_format", ImageFormat.JPEG),
        ({"output_format": "webp", "background": "transparent"}, "transparent", True),
        ({"background": "opaque"}, "transparent", False),
        ({"style": "natural"}, "style", "natural"),
        ({"quality": "hd"}, "quality", "hd"),
        ({"output_compression": 0}, "compression", 0),
        ({"output_compression": 100, "output_format": "jpeg"}, "compression", 100),
        ({"moderation": "low", "user": "u-1", "safety_identifier": "s-1"}, "n", 1),
        ({"stream": False, "partial_images": 0}, "n", 1),
        ({"prompt": "x" * (1 << 20)}, "prompt", "x" * (1 << 20)),  # a 1 MiB prompt
    ],
)
def test_accepted_values(fields, attribute, expected):
    assert getattr(plan_for(**fields).generation, attribute) == expected


def test_url_response_format():
    assert plan_for(response_format="url").response_format == "url"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": "   \n"}, "prompt"),
        ({"n": 0}, "n"),
        ({"n": 11}, "n"),
        ({"n": -1}, "n"),
        ({"size": "4096x4096"}, "size"),
        ({"size": "big"}, "size"),
        ({"size": "1000x1000"}, "size"),  # not multiples of 16
        ({"size": "2160x3856"}, "size"),  # an edge over 3840
        ({"size": "3840x2176"}, "size"),  # over 3840x2160 pixels
        ({"size": "48x160"}, "size"),  # beyond 1:3
        ({"size": "01024x1024"}, "size"),
        ({"size": " 1024x1024"}, "size"),
        ({"response_format": "png"}, "response_format"),
        ({"output_format": "gif"}, "output_format"),
        ({"quality": "ultra"}, "quality"),
        ({"style": "noir"}, "style"),
        ({"background": "none"}, "background"),
        ({"background": "transparent", "output_format": "jpeg"}, "background"),
        ({"output_compression": 101}, "output_compression"),
        ({"output_compression": -1}, "output_compression"),
        ({"moderation": "off"}, "moderation"),
        ({"stream": True}, "stream"),
        ({"partial_images": 2}, "partial_images"),
    ],
)
def test_refusals_name_the_field(fields, param):
    with pytest.raises(InvalidRequest) as caught:
        plan_for(**fields)
    assert caught.value.param == param
    assert caught.value.kind.http_status == 400


def test_absurd_prompt_is_a_413():
    with pytest.raises(RequestTooLarge) as caught:
        plan_for(prompt="x" * (4 * 1024 * 1024 + 1))
    assert caught.value.param == "prompt" and caught.value.kind.http_status == 413


def test_long_bad_values_are_shortened_in_the_message():
    with pytest.raises(InvalidRequest) as caught:
        plan_for(size="9" * 10_000)
    assert len(caught.value.message) < 200


IMAGES = ImageAnswer((GeneratedImage(b"\x89PNG-one", ImageFormat.PNG, "drawn"),
                      GeneratedImage(b"two", ImageFormat.PNG)))


def test_b64_response_body():
    body = images_response(1700000000, plan_for(n=2, size="512x512"), IMAGES)
    assert body == {
        "created": 1700000000,
        "data": [
            {"b64_json": base64.b64encode(b"\x89PNG-one").decode(), "revised_prompt": "drawn"},
            {"b64_json": base64.b64encode(b"two").decode()},  # no revised_prompt: omitted, never ""
        ],
        "background": "opaque",
        "output_format": "png",
        "size": "512x512",
    }


def test_url_response_body():
    plan = plan_for(n=2, response_format="url", output_format="webp", background="transparent")
    body = images_response(5, plan, IMAGES, ["http://h/a", "http://h/b"])
    assert body["data"] == [{"url": "http://h/a", "revised_prompt": "drawn"}, {"url": "http://h/b"}]
    # The images are PNGs whatever was asked (an upstream may ignore output_format); headers it cannot read leave
    # the requested size.
    assert (body["background"], body["output_format"], body["size"]) == ("transparent", "png", "1024x1024")
