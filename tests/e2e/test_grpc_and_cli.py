"""Native gRPC through Envoy's port, images through the openai SDK, and key revocation on a running server."""

from __future__ import annotations

import base64
import io
import time

import grpc
import httpx
import openai
import pytest
from google.protobuf import descriptor_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from PIL import Image

from portico.v1 import (
    anthropic_model_pb2, anthropic_model_service_pb2_grpc, chat_service_pb2_grpc, message_service_pb2_grpc, model_pb2,
    model_service_pb2_grpc,
)
from tests.helpers import bearer, chat_request, error_details, message_body, message_request


@pytest.fixture(scope="module")
def channel(gateway):
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        yield channel


def test_grpc_stubs_through_envoy(channel, gateway):
    health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    models = model_service_pb2_grpc.ModelServiceStub(channel).ListModels(
        model_pb2.ListModelsRequest(), metadata=bearer(gateway.secret))
    assert len(models.data) == 8
    chat = chat_service_pb2_grpc.ChatServiceStub(channel)
    completion = chat.CreateChatCompletion(chat_request(max_tokens=3, temperature=0), metadata=bearer(gateway.secret))
    assert completion.usage.completion_tokens == 3
    chunks = list(chat.StreamChatCompletion(chat_request(max_tokens=3, temperature=0), metadata=bearer(gateway.secret)))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_grpc_errors_through_envoy_keep_status_and_details(channel, gateway):
    chat = chat_service_pb2_grpc.ChatServiceStub(channel)
    with pytest.raises(grpc.RpcError) as caught:
        chat.CreateChatCompletion(chat_request(temperature=9), metadata=bearer(gateway.secret))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_details(caught.value).error.param == "temperature"


def test_anthropic_services_give_grpc_callers_the_error_object_rest_callers_get(channel, gateway):
    """MessageService and AnthropicModelService answer REST callers with Anthropic's `type` for the status
    (`not_found_error` for a 404): their gRPC callers find the same object in the status details."""
    messages = message_service_pb2_grpc.MessageServiceStub(channel)
    with pytest.raises(grpc.RpcError) as caught:
        messages.CreateMessage(message_request(model="family-a-5.5"), metadata=bearer(gateway.secret))
    rest = httpx.post(f"{gateway.base_url}/v1/messages", json=message_body(model="family-a-5.5"),
                      headers={"x-api-key": gateway.secret}).json()["error"]
    detail = error_details(caught.value).error
    assert (detail.type, detail.code, detail.param) == (rest["type"], rest["code"], rest["param"])
    assert detail.type == "not_found_error"
    models = anthropic_model_service_pb2_grpc.AnthropicModelServiceStub(channel)
    with pytest.raises(grpc.RpcError) as caught:
        models.GetAnthropicModel(anthropic_model_pb2.GetAnthropicModelRequest(model_id="nope"),
                                 metadata=bearer(gateway.secret))
    assert error_details(caught.value).error.type == "not_found_error"


def test_health_lists_every_service_it_checks(channel, gateway):
    """Health.List (in health.proto, so reflection shows it) answers every name Check knows, rather than
    UNIMPLEMENTED with a traceback in the server's log."""
    health = health_pb2_grpc.HealthStub(channel)
    listed = health.List(health_pb2.HealthListRequest(), timeout=5).statuses
    assert {"", "portico.v1.ChatService", "portico.v1.MessageService"} <= set(listed)
    assert {status.status for status in listed.values()} == {health_pb2.HealthCheckResponse.SERVING}
    assert "NotImplementedError" not in gateway.log_path.read_text()


def test_a_deadline_through_envoy_is_deadline_exceeded_and_frees_the_slot(channel, gateway):
    """A caller's grpc-timeout that passes mid-answer is DEADLINE_EXCEEDED, never INTERNAL: Envoy enforcing it too
    reset calls whose headers had gone (RST_STREAM, INTERNAL, which portico.client retries as a 500). Each leaves a
    499 `cancelled` ledger row and its concurrency slot free."""
    created = gateway.cli("keys", "create", "--name", "deadlines", "--models", "family-a-5.5", "--concurrency", "1")
    secret = created.stdout.strip().splitlines()[-1]
    chat = chat_service_pb2_grpc.ChatServiceStub(channel)
    long = chat_request(max_tokens=400, temperature=0,  # greedy: 400 tokens (~4 s) for this prompt
                        messages=[{"role": "user", "content": "Write a very long story."}])
    codes = []
    for timeout in (0.1, 0.2, 0.3, 0.4, 0.5, 0.6) * 2:
        for call in (chat.CreateChatCompletion, lambda r, **kw: list(chat.StreamChatCompletion(r, **kw))):
            with pytest.raises(grpc.RpcError) as caught:
                call(long, metadata=bearer(secret), timeout=timeout)
            codes.append(caught.value.code())
    assert set(codes) == {grpc.StatusCode.DEADLINE_EXCEEDED}
    assert chat.CreateChatCompletion(chat_request(max_tokens=1), metadata=bearer(secret)).usage.completion_tokens == 1
    time.sleep(1.5)  # usage.flush_seconds
    rows = httpx.get(f"{gateway.base_url}/v1/organization/requests", params={"start_time": 0, "limit": 100},
                     headers={"Authorization": f"Bearer {secret}"}).json()["data"]
    assert sorted((row["status"], row["code"]) for row in rows) == [(200, None)] + [(499, "cancelled")] * len(codes)


