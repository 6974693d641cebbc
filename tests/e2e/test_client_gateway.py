"""portico.client against the real gateway (Envoy + server), over gRPC and REST, sync and asyncio: typed errors that
are never retried, 429s retried with jittered backoff within the cap and then surfaced, the client-side limiter,
and the queue bounding concurrency at the gateway."""

from __future__ import annotations

import asyncio
import random
import threading

import grpc
import httpx
import pytest

from portico.client import (
    AsyncPorticoClient, AsyncRequestQueue, AuthenticationError, BadRequestError, ClientRateLimitError, ModelAliases,
    NotFoundError, Operation, PermissionDeniedError, PorticoClient, QueueFull, RateLimitError, RequestQueue,
    RetriesExhausted, RetryPolicy, UserRateLimiter,
)
from portico.v1 import (
    anthropic_model_pb2, anthropic_model_service_pb2_grpc, key_pb2, key_service_pb2_grpc, model_pb2,
    model_service_pb2_grpc, organization_usage_pb2, usage_service_pb2_grpc,
)
from tests.e2e.test_operations import wait_for_line


HI = [{"role": "user", "content": "Hi"}]
ALIASES = ModelAliases.from_config({
    "chat": {"primary": "family-a-5.5", "fallbacks": ["family-a-5.4"]},
    "writer": "family-b-haiku-4-5-20251001",
    "retired": {"primary": "family-a-0.1", "fallbacks": ["family-a-5.4"]},
})
LIST_KEYS = Operation(key_service_pb2_grpc.KeyServiceStub, "ListKeys", key_pb2.ListKeysRequest,
                      key_pb2.ListKeysResponse, "GET", "/v1/admin/keys")
GET_MODEL = Operation(model_service_pb2_grpc.ModelServiceStub, "GetModel", model_pb2.GetModelRequest, model_pb2.Model,
                      "GET", "/v1/models/{model}")
GET_COSTS = Operation(usage_service_pb2_grpc.UsageServiceStub, "GetCosts", organization_usage_pb2.GetCostsRequest,
                      organization_usage_pb2.GetCostsResponse, "GET", "/v1/organization/costs")
GET_ANTHROPIC_MODEL = Operation(anthropic_model_service_pb2_grpc.AnthropicModelServiceStub, "GetAnthropicModel",
                                anthropic_model_pb2.GetAnthropicModelRequest, anthropic_model_pb2.AnthropicModel,
                                "GET", "/v1/models/{model_id}")
LIST_ANTHROPIC_MODELS = Operation(anthropic_model_service_pb2_grpc.AnthropicModelServiceStub, "ListAnthropicModels",
                                  anthropic_model_pb2.ListAnthropicModelsRequest,
                                  anthropic_model_pb2.ListAnthropicModelsResponse, "GET", "/v1/models")
UPDATE_KEY = Operation(key_service_pb2_grpc.KeyServiceStub, "UpdateKey", key_pb2.UpdateKeyRequest,
                       key_pb2.UpdateKeyResponse, "PATCH", "/v1/admin/keys/{id}")


def create_key(gateway, *options: str) -> str:
    return gateway.cli("keys", "create", "--name", "client", *options).stdout.strip().splitlines()[-1]


class Sleeps(list):
    """An injected sleep that records how long it was asked to wait, and does not wait."""

    def __call__(self, seconds: float) -> None:
        self.append(seconds)


class Draws(list):
    """A seeded random source that remembers its draws, so each delay can be recomputed exactly."""

    def __init__(self, seed: int) -> None:
        super().__init__()
        self._random = random.Random(seed)

    def __call__(self) -> float:
        self.append(self._random.random())
        return self[-1]


def client_for(gateway, transport: str, secret: str, **options) -> PorticoClient:
    options.setdefault("aliases", ALIASES)
    if transport == "grpc":
        return PorticoClient.over_grpc(f"127.0.0.1:{gateway.port}", secret, **options)
    return PorticoClient.over_rest(gateway.base_url, secret, **options)


