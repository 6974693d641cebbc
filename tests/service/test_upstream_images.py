"""Images through an OpenAI-compatible images upstream (the upstream double), beside the development provider:
the request passed on, both answer forms read, the caller's format honoured, retries, fallbacks and errors."""

from __future__ import annotations

import base64
import io
import random
import struct
import zlib
from urllib.parse import parse_qs, urlsplit

import grpc
import orjson
import pytest
from google.protobuf import json_format
from PIL import Image

from portico.v1 import image_pb2, image_service_pb2_grpc
from server.domain_keys import KeyLimits
from server.providers.dev_image import REVISED_PROMPT
from tests.helpers import bearer, error_details, http_body
from tests.upstream_double import Cue
from tests.upstream_echo import tiny_png
from tests.upstream_support import FAST_RETRY, UPSTREAM_KEY, UPSTREAM_KEY_ENV, upstream_server

IMAGES = "/v1/images/generations"


@pytest.fixture(scope="module")
async def running(double, tmp_path_factory):
    provider = f"kind: openai, base_url: '{double.url}', api_key_env: {UPSTREAM_KEY_ENV}, model: image-up"
    down = f"kind: openai, base_url: 'http://127.0.0.1:9/v1', model: x, retry: {FAST_RETRY}"
    models = f"""\
  - {{id: image-up, endpoint: {IMAGES}, provider: {{{provider}, retry: {FAST_RETRY}}}}}
  - {{id: image-down, endpoint: {IMAGES}, provider: {{{down}}}, fallbacks: [image-dev]}}
  - {{id: image-dev, endpoint: {IMAGES}, provider: {{kind: dev-image}}}}
  - {{id: image-priced, endpoint: {IMAGES}, provider: {{{provider}}}, price: {{image: 0.01}}}}
  - {{id: image-mixed, endpoint: {IMAGES}, deployments: [{{name: dev, weight: 1000, provider: {{kind: dev-image}}}},
                                                         {{name: up, provider: {{{provider}}}}}]}}
"""
    async with upstream_server(tmp_path_factory.mktemp("images"), models) as server:
        yield server


@pytest.fixture(scope="module")
async def images(running):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        yield image_service_pb2_grpc.ImageServiceStub(channel)


@pytest.fixture
async def secret(running, double):
    double.reset()
    return (await running.store.create("images", all_models=True))[1]


def image_request(**fields) -> image_pb2.CreateImageRequest:
    body = {"model": "image-up", "prompt": "a lighthouse", **fields}
    return json_format.ParseDict(body, image_pb2.CreateImageRequest())


async def test_b64_images_from_the_upstream(images, double, secret):
    response = await images.CreateImage(image_request(n=2, size="512x512", quality="high", user="u-1"),
                                        metadata=bearer(secret))
    assert [base64.b64decode(item.b64_json) for item in response.data] == [tiny_png(12), tiny_png(13)]
    assert response.data[0].revised_prompt == "echo a lighthouse"
    seen = double.seen[-1]
    assert seen.headers["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert seen.body == {"model": "image-up", "prompt": "a lighthouse", "n": 2, "size": "512x512", "quality": "high",
                         "user": "u-1"}  # response_format is never passed on: the upstream answers in its own way


async def test_base64_wrapped_in_lines_is_read_as_the_openai_sdk_reads_it(images, double, secret):
    """A Python shim answering with base64.encodebytes (a newline every 76 characters) drew and billed the image, and
    the openai SDK's users decode it with b64decode, which skips the newlines: it was a 502 "not base64" here."""
    png = tiny_png(3)
    wrapped = base64.encodebytes(png).decode().replace("\n", "\r\n")
    assert "\n" in wrapped.strip()
    double.cue(Cue(body={"created": 1, "data": [{"b64_json": wrapped}]}))
    response = await images.CreateImage(image_request(), metadata=bearer(secret))
    assert base64.b64decode(response.data[0].b64_json, validate=True) == png
    double.cue(Cue(body={"created": 1, "data": [{"b64_json": "iVBOR w0K!GgoA"}]}))  # still no base64 at all
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await images.CreateImage(image_request(), metadata=bearer(secret))
    assert "not base64" in refused.value.details()


async def test_base64_with_a_character_beyond_ascii_is_the_upstreams_failure(images, double, secret):
    """b64decode refuses a non-ASCII character with a ValueError, not binascii.Error: it was a 500 internal_error
    (the server's fault, said the answer) instead of the upstream's 502."""
    double.cue(Cue(body={"created": 1, "data": [{"b64_json": "iVBORw0KGgo\u00e9"}]}))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await images.CreateImage(image_request(), metadata=bearer(secret))
    assert refused.value.code() != grpc.StatusCode.INTERNAL
    assert "not base64" in refused.value.details()


