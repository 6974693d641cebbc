"""portico.client against a gateway whose images model is an OpenAI-compatible upstream (the double), for answers the
embedded models cannot give: a CreateImage answer larger than the 4 MiB a grpc channel receives by default."""

from __future__ import annotations

import base64
import os

import pytest

from portico.client import Operation, PorticoClient, RetryPolicy
from portico.v1 import image_pb2, image_service_pb2_grpc
from tests.e2e.conftest import upstream_gateway
from tests.upstream_double import Cue
from tests.upstream_echo import tiny_png
from tests.upstream_support import UPSTREAM_KEY_ENV

CREATE_IMAGE = Operation(image_service_pb2_grpc.ImageServiceStub, "CreateImage", image_pb2.CreateImageRequest,
                         image_pb2.ImagesResponse, "POST", "/v1/images/generations")


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    provider = f"{{kind: openai, base_url: '{double.url}', api_key_env: {UPSTREAM_KEY_ENV}, model: gpt-image-up}}"
    models = f"  - {{id: image-up, endpoint: /v1/images/generations, provider: {provider}}}\n"
    with upstream_gateway(tmp_path_factory.mktemp("client-upstream"), models) as gateway:
        yield gateway


@pytest.fixture(params=["grpc", "rest"])
def transport(request) -> str:
    return request.param


def test_an_images_answer_over_4_mib_is_received_on_both_transports(gateway, double, transport):
    """api.md: the server sends gRPC answers of up to 64 MiB. A channel with grpc's default 4 MiB limit failed with a
    client-side RESOURCE_EXHAUSTED, which read as a 429 and was retried: three generations, all lost."""
    double.reset()
    images = [tiny_png(i) + os.urandom(700_000) for i in range(8)]  # about 7.5 MiB as base64
    data = [{"b64_json": base64.b64encode(image).decode()} for image in images]
    double.cue(Cue(body={"created": 1, "data": data}))
    sleeps: list[float] = []
    target = f"127.0.0.1:{gateway.port}" if transport == "grpc" else gateway.base_url
    make = PorticoClient.over_grpc if transport == "grpc" else PorticoClient.over_rest
    with make(target, gateway.secret, retry=RetryPolicy(attempts=3), sleep=sleeps.append) as client:
        answer = client.call(CREATE_IMAGE, {"prompt": "a cat", "n": 8, "response_format": "b64_json"},
                             model="image-up")
    assert sleeps == [] and len([seen for seen in double.seen if seen.path.endswith("/images/generations")]) == 1
    assert [item.b64_json for item in answer.data] == [entry["b64_json"] for entry in data]
