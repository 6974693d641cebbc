"""Rate limits through Envoy with the official SDKs: 429 RateLimitError with retry-after, x-ratelimit-* headers on
JSON and streamed answers of both dialects, RESOURCE_EXHAUSTED with RetryInfo for gRPC callers."""

from __future__ import annotations

import datetime
import threading
import time

import anthropic
import grpc
import httpx
import httpx2  # the anthropic SDK's own fork of httpx
import openai
import pytest
from google.rpc import error_details_pb2, status_pb2

from portico.v1 import chat_service_pb2_grpc
from server.limits.core import until_midnight
from tests.helpers import bearer, chat_request, internal_headers

HEADERS = {f"x-ratelimit-{what}-{kind}" for what in ("limit", "remaining", "reset") for kind in ("requests", "tokens")}
HI = [{"role": "user", "content": "Hi"}]


def create_key(gateway, *limits: str) -> str:
    return gateway.cli("keys", "create", "--name", "limited", "--all-models", *limits).stdout.strip().splitlines()[-1]


def test_openai_sdk_headers_on_json_and_stream_then_rate_limit_error(gateway):
    secret = create_key(gateway, "--rpm", "2", "--tpm", "50000")
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=secret, max_retries=0)
    raw = client.chat.completions.with_raw_response.create(model="family-a-5.5", messages=HI, max_tokens=2)
    assert HEADERS <= set(raw.headers)
    assert (raw.headers["x-ratelimit-limit-requests"], raw.headers["x-ratelimit-remaining-requests"]) == ("2", "1")
    assert raw.headers["x-ratelimit-limit-tokens"] == "50000"
    assert raw.parse().choices[0].message.content is not None
    with client.chat.completions.with_streaming_response.create(
        model="family-a-5.5", messages=HI, max_tokens=2, stream=True
    ) as streamed:
        assert streamed.headers["content-type"].startswith("text/event-stream")
        assert streamed.headers["x-ratelimit-remaining-requests"] == "0"
        assert HEADERS <= set(streamed.headers)
        assert [line for line in streamed.iter_lines() if line][-1] == "data: [DONE]"
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="family-a-5.5", messages=HI, max_tokens=2)
    error = caught.value
    assert (error.code, error.type, error.param) == ("rate_limit_exceeded", "rate_limit_error", None)
    assert "requests per minute" in error.message
    retry_after = int(error.response.headers["retry-after"])
    retry_after_ms = int(error.response.headers["retry-after-ms"])
    assert 0 < retry_after <= 60 and retry_after - 1 < retry_after_ms / 1000 <= retry_after
    # The refusing limit, as OpenAI describes it on a 429: clients can wait for its reset.
    refused = error.response.headers
    assert (refused["x-ratelimit-limit-requests"], refused["x-ratelimit-remaining-requests"]) == ("2", "0")
    assert refused["x-ratelimit-reset-requests"].endswith("s")
    assert not internal_headers(error.response.headers)


def test_anthropic_sdk_headers_on_json_and_stream_then_rate_limit_error(gateway):
    secret = create_key(gateway, "--rpm", "2")
    client = anthropic.Anthropic(base_url=gateway.base_url, api_key=secret, max_retries=0)
    model = "family-b-haiku-4-5-20251001"
    raw = client.messages.with_raw_response.create(model=model, max_tokens=2, messages=HI)
    assert HEADERS <= set(raw.headers) and raw.headers["x-ratelimit-remaining-requests"] == "1"
    assert raw.parse().type == "message"
    with client.messages.with_streaming_response.create(model=model, max_tokens=2, messages=HI, stream=True) as s:
        assert HEADERS <= set(s.headers) and s.headers["x-ratelimit-remaining-requests"] == "0"
        assert "event: message_stop" in list(s.iter_lines())
    with pytest.raises(anthropic.RateLimitError) as caught:
        client.messages.create(model=model, max_tokens=2, messages=HI)
    body = caught.value.body
    assert body["type"] == "error"
    assert (body["error"]["type"], body["error"]["code"], body["error"]["param"]) == (
        "rate_limit_error", "rate_limit_exceeded", None)
    assert 0 < int(caught.value.response.headers["retry-after"]) <= 60
    assert caught.value.response.headers["x-ratelimit-remaining-requests"] == "0"


ANTHROPIC_HEADERS = {f"anthropic-ratelimit-{kind}-{what}" for kind in ("requests", "tokens")
                     for what in ("limit", "remaining", "reset")}