async def test_an_image_of_very_many_pixels_reaches_its_caller(images, double, secret):
    """The answer's `size` is read from the image's header with Pillow, whose guard against decompression bombs
    raises (not OSError) for a header of more than ~179 million pixels: the caller got a 500 internal_error for an
    image the upstream had drawn and billed. The pixels are never decoded, so the image is passed on as it is."""
    png = bytearray(tiny_png(4))
    header = bytearray(png[12:29])  # IHDR: its type, width, height, ...
    header[4:12] = struct.pack(">II", 20000, 20000)
    png[12:29], png[29:33] = header, struct.pack(">I", zlib.crc32(bytes(header)))
    double.cue(Cue(body={"created": 1, "data": [{"b64_json": base64.b64encode(bytes(png)).decode()}]}))
    response = await images.CreateImage(image_request(), metadata=bearer(secret))
    assert base64.b64decode(response.data[0].b64_json) == bytes(png)
    assert response.size == "20000x20000"


async def test_an_image_sent_as_a_data_url_is_read_from_it(images, double, secret):
    """A server that answers `url` with a `data:image/png;base64,...` URL (one a browser shows as it is) had drawn
    and billed the image, and was a 502 saying it "sent a link that is not a URL". Its bytes are read from it, in
    either response format, and nothing is fetched; a data URL that is no base64 image is still the 502."""
    png = tiny_png(5)
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    double.cue(Cue(body={"created": 1, "data": [{"url": data_url}]}))
    response = await images.CreateImage(image_request(), metadata=bearer(secret))
    assert base64.b64decode(response.data[0].b64_json) == png
    double.cue(Cue(body={"created": 1, "data": [{"url": data_url}]}))
    linked = await images.CreateImage(image_request(response_format="url"), metadata=bearer(secret))
    assert linked.data[0].url.startswith("http://127.0.0.1:8080/v1/images/content/")
    assert all(seen.path.endswith("/images/generations") for seen in double.seen)  # no fetch
    for url in ("data:text/plain,hello", "data:image/png;base64,@@@@"):
        double.cue(Cue(body={"created": 1, "data": [{"url": url}]}))
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await images.CreateImage(image_request(), metadata=bearer(secret))
        assert refused.value.code() != grpc.StatusCode.INTERNAL and "data URL" in refused.value.details()


async def test_a_scheme_relative_link_is_fetched_from_its_host(images, double, secret):
    """`//host:port/path` (a link that keeps the page's scheme, as an HTML page's would) names its host: it was
    fetched as `{base_url}host:port/path` from the upstream itself, a 404 and a 502 for an image drawn and billed."""
    double.files["s.png"] = tiny_png(6)
    double.cue(Cue(body={"created": 1, "data": [{"url": f"//127.0.0.1:{double.port}/files/s.png"}]}))
    response = await images.CreateImage(image_request(), metadata=bearer(secret))
    assert base64.b64decode(response.data[0].b64_json) == tiny_png(6)
    assert double.seen[-1].path == "/files/s.png"


async def test_members_the_gateway_does_not_read_reach_the_upstream(images, double, secret):
    body = {"model": "image-up", "prompt": "a lighthouse", "input_fidelity": "high", "extra": {"seed": 7}}
    bodies = [b async for b in images.CreateImageHttp(http_body(body), metadata=bearer(secret))]
    assert len(bodies) == 1
    assert double.seen[-1].body == body


async def test_linked_images_are_fetched_without_the_key_and_served_as_ours(images, double, secret):
    double.files["a.png"] = tiny_png(1)
    double.cue(Cue(body={"created": 1, "data": [{"url": f"http://127.0.0.1:{double.port}/files/a.png"}]}))
    response = await images.CreateImage(image_request(response_format="url"), metadata=bearer(secret))
    (item,) = response.data
    assert item.url.startswith("http://127.0.0.1:8080/v1/images/content/")  # the gateway's own signed link
    fetch = double.seen[-1]
    assert fetch.path == "/files/a.png" and "authorization" not in fetch.headers
    b64 = await images.CreateImage(image_request(), metadata=bearer(secret))  # and as b64_json, by default
    assert base64.b64decode(b64.data[0].b64_json) == tiny_png(12)
    double.files["b"], double.file_types["b"] = tiny_png(2), ""  # a link that does not say its type: the bytes do
    double.cue(Cue(body={"created": 1, "data": [{"url": f"http://127.0.0.1:{double.port}/files/b"}]}))
    unsaid = await images.CreateImage(image_request(), metadata=bearer(secret))
    assert base64.b64decode(unsaid.data[0].b64_json) == tiny_png(2)


