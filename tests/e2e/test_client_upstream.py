"""portico.client against a gateway whose models are an OpenAI-compatible upstream (the double), for answers the
embedded models cannot give: a CreateImage answer larger than the 4 MiB a grpc channel receives by default, and
answers that take as long as a test needs, to give up on or close the client under."""

from __future__ import annotations

import asyncio
import base64
import os
import threading
import time

import grpc
import pytest

from portico.client import (
    APITimeoutError, AsyncPorticoClient, AsyncRequestQueue, BadRequestError, GrpcTransport, ModelAliases, Operation,
    PorticoClient, RateLimitError, RetriesExhausted, RetryPolicy, UpstreamError,
)
from portico.v1 import image_pb2, image_service_pb2_grpc
from tests.e2e.conftest import upstream_gateway
from tests.e2e.test_operations import access_lines
from tests.upstream_double import Cue
from tests.upstream_echo import tiny_png
from tests.upstream_support import UPSTREAM_KEY_ENV

CREATE_IMAGE = Operation(image_service_pb2_grpc.ImageServiceStub, "CreateImage", image_pb2.CreateImageRequest,
                         image_pb2.ImagesResponse, "POST", "/v1/images/generations")


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    provider = f"{{kind: openai, base_url: '{double.url}', api_key_env: {UPSTREAM_KEY_ENV}, model: gpt-image-up}}"
    once = provider.removesuffix("}") + ", retry: {attempts: 1}}"  # an upstream 503 is answered as it comes
    models = (f"  - {{id: image-up, endpoint: /v1/images/generations, provider: {provider}}}\n"
              f"  - {{id: chat-up, endpoint: /v1/chat/completions, provider: {provider}}}\n"
              f"  - {{id: chat-once, endpoint: /v1/chat/completions, provider: {once}}}\n"
              f"  - {{id: chat-priced, endpoint: /v1/chat/completions, provider: {provider},\n"
              f"      price: {{input: 1, output: 2}}}}\n")
    with upstream_gateway(tmp_path_factory.mktemp("client-upstream"), models) as gateway:
        yield gateway


HI = [{"role": "user", "content": "Hi"}]
SLOW = Cue(delay=4.0)  # an answer still on its way when the test gives up on it


@pytest.fixture(params=["grpc", "rest"])
def transport(request) -> str:
    return request.param


def client_for(gateway, transport: str, secret: str, *, use_asyncio: bool = False, **options):
    kind = AsyncPorticoClient if use_asyncio else PorticoClient
    target = f"127.0.0.1:{gateway.port}" if transport == "grpc" else gateway.base_url
    return (kind.over_grpc if transport == "grpc" else kind.over_rest)(target, secret, **options)


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


def test_an_answer_over_the_receive_limit_of_a_channel_of_ones_own_is_not_asked_for_again(gateway, double):
    """A transport built over one's own channel (client.md) without CHANNEL_OPTIONS receives 4 MiB: a bigger answer
    fails in grpc itself with a bare RESOURCE_EXHAUSTED, which read as the gateway's 429 and was retried, the images
    generated (and billed) three times and all lost. The gateway's 429s always carry their error object; grpc's own
    limit is raised at once."""
    double.reset()
    images = [tiny_png(i) + os.urandom(700_000) for i in range(8)]  # about 7.5 MiB as base64
    double.default_cue = Cue(body={"created": 1, "data": [{"b64_json": base64.b64encode(image).decode()}
                                                          for image in images]})
    sleeps: list[float] = []
    transport = GrpcTransport(grpc.insecure_channel(f"127.0.0.1:{gateway.port}"), gateway.secret)
    try:
        with PorticoClient(transport, retry=RetryPolicy(attempts=3), sleep=sleeps.append) as client:
            with pytest.raises(RateLimitError) as refused:
                client.call(CREATE_IMAGE, {"prompt": "a cat", "n": 8, "response_format": "b64_json"}, model="image-up")
    finally:
        double.default_cue = Cue()
    assert refused.value.should_retry is False and "larger than max" in refused.value.message
    assert sleeps == [] and len([seen for seen in double.seen if seen.path.endswith("/images/generations")]) == 1