def test_anthropic_sdk_callers_get_anthropics_own_rate_limit_headers(gateway):
    """Anthropic-SDK callers (and tools built on them) read anthropic-ratelimit-{requests,tokens}-{limit,remaining,
    reset}, the reset an RFC 3339 time, on answers and on a 429; a gateway that only says x-ratelimit-* leaves them
    blind until the 429. OpenAI callers keep OpenAI's names only."""
    secret = create_key(gateway, "--rpm", "2", "--tpm", "50000")
    client = anthropic.Anthropic(base_url=gateway.base_url, api_key=secret, max_retries=0)
    model = "family-b-haiku-4-5-20251001"
    raw = client.messages.with_raw_response.create(model=model, max_tokens=2, messages=HI)
    assert ANTHROPIC_HEADERS <= set(raw.headers), raw.headers
    assert (raw.headers["anthropic-ratelimit-requests-limit"], raw.headers["anthropic-ratelimit-requests-remaining"],
            raw.headers["anthropic-ratelimit-tokens-limit"]) == ("2", "1", "50000")
    reset = datetime.datetime.fromisoformat(raw.headers["anthropic-ratelimit-requests-reset"].replace("Z", "+00:00"))
    now = datetime.datetime.now(datetime.timezone.utc)
    assert now - datetime.timedelta(seconds=2) <= reset <= now + datetime.timedelta(seconds=61)
    assert raw.headers["anthropic-ratelimit-requests-reset"].endswith("Z")
    with client.messages.with_streaming_response.create(model=model, max_tokens=2, messages=HI, stream=True) as s:
        assert ANTHROPIC_HEADERS <= set(s.headers) and s.headers["anthropic-ratelimit-requests-remaining"] == "0"
    with pytest.raises(anthropic.RateLimitError) as caught:
        client.messages.create(model=model, max_tokens=2, messages=HI)
    refused = caught.value.response.headers
    assert (refused["anthropic-ratelimit-requests-limit"], refused["anthropic-ratelimit-requests-remaining"]) == (
        "2", "0")
    assert refused["anthropic-ratelimit-requests-reset"].endswith("Z")
    openai_caller = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=create_key(gateway, "--rpm", "2"),
                                  max_retries=0)
    chat = openai_caller.chat.completions.with_raw_response.create(model="family-a-5.5", messages=HI, max_tokens=2)
    assert HEADERS <= set(chat.headers) and not any(h.startswith("anthropic-") for h in chat.headers)


def test_both_sdks_do_not_retry_a_request_too_large_for_the_keys_limits(gateway):
    secret = create_key(gateway, "--tpm", "100")
    sent = []
    hooks = {"request": [sent.append]}
    openai_client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=secret, max_retries=3,
                                  http_client=httpx.Client(event_hooks=hooks))
    with pytest.raises(openai.RateLimitError) as refused:
        openai_client.chat.completions.create(model="family-a-5.5", messages=HI, max_tokens=500)
    assert "Request too large" in refused.value.message and len(sent) == 1
    assert "Lower max_tokens" in refused.value.message
    assert refused.value.response.headers["x-should-retry"] == "false"
    assert "retry-after" not in refused.value.response.headers
    with pytest.raises(openai.RateLimitError) as refused:  # the message names the field the caller set
        openai_client.chat.completions.create(model="family-a-5.5", messages=HI, max_completion_tokens=500)
    assert "Lower max_completion_tokens" in refused.value.message and len(sent) == 2
    with pytest.raises(openai.RateLimitError) as refused:  # none set: the default made it too large, and is named
        openai_client.chat.completions.create(model="family-a-5.5", messages=HI)
    assert "Lower max_tokens (not sent, so the default of 1024 applied)" in refused.value.message and len(sent) == 3
    anthropic_client = anthropic.Anthropic(base_url=gateway.base_url, api_key=secret, max_retries=3,
                                           http_client=httpx2.Client(event_hooks=hooks))
    with pytest.raises(anthropic.RateLimitError) as refused:
        anthropic_client.messages.create(model="family-b-haiku-4-5-20251001", max_tokens=500, messages=HI)
    assert refused.value.body["error"]["message"].startswith("Request too large") and len(sent) == 4


