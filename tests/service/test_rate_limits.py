"""Rate limits over real stubs: 429 with details, headers on every success, no slot left behind by a caller who
goes away, token reservations settled with real usage."""

from __future__ import annotations

import asyncio
import math
import time

import grpc
import orjson
import pytest
from google.rpc import error_details_pb2, status_pb2

from portico.v1 import image_pb2, image_service_pb2_grpc, message_service_pb2_grpc
from server.domain_keys import KeyLimits
from tests.helpers import bearer, chat_request, error_details, message_request, http_body
from tests.service.test_usage_ledger import usage_json
from tests.upstream_support import window_tokens

# Greedy sampling writes 1,000 tokens (~9 s) for this prompt; a sampled answer once ended in well under a second,
# before the test could see it hold its slot or pass its deadline.
LONG = "Write a very long story."
LONG_ANSWER = {"temperature": 0, "messages": [{"role": "user", "content": LONG}]}
HEADERS = {f"x-ratelimit-{what}-{kind}" for what in ("limit", "remaining", "reset") for kind in ("requests", "tokens")}


async def new_key(running, **limits) -> tuple[str, str]:
    key, secret = await running.store.create("limited", all_models=True, limits=KeyLimits(**limits))
    return key.id, secret


def status_details(error: grpc.aio.AioRpcError) -> list:
    raw = dict(error.trailing_metadata())["grpc-status-details-bin"]
    return list(status_pb2.Status.FromString(raw).details)


async def test_over_the_limit_is_resource_exhausted_with_retry_info_and_quota_failure(chat, running):
    key_id, secret = await new_key(running, requests_per_minute=2)
    for _ in range(2):
        await chat.CreateChatCompletion(chat_request(max_tokens=1), metadata=bearer(secret))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await chat.CreateChatCompletion(chat_request(max_tokens=1), metadata=bearer(secret))
    error = caught.value
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    detail = error_details(error)
    assert (detail.http_status, detail.error.code) == (429, "rate_limit_exceeded")
    assert detail.error.type == "rate_limit_error"
    assert not detail.error.HasField("param")
    assert f"requests per minute on key {key_id}" in detail.error.message
    assert 0 < detail.retry_after_seconds <= 60  # 60 s after the first request, which was moments ago
    retry, quota = error_details_pb2.RetryInfo(), error_details_pb2.QuotaFailure()
    details = status_details(error)
    assert details[1].Unpack(retry) and 0 < retry.retry_delay.ToMilliseconds() <= 60_000
    assert details[2].Unpack(quota) and quota.violations[0].subject == f"key {key_id}: requests per minute"
    trailing = dict(error.trailing_metadata())
    assert int(trailing["retry-after"]) == math.ceil(detail.retry_after_seconds)
    assert int(trailing["retry-after-ms"]) == math.ceil(detail.retry_after_seconds * 1000)


async def test_headers_on_every_kind_of_success(chat, channel, running):
    _, secret = await new_key(running, requests_per_minute=100, tokens_per_minute=100_000)
    messages = message_service_pb2_grpc.MessageServiceStub(channel)
    calls = [
        chat.CreateChatCompletion(chat_request(max_tokens=2), metadata=bearer(secret)),
        chat.StreamChatCompletion(chat_request(max_tokens=2), metadata=bearer(secret)),
        chat.CreateChatCompletionHttp(http_body(chat_request(max_tokens=2)), metadata=bearer(secret)),
        chat.CreateChatCompletionHttp(http_body(chat_request(max_tokens=2, stream=True)), metadata=bearer(secret)),
        messages.CreateMessage(message_request(max_tokens=2), metadata=bearer(secret)),
        messages.CreateMessageHttp(http_body(message_request(max_tokens=2, stream=True)), metadata=bearer(secret)),
    ]
    seen = []
    for call in calls:
        headers = dict(await call.initial_metadata())
        assert HEADERS <= set(headers)
        seen.append(int(headers["x-ratelimit-remaining-requests"]))
        if hasattr(call, "__aiter__"):
            [_ async for _ in call]
        else:
            await call
    assert sorted(seen) == [94, 95, 96, 97, 98, 99]  # the calls above run at once
    assert headers["x-ratelimit-limit-tokens"] == "100000"


