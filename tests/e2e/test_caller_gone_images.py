"""A caller that leaves an image request to an OpenAI-compatible images upstream (a REST client that disconnects, a
gRPC deadline that passes) while the upstream draws: the upstream goes on and bills the images, so Portico lets the
exchange run to its end and counts them, as for a non-streamed chat (test_caller_gone_unary.py; api.md, Rate limits).
The row says 499 `cancelled`, with the images and their cost; the key's budget and concurrency slot say so too. The
development image provider, which costs nothing upstream, still stops at once."""

from __future__ import annotations

import signal
import time

import grpc
import httpx
import pytest
import yaml
from google.protobuf import json_format

from portico.v1 import image_pb2, image_service_pb2_grpc
from tests.e2e.conftest import running_gateway, upstream_gateway
from tests.e2e.test_caller_gone_unary import _ledger_rows, admin, leave, reached, rows, standing
from tests.e2e.test_operations import scrape, value
from tests.helpers import bearer
from tests.upstream_double import Cue
from tests.upstream_echo import tiny_png
from tests.upstream_support import UPSTREAM_KEY_ENV

IMAGES = "/v1/images/generations"
PRICE = 0.01  # dollars an image
UPSTREAM_SECONDS = 3.0  # the upstream's answer comes this long after the request; the caller leaves after 0.5 s


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    provider = f"kind: openai, base_url: '{double.url}', api_key_env: {UPSTREAM_KEY_ENV}, model: image-up"
    retry = "{attempts: 3, initial_backoff: 0.02, max_backoff: 0.1, total_seconds: 10}"
    models = f"""\
  - {{id: image-up, endpoint: {IMAGES}, provider: {{{provider}}}, price: {{image: {PRICE}}}}}
  - {{id: image-flaky, endpoint: {IMAGES}, provider: {{{provider}, retry: {retry}}}, fallbacks: [image-dev],
     price: {{image: {PRICE}}}}}
  - {{id: image-dev, endpoint: {IMAGES}, provider: {{kind: dev-image}}, price: {{image: {PRICE}}}}}
"""
    with upstream_gateway(tmp_path_factory.mktemp("caller-gone-images"), models) as gateway:
        yield gateway


def key(gateway, name: str) -> tuple[str, str]:
    out = gateway.cli("keys", "create", "--name", name, "--all-models", "--concurrency", "5",
                      "--max-spend-day", "5").stdout
    return out.split()[2], out.split()[-1]


def test_a_rest_caller_who_leaves_is_counted_with_the_images_the_upstream_drew(gateway, double):
    double.reset()
    double.cue(Cue(delay=UPSTREAM_SECONDS))
    key_id, secret = key(gateway, "leaves")
    headers = admin(gateway)
    before = scrape(gateway)
    leave(f"{gateway.base_url}{IMAGES}", {"model": "image-up", "prompt": "a lighthouse", "n": 3},
          {"authorization": f"Bearer {secret}"}, once=reached(double))
    time.sleep(0.5)
    # The upstream is still drawing for this key: its slot stays taken until the images are in.
    assert standing(gateway, key_id, headers)["concurrent_requests"] == 1
    (row,) = rows(gateway, key_id, headers)
    assert (row["status"], row["code"], row["images"]) == (499, "cancelled", 3), row
    assert row["cost_microdollars"] == 3 * PRICE * 1_000_000
    assert double.gone == 0  # the upstream's answer was read to its end
    used = standing(gateway, key_id, headers)
    assert used["concurrent_requests"] == 0 and used["max_spend_day"] == pytest.approx(3 * PRICE)
    after = scrape(gateway)
    spend = "portico_spend_microdollars_total"
    assert value(after, spend, model="image-up", key_id=key_id) - value(before, spend, model="image-up",
                                                                        key_id=key_id) == row["cost_microdollars"]
    cancelled = {"endpoint": IMAGES, "model": "image-up", "status": "499", "code": "cancelled"}
    assert value(after, "portico_requests_total", **cancelled) - value(before, "portico_requests_total",
                                                                       **cancelled) == 1


def test_linked_images_are_fetched_and_counted_after_the_caller_left(gateway, double):
    """An upstream answering with links: the caller leaves while they are fetched, after the upstream drew them."""
    double.reset()
    double.files["a.png"] = tiny_png(1)
    link = f"{double.url.removesuffix('/v1')}/files/a.png"
    double.cue(Cue(body={"created": 1, "data": [{"url": link}]}), Cue(delay=UPSTREAM_SECONDS))
    key_id, secret = key(gateway, "leaves-while-fetching")
    headers = admin(gateway)
    leave(f"{gateway.base_url}{IMAGES}", {"model": "image-up", "prompt": "a lighthouse"},
          {"authorization": f"Bearer {secret}"}, once=reached(double, 2))  # the image's link being fetched
    (row,) = rows(gateway, key_id, headers)
    assert (row["status"], row["code"], row["images"]) == (499, "cancelled", 1), row
    assert row["cost_microdollars"] == PRICE * 1_000_000
    assert standing(gateway, key_id, headers)["max_spend_day"] == pytest.approx(PRICE)