def remaining_requests(gateway, secret: str) -> int:
    response = httpx.post(f"{gateway.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                          json={"model": "family-a-5.5", "messages": HI, "max_tokens": 1}, timeout=60)
    assert response.status_code == 200, response.text
    return int(response.headers["x-ratelimit-remaining-requests"])


@pytest.fixture(params=["grpc", "rest"])
def transport(request) -> str:
    return request.param


def test_aliases_resolve_and_answers_are_typed_messages(gateway, transport):
    sleeps = Sleeps()
    with client_for(gateway, transport, gateway.secret, sleep=sleeps) as client:
        completion = client.chat_completion("chat", HI, max_tokens=2)
        assert completion.model == "family-a-5.5" and completion.id.startswith("chatcmpl-")
        assert 1 <= completion.usage.completion_tokens <= 2 and completion.choices[0].message.role == "assistant"
        message = client.message("writer", HI, max_tokens=2, temperature=0)
        assert (message.type, message.model) == ("message", "family-b-haiku-4-5-20251001")
        assert message.content[0].type == "text" and message.usage.output_tokens <= 2
        assert len(client.list_models().data) == 8
        direct = client.chat_completion("family-a-5.4", HI, max_tokens=1)  # not an alias: used as it is
        assert direct.model == "family-a-5.4"
    assert sleeps == []


def test_count_message_tokens_gives_the_prompt_a_message_is_charged_for(gateway, transport):
    with client_for(gateway, transport, gateway.secret) as client:
        count = client.count_message_tokens("writer", HI, system="Answer in French.")
        message = client.message("writer", HI, max_tokens=1, system="Answer in French.")
        assert count.input_tokens == message.usage.input_tokens > 0
        longer = client.count_message_tokens("writer", HI, system="Answer in French, in one short sentence.")
        assert longer.input_tokens > count.input_tokens


def test_client_errors_are_typed_and_raised_at_once_without_retry_or_fallback(gateway, transport):
    sleeps = Sleeps()
    policy = RetryPolicy(attempts=5, base=0.1, cap=1.0)
    narrow = create_key(gateway, "--models", "family-a-5.5", "--rpm", "100")
    with client_for(gateway, transport, narrow, retry=policy, sleep=sleeps) as client:
        with pytest.raises(BadRequestError) as bad:
            client.chat_completion("chat", HI, max_tokens=1, temperature=9)
        with pytest.raises(NotFoundError) as retired:
            client.chat_completion("retired", HI, max_tokens=1)  # its fallback would have answered
        with pytest.raises(NotFoundError) as ungranted:
            client.chat_completion("family-a-5.4", HI, max_tokens=1)
        with pytest.raises(PermissionDeniedError) as denied:
            client.call(LIST_KEYS, {})
        assert remaining_requests(gateway, narrow) == 99  # none of those was admitted, nor retried
    with client_for(gateway, transport, "pk-not-a-key", retry=policy, sleep=sleeps) as client:
        with pytest.raises(AuthenticationError) as unauthenticated:
            client.chat_completion("chat", HI, max_tokens=1)
    assert sleeps == []
    rows = [(e.value.status, e.value.code, e.value.type, e.value.param)
            for e in (bad, retired, ungranted, denied, unauthenticated)]
    assert rows == [
        (400, "invalid_request", "invalid_request_error", "temperature"),
        (404, "model_not_found", "invalid_request_error", "model"),
        (404, "model_not_found", "invalid_request_error", "model"),
        (403, "permission_denied", "permission_error", None),
        (401, "invalid_api_key", "authentication_error", None),
    ]
    assert "family-a-0.1" in retired.value.message
    expected_codes = [grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.NOT_FOUND,
                      grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNAUTHENTICATED]
    grpc_codes = [e.value.grpc_code for e in (bad, retired, ungranted, denied, unauthenticated)]
    assert grpc_codes == (expected_codes if transport == "grpc" else [None] * 5)


def test_rate_limited_calls_back_off_with_jitter_within_the_cap_then_surface_the_last_error(gateway, transport):
    secret = create_key(gateway, "--all-models", "--rpm", "1")
    sleeps, draws = Sleeps(), Draws(seed=1)
    policy = RetryPolicy(attempts=4, base=40.0, cap=100.0)  # a cap above the per-minute hint, so it is waited for
    with client_for(gateway, transport, secret, retry=policy, sleep=sleeps, random=draws) as client:
        assert client.chat_completion("family-a-5.5", HI, max_tokens=1).model == "family-a-5.5"
        with pytest.raises(RetriesExhausted) as caught:
            client.chat_completion("family-a-5.5", HI, max_tokens=1)
    failures = caught.value.failures
    assert [model for model, _ in failures] == ["family-a-5.5"] * 4  # stopped at the maximum
    last = caught.value.last
    assert isinstance(last, RateLimitError) and last is failures[-1][1]
    assert (last.status, last.code, last.type, last.param) == (429, "rate_limit_exceeded", "rate_limit_error", None)
    assert "requests per minute" in last.message and 50 < last.retry_after <= 60
    assert "gave up after 4 attempt(s) on family-a-5.5" in str(caught.value)
    assert len(sleeps) == len(draws) == 3
    for retry, (wait, draw, (_, error)) in enumerate(zip(sleeps, draws, failures), start=1):
        assert wait == max(error.retry_after, draw * policy.ceiling(retry))  # full jitter, the hint as a floor
        assert error.retry_after <= wait <= policy.cap
    # Seed 1 draws 0.13, 0.85, 0.76: the first jittered wait (5 s) is under the ~59 s hint, the next two above it.
    assert sleeps[0] == failures[0][1].retry_after and sleeps[1] > failures[1][1].retry_after

    sleeps.clear()
    with client_for(gateway, transport, secret, retry=RetryPolicy(attempts=4, cap=30.0), sleep=sleeps) as client:
        with pytest.raises(RetriesExhausted) as caught:
            client.chat_completion("family-a-5.5", HI, max_tokens=1)
    assert len(caught.value.failures) == 1 and sleeps == []  # a hint over the cap is not waited for


def test_a_request_too_large_for_the_keys_limits_is_raised_at_once_not_retried(gateway, transport):
    secret = create_key(gateway, "--all-models", "--tpm", "100", "--rpm", "100")
    sleeps = Sleeps()
    with client_for(gateway, transport, secret, retry=RetryPolicy(attempts=4), sleep=sleeps) as client:
        with pytest.raises(RateLimitError) as caught:  # not RetriesExhausted after four tries
            client.chat_completion("chat", HI, max_tokens=500)  # nor moved on to the alias's fallback
    assert caught.value.message.startswith("Request too large") and caught.value.should_retry is False
    assert sleeps == [] and remaining_requests(gateway, secret) == 99


def test_the_client_side_limiter_holds_per_user_before_anything_is_sent(gateway, transport):
    secret = create_key(gateway, "--all-models", "--rpm", "20")
    now = [0.0]
    limiter = UserRateLimiter.per_minute(1, burst=2, clock=lambda: now[0])
    with client_for(gateway, transport, secret, limiter=limiter) as client:
        for _ in range(2):
            client.chat_completion("chat", HI, max_tokens=1, user="alice")
        with pytest.raises(ClientRateLimitError) as caught:
            client.chat_completion("chat", HI, max_tokens=1, user="alice")
        assert caught.value.status == 429 and caught.value.retry_after == pytest.approx(60.0)
        client.chat_completion("chat", HI, max_tokens=1, user="bob")
        assert remaining_requests(gateway, secret) == 20 - 4  # alice 2, bob 1, this one: the refusal sent nothing
        now[0] += 60.0
        client.chat_completion("chat", HI, max_tokens=1, user="alice")

    sleeps = Sleeps()
    waiting = UserRateLimiter(rate=2.0, burst=1, max_wait=1.0, clock=lambda: now[0])
    with client_for(gateway, transport, secret, limiter=waiting, sleep=sleeps) as client:
        for _ in range(3):
            client.chat_completion("chat", HI, max_tokens=1, user="carol")
    assert sleeps == [pytest.approx(0.5), pytest.approx(1.0)]  # the clock stood still: each waits its turn


def test_the_sync_queue_bounds_waiting_work_and_concurrency_at_the_gateway(gateway, transport):
    secret = create_key(gateway, "--all-models", "--concurrency", "2")
    gate, started = threading.Event(), threading.Event()
    with client_for(gateway, transport, secret, retry=RetryPolicy(attempts=1)) as client:

        def first():
            started.set()
            gate.wait(10)
            return client.chat_completion("chat", HI, max_tokens=1)

        with RequestQueue(max_size=3, concurrency=1) as queue:
            futures = [queue.submit(first)]
            assert started.wait(10)
            futures += [queue.submit(lambda: client.chat_completion("chat", HI, max_tokens=1)) for _ in range(3)]
            with pytest.raises(QueueFull):
                queue.submit(lambda: client.chat_completion("chat", HI, max_tokens=1))
            gate.set()
            assert all(f.result(60).model == "family-a-5.5" for f in futures)


async def test_the_async_queue_keeps_a_burst_under_the_keys_concurrency_limit(gateway):
    # The key admits 2 at once; the queue runs 1 at a time, which leaves room for a slot freed just after its answer.
    secret = create_key(gateway, "--all-models", "--concurrency", "2")
    async with AsyncPorticoClient.over_grpc(f"127.0.0.1:{gateway.port}", secret, aliases=ALIASES,
                                            retry=RetryPolicy(attempts=1)) as client:
        # Unqueued, a burst overlaps at the gateway and some of it is refused (long enough answers to overlap).
        burst = await asyncio.gather(*(client.chat_completion("chat", HI, max_tokens=12) for _ in range(6)),
                                     return_exceptions=True)
        assert any(isinstance(r, RetriesExhausted) and isinstance(r.last, RateLimitError) for r in burst)
        in_flight, peak = [0], [0]

        async def job():
            in_flight[0] += 1
            peak[0] = max(peak[0], in_flight[0])
            try:
                return await client.chat_completion("chat", HI, max_tokens=1)
            finally:
                in_flight[0] -= 1

        async with AsyncRequestQueue(max_size=4, concurrency=1) as queue:
            futures = [queue.submit(job) for _ in range(4)]
            with pytest.raises(QueueFull):
                queue.submit(job)
            results = await asyncio.gather(*futures)
    assert [r.model for r in results] == ["family-a-5.5"] * 4 and peak[0] == 1


async def test_asyncio_clients_retry_and_raise_the_same_way(gateway, transport):
    secret = create_key(gateway, "--all-models", "--rpm", "1")
    sleeps = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    options = dict(aliases=ALIASES, retry=RetryPolicy(attempts=2, cap=90.0), sleep=sleep)
    client = (AsyncPorticoClient.over_grpc(f"127.0.0.1:{gateway.port}", secret, **options) if transport == "grpc"
              else AsyncPorticoClient.over_rest(gateway.base_url, secret, **options))
    async with client:
        assert (await client.message("writer", HI, max_tokens=1)).type == "message"
        with pytest.raises(BadRequestError):
            await client.chat_completion("chat", HI, max_tokens=1, top_p=3)
        with pytest.raises(RetriesExhausted) as caught:
            await client.chat_completion("chat", HI, max_tokens=1)
    hint = caught.value.failures[0][1].retry_after
    # The key's own rpm limits every model, so the fallback is refused too: primary twice, then family-a-5.4 twice.
    assert [m for m, _ in caught.value.failures] == ["family-a-5.5"] * 2 + ["family-a-5.4"] * 2
    assert len(sleeps) == 2 and all(50 < s <= 90 for s in sleeps) and sleeps[0] >= hint


class NewerStub:
    """A stub for a method this gateway does not have (a client newer than the gateway it talks to)."""

    def __init__(self, channel) -> None:
        self.GetNothing = channel.unary_unary("/portico.v1.ModelService/GetNothing",
                                              request_serializer=model_pb2.ListModelsRequest.SerializeToString,
                                              response_deserializer=model_pb2.ListModelsResponse.FromString)


def test_a_method_the_gateway_does_not_have_is_a_404_at_once_on_both_transports(gateway, transport):
    """Over REST an unknown route is a 404 raised at once; over gRPC grpc's UNIMPLEMENTED read as a 500
    `internal_error` (a gateway bug) and was retried up to the policy's maximum."""
    operation = Operation(NewerStub, "GetNothing", model_pb2.ListModelsRequest, model_pb2.ListModelsResponse,
                          "GET", "/v1/nothing")
    sleeps = Sleeps()
    with client_for(gateway, transport, gateway.secret, retry=RetryPolicy(attempts=3), sleep=sleeps) as client:
        with pytest.raises(NotFoundError) as caught:
            client.call(operation, {})
    assert (caught.value.status, caught.value.code) == (404, "not_found") and sleeps == []


def test_any_unary_rpc_takes_its_fields_on_both_transports(gateway, transport):
    """`call` runs any unary RPC, but over REST only a POST sent the request's fields: a GET sent neither a query
    string nor its path's {fields} (a 400 for the usage API's start_time), and a PATCH sent no body at all."""
    admin = create_key(gateway, "--all-models", "--admin")
    key_id = gateway.cli("keys", "create", "--name", "patched", "--all-models").stdout.split()[2]
    with client_for(gateway, transport, admin) as client:
        assert client.call(GET_MODEL, {"model": "family-a-5.4"}).id == "family-a-5.4"
        costs = client.call(GET_COSTS, {"start_time": 1795392000, "end_time": 1795392000 + 3 * 3600,
                                        "bucket_width": "1h", "limit": 2, "group_by": ["model", "project_id"]})
        assert [bucket.start_time for bucket in costs.data] == [1795392000, 1795395600] and costs.has_more
        updated = client.call(UPDATE_KEY, {"id": key_id, "name": f"patched-{transport}",
                                           "limits": {"requests_per_minute": 7}})
        assert (updated.key.name, updated.key.limits.requests_per_minute) == (f"patched-{transport}", 7)
        with pytest.raises(BadRequestError) as unknown:  # a query string would have dropped it unread
            client.call(GET_MODEL, {"model": "family-a-5.4", "modle": "x"})
        assert unknown.value.param == "modle"


def test_the_anthropic_models_service_answers_in_its_shape_on_both_transports(gateway, transport):
    """AnthropicModelService binds the same REST paths as ModelService, told apart by an `anthropic-version` header
    (api.md), which the client did not send: over REST `call` got ModelService's answer read into an AnthropicModel,
    every field but `id` empty (no `type`, `display_name`, `created_at`), and the whole catalog's listing for
    ListAnthropicModels, unpaged, with no error to say so."""
    with client_for(gateway, transport, gateway.secret) as client:
        model = client.call(GET_ANTHROPIC_MODEL, {"model_id": "family-b-sonnet-4-6"})
        page = client.call(LIST_ANTHROPIC_MODELS, {"limit": 2})
        with pytest.raises(NotFoundError) as unknown:
            client.call(GET_ANTHROPIC_MODEL, {"model_id": "family-b-nope"})
    assert (model.id, model.type, model.display_name) == ("family-b-sonnet-4-6", "model", "family-b-sonnet-4-6")
    assert model.created_at and model.lifecycle == "active"
    assert len(page.data) == 2 and page.has_more and all(entry.type == "model" for entry in page.data)
    assert unknown.value.type == "not_found_error"  # Anthropic's error shape, as its REST callers get


async def test_an_error_carries_the_request_id_the_gateway_logged_it_under(gateway, transport):
    """The SDKs give a failed call's id (`APIStatusError.request_id`), to quote to the gateway's operators; this
    client's errors had none, on either transport, so its callers could not tell which logged request failed."""
    with client_for(gateway, transport, gateway.secret) as client:
        with pytest.raises(NotFoundError) as caught:
            client.chat_completion("family-a-0.1", HI, max_tokens=1)
    make = AsyncPorticoClient.over_grpc if transport == "grpc" else AsyncPorticoClient.over_rest
    async with make(f"127.0.0.1:{gateway.port}" if transport == "grpc" else gateway.base_url, gateway.secret) as aclient:
        with pytest.raises(NotFoundError) as caught_async:
            await aclient.chat_completion("family-a-0.1", HI, max_tokens=1)
    for error in (caught.value, caught_async.value):
        line = wait_for_line(gateway, error.request_id)
        assert (line["status"], line["code"]) == (404, "model_not_found")
