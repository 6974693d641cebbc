"""portico.client given what it cannot send, against the real gateway, over gRPC and REST: a clear typed error at
once, the same on both transports, never a raw grpc/httpx/json error, a round of pointless retries, or a crash."""

from __future__ import annotations

import pytest

from portico.client import (
    CHAT_COMPLETION, MESSAGE, AsyncPorticoClient, AuthenticationError, BadRequestError, ModelAliases, Operation,
    PorticoClient, RetryPolicy,
)
from portico.v1 import key_pb2, key_service_pb2_grpc, model_pb2, model_service_pb2_grpc

HI = [{"role": "user", "content": "Hi"}]
ALIASES = ModelAliases.from_config({"chat": {"primary": "family-a-5.5", "fallbacks": ["family-a-5.4"]}})
GET_MODEL = Operation(model_service_pb2_grpc.ModelServiceStub, "GetModel", model_pb2.GetModelRequest, model_pb2.Model,
                      "GET", "/v1/models/{model}")
GET_KEY = Operation(key_service_pb2_grpc.KeyServiceStub, "GetKey", key_pb2.GetKeyRequest, key_pb2.GetKeyResponse,
                    "GET", "/v1/admin/keys/{id}")
UPDATE_KEY = Operation(key_service_pb2_grpc.KeyServiceStub, "UpdateKey", key_pb2.UpdateKeyRequest,
                       key_pb2.UpdateKeyResponse, "PATCH", "/v1/admin/keys/{id}")


class Sleeps(list):
    def __call__(self, seconds: float) -> None:
        self.append(seconds)


@pytest.fixture(params=["grpc", "rest"])
def transport(request) -> str:
    return request.param


def client_for(gateway, transport: str, secret: str, *, asyncio: bool = False, **options):
    kind = AsyncPorticoClient if asyncio else PorticoClient
    options.setdefault("aliases", ALIASES)
    options.setdefault("retry", RetryPolicy(attempts=3, base=0.1, cap=1.0))
    if transport == "grpc":
        return kind.over_grpc(f"127.0.0.1:{gateway.port}", secret, **options)
    return kind.over_rest(gateway.base_url, secret, **options)


@pytest.mark.parametrize("key", ["pk-abc\n", "pk-é", "pk a"])
def test_a_key_that_cannot_be_a_header_is_a_401_at_once(gateway, transport, key):
    """As the gateway answers such a key (api.md), not grpc's INTERNAL or httpx's protocol error retried 6 times."""
    sleeps = Sleeps()
    with client_for(gateway, transport, key, sleep=sleeps) as client:
        with pytest.raises(AuthenticationError) as caught:
            client.chat_completion("chat", HI, max_tokens=1)
    assert (caught.value.status, caught.value.code, caught.value.type) == (
        401, "invalid_api_key", "authentication_error")
    assert key.strip() not in str(caught.value) and sleeps == []


@pytest.mark.parametrize("key", ["", None])
def test_no_key_is_the_gateways_401(gateway, transport, key):
    sleeps = Sleeps()
    with client_for(gateway, transport, key, sleep=sleeps) as client:
        with pytest.raises(AuthenticationError) as caught:
            client.chat_completion("chat", HI, max_tokens=1)
    assert "didn't provide an API key" in caught.value.message and sleeps == []


async def test_the_asyncio_client_refuses_such_a_key_too(gateway, transport):
    async with client_for(gateway, transport, "pk-\x7f", asyncio=True) as client:
        with pytest.raises(AuthenticationError):
            await client.chat_completion("chat", HI, max_tokens=1)


@pytest.mark.parametrize("fields", [
    {"temperature": float("nan")},
    {"messages": [{"role": "user", "content": {"a set"}}]},
    {"messages": [{"role": "user", "content": object()}]},
])
def test_a_value_json_cannot_hold_is_a_bad_request_on_both_transports(gateway, transport, fields):
    sleeps, fields = Sleeps(), dict(fields)
    with client_for(gateway, transport, gateway.secret, sleep=sleeps) as client:
        with pytest.raises(BadRequestError) as caught:
            client.chat_completion("chat", fields.pop("messages", HI), max_tokens=1, **fields)
    assert (caught.value.status, caught.value.code) == (400, "invalid_request") and sleeps == []