async def test_the_answer_describes_the_images_the_upstream_drew(images, secret):
    """A model may ignore output_format and size (the double always draws an 8x8 PNG): the answer's `output_format`
    and `size` say what the images are, so a caller naming the file by them gets it right."""
    response = await images.CreateImage(image_request(output_format="jpeg", size="512x512"), metadata=bearer(secret))
    assert base64.b64decode(response.data[0].b64_json)[:4] == b"\x89PNG"
    assert (response.output_format, response.size) == ("png", "8x8")


@pytest.mark.parametrize("asked, drawn", [("auto", "transparent"), ("transparent", "opaque")])
async def test_the_answer_says_the_background_the_upstream_drew(images, double, secret, asked, drawn):
    """gpt-image models choose the background for `auto` (and say which): the answer's `background` is theirs."""
    png = base64.b64encode(tiny_png(1)).decode()
    double.cue(Cue(body={"created": 1, "background": drawn, "data": [{"b64_json": png}]}))
    response = await images.CreateImage(image_request(background=asked), metadata=bearer(secret))
    assert response.background == drawn


async def test_a_linked_image_over_4_mib_reaches_a_grpc_caller_with_default_limits(images, double, secret):
    """grpc clients take messages up to 4 MiB by default: GetImageContent streams a big image in pieces (an upstream
    model's PNG can be several MiB) instead of failing the caller with RESOURCE_EXHAUSTED."""
    out = io.BytesIO()
    Image.frombytes("RGB", (1400, 1100), random.Random(7).randbytes(1400 * 1100 * 3)).save(out, "PNG")
    big = out.getvalue()
    assert len(big) > 4 * 1024 * 1024
    double.cue(Cue(body={"created": 1, "data": [{"b64_json": base64.b64encode(big).decode()}]}))
    response = await images.CreateImage(image_request(response_format="url"), metadata=bearer(secret))
    parts = urlsplit(response.data[0].url)
    query = parse_qs(parts.query)
    request = image_pb2.GetImageContentRequest(name=parts.path.rsplit("/", 1)[1], expires=int(query["expires"][0]),
                                               signature=query["signature"][0])
    pieces = [piece async for piece in images.GetImageContent(request)]
    assert b"".join(piece.data for piece in pieces) == big
    assert {piece.content_type for piece in pieces} == {"image/png"}


def linked_images(double, count: int, size: tuple[int, int]) -> Cue:
    """An answer linking `count` copies of one PNG of `size` (stored uncompressed: about 3 bytes a pixel)."""
    out = io.BytesIO()
    Image.new("RGB", size).save(out, "PNG", compress_level=0)
    double.files["big.png"] = out.getvalue()
    return Cue(body={"created": 1, "data": [{"url": f"http://127.0.0.1:{double.port}/files/big.png"}] * count})


async def test_b64_images_over_64_mib_together_reach_a_rest_caller(images, double, secret):
    """Ten 5 MiB images are 69 MiB as base64, over the largest gRPC message the server sends: the JSON body
    goes to Envoy (which joins it for REST callers) in pieces."""
    double.cue(linked_images(double, 10, (1500, 1200)))
    body = {"model": "image-up", "prompt": "a lighthouse", "n": 10}
    pieces = [b async for b in images.CreateImageHttp(http_body(body), metadata=bearer(secret))]
    answer = orjson.loads(b"".join(piece.data for piece in pieces))
    assert len(answer["data"]) == 10 and answer["size"] == "1500x1200"
    assert {piece.content_type for piece in pieces} == {"application/json"}


async def test_a_typed_answer_too_big_to_send_says_so(images, double, secret):
    """The upstream drew and billed the images: the same request again would be billed and too big again, so the
    answer says `x-should-retry: false` (Portico's client, like the SDKs, retries a 502 otherwise)."""
    double.cue(linked_images(double, 10, (1500, 1200)))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await images.CreateImage(image_request(n=10), metadata=bearer(secret))
    detail = error_details(caught.value)
    assert (detail.http_status, detail.error.code) == (502, "upstream_error")
    assert "64 MiB" in detail.error.message and "response_format" in detail.error.message
    assert ("x-should-retry", "false") in tuple(caught.value.trailing_metadata())


