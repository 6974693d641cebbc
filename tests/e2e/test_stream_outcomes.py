"""Answers through Envoy with Redis limits, counted as the caller saw them: streams read to `[DONE]` by callers who
close at once are 200s in the access log and the metrics (never 499s), and the shared limit store settles exactly
the tokens they used; an upstream failure of a cached model still says `x-portico-cache`."""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest
import redis
import yaml

from server.limits.core import day_of
from tests.e2e.conftest import Gateway, running_gateway
from tests.e2e.test_operations import access_lines, scrape, value
from tests.upstream_double import Cue
from tests.upstream_support import UPSTREAM_KEY, UPSTREAM_KEY_ENV

HELLO = [{"role": "user", "content": "Say hello."}]
STREAMS = 60


@pytest.fixture(scope="module")
def limited(tmp_path_factory, redis_server, double) -> Gateway:
    provider = {"kind": "openai", "base_url": double.url, "api_key_env": UPSTREAM_KEY_ENV, "model": "m",
                "retry": {"attempts": 1}}
    raw = {
        "limits": {"store": redis_server.url, "defaults": {"requests_per_minute": 100_000}},
        "models": [
            {"id": "plain-chat", "endpoint": "/v1/chat/completions", "provider": provider},
            {"id": "cached-chat", "endpoint": "/v1/chat/completions", "provider": provider, "cache": {}},
        ],
    }
    config = tmp_path_factory.mktemp("outcomes-config") / "portico.yaml"
    config.write_text(yaml.safe_dump(raw))
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    try:
        with running_gateway(tmp_path_factory.mktemp("outcomes-data"), config=config) as gateway:
            yield gateway
    finally:
        os.environ.pop(UPSTREAM_KEY_ENV, None)


def new_key(gateway: Gateway) -> tuple[str, str]:
    created = gateway.cli("keys", "create", "--name", "streams", "--all-models").stdout
    return created.split()[2], created.split()[-1]


async def read_to_done(client: httpx.AsyncClient, secret: str, model: str) -> int:
    """A stream read up to `data: [DONE]`, then closed at once, as the official SDKs do."""
    async with client.stream("POST", "/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                             json={"model": model, "messages": HELLO, "stream": True, "max_tokens": 8}) as response:
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                return response.status_code
    raise AssertionError("the stream ended without [DONE]")


async def many_streams(gateway: Gateway, secret: str, model: str, count: int) -> list[int]:
    # One connection per stream: closing it is what tells Envoy, and then the server, that the caller left.
    limits = httpx.Limits(max_connections=count, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=gateway.base_url, timeout=30, limits=limits) as client:
        return await asyncio.gather(*(read_to_done(client, secret, model) for _ in range(count)))


@pytest.mark.parametrize("model", ["cached-chat", "plain-chat"])
def test_streams_read_to_done_are_200s_and_settle_what_they_used(limited, redis_server, double, model):
    double.reset()
    key_id, secret = new_key(limited)
    if model == "cached-chat":
        assert asyncio.run(many_streams(limited, secret, model, 1)) == [200]  # the miss that fills the cache
    statuses = asyncio.run(many_streams(limited, secret, model, STREAMS))
    assert statuses == [200] * STREAMS

    expected = STREAMS + (model == "cached-chat")
    deadline = time.monotonic() + 10
    while len(lines := [x for x in access_lines(limited) if x["key_id"] == key_id]) < expected:
        assert time.monotonic() < deadline, f"{len(lines)} access-log lines"
        time.sleep(0.05)
    assert [line["status"] for line in lines] == [200] * expected
    samples = scrape(limited)
    assert value(samples, "portico_requests_total", endpoint="/v1/chat/completions", model=model, status="200",
                 code="") >= expected
    assert value(samples, "portico_requests_total", endpoint="/v1/chat/completions", model=model, status="499",
                 code="cancelled") == 0

    # The shared limit store holds what the streams really used (the estimates were larger: max_tokens 8).
    used = sum(line["input_tokens"] + line["output_tokens"] for line in lines)
    assert used == 5 * (expected - STREAMS if model == "cached-chat" else STREAMS)  # hits use nothing
    day = redis.Redis.from_url(redis_server.url).hgetall(f"portico:limits:{key_id}:day:{day_of(time.time())}")
    assert (int(day[b"requests"]), int(day[b"tokens"])) == (expected, used)


@pytest.mark.parametrize("stream", [False, True])
def test_an_upstream_failure_of_a_cached_model_says_the_cache_missed(limited, double, stream):
    double.reset()
    double.cue(Cue(500, {"error": {"message": "boom"}}))
    answer = httpx.post(f"{limited.base_url}/v1/chat/completions", timeout=30,
                        headers={"Authorization": f"Bearer {limited.secret}"},
                        json={"model": "cached-chat", "messages": HELLO, "stream": stream, "seed": 11})
    assert answer.status_code == 502 and answer.json()["error"]["code"] == "upstream_error"
    assert answer.headers["x-portico-cache"] == "miss"