@pytest.mark.parametrize("fields, param", [
    ({"max_tokens": "many"}, "max_tokens"),
    ({"messages": "Hi"}, "messages"),
    ({"max_tokens": "2"}, "max_tokens"),
    ({"temperature": "0.5"}, "temperature"),
    ({"seed": "7"}, "seed"),
    ({"logit_bias": {"50256": "-100"}}, "logit_bias.50256"),
])
def test_a_wrongly_typed_field_is_named_in_param_on_both_transports(gateway, transport, fields, param):
    """Over gRPC the client finds it cannot build the request message; over REST the gateway says so. A number
    written as a string ("2") passed over gRPC, which protobuf's JSON reading takes for a number."""
    fields = dict(fields)
    with client_for(gateway, transport, gateway.secret) as client:
        with pytest.raises(BadRequestError) as caught:
            client.chat_completion("chat", fields.pop("messages", HI), **{"max_tokens": 1, **fields})
    assert (caught.value.status, caught.value.param) == (400, param)


@pytest.mark.parametrize("mib", [9, 17])
def test_a_request_over_8_mib_is_a_413_at_once_on_both_transports(gateway, transport, mib):
    """Over 16 MiB grpc's own RESOURCE_EXHAUSTED (no error object) read as a 429: retried, then the fallback tried."""
    sleeps, prompt = Sleeps(), [{"role": "user", "content": "a" * (mib << 20)}]
    with client_for(gateway, transport, gateway.secret, sleep=sleeps) as client:
        with pytest.raises(BadRequestError) as caught:
            client.chat_completion("chat", prompt, max_tokens=1)
    assert (caught.value.status, caught.value.code) == (413, "request_too_large") and sleeps == []


@pytest.mark.parametrize(("operation", "body", "param"), [
    (GET_MODEL, {}, "model"), (GET_MODEL, {"model": ""}, "model"), (GET_KEY, {"id": ""}, "id"),
    (UPDATE_KEY, {"name": "renamed"}, "id"),
])
def test_a_path_field_left_out_is_a_bad_request_on_both_transports(gateway, transport, operation, body, param):
    """Over REST the route lost its last segment and addressed another resource: GET /v1/models/ is the model list,
    which came back as an empty Model (and /v1/admin/keys/ as an empty GetKeyResponse), with no error at all."""
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    sleeps = Sleeps()
    with client_for(gateway, transport, admin, sleep=sleeps) as client:
        with pytest.raises(BadRequestError) as caught:
            client.call(operation, body)
    assert (caught.value.status, caught.value.param) == (400, param) and sleeps == []


def test_a_closed_client_says_so(gateway, transport):
    """grpc crashed the process (a segmentation fault) when a stub was made on the closed channel."""
    client = client_for(gateway, transport, gateway.secret)
    client.close()
    for call in (lambda: client.chat_completion("chat", HI, max_tokens=1), client.list_models):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    client.close()  # twice is harmless


async def test_a_closed_asyncio_client_says_so(gateway, transport):
    """The asyncio gRPC client used to open a new channel after close() and go on as if never closed."""
    client = client_for(gateway, transport, gateway.secret, asyncio=True)
    await client.chat_completion("chat", HI, max_tokens=1)
    await client.close()
    for call in (lambda: client.chat_completion("chat", HI, max_tokens=1), client.list_models):
        with pytest.raises(RuntimeError, match="closed"):
            await call()
    await client.close()  # twice is harmless


@pytest.mark.parametrize(("operation", "model"), [(CHAT_COMPLETION, "chat"), (MESSAGE, "family-b-opus-4-8")])
async def test_stream_through_call_is_refused_as_by_the_named_methods(gateway, transport, operation, model):
    """The client is unary: REST used to generate the whole stream, then fail to read it as JSON (an APIError with
    status 200); gRPC dropped `stream` and answered in one piece."""
    body = {"messages": HI, "max_tokens": 1, "stream": True}
    with client_for(gateway, transport, gateway.secret) as client:
        with pytest.raises(ValueError, match="unary calls only"):
            client.call(operation, body, model=model)
    async with client_for(gateway, transport, gateway.secret, asyncio=True) as client:
        with pytest.raises(ValueError, match="unary calls only"):
            await client.call(operation, body, model=model)

