"""Image links (`response_format: url`) as a browser or an HTTP client meets them through the real gateway."""

from __future__ import annotations

import base64
import os
import re
import socket

import httpx
import openai
import pytest

from server.image_store import LINK_TTL_SECONDS
from tests.e2e.conftest import upstream_gateway
from tests.e2e.test_caller_gone_unary import admin, rows
from tests.upstream_double import Cue
from tests.upstream_echo import tiny_png
from tests.upstream_support import UPSTREAM_KEY_ENV


def test_a_link_may_be_kept_by_the_callers_cache_until_it_expires(oai: openai.OpenAI):
    """The bytes behind a link never change: a page that shows the image again need not fetch it again, but no
    cache may keep it past the link's hour, nor share it (the link is its only credential)."""
    url = oai.images.generate(model="family-a-image-2", prompt="a lighthouse", size="256x256",
                              response_format="url").data[0].url
    for answer in (httpx.get(url), httpx.head(url)):
        assert answer.status_code == 200 and answer.headers["content-type"] == "image/png"
        cache = answer.headers.get("cache-control", "")
        assert re.fullmatch(r"private, max-age=\d+, immutable", cache), cache
        assert LINK_TTL_SECONDS - 60 <= int(cache.split("max-age=")[1].split(",")[0]) <= LINK_TTL_SECONDS
    refused = httpx.get(url[:-4] + "0000")  # its signature changed
    assert refused.status_code == 404 and "max-age" not in refused.headers.get("cache-control", "")


REFUSED = "points at an address Portico does not fetch from"


@pytest.fixture(scope="module")
def linking(double, tmp_path_factory):
    """`image-local`: an upstream on 127.0.0.1 (as vLLM beside the gateway); `image-far`: one on a public address,
    reached through HTTP_PROXY (the double, answering as the upstream), whose links are its own to choose."""
    provider = f"kind: openai, api_key_env: {UPSTREAM_KEY_ENV}, model: image-up, retry: {{attempts: 1}}"
    models = (f"  - {{id: image-local, endpoint: /v1/images/generations, provider: {{{provider}, "
              f"base_url: '{double.url}'}}}}\n"
              f"  - {{id: image-far, endpoint: /v1/images/generations, provider: {{{provider}, "
              "base_url: 'http://93.184.215.14/v1'}}\n"
              f"  - {{id: image-priced, endpoint: /v1/images/generations, price: {{image: 0.01}}, provider: "
              f"{{{provider}, base_url: '{double.url}', timeouts: {{answer: 1}}}}}}\n")
    proxies = {"HTTP_PROXY": f"http://127.0.0.1:{double.port}", "NO_PROXY": "127.0.0.1,localhost"}
    os.environ.update(proxies)
    try:
        with upstream_gateway(tmp_path_factory.mktemp("image-links"), models) as gateway:
            yield gateway
    finally:
        for name in proxies:
            os.environ.pop(name, None)


@pytest.fixture
def sdk(linking, double) -> openai.OpenAI:
    double.reset()
    return openai.OpenAI(base_url=f"{linking.base_url}/v1", api_key=linking.secret, max_retries=0)


