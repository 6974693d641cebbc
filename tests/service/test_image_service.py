"""ImageService over real gRPC stubs: typed and HttpBody generation, b64 and url answers, links fetched back
through GetImageContent, and errors with their `param`."""

from __future__ import annotations

import base64
import logging
import shutil
import io
from urllib.parse import parse_qs, urlsplit

import grpc
import orjson
import pytest
from google.protobuf import json_format
from PIL import Image

from portico.v1 import image_pb2, image_service_pb2_grpc
from server.providers.dev_image import REVISED_PROMPT
from server.translate.values import proto_to_json as proto_json
from tests.helpers import bearer, error_details, http_body


@pytest.fixture(scope="module")
def images(channel) -> image_service_pb2_grpc.ImageServiceStub:
    return image_service_pb2_grpc.ImageServiceStub(channel)


def image_request(**fields) -> image_pb2.CreateImageRequest:
    body = {"model": "family-a-image-2", "prompt": "a lighthouse at dusk", "size": "256x256", **fields}
    return json_format.ParseDict(body, image_pb2.CreateImageRequest())


def decode(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def content_request(url: str, **changes) -> image_pb2.GetImageContentRequest:
    parts = urlsplit(url)
    query = parse_qs(parts.query)
    fields = {"name": parts.path.rsplit("/", 1)[1], "expires": int(query["expires"][0]),
              "signature": query["signature"][0], **changes}
    return image_pb2.GetImageContentRequest(**fields)


async def fetch(images, url: str, **changes) -> list:
    return [b async for b in images.GetImageContent(content_request(url, **changes))]


async def test_typed_rpc_returns_b64_images(images, secret):
    response = await images.CreateImage(image_request(n=2), metadata=bearer(secret))
    assert response.created > 1_700_000_000 and len(response.data) == 2
    for item in response.data:
        assert not item.HasField("url") and item.revised_prompt == REVISED_PROMPT
        picture = decode(base64.b64decode(item.b64_json))
        assert (picture.format, picture.size) == ("PNG", (256, 256))
    assert (response.size, response.output_format, response.background) == ("256x256", "png", "opaque")


async def test_http_rpc_answers_the_json_the_openai_sdk_parses(images, secret):
    request = image_request(output_format="jpeg", size="1024x1536", quality="high", style="natural", user="u1")
    bodies = [b async for b in images.CreateImageHttp(http_body(request), metadata=bearer(secret))]
    assert len(bodies) == 1 and bodies[0].content_type == "application/json"
    body = orjson.loads(bodies[0].data)
    assert set(body) == {"created", "data", "background", "output_format", "size"}
    assert isinstance(body["created"], int)
    (item,) = body["data"]
    assert set(item) == {"b64_json", "revised_prompt"}  # no url member at all, rather than ""
    picture = decode(base64.b64decode(item["b64_json"]))
    assert (picture.format, picture.size) == ("JPEG", (1024, 1536))


async def test_url_answers_are_fetchable_without_a_key(images, secret):
    request = image_request(response_format="url", output_format="webp", background="transparent", n=2)
    bodies = [b async for b in images.CreateImageHttp(http_body(request), metadata=bearer(secret))]
    data = orjson.loads(bodies[0].data)["data"]
    assert len(data) == 2 and all(set(item) == {"url", "revised_prompt"} for item in data)
    url = data[0]["url"]
    assert url.startswith("http://127.0.0.1:8080/v1/images/content/") and "&signature=" in url
    (content,) = await fetch(images, url)  # no metadata: the signed link is the credential
    assert content.content_type == "image/webp"
    picture = decode(content.data)
    assert (picture.format, picture.size, picture.mode) == ("WEBP", (256, 256), "RGBA")
    assert data[1]["url"] != url


async def test_typed_rpc_can_answer_urls(images, secret):
    response = await images.CreateImage(image_request(response_format="url"), metadata=bearer(secret))
    (content,) = await fetch(images, response.data[0].url)
    assert content.content_type == "image/png" and decode(content.data).size == (256, 256)


@pytest.mark.parametrize(
    "changes",
    [{"signature": "0" * 64}, {"expires": 4_000_000_000}, {"expires": 1}, {"name": "AAAAAAAAAAAAAAAAAAAAAAAA.png"}],
)
async def test_tampered_links_are_404(images, secret, changes):
    response = await images.CreateImage(image_request(response_format="url"), metadata=bearer(secret))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await fetch(images, response.data[0].url, **changes)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    detail = error_details(caught.value)
    assert (detail.http_status, detail.error.code) == (404, "not_found")


async def test_megabyte_prompt(images, secret):
    response = await images.CreateImage(image_request(prompt="p" * (1 << 20)), metadata=bearer(secret))
    assert len(response.data) == 1


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"n": 11}, "n"),
        ({"size": "4096x4096"}, "size"),
        ({"response_format": "file"}, "response_format"),
        ({"background": "transparent", "output_format": "jpeg"}, "background"),
        ({"output_compression": 150}, "output_compression"),
        ({"stream": True}, "stream"),
        ({"model": ""}, "model"),
    ],
)
async def test_invalid_requests_name_the_field(images, secret, fields, param):
    for call in (images.CreateImage, lambda r, **k: _drain(images.CreateImageHttp(http_body(r), **k))):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call(image_request(**fields), metadata=bearer(secret))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        detail = error_details(caught.value)
        assert (detail.http_status, detail.error.code, detail.error.param) == (400, "invalid_request", param)