async def test_an_upstream_failure_is_retried(images, double, secret):
    double.cue(Cue(503, {"error": {"message": "busy"}}))
    response = await images.CreateImage(image_request(), metadata=bearer(secret))
    assert len(response.data) == 1 and len(double.seen) == 2



async def test_an_image_link_that_cannot_be_fetched_is_not_drawn_again(images, double, secret):
    """Once the upstream answers, it has drawn and billed the images: a link whose host cannot be reached is that
    answer's failure (502), never a reason to ask the upstream for the images again and pay for them twice."""
    double.cue(Cue(body={"created": 1, "data": [{"url": "http://127.0.0.1:9/lost.png"}]}))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await images.CreateImage(image_request(), metadata=bearer(secret))
    detail = error_details(caught.value)
    assert (detail.http_status, detail.error.code) == (502, "upstream_error")
    assert "fetch a result of `image-up`" in detail.error.message
    assert [seen.path for seen in double.seen] == ["/v1/images/generations"]


@pytest.mark.parametrize("host", ["a" * 64 + ".example", "a\x00b", "a..b"])
async def test_a_link_whose_host_no_resolver_takes_is_the_upstreams_failure(images, double, secret, host):
    """A link naming a host name that cannot be looked up at all (a label over 63 characters, an empty label, a NUL)
    made the connect raise ValueError/UnicodeError rather than OSError: the caller got a 500 internal_error, the
    gateway's fault said the answer, for a link the upstream sent. It is a link that cannot be fetched: a 502."""
    double.cue(Cue(body={"created": 1, "data": [{"url": f"http://{host}/x.png"}]}))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await images.CreateImage(image_request(), metadata=bearer(secret))
    detail = error_details(caught.value)
    assert (detail.http_status, detail.error.code) == (502, "upstream_error")
    assert "fetch a result of `image-up`" in detail.error.message and host not in detail.error.message
    assert [seen.path for seen in double.seen] == ["/v1/images/generations"]


async def test_an_answer_cut_off_is_not_drawn_again(images, double, secret):
    """An answer that began (200) has been drawn and billed, even if its connection breaks before its end."""
    one = {"created": 1, "data": [{"b64_json": base64.b64encode(tiny_png(1)).decode()}]}
    double.cue(Cue(body=one, drop_after=1))  # the answer's first half, then the connection closes
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await images.CreateImage(image_request(), metadata=bearer(secret))
    detail = error_details(caught.value)
    assert (detail.http_status, detail.error.code) == (502, "upstream_error") and "broke off" in detail.error.message
    assert len(double.seen) == 1

async def test_an_unreachable_upstream_falls_back_to_the_development_provider(images, secret):
    response = await images.CreateImage(image_request(model="image-down", size="256x256"), metadata=bearer(secret))
    assert response.data[0].revised_prompt == REVISED_PROMPT


async def test_a_fallback_that_would_refuse_a_member_is_skipped(images, secret):
    """dev-image refuses members it does not read: it never draws such a request in an upstream's place."""
    body = {"model": "image-down", "prompt": "a lighthouse", "size": "256x256", "input_fidelity": "high"}
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [b async for b in images.CreateImageHttp(http_body(body), metadata=bearer(secret))]
    assert error_details(caught.value).http_status == 503  # the upstream is unreachable, and nothing else may answer


async def test_members_the_gateway_does_not_read_go_only_to_a_deployment_that_gets_them(images, double, secret):
    body = {"model": "image-mixed", "prompt": "a lighthouse", "input_fidelity": "high"}
    for _ in range(4):
        bodies = [b async for b in images.CreateImageHttp(http_body(body), metadata=bearer(secret))]
        assert orjson.loads(bodies[0].data)["data"][0]["revised_prompt"] == "echo a lighthouse"
    assert len(double.seen) == 4


async def test_upstream_refusals_keep_their_meaning(images, double, secret):
    double.cue(Cue(400, {"error": {"message": "Your prompt was rejected.", "param": "prompt"}}),
               Cue(429, {"error": {"message": "slow"}}, headers={"retry-after": "60"}))
    for code, status, param in ((grpc.StatusCode.INVALID_ARGUMENT, 400, "prompt"),
                                (grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "")):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await images.CreateImage(image_request(), metadata=bearer(secret))
        detail = error_details(caught.value)
        assert (caught.value.code(), detail.http_status, detail.error.param) == (code, status, param)
    assert len(double.seen) == 2