async def test_cancelling_a_running_queued_request_ends_its_call_and_frees_the_keys_slot(gateway, double, transport):
    """A caller that gives up on a queued request (asyncio.wait_for, a cancelled task) cancels its future: the call
    itself went on, holding the queue's worker until the whole answer came, and was answered (200). Now the call
    ends (499) and frees the key's one concurrency slot (a model without a price: api.md, Rate limits)."""
    double.reset()
    double.cue(SLOW)
    created = gateway.cli("keys", "create", "--name", "one-at-a-time", "--all-models", "--concurrency", "1").stdout
    key_id = created.split()[2]
    async with client_for(gateway, transport, created.split()[-1], use_asyncio=True,
                          retry=RetryPolicy(attempts=1)) as client:
        queue = AsyncRequestQueue(max_size=2, concurrency=1)
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(queue.submit(lambda: client.chat_completion("chat-up", HI, max_tokens=5)), 1.0)
        await asyncio.wait_for(queue.close(), 2.0)  # its worker is free again: nothing left to wait for
        while time.monotonic() - started < SLOW.delay + 3:  # the slot is free once the upstream's answer is in
            await asyncio.sleep(0.2)
            try:
                await client.chat_completion("chat-up", HI, max_tokens=5)
                break
            except RetriesExhausted as refused:
                assert isinstance(refused.last, RateLimitError), refused
        else:
            pytest.fail("the cancelled request still holds the key's concurrency slot")
    lines = [line for line in access_lines(gateway) if line["key_id"] == key_id]
    assert [line["status"] for line in lines if line["status"] != 429] == [499, 200]


@pytest.mark.parametrize("model", ["chat-up", "chat-priced"])
async def test_a_cancelled_call_frees_the_keys_slot_at_once_unless_its_model_has_a_price(gateway, double, transport,
                                                                                         model):
    """client.md said a cancelled call is stopped by the gateway, its concurrency slot freed; a non-streamed call to
    an upstream model with a price runs on until the upstream, which bills it anyway, has answered (api.md, Rate
    limits), and holds the slot meanwhile: the next call is refused until then."""
    double.reset()
    double.cue(SLOW)
    created = gateway.cli("keys", "create", "--name", "one-at-a-time", "--all-models", "--concurrency", "1").stdout
    async with client_for(gateway, transport, created.split()[-1], use_asyncio=True,
                          retry=RetryPolicy(attempts=1)) as client:
        started = time.monotonic()
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(client.chat_completion(model, HI, max_tokens=5), 0.5)
        await asyncio.sleep(0.3)  # the gateway has seen the caller leave
        if model == "chat-up":
            await client.chat_completion(model, HI, max_tokens=5)
            return
        with pytest.raises(RetriesExhausted) as refused:
            await client.chat_completion(model, HI, max_tokens=5)
        assert refused.value.last.code == "rate_limit_exceeded" and "concurrent" in refused.value.last.message
        await asyncio.sleep(SLOW.delay + 0.5 - (time.monotonic() - started))  # the upstream's answer is in
        await client.chat_completion(model, HI, max_tokens=5)


@pytest.mark.parametrize("refusal", [
    Cue(status=401, body={"error": {"message": "Incorrect API key provided.", "type": "invalid_request_error",
                                    "code": "invalid_api_key"}}),
    Cue(status=429, body={"error": {"message": "You exceeded your current quota.", "type": "insufficient_quota",
                                    "code": "insufficient_quota"}}),
], ids=["upstream key refused", "upstream account out of quota"])
def test_a_primary_whose_upstream_refuses_the_gateway_falls_back_to_the_next_model(gateway, double, transport,
                                                                                   refusal):
    """An upstream that refuses the gateway's key or account is a 502 `upstream_error` marked x-should-retry: false
    (api.md): that model will not answer again soon, but another may. The client raised it at once, as for a request
    that can never pass, and never tried the alias's fallback, which is there for such an outage."""
    double.reset()
    double.default_cue = refusal
    aliases = ModelAliases.from_config({"chat": {"primary": "chat-up", "fallbacks": ["chat-priced"]}})
    sleeps: list[float] = []
    try:
        with client_for(gateway, transport, gateway.secret, aliases=aliases, sleep=sleeps.append) as client:
            with pytest.raises(UpstreamError) as refused:  # a model without a fallback: the error itself
                client.chat_completion("chat-up", HI, max_tokens=5)
            assert refused.value.should_retry is False and refused.value.status == 502
            tries = len(double.seen)  # the gateway's own tries of the upstream (a 429 is tried again)
            double.default_cue = Cue()
            double.cue(*[refusal] * tries)  # the primary's call, once; the fallback is answered
            answer = client.chat_completion("chat", HI, max_tokens=5)
    finally:
        double.default_cue = Cue()
    assert answer.model == "chat-priced" and sleeps == [] and len(double.seen) == 2 * tries + 1


