"""`portico serve --workers 2` with Redis, through Envoy and the official SDKs: one deployment health board shared
by both workers (the ejection threshold counts failures from both), /readyz showing it, and response-cache answers
shared by both processes, JSON and streams, with `x-portico-cache` and `Cache-Control: no-cache`."""

from __future__ import annotations

import os
import re

import anthropic
import httpx
import openai
import pytest

from tests.e2e.conftest import Gateway, running_gateway
from tests.upstream_double import Cue
from tests.upstream_support import UPSTREAM_KEY, UPSTREAM_KEY_ENV, write_config

BUSY = Cue(503, {"error": {"message": "busy"}})
HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def west(other_double):
    return other_double


@pytest.fixture(scope="module")
def workers(tmp_path_factory, redis_server, double, west) -> Gateway:
    def provider(url: str, kind: str = "openai") -> str:
        url = url if kind == "openai" else url.removesuffix("/v1")
        return (f"{{kind: {kind}, base_url: '{url}', api_key_env: {UPSTREAM_KEY_ENV}, model: m, "
                "retry: {attempts: 1}}")

    models = f"""\
  - id: pair
    endpoint: /v1/chat/completions
    deployments:
      - {{name: east, provider: {provider(double.url)}}}
      - {{name: west, provider: {provider(west.url)}}}
    health: {{consecutive_failures: 4, cooldown_seconds: 60}}
  - {{id: cached-chat, endpoint: /v1/chat/completions, provider: {provider(west.url)}, cache: {{}}}}
  - {{id: cached-messages, endpoint: /v1/messages, provider: {provider(west.url, "anthropic")}, cache: {{}}}}
"""
    directory = tmp_path_factory.mktemp("deployments-e2e")
    config = write_config(directory, models, data_dir=directory / "data")
    config.write_text(config.read_text() + f"limits: {{store: '{redis_server.url}'}}\n")
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    try:
        with running_gateway(directory / "data", "--workers", "2", config=config) as gateway:
            yield gateway
    finally:
        os.environ.pop(UPSTREAM_KEY_ENV, None)


def requests_per_worker(gateway: Gateway) -> list[int]:
    clusters = httpx.get(f"http://127.0.0.1:{gateway.admin_port}/clusters", timeout=60).text
    return [int(n) for n in re.findall(r"^portico_grpc::.*grpc-\d\.sock::rq_total::(\d+)$", clusters, re.M)]


def test_both_workers_share_one_health_board(workers, double, west):
    double.reset()
    double.cue(*[BUSY] * 50)
    client = openai.OpenAI(base_url=f"{workers.base_url}/v1", api_key=workers.secret, max_retries=0)
    before = requests_per_worker(workers)
    for _ in range(40):
        answer = client.chat.completions.create(model="pair", messages=HELLO, max_tokens=8)
        assert answer.choices[0].message.content == "echo Say hello."  # no caller sees east's failures
    assert all(after > b for after, b in zip(requests_per_worker(workers), before))  # both workers served
    assert len(double.seen) == 4  # the threshold, counted across both workers (each alone would allow 4 more)
    ready = httpx.get(f"{workers.base_url}/readyz", timeout=60).json()
    assert ready["status"] == "ready"
    assert (ready["checks"]["deployment:pair/east"], ready["checks"]["deployment:pair/west"]) == ("ejected",
                                                                                                  "healthy")


def test_cached_answers_are_shared_by_both_workers_for_json_and_streams(workers, west):
    west.reset()
    client = openai.OpenAI(base_url=f"{workers.base_url}/v1", api_key=workers.secret, max_retries=0)
    results = []
    for _ in range(6):
        raw = client.chat.completions.with_raw_response.create(model="cached-chat", messages=HELLO, max_tokens=8,
                                                                seed=5)
        results.append(raw.headers["x-portico-cache"])
        assert raw.parse().choices[0].message.content == "echo Say hello."
    assert results == ["miss"] + ["hit"] * 5 and len(west.seen) == 1
    for expected in ("miss", "hit"):
        with client.chat.completions.with_streaming_response.create(
                model="cached-chat", messages=HELLO, max_tokens=8, stream=True) as response:
            assert response.headers["x-portico-cache"] == expected
            text = "".join(chunk.choices[0].delta.content or "" for chunk in response.parse() if chunk.choices)
        assert text == "echo Say hello."
    refused = client.chat.completions.with_raw_response.create(
        model="cached-chat", messages=HELLO, max_tokens=8, seed=5, extra_headers={"Cache-Control": "no-cache"})
    assert refused.headers["x-portico-cache"] == "miss" and len(west.seen) == 3


def test_cached_messages_through_the_anthropic_sdk(workers, west):
    west.reset()
    client = anthropic.Anthropic(base_url=workers.base_url, api_key=workers.secret, max_retries=0)
    for expected in ("miss", "hit"):
        raw = client.messages.with_raw_response.create(model="cached-messages", messages=HELLO, max_tokens=8)
        assert raw.headers["x-portico-cache"] == expected
        assert raw.parse().content[0].text == "echo Say hello."
    for expected in ("miss", "hit"):
        with client.messages.stream(model="cached-messages", messages=HELLO, max_tokens=8) as stream:
            assert stream.response.headers["x-portico-cache"] == expected
            assert stream.get_final_text() == "echo Say hello."
    assert len(west.seen) == 2