def test_a_grpc_deadline_that_passes_is_counted_with_the_images(gateway, double):
    double.reset()
    double.cue(Cue(delay=UPSTREAM_SECONDS))
    key_id, secret = key(gateway, "deadline")
    headers = admin(gateway)
    request = json_format.ParseDict({"model": "image-up", "prompt": "a lighthouse", "n": 2},
                                    image_pb2.CreateImageRequest())
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        with pytest.raises(grpc.RpcError) as raised:
            image_service_pb2_grpc.ImageServiceStub(channel).CreateImage(request, metadata=bearer(secret), timeout=0.5)
    assert raised.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    (row,) = rows(gateway, key_id, headers)
    assert (row["status"], row["code"], row["images"]) == (499, "cancelled", 2), row
    assert standing(gateway, key_id, headers)["max_spend_day"] == pytest.approx(2 * PRICE)


def test_no_retry_or_fallback_starts_after_the_caller_left(gateway, double):
    """The exchange that then fails is not tried again, nor passed to the development fallback (which would draw for
    nobody): its row says the upstream's 503, with nothing used."""
    double.reset()
    down = {"error": {"message": "overloaded", "type": "server_error"}}
    double.cue(Cue(delay=1.5, status=503, body=down))
    key_id, secret = key(gateway, "no-retry")
    headers = admin(gateway)
    leave(f"{gateway.base_url}{IMAGES}", {"model": "image-flaky", "prompt": "a lighthouse"},
          {"authorization": f"Bearer {secret}"}, once=reached(double))
    (row,) = rows(gateway, key_id, headers)
    assert len(double.seen) == 1
    assert (row["status"], row["code"], row["images"], row["cost_microdollars"]) == (503, "service_unavailable", 0, 0)
    used = standing(gateway, key_id, headers)
    assert used["concurrent_requests"] == 0 and used["max_spend_day"] == 0


def test_the_development_provider_still_stops_when_its_caller_leaves(gateway):
    """It costs nothing upstream: a caller who leaves ends the request at once, with nothing counted."""
    key_id, secret = key(gateway, "dev")
    headers = admin(gateway)
    body = {"model": "image-dev", "prompt": "a lighthouse", "n": 10, "size": "1536x1024", "output_format": "png"}
    with pytest.raises(httpx.ReadTimeout):  # ten such pictures take ~0.6 s to draw: it leaves well before
        httpx.post(f"{gateway.base_url}{IMAGES}", json=body, headers={"authorization": f"Bearer {secret}"},
                   timeout=httpx.Timeout(10, read=0.1))
    (row,) = rows(gateway, key_id, headers)
    assert (row["status"], row["code"], row["images"], row["cost_microdollars"]) == (499, "cancelled", 0, 0), row


def test_a_drain_waits_for_images_whose_caller_left(tmp_path, double, monkeypatch):
    """As for chat: the drain gives the exchange its `drain_seconds`, and the images drawn are counted."""
    monkeypatch.setenv(UPSTREAM_KEY_ENV, "sk-test-drain")
    double.reset()
    double.cue(Cue(delay=UPSTREAM_SECONDS))
    raw = {"drain_seconds": 30, "usage": {"flush_seconds": 0.2},
           "models": [{"id": "image-up", "endpoint": IMAGES, "price": {"image": PRICE},
                       "provider": {"kind": "openai", "base_url": double.url, "api_key_env": UPSTREAM_KEY_ENV,
                                    "model": "image-up"}}]}
    (tmp_path / "portico.yaml").write_text(yaml.safe_dump(raw))
    data_dir = tmp_path / "data"
    with running_gateway(data_dir, config=tmp_path / "portico.yaml") as gateway:
        key_id, secret = key(gateway, "drained")
        left = time.monotonic()
        leave(f"{gateway.base_url}{IMAGES}", {"model": "image-up", "prompt": "a lighthouse", "n": 2},
              {"authorization": f"Bearer {secret}"}, once=reached(double))
        gateway.process.send_signal(signal.SIGTERM)
        assert gateway.process.wait(timeout=30) == 0
        assert time.monotonic() - left >= UPSTREAM_SECONDS - 0.5  # it waited for the images ...
    (row,) = _ledger_rows(data_dir, key_id)
    assert (row.status, row.code, row.images, row.cost_micros) == (499, "cancelled", 2, 2 * PRICE * 1_000_000)