async def test_an_answer_without_images_is_an_upstream_error(images, double, secret):
    double.cue(Cue(body={"created": 1, "data": []}))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await images.CreateImage(image_request(), metadata=bearer(secret))
    assert (caught.value.code(), error_details(caught.value).http_status) == (grpc.StatusCode.UNAVAILABLE, 502)


HELLO = b"hello world"
PAGE = b"<!doctype html><html><body>Sign in</body></html>"


@pytest.mark.parametrize("response_format", ["b64_json", "url"])
@pytest.mark.parametrize("answer, content_type, named", [
    ({"b64_json": base64.b64encode(HELLO).decode()}, None, "11 bytes of text"),
    # A link to the double's file `page` (PAGE, served with that content-type).
    (None, "text/html; charset=utf-8", "text/html, not image/*"),
    (None, "application/octet-stream", "application/octet-stream, not image/*"),
    (None, "image/png", f"{len(PAGE)} bytes of HTML or XML"),  # the type says image, the bytes do not
    (None, "", f"{len(PAGE)} bytes of HTML or XML"),  # no content-type: the bytes decide
], ids=["b64-text", "link-html", "link-octet-stream", "link-html-said-png", "link-html-unsaid"])
async def test_an_answer_that_is_no_image_is_an_upstream_error(images, double, secret, response_format, answer,
                                                               content_type, named):
    if content_type is not None:
        double.files["page"], double.file_types["page"] = PAGE, content_type
        answer = {"url": f"http://127.0.0.1:{double.port}/files/page"}
    double.cue(Cue(body={"created": 1, "data": [answer]}))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await images.CreateImage(image_request(response_format=response_format), metadata=bearer(secret))
    detail = error_details(caught.value)
    assert (detail.http_status, detail.error.code) == (502, "upstream_error")
    assert named in detail.error.message and "image-up" in detail.error.message
    assert "hello" not in detail.error.message and "Sign in" not in detail.error.message  # never the bytes


async def test_an_upstream_answering_more_images_than_asked_gives_and_bills_only_those_asked(images, double, running):
    """The budget reserved the images asked for: more from the upstream would overspend it (and are not wanted)."""
    double.reset()
    _, secret = await running.store.create("two-cents", all_models=True, limits=KeyLimits(max_spend_day=20_000))
    three = {"created": 1, "data": [{"b64_json": base64.b64encode(tiny_png(i)).decode()} for i in range(3)]}
    double.cue(Cue(body=three))
    response = await images.CreateImage(image_request(model="image-priced", n=1), metadata=bearer(secret))
    assert [base64.b64decode(item.b64_json) for item in response.data] == [tiny_png(0)]
    await images.CreateImage(image_request(model="image-priced", n=1), metadata=bearer(secret))  # the second cent
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await images.CreateImage(image_request(model="image-priced", n=1), metadata=bearer(secret))
    assert error_details(caught.value).error.message.startswith("Budget reached")


async def test_images_the_upstream_drew_and_billed_count_when_their_answer_then_fails(images, double, running):
    """An answer naming images has been drawn and billed by the upstream: a link that then cannot be fetched (or an
    image that is none) fails the request, but its images cost the key all the same, so a budget stops a caller
    whose every retry the upstream bills while the answers keep failing."""
    double.reset()
    _, secret = await running.store.create("broken-links", all_models=True, limits=KeyLimits(max_spend_day=20_000))
    lost = {"created": 1, "data": [{"url": "http://127.0.0.1:9/lost.png"}]}
    not_an_image = {"created": 1, "data": [{"b64_json": base64.b64encode(HELLO).decode()}]}
    double.cue(Cue(body=lost), Cue(body=not_an_image))
    for _ in range(2):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await images.CreateImage(image_request(model="image-priced"), metadata=bearer(secret))
        assert error_details(caught.value).http_status == 502
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await images.CreateImage(image_request(model="image-priced"), metadata=bearer(secret))
    assert error_details(caught.value).error.message.startswith("Budget reached")
    assert len(double.seen) == 2  # the third was never drawn