def test_images_b64_and_url(gateway):
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.secret, max_retries=0)
    result = client.images.generate(model="family-a-image-2", prompt="a lighthouse", size="256x256")
    image = Image.open(io.BytesIO(base64.b64decode(result.data[0].b64_json)))
    assert image.size == (256, 256) and image.format == "PNG"
    linked = client.images.generate(model="family-a-image-2", prompt="a harbour", size="512x512",
                                    response_format="url", output_format="jpeg")
    fetched = httpx.get(linked.data[0].url, timeout=60)
    assert fetched.status_code == 200 and fetched.headers["content-type"] == "image/jpeg"
    assert Image.open(io.BytesIO(fetched.content)).size == (512, 512)


def test_cli_keys_and_revocation_on_a_running_server(gateway):
    created = gateway.cli("keys", "create", "--name", "e2e", "--models", "family-a-5.5", "--rpm", "10")
    secret = created.stdout.strip().splitlines()[-1]
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=secret, max_retries=0)
    assert [m.id for m in client.models.list()] == ["family-a-5.5"]
    listed = gateway.cli("keys", "list").stdout
    assert "e2e" in listed and secret not in listed
    gateway.cli("keys", "revoke", secret)
    time.sleep(2.0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()


def test_no_secret_in_the_gateway_log(gateway):
    assert gateway.secret not in gateway.log_path.read_text()


def test_reflection_describes_every_service_it_lists(gateway):
    """What grpcurl `describe` and Postman do, through the public port: the file that holds each listed service,
    then its methods. (In a separate process from the test, whose own imports cannot fill the server's pool.)"""
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        listed = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = [s.name for r in listed for s in r.list_services_response.service]
        asks = [reflection_pb2.ServerReflectionRequest(file_containing_symbol=name) for name in names]
        described = {}
        for response in stub.ServerReflectionInfo(iter(asks)):
            symbol = response.original_request.file_containing_symbol
            assert response.HasField("file_descriptor_response"), f"{symbol}: {response.error_response.error_message}"
            files = [descriptor_pb2.FileDescriptorProto.FromString(raw)
                     for raw in response.file_descriptor_response.file_descriptor_proto]
            described[symbol] = [m.name for f in files for service in f.service
                                 if f"{f.package}.{service.name}" == symbol for m in service.method]
    assert set(described) == set(names) and all(described.values())
    assert {"portico.v1.ChatService", "portico.v1.AnthropicModelService"} <= set(names)
    assert "CreateChatCompletion" in described["portico.v1.ChatService"]


def test_reflection_finds_the_file_of_a_method(gateway):
    """`grpcurl describe portico.v1.ChatService.CreateChatCompletion` asks for the file holding the method's symbol
    (the reflection protocol's `<package>.<service>.<method>`): it was "not found", as the server's descriptor pool
    looks up no method names."""
    methods = ["portico.v1.ChatService.CreateChatCompletion", "portico.v1.MessageService.CountMessageTokens",
               "grpc.health.v1.Health.Check"]
    asks = [reflection_pb2.ServerReflectionRequest(file_containing_symbol=name)
            for name in [*methods, "portico.v1.ChatService.Nope"]]
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        answers = list(reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(iter(asks)))
    for name, answer in zip(methods, answers):
        assert answer.HasField("file_descriptor_response"), f"{name}: {answer.error_response.error_message}"
        first = descriptor_pb2.FileDescriptorProto.FromString(answer.file_descriptor_response.file_descriptor_proto[0])
        service, method = name.rsplit(".", 2)[1:]
        assert method in [m.name for s in first.service if s.name == service for m in s.method]
    assert answers[-1].error_response.error_code == grpc.StatusCode.NOT_FOUND.value[0]


def test_reflection_answers_the_v1_protocol_too(gateway):
    """grpc.reflection.v1 is the protocol current clients ask first, and some ask only it: they got UNIMPLEMENTED.
    Its messages are v1alpha's on the wire, so v1alpha's classes stand in for a v1 client here."""
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        info = channel.stream_stream("/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
                                     request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
                                     response_deserializer=reflection_pb2.ServerReflectionResponse.FromString)
        asks = [reflection_pb2.ServerReflectionRequest(list_services=""),
                reflection_pb2.ServerReflectionRequest(file_containing_symbol="portico.v1.ChatService")]
        listed, described = list(info(iter(asks), timeout=10))
    assert "portico.v1.ChatService" in [s.name for s in listed.list_services_response.service]
    first = descriptor_pb2.FileDescriptorProto.FromString(described.file_descriptor_response.file_descriptor_proto[0])
    assert first.name == "portico/v1/chat_service.proto"