def test_a_fallback_whose_answer_did_not_come_in_time_is_not_sent_on_to_the_next(gateway, double, transport):
    """client.md: a POST past the client's timeout raises APITimeoutError and is never retried, since the gateway
    may still be working on it and its upstream billing for it. That held for the primary only: a fallback that
    timed out was skipped like a model not granted, and the same request went on to the next fallback (here one
    with a price, which billed a second answer) while the first could still be running."""
    double.reset()
    double.cue(Cue(status=503, body={"error": {"message": "busy"}}), SLOW)  # the primary fails, the fallback is slow
    aliases = ModelAliases.from_config({"chain": {"primary": "chat-once", "fallbacks": ["chat-up", "chat-priced"]}})
    with client_for(gateway, transport, gateway.secret, aliases=aliases, timeout=1.0,
                    retry=RetryPolicy(attempts=1)) as client:
        with pytest.raises(APITimeoutError) as caught:
            client.chat_completion("chain", HI, max_tokens=5)
    chats = [seen.body["model"] for seen in double.seen if seen.path.endswith("/chat/completions")]
    assert chats == ["gpt-image-up", "gpt-image-up"]  # the primary's try and the fallback's, no third
    assert caught.value.code == "timeout"


def test_an_integer_a_grpc_json_value_cannot_hold_exactly_is_not_sent_changed(gateway, double, transport):
    """Open JSON fields (chat_template_kwargs, a tool's schema) are google.protobuf.Values over gRPC, whose numbers
    are doubles: 2**60 reached the upstream as 1.152921504606847e+18, where REST sends it exactly. Over gRPC the
    client now refuses it before sending, naming it."""
    double.reset()
    big = 2**53 + 1
    with client_for(gateway, transport, gateway.secret) as client:
        call = lambda: client.chat_completion("chat-up", HI, max_tokens=5,  # noqa: E731
                                              chat_template_kwargs={"n": 3, "seeds": [1, big]})
        if transport == "rest":
            call()
            assert double.seen[-1].body["chat_template_kwargs"] == {"n": 3, "seeds": [1, big]}
            return
        with pytest.raises(BadRequestError) as refused:
            call()
    assert refused.value.param == "chat_template_kwargs.seeds[1]" and str(big) in refused.value.message
    assert double.seen == []


def test_a_call_in_flight_when_the_client_is_closed_says_so(gateway, double, transport):
    """Closed from another thread (a service shutting down) mid-call, gRPC raised InternalServerError 499
    `internal_error` (as if the gateway had a bug), and REST retried the call first."""
    double.reset()
    double.cue(SLOW)
    sleeps, outcome = [], []
    client = client_for(gateway, transport, gateway.secret, sleep=sleeps.append)
    call = threading.Thread(target=lambda: outcome.append(_raised(lambda: client.chat_completion("chat-up", HI))))
    call.start()
    time.sleep(0.5)  # the call is at the gateway, waiting for the upstream
    client.close()
    call.join(10)
    assert isinstance(outcome[0], RuntimeError) and "closed" in str(outcome[0]) and sleeps == []


async def test_an_asyncio_call_in_flight_when_the_client_is_closed_says_so(gateway, double, transport):
    """The asyncio gRPC call raised asyncio.CancelledError, which reads to asyncio as the task itself having been
    cancelled (gather and TaskGroup pass it on as a cancellation, not as an error); REST retried the call first."""
    double.reset()
    double.cue(SLOW)
    sleeps = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)

    client = client_for(gateway, transport, gateway.secret, use_asyncio=True, sleep=sleep)
    call = asyncio.ensure_future(client.chat_completion("chat-up", HI))
    await asyncio.sleep(0.5)
    await client.close()
    with pytest.raises(RuntimeError, match="closed"):
        await asyncio.wait_for(call, 10)
    assert sleeps == []


def _raised(call) -> BaseException | None:
    try:
        call()
    except BaseException as error:  # noqa: BLE001 - the test looks at it
        return error
    return None
