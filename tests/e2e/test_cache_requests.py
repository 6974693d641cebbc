"""The response cache as an HTTP caller meets it through Envoy: the request headers HTTP gives for "no stored
answer" (`Cache-Control: no-cache`, `max-age=0`, `Pragma: no-cache`) each reach the upstream, and a body that
differs only in how a number is spelled (`1` or `1.0`) is the same request, so a hit."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.conftest import Gateway, upstream_gateway

HELLO = [{"role": "user", "content": "Say hello."}]


@pytest.fixture(scope="module")
def cached(tmp_path_factory, double) -> Gateway:
    provider = f"{{kind: openai, base_url: '{double.url}', api_key_env: PORTICO_TEST_UPSTREAM_KEY, model: m}}"
    models = f"  - {{id: cached-chat, endpoint: /v1/chat/completions, provider: {provider}, cache: {{}}}}\n"
    with upstream_gateway(tmp_path_factory.mktemp("cache-requests"), models) as gateway:
        yield gateway


def post(gateway: Gateway, body: bytes, **headers: str) -> str:
    answer = httpx.post(f"{gateway.base_url}/v1/chat/completions", content=body, timeout=60,
                        headers={"authorization": f"Bearer {gateway.secret}", "content-type": "application/json",
                                 **headers})
    assert answer.status_code == 200, answer.text
    return answer.headers["x-portico-cache"]


@pytest.mark.parametrize("headers", [{"cache-control": "no-cache"}, {"cache-control": "max-age=0"},
                                     {"cache-control": "Max-Age=0, no-transform"}, {"pragma": "no-cache"}],
                         ids=["no-cache", "max-age=0", "max-age=0-among-others", "pragma"])
def test_a_caller_asking_for_no_stored_answer_gets_a_fresh_one(cached, double, headers):
    body = b'{"model": "cached-chat", "messages": [{"role": "user", "content": "%s"}], "max_tokens": 8}' % (
        repr(headers).encode())
    assert post(cached, body) == "miss"
    assert post(cached, body) == "hit"
    before = len(double.seen)
    assert post(cached, body, **headers) == "miss"
    assert len(double.seen) == before + 1
    assert post(cached, body) == "hit"  # the fresh answer was kept


def test_max_age_refuses_older_answers_only(cached, double):
    body = b'{"model": "cached-chat", "messages": [{"role": "user", "content": "kept"}], "max_tokens": 8}'
    assert post(cached, body) == "miss"
    assert post(cached, body, **{"cache-control": "max-age=3600"}) == "hit"
    # RFC 9111 5.4: Pragma is read only when there is no Cache-Control
    assert post(cached, body, **{"cache-control": "max-stale", "pragma": "no-cache"}) == "hit"
    time.sleep(1.1)
    before = len(double.seen)
    assert post(cached, body, **{"cache-control": "max-age=1"}) == "miss"
    assert len(double.seen) == before + 1
    assert post(cached, body, **{"cache-control": "max-age=1"}) == "hit"  # the fresh answer


def test_numbers_spelled_differently_are_one_request(cached, double):
    before = len(double.seen)
    first = b'{"model": "cached-chat", "messages": %s, "max_tokens": 5, "temperature": 1, "seed": 7}'
    again = b'{"model": "cached-chat", "messages": %s, "max_tokens": 5.0, "temperature": 1.0, "seed": 7e0}'
    messages = b'[{"role": "user", "content": "Say hello."}]'
    assert post(cached, first % messages) == "miss"
    assert post(cached, again % messages) == "hit"
    assert post(cached, (first % messages).replace(b'"temperature": 1', b'"temperature": 0.5')) == "miss"
    assert len(double.seen) == before + 2