async def test_images_behind_a_link_portico_does_not_fetch_from_count_all_the_same(images, double, running):
    """A link into cloud metadata is refused, not fetched: the upstream drew and billed the image regardless, so it
    costs the key as any link that cannot be fetched does (api.md, Images)."""
    double.reset()
    _, secret = await running.store.create("metadata-links", all_models=True, limits=KeyLimits(max_spend_day=20_000))
    double.cue(*[Cue(body={"created": 1, "data": [{"url": "http://169.254.169.254/latest/meta-data/"}]})] * 2)
    for _ in range(2):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await images.CreateImage(image_request(model="image-priced"), metadata=bearer(secret))
        detail = error_details(caught.value)
        assert (detail.http_status, detail.error.code) == (502, "upstream_error")
        assert detail.error.message == ("The upstream's image link for `image-priced` points at an address Portico "
                                        "does not fetch from.")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await images.CreateImage(image_request(model="image-priced"), metadata=bearer(secret))
    assert error_details(caught.value).error.message.startswith("Budget reached")
    assert len(double.seen) == 2  # the third was never drawn

async def test_the_upstreams_usage_and_quality_reach_rest_and_grpc_callers(images, double, secret):
    """gpt-image models answer with the quality they drew at and their token usage (which OpenAI bills them by), both
    read by the openai SDK (`ImagesResponse.quality`, `.usage`): a REST caller gets them as the upstream sent them, a
    typed caller in ImagesResponse's quality and usage (a usage of another shape: none); dev-image says neither."""
    usage = {"input_tokens": 50, "output_tokens": 4160, "total_tokens": 4210,
             "input_tokens_details": {"text_tokens": 50, "image_tokens": 0}}
    png = base64.b64encode(tiny_png(1)).decode()
    answer = {"created": 1, "quality": "high", "usage": usage, "data": [{"b64_json": png}]}
    odd = {**answer, "usage": {"input_tokens": "fifty"}}
    double.cue(Cue(body=answer), Cue(body=answer), Cue(body=odd), Cue(body=odd))
    body = {"model": "image-up", "prompt": "a lighthouse", "quality": "auto"}
    pieces = [b async for b in images.CreateImageHttp(http_body(body), metadata=bearer(secret))]
    rest = orjson.loads(b"".join(piece.data for piece in pieces))
    assert (rest["quality"], rest["usage"]) == ("high", usage)
    typed = await images.CreateImage(image_request(), metadata=bearer(secret))
    assert base64.b64decode(typed.data[0].b64_json) == tiny_png(1)
    assert typed.quality == "high" and json_format.MessageToDict(typed.usage, preserving_proto_field_name=True) == {
        "input_tokens": "50", "output_tokens": "4160", "total_tokens": "4210",
        "input_tokens_details": {"text_tokens": "50"}}  # proto3 JSON: int64 as strings, zeros left out
    pieces = [b async for b in images.CreateImageHttp(http_body(body), metadata=bearer(secret))]
    assert orjson.loads(b"".join(piece.data for piece in pieces))["usage"] == {"input_tokens": "fifty"}
    typed = await images.CreateImage(image_request(), metadata=bearer(secret))
    assert typed.quality == "high" and not typed.HasField("usage")
    dev = [b async for b in images.CreateImageHttp(http_body({**body, "model": "image-dev", "size": "256x256"}),
                                                   metadata=bearer(secret))]
    assert not {"quality", "usage"} & set(orjson.loads(b"".join(piece.data for piece in dev)))
    typed = await images.CreateImage(image_request(model="image-dev", size="256x256"), metadata=bearer(secret))
    assert not typed.HasField("quality") and not typed.HasField("usage")


async def test_a_failure_the_upstream_reports_in_a_200_answer_keeps_its_meaning(images, double, secret):
    """OpenAI-compatible servers may report a failure in a 200 answer, as chat completions read it: the caller gets
    the upstream's status and words (a refused prompt is the 400 naming it), not 'answered without images'."""
    refusal = {"error": {"message": "Your prompt was rejected.", "param": "prompt", "code": 400}}
    double.cue(Cue(body=refusal))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await images.CreateImage(image_request(), metadata=bearer(secret))
    detail = error_details(caught.value)
    assert (detail.http_status, detail.error.param) == (400, "prompt")
    assert detail.error.message == "Your prompt was rejected."
    assert len(double.seen) == 1


async def test_an_answer_whose_error_member_is_null_is_an_answer(images, double, secret):
    """`"error": null` beside the images (a server whose answer model has an optional error) says no error, as the
    openai SDK reads it (a truthy `error` only): it was a 502 'failed', asked for again, and each time drawn."""
    double.cue(Cue(body={"created": 1, "data": [{"b64_json": base64.b64encode(tiny_png(1)).decode()}], "error": None}))
    response = await images.CreateImage(image_request(), metadata=bearer(secret))
    assert len(response.data) == 1 and len(double.seen) == 1