@pytest.fixture
def listener():
    """A server on 127.0.0.1 that must never be connected to: a connection would wait in its backlog."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.setblocking(False)
        yield server


def links(*urls: str) -> Cue:
    return Cue(body={"created": 1, "data": [{"url": url} for url in urls]})


def test_a_public_upstreams_link_into_the_gateways_network_is_refused_unfetched(sdk, double, linking, listener):
    """A third-party or compromised upstream choosing links to 127.0.0.1 (the gateway's metrics, Envoy's admin
    port), in any spelling, learns nothing from the 502, and nothing there is connected to; logged once."""
    port = listener.getsockname()[1]
    for host in ("127.0.0.1", "2130706433", "localhost", "127.0.0.1"):
        double.cue(links(f"http://{host}:{port}/x.png"))
        with pytest.raises(openai.APIStatusError) as caught:
            sdk.images.generate(model="image-far", prompt="a lighthouse", size="256x256", response_format="url")
        error = caught.value
        assert (error.status_code, error.code) == (502, "upstream_error")
        assert error.body["message"] == f"The upstream's image link for `image-far` {REFUSED}."
    assert [seen.path for seen in double.seen] == ["/v1/images/generations"] * 4  # asked through the proxy, once each
    with pytest.raises(BlockingIOError):
        listener.accept()  # no connection came
    logged = [line for line in linking.log_path.read_text().splitlines() if "not fetched" in line]
    assert len(logged) == 1 and "image-far" in logged[0] and "loopback" in logged[0]


def test_a_link_to_cloud_metadata_is_refused_even_from_a_local_upstream(sdk, double):
    for link in ("http://169.254.169.254/latest/meta-data/", "http://[::ffff:169.254.169.254]/latest/meta-data/"):
        double.cue(links(link))
        with pytest.raises(openai.APIStatusError) as caught:
            sdk.images.generate(model="image-local", prompt="a lighthouse", size="256x256")
        assert (caught.value.status_code, caught.value.code) == (502, "upstream_error")
        assert REFUSED in caught.value.message and "169.254" not in caught.value.message


def png_b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# Answers after which the upstream has drawn and billed (a 200), but Portico answers 502, and the images it counts.
BILLED_502S = {
    "a-link-that-cannot-be-fetched": (lambda url: links(f"{url}/files/lost.png", f"{url}/files/lost.png"), 2),
    "a-link-into-cloud-metadata": (lambda url: links("http://169.254.169.254/latest/meta-data/"), 1),
    "bytes-that-are-no-image": (lambda url: Cue(body={"created": 1, "data": [{"b64_json": png_b64(b"hello")}]}), 1),
    # An answer that cannot be read names no images: counted as the two asked for, which it was drawing.
    "an-answer-cut-off": (lambda url: Cue(body={"created": 1, "data": [{"b64_json": png_b64(tiny_png(1))}] * 2},
                                          drop_after=1), 2),
    "invalid-json": (lambda url: Cue(body=b'{"created": 1, "data": [{"b64_json": "'), 2),
    # Its second half comes after the deployment's 1 s answer timeout: a 504.
    "an-answer-too-slow": (lambda url: Cue(body={"created": 1, "data": [{"b64_json": png_b64(tiny_png(1))}] * 2},
                                           frame_delay=1.5), 2),
    # No answer at all within the 1 s (an images API answers once its images are drawn): it was drawing the two.
    "no-answer-in-time": (lambda url: Cue(body={"created": 1, "data": [{"b64_json": png_b64(tiny_png(1))}] * 2},
                                          delay=1.5), 2),
}
TIMEOUTS = ("an-answer-too-slow", "no-answer-in-time")


@pytest.mark.parametrize("fault", BILLED_502S)
def test_a_502_after_the_upstream_drew_is_not_retried_by_the_sdk_and_counts_the_images(linking, double, fault):
    """The openai SDK retries a 502 twice by default: each retry had the upstream draw and bill the images again, for
    an answer that failed the same way. Now the 502 says `x-should-retry: false` (one draw), and its ledger row
    counts the images drawn, at their price."""
    double.reset()
    cue, drawn = BILLED_502S[fault]
    double.cue(cue(double.url.removesuffix("/v1")))  # once: a retry would be answered with images
    out = linking.cli("keys", "create", "--name", f"billed-{fault}", "--all-models").stdout
    key_id, secret = out.split()[2], out.split()[-1]
    sdk = openai.OpenAI(base_url=f"{linking.base_url}/v1", api_key=secret)  # the default 2 retries
    with pytest.raises(openai.APIStatusError) as caught:
        sdk.images.generate(model="image-priced", prompt="a lighthouse", n=2, size="256x256")
    status, code = (504, "upstream_timeout") if fault in TIMEOUTS else (502, "upstream_error")
    assert (caught.value.status_code, caught.value.code) == (status, code)
    assert caught.value.response.headers.get("x-should-retry") == "false"
    assert [seen.path for seen in double.seen].count("/v1/images/generations") == 1
    (row,) = rows(linking, key_id, admin(linking))
    assert (row["status"], row["images"], row["cost_microdollars"]) == (status, drawn, drawn * 10_000), row


def test_a_local_upstreams_links_on_the_same_host_are_fetched(sdk, double):
    """vLLM on 127.0.0.1 whose links name `localhost` (another origin, the same class): fetched as before."""
    double.files["s.png"] = tiny_png(7)
    double.cue(links(f"http://localhost:{double.port}/files/s.png"))
    image = sdk.images.generate(model="image-local", prompt="a lighthouse", size="256x256",
                                response_format="b64_json").data[0]
    assert base64.b64decode(image.b64_json) == tiny_png(7)
