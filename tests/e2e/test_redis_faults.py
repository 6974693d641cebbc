"""The Redis limit store failing while `portico serve` (real Envoy) serves the official SDKs, as docs/operations.md
"Several hosts" describes it: a Redis full under `noeviction` (its `maxmemory` reached) refuses writes, answered as
`limits.on_store_error` says (here `closed`: 503 and not ready), and serves again once it has room, with no restart.
"""

from __future__ import annotations

import signal
import subprocess
import time

import httpx
import openai
import pytest

from tests.e2e.conftest import default_config_with_limits, running_gateway

HI = [{"role": "user", "content": "Hi"}]


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, redis):
    config = default_config_with_limits(tmp_path_factory.mktemp("faults-config"), store=redis.url,
                                        store_timeout_seconds=0.5)
    with running_gateway(tmp_path_factory.mktemp("faults-data"), config=config) as gateway:
        yield gateway


def redis_cli(redis, *args: str) -> str:
    return subprocess.run(["redis-cli", "-p", str(redis.port), *args], capture_output=True, text=True,
                          timeout=10, check=True).stdout.strip()


def ready(gateway) -> int:
    return httpx.get(f"{gateway.base_url}/readyz", timeout=10).status_code


def wait_for_readiness(gateway, status: int, seconds: float = 5.0) -> None:
    deadline = time.monotonic() + seconds
    while (now := ready(gateway)) != status:
        assert time.monotonic() < deadline, f"/readyz stayed {now}"
        time.sleep(0.1)


def test_a_full_redis_under_noeviction_is_a_503_for_callers_not_a_count_past_its_maxmemory(gateway, redis):
    """Portico's reservation script began with a write Redis does not refuse when out of memory (pruning the window),
    and Redis lets a script that has written go on writing: a full Redis booked every request past its maxmemory,
    while readiness (a plain write) said the limit store was unreachable. Callers now get the 503 readiness
    promises, and nothing is booked until Redis has room."""
    sdk = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.secret, max_retries=0)
    sdk.chat.completions.create(model="family-a-5.5", messages=HI, max_tokens=1)  # its scopes exist in Redis
    keys_before = redis_cli(redis, "DBSIZE")
    redis_cli(redis, "CONFIG", "SET", "maxmemory", "1")  # full: every write that needs memory is refused
    try:
        wait_for_readiness(gateway, 503)
        for _ in range(3):
            with pytest.raises(openai.APIStatusError) as refused:
                sdk.chat.completions.create(model="family-a-5.5", messages=HI, max_tokens=1)
            assert refused.value.status_code == 503
            assert refused.value.body["code"] == "service_unavailable"
            assert "limit store" in refused.value.body["message"]
            assert refused.value.response.headers["retry-after"]
        assert redis_cli(redis, "DBSIZE") == keys_before  # no reservation booked while full
    finally:
        redis_cli(redis, "CONFIG", "SET", "maxmemory", "0")
    wait_for_readiness(gateway, 200)
    answer = sdk.chat.completions.create(model="family-a-5.5", messages=HI, max_tokens=1)
    assert answer.choices[0].message.content


def test_a_frozen_redis_makes_callers_wait_its_timeout_about_once_a_second_not_at_every_request(gateway, redis):
    """A Redis frozen (SIGSTOP; a host gone without a reset) takes connections and answers nothing: every request
    waited out limits.store_timeout_seconds (0.5 s here) before its 503, one after another, for the whole outage.
    Now one request a second tries Redis; the others get the 503 at once. Served again once it answers."""
    sdk = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.secret, max_retries=0)
    sdk.chat.completions.create(model="family-a-5.5", messages=HI, max_tokens=1)
    redis.process.send_signal(signal.SIGSTOP)
    try:
        waits = []
        started = time.monotonic()
        while len(waits) < 12:
            began = time.monotonic()
            with pytest.raises(openai.APIStatusError) as refused:
                sdk.chat.completions.create(model="family-a-5.5", messages=HI, max_tokens=1)
            waits.append(time.monotonic() - began)
            assert refused.value.status_code == 503
            assert refused.value.body["code"] == "service_unavailable"
        seconds = time.monotonic() - started
        slow = [wait for wait in waits if wait >= 0.4]
        assert len(slow) <= seconds + 1, waits  # about one a second, not all twelve (6 s)
        assert len(waits) - len(slow) >= 6, waits
    finally:
        redis.process.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 5
    while True:
        try:
            assert sdk.chat.completions.create(model="family-a-5.5", messages=HI, max_tokens=1).choices
            break
        except openai.APIStatusError as error:
            assert error.status_code == 503 and time.monotonic() < deadline
            time.sleep(0.1)
