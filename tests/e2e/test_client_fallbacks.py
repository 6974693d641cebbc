"""portico.client's fallbacks and 503 handling against a real gateway whose limits live in a Redis of this module:
family-a-5.4 is limited to 1 request per minute per key (limits.models), so an alias whose primary it is gets a
real 429 on its second call; stopping Redis (SIGSTOP) makes the gateway answer a real 503 until it is resumed."""

from __future__ import annotations

import signal
import time

import pytest

from portico.client import (
    AsyncPorticoClient, ModelAliases, NotFoundError, PorticoClient, RateLimitError, RetriesExhausted, RetryPolicy,
    ServiceUnavailableError,
)
from tests.e2e.conftest import default_config_with_limits, running_gateway

HI = [{"role": "user", "content": "Hi"}]
ALIASES = ModelAliases.from_config({"chat": {"primary": "family-a-5.4", "fallbacks": ["family-a-5.5"]}})


@pytest.fixture(scope="module")
def limited(tmp_path_factory, redis):
    config = default_config_with_limits(tmp_path_factory.mktemp("client-config"), store=redis.url,
                                        store_timeout_seconds=0.2,
                                        models={"family-a-5.4": {"requests_per_minute": 1}})
    with running_gateway(tmp_path_factory.mktemp("client-data"), config=config) as gateway:
        yield gateway


@pytest.fixture(params=["grpc", "rest"])
def transport(request) -> str:
    return request.param


def client_for(gateway, transport: str, secret: str, **options) -> PorticoClient:
    options.setdefault("aliases", ALIASES)
    if transport == "grpc":
        return PorticoClient.over_grpc(f"127.0.0.1:{gateway.port}", secret, **options)
    return PorticoClient.over_rest(gateway.base_url, secret, **options)


def create_key(gateway, *options: str) -> str:
    return gateway.cli("keys", "create", "--name", "fallbacks", *options).stdout.strip().splitlines()[-1]


def test_a_rate_limited_primary_falls_back(limited, transport):
    secret = create_key(limited, "--all-models")
    sleeps = []
    with client_for(limited, transport, secret, retry=RetryPolicy(attempts=3, cap=10.0), sleep=sleeps.append) as c:
        assert c.chat_completion("chat", HI, max_tokens=1).model == "family-a-5.4"
        # The primary's 429 asks for ~60 s, over the cap: no waiting, straight to the fallback.
        assert c.chat_completion("chat", HI, max_tokens=1).model == "family-a-5.5"
    assert sleeps == []
    with client_for(limited, transport, secret, retry=RetryPolicy(attempts=2, cap=90.0), sleep=sleeps.append) as c:
        assert c.chat_completion("chat", HI, max_tokens=1).model == "family-a-5.5"
    assert len(sleeps) == 1 and 50 < sleeps[0] <= 90  # one wait for the hint, a second 429, then the fallback


def test_when_the_fallback_cannot_serve_either_the_error_names_every_failure(limited, transport):
    secret = create_key(limited, "--models", "family-a-5.4")
    with client_for(limited, transport, secret, retry=RetryPolicy(attempts=2, cap=5.0)) as client:
        assert client.chat_completion("chat", HI, max_tokens=1).model == "family-a-5.4"
        with pytest.raises(RetriesExhausted) as caught:
            client.chat_completion("chat", HI, max_tokens=1)
    (primary, rate_limited), (fallback, not_granted) = caught.value.failures
    assert (primary, fallback) == ("family-a-5.4", "family-a-5.5")
    assert isinstance(rate_limited, RateLimitError) and 50 < rate_limited.retry_after <= 60
    assert isinstance(not_granted, NotFoundError) and not_granted.param == "model"
    assert caught.value.last is not_granted
    assert "on family-a-5.4 -> family-a-5.5" in str(caught.value)


async def test_the_asyncio_client_falls_back_too(limited):
    secret = create_key(limited, "--all-models")
    async with AsyncPorticoClient.over_grpc(f"127.0.0.1:{limited.port}", secret, aliases=ALIASES) as client:
        models = [(await client.chat_completion("chat", HI, max_tokens=1)).model for _ in range(3)]
    assert models == ["family-a-5.4", "family-a-5.5", "family-a-5.5"]


def test_a_503_from_the_gateway_is_retried_until_it_recovers(limited, redis, transport):
    secret = create_key(limited, "--all-models")
    policy = RetryPolicy(attempts=2, base=0.5, cap=5.0)
    sleeps = []
    redis.process.send_signal(signal.SIGSTOP)  # the limit store stops answering; limits.on_store_error is closed
    try:
        with client_for(limited, transport, secret, retry=policy, sleep=sleeps.append) as client:
            with pytest.raises(RetriesExhausted) as caught:
                client.chat_completion("family-a-5.5", HI, max_tokens=1)
        assert len(sleeps) == 1 and 1.0 <= sleeps[0] <= 5.0
        for _, error in caught.value.failures:
            assert isinstance(error, ServiceUnavailableError)
            assert (error.status, error.code, error.retry_after) == (503, "service_unavailable", 1.0)

        def sleep_then_resume(seconds: float) -> None:
            sleeps.append(seconds)
            if len(sleeps) == 3:
                redis.process.send_signal(signal.SIGCONT)
            if len(sleeps) >= 3:  # the wait retry-after asks for, in which the gateway finds Redis answering again
                time.sleep(seconds)

        with client_for(limited, transport, secret, retry=RetryPolicy(attempts=6, base=0.5, cap=5.0),
                        sleep=sleep_then_resume) as client:
            assert client.chat_completion("family-a-5.5", HI, max_tokens=1).model == "family-a-5.5"
        assert len(sleeps) >= 3 and all(1.0 <= s <= 5.0 for s in sleeps)
    finally:
        redis.process.send_signal(signal.SIGCONT)