def test_both_sdks_raise_a_daily_quota_at_once_rather_than_sleep_until_utc_midnight(gateway):
    if until_midnight(time.time()) < 120:
        pytest.skip("the quota resets within two minutes: then the SDKs may wait for it")
    secret = create_key(gateway, "--daily-requests", "1")
    sent = []
    hooks = {"request": [sent.append]}
    client = anthropic.Anthropic(base_url=gateway.base_url, api_key=secret, max_retries=2,
                                 http_client=httpx2.Client(event_hooks=hooks))
    model = "family-b-haiku-4-5-20251001"
    client.messages.create(model=model, max_tokens=1, messages=HI)
    outcome: list[BaseException] = []

    def refused() -> None:  # in a thread: an SDK that honours a retry-after of hours would hang the test
        try:
            client.messages.create(model=model, max_tokens=1, messages=HI)
        except anthropic.RateLimitError as error:
            outcome.append(error)

    waiting = threading.Thread(target=refused, daemon=True)
    waiting.start()
    waiting.join(10)
    assert not waiting.is_alive() and len(sent) == 2, "the anthropic SDK is asleep until the quota resets"
    headers = outcome[0].response.headers
    assert headers["x-should-retry"] == "false" and int(headers["retry-after"]) > 60  # it still says when
    openai_client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=secret, max_retries=2,
                                  http_client=httpx.Client(event_hooks=hooks))
    with pytest.raises(openai.RateLimitError):
        openai_client.chat.completions.create(model="family-a-5.5", messages=HI, max_tokens=1)
    assert len(sent) == 3


def _refused_during_a_long_stream(gateway, secret: str, ask) -> openai.RateLimitError:
    """What `ask()` raises while a 2,000-token stream of the key's is in flight (breaking out of iter_lines ends the
    stream, so it is asked from inside)."""
    body = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Write a very long story."}],
            "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", f"{gateway.base_url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {secret}"}, timeout=60) as response:
        for number, _ in enumerate(response.iter_lines()):
            if number == 4:
                with pytest.raises(openai.RateLimitError) as caught:
                    ask()
                return caught.value
    raise AssertionError("the stream ended before its fifth line")


STOPS = [" ", "e", ".", "\n"]  # one of them comes within the first tokens of any answer


def _answered_within(seconds: float, ask) -> None:
    """`ask()` succeeds within `seconds` (retried while it is refused with 429)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            assert ask().choices
            return
        except openai.RateLimitError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def test_concurrency_limit_through_envoy_frees_the_slot_of_an_abandoned_stream(gateway):
    secret = create_key(gateway, "--concurrency", "1")
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=secret, max_retries=0)

    def ask():
        return client.chat.completions.create(model="family-a-5.5", messages=HI, max_tokens=1)

    assert "concurrent requests" in _refused_during_a_long_stream(gateway, secret, ask).message
    # The stream is gone: its slot must be free within moments, not when some lease or window runs out.
    _answered_within(5.0, ask)


def test_grpc_through_envoy_gets_resource_exhausted_with_retry_info(gateway):
    secret = create_key(gateway, "--daily-requests", "1")
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        chat = chat_service_pb2_grpc.ChatServiceStub(channel)
        _, call = chat.CreateChatCompletion.with_call(chat_request(max_tokens=1), metadata=bearer(secret))
        headers = dict(call.initial_metadata())
        assert headers["x-ratelimit-limit-requests"] == "1" and headers["x-ratelimit-remaining-requests"] == "0"
        with pytest.raises(grpc.RpcError) as caught:
            chat.CreateChatCompletion(chat_request(max_tokens=1), metadata=bearer(secret))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    raw = dict(caught.value.trailing_metadata())["grpc-status-details-bin"]
    retry = error_details_pb2.RetryInfo()
    assert status_pb2.Status.FromString(raw).details[1].Unpack(retry)
    assert 0 < retry.retry_delay.seconds <= 86_400


def test_tokens_per_minute_held_by_a_request_in_flight_are_retried_soon_not_when_the_minute_moves(gateway):
    """The stream in flight holds its max tokens in the minute's window: the next request was told to retry when
    that entry left the window (up to 60 s, which the SDKs sleep), though the stream's end gave the tokens back."""
    secret = create_key(gateway, "--tpm", "3000")
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=secret, max_retries=0)

    def ask():
        # 1,500 tokens reserved, a few generated: a stop ends it at once (generating 1,500 on a loaded machine, the
        # embedded model was once answered 504 upstream_timeout)
        return client.chat.completions.create(model="family-a-5.5", messages=HI, max_tokens=1500, stop=STOPS)

    refused = _refused_during_a_long_stream(gateway, secret, ask)
    headers = refused.response.headers
    assert headers["retry-after"] == "1" and headers["x-ratelimit-reset-tokens"] == "1s", headers
    assert "tokens per minute" in refused.message and "held by requests in flight until they end" in refused.message
    _answered_within(5.0, ask)