async def test_images_are_admitted_as_requests(channel, running):
    _, secret = await new_key(running, requests_per_minute=1, tokens_per_minute=10)
    images = image_service_pb2_grpc.ImageServiceStub(channel)
    request = image_pb2.CreateImageRequest(model="family-a-image-2", prompt="a boat", size="256x256")
    call = images.CreateImage(request, metadata=bearer(secret))
    assert dict(await call.initial_metadata())["x-ratelimit-remaining-tokens"] == "10"
    await call
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await images.CreateImage(request, metadata=bearer(secret))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def wait_until_freed(running, key_id: str, within: float = 5.0) -> None:
    """The key's slots are all free again: promptly, not when the generation would have ended on its own."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while await running.limiter.store.in_flight(key_id):
        assert loop.time() < deadline, "a concurrency slot was left behind"
        await asyncio.sleep(0.02)


@pytest.mark.parametrize("rpc", ["StreamChatCompletion", "CreateChatCompletionHttp"])
async def test_abandoned_stream_frees_its_slot_and_settles_what_it_used(chat, running, rpc):
    # 300 max tokens reserve ~330 of 400 tokens per minute: a second request fits only if the first is settled
    # with what it really generated before its caller went away.
    key_id, secret = await new_key(running, concurrent_requests=1, tokens_per_minute=400)
    request = chat_request(max_tokens=300, stream=True, **LONG_ANSWER)
    call = getattr(chat, rpc)(request if rpc == "StreamChatCompletion" else http_body(request), metadata=bearer(secret))
    for _ in range(4):
        await call.read()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await chat.CreateChatCompletion(chat_request(max_tokens=1), metadata=bearer(secret))
    assert "concurrent requests" in error_details(caught.value).error.message
    call.cancel()
    await wait_until_freed(running, key_id)
    # Admitted at once: the slot is free and the tokens were settled with the few generated before the cancel.
    await chat.CreateChatCompletion(chat_request(max_tokens=300, stop=["."]), metadata=bearer(secret))


async def test_failed_requests_free_their_slot(chat, running):
    key_id, secret = await new_key(running, concurrent_requests=1)
    too_long = chat_request(messages=[{"role": "user", "content": "word " * 3000}])  # over the context window
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await chat.CreateChatCompletion(too_long, metadata=bearer(secret))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert await running.limiter.store.in_flight(key_id) == 0
    await chat.CreateChatCompletion(chat_request(max_tokens=1), metadata=bearer(secret))


async def test_a_prompt_over_the_context_window_never_reaches_a_model(chat, messages, channel, running):
    """Refused with 400 on either path, it costs nothing, and the usage API counts it as a request and an error,
    not as a model request, and gives it no latency."""
    key_id, secret = await new_key(running, requests_per_minute=100)
    too_long = [{"role": "user", "content": "word " * 6000}]  # ~6,000 tokens: the window is 2,048
    start = int(time.time())
    for call in (chat.CreateChatCompletion(chat_request(messages=too_long), metadata=bearer(secret)),
                 messages.CreateMessage(message_request(model="family-b-opus-4-7", messages=too_long),
                                        metadata=bearer(secret))):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_details(caught.value).error.code == "context_length_exceeded"
    assert window_tokens(running, key_id) == 0
    await running.core.ledger.flush()
    page = await usage_json(channel, secret, start_time=start)
    [result] = page["data"][0]["results"]
    assert (result["num_requests"], result["num_errors"], result["num_model_requests"]) == (2, 2, 0)
    assert "latency_ms_p50" not in result and "latency_ms_p95" not in result
    rows = await usage_json(channel, secret, "ListRequestsHttp", start_time=start)
    assert [(r["status"], r["upstream"]) for r in rows["data"]] == [(400, None)] * 2  # no model was asked


async def test_unary_caller_that_gives_up_frees_its_slot(chat, running):
    key_id, secret = await new_key(running, concurrent_requests=1)
    long = chat_request(max_tokens=1000, **LONG_ANSWER)
    call = chat.CreateChatCompletion(long, metadata=bearer(secret))
    deadline = asyncio.get_running_loop().time() + 10
    while not await running.limiter.store.in_flight(key_id):  # admitted: a busy machine may take a while
        assert not call.done() and asyncio.get_running_loop().time() < deadline, "the request never held its slot"
        await asyncio.sleep(0.02)
    call.cancel()
    await wait_until_freed(running, key_id)
    await chat.CreateChatCompletion(chat_request(max_tokens=1), metadata=bearer(secret))


async def test_a_request_past_its_deadline_frees_its_slot(chat, running):
    key_id, secret = await new_key(running, concurrent_requests=1)
    long = chat_request(max_tokens=1000, **LONG_ANSWER)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await chat.CreateChatCompletion(long, metadata=bearer(secret), timeout=0.5)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await wait_until_freed(running, key_id)
    await chat.CreateChatCompletion(chat_request(max_tokens=1), metadata=bearer(secret))


async def test_request_too_large_for_the_token_limit(chat, running):
    _, secret = await new_key(running, tokens_per_minute=100)
    bodies = chat.CreateChatCompletionHttp(http_body(chat_request(max_tokens=500)), metadata=bearer(secret))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        [_ async for _ in bodies]
    detail = error_details(caught.value)
    assert detail.http_status == 429 and detail.error.message.startswith("Request too large")
    assert detail.retry_after_seconds == 0
    body = orjson.loads(dict(caught.value.trailing_metadata())["portico-error"])
    assert body["error"]["code"] == "rate_limit_exceeded" and body["error"]["param"] is None


async def test_the_embedded_model_reserves_no_more_than_its_context_window_leaves(chat, running):
    """An answer of the embedded model ends where its context window does (2,048 tokens, prompt included), so a
    max_tokens far beyond it (an SDK's default, say) must not make the request "too large" for a key's token limit
    that the whole window fits in, nor hold the key's tokens it can never use while it runs."""
    key_id, secret = await new_key(running, tokens_per_minute=3000)
    answer = await chat.CreateChatCompletion(chat_request(max_tokens=100_000, temperature=0), metadata=bearer(secret))
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert window_tokens(running, key_id) == answer.usage.prompt_tokens + answer.usage.completion_tokens