async def test_a_member_the_development_model_does_not_read_is_refused_not_dropped(images, secret):
    body = {**proto_json(image_request()), "qualty": "hd", "safety_identifier": "user-7"}  # a typo; a known one
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _drain(images.CreateImageHttp(http_body(body), metadata=bearer(secret)))
    detail = error_details(caught.value)
    assert (detail.http_status, detail.error.code, detail.error.param) == (400, "invalid_request", "qualty")
    assert "not supported by this model" in detail.error.message
    del body["qualty"]
    assert len([b async for b in images.CreateImageHttp(http_body(body), metadata=bearer(secret))]) == 1


async def test_text_model_is_404_naming_the_right_path(images, secret):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await images.CreateImage(image_request(model="family-a-5.5"), metadata=bearer(secret))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    detail = error_details(caught.value)
    assert detail.error.code == "model_not_found" and detail.error.param == "model"
    assert "/v1/chat/completions" in detail.error.message


async def test_generation_needs_a_key(images):
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await _drain(images.CreateImageHttp(http_body(image_request())))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def _drain(stream) -> list:
    return [item async for item in stream]


async def test_url_answers_survive_the_images_directory_deleted(images, secret, running):
    """`rm -rf <data_dir>/images` under a running gateway made every url answer a 500 until a restart."""
    directory = running.core.images._dir
    shutil.rmtree(directory)
    response = await images.CreateImage(image_request(response_format="url"), metadata=bearer(secret))
    (content,) = await fetch(images, response.data[0].url)
    assert decode(content.data).size == (256, 256)


async def test_an_image_that_cannot_be_stored_is_a_503_naming_b64_json(images, secret, running, caplog):
    """A full disk (here: a file where the images directory should be) was a 500 internal_error with a traceback,
    leaving an empty image file behind."""
    directory = running.core.images._dir
    shutil.rmtree(directory, ignore_errors=True)
    directory.write_bytes(b"")
    try:
        with caplog.at_level(logging.ERROR), pytest.raises(grpc.aio.AioRpcError) as raised:
            await images.CreateImage(image_request(response_format="url"), metadata=bearer(secret))
    finally:
        directory.unlink()
        directory.mkdir()
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    detail = error_details(raised.value).error
    assert (detail.code, detail.type) == ("service_unavailable", "service_unavailable_error")
    assert "b64_json" in detail.message
    assert "cannot store generated images" in caplog.text and "Traceback" not in caplog.text
    assert list(directory.iterdir()) == []