def test_a_daily_quota_held_by_a_request_in_flight_is_retried_soon_not_at_utc_midnight(gateway):
    """A stream in flight reserves its max tokens of the day's quota. The next request was refused until UTC
    midnight with x-should-retry: false, so the SDK gave up at once, though the stream's end gave the tokens back."""
    secret = create_key(gateway, "--daily-tokens", "3000")
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=secret, max_retries=0)

    def ask():
        # 1,500 tokens reserved, a few generated: a stop ends it at once (generating 1,500 on a loaded machine, the
        # embedded model was once answered 504 upstream_timeout)
        return client.chat.completions.create(model="family-a-5.5", messages=HI, max_tokens=1500, stop=STOPS)

    refused = _refused_during_a_long_stream(gateway, secret, ask)  # the stream holds its 2,000 tokens meanwhile
    headers = refused.response.headers
    assert "x-should-retry" not in headers and headers["retry-after"] == "1", headers
    assert "held by requests in flight until they end" in refused.message
    _answered_within(5.0, ask)  # the stream is gone: what it held is back, apart from what it used


def test_tokens_per_minute_reset_says_when_tokens_free_up_not_when_a_count_leaves(gateway):
    """A token count has its place in the minute's window but no tokens: the key's limit status said its tokens per
    minute went down in ~60 s with none used, and the next answer's x-ratelimit-reset-tokens said tokens freed up when
    the count left the window, though none did then."""
    out = gateway.cli("keys", "create", "--name", "limited", "--all-models", "--tpm", "3000").stdout.split()
    key_id, secret = out[2], out[-1]
    admin = create_key(gateway, "--admin")
    anthropic.Anthropic(base_url=gateway.base_url, api_key=secret, max_retries=0).messages.count_tokens(
        model="family-b-sonnet-4-6", messages=HI)
    status = httpx.get(f"{gateway.base_url}/v1/admin/keys/{key_id}/limits", timeout=30,
                       headers={"authorization": f"Bearer {admin}"}).json()
    assert [(s["used"], s["reset_seconds"]) for s in status["limits"] if s["limit"] == "tokens_per_minute"] == [(0, 0)]
    time.sleep(1.5)  # the count is well into the window now
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=secret, max_retries=0)
    answer = client.chat.completions.with_raw_response.create(model="family-a-5.5", messages=HI, max_tokens=1)
    assert answer.headers["x-ratelimit-reset-tokens"] == "1m0s"  # its own tokens, the only ones, leave in a minute


def test_anthropic_reset_times_name_one_moment_the_windows_end_or_utc_midnight(gateway):
    """anthropic-ratelimit-*-reset was the render time's whole second plus the reset rounded up: the same window's end
    read a second earlier on some answers than on others (a tool that waited until then was refused again), and a
    daily quota's reset said 00:00:01 when the answer was written a second after its admission."""
    if until_midnight(time.time()) < 30:
        pytest.skip("the day ends during the test")
    secret = create_key(gateway, "--tpm", "50000", "--daily-requests", "100")
    client = anthropic.Anthropic(base_url=gateway.base_url, api_key=secret, max_retries=0)
    model = "family-b-haiku-4-5-20251001"
    answers = [client.messages.with_raw_response.create(model=model, max_tokens=1, messages=HI)]
    for _ in range(8):  # their fractions of a second run through the first's: every rounding shows
        time.sleep(0.13)
        answers.append(client.messages.with_raw_response.count_tokens(model=model, messages=HI))
    tomorrow = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=1)
    midnight = tomorrow.strftime("%Y-%m-%dT00:00:00Z")
    assert {a.headers["anthropic-ratelimit-requests-reset"] for a in answers} == {midnight}
    # The first request's tokens are the oldest in the window all along: every answer names its end.
    assert len({a.headers["anthropic-ratelimit-tokens-reset"] for a in answers}) == 1, [
        (a.headers["anthropic-ratelimit-tokens-reset"], a.headers["x-ratelimit-reset-tokens"]) for a in answers]
