"""ModelService, KeyService, health and reflection over real gRPC stubs."""

from __future__ import annotations

import asyncio
import importlib
import pkgutil

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

import portico.v1
from portico.v1 import anthropic_model_pb2, anthropic_model_service_pb2_grpc
from portico.v1 import key_pb2, key_service_pb2_grpc, model_pb2, model_service_pb2_grpc
from tests.helpers import bearer, chat_request, error_details
from portico.v1 import chat_service_pb2_grpc

ALL_MODELS = {
    "family-a-5.4": "/v1/chat/completions",
    "family-a-5.5": "/v1/chat/completions",
    "family-a-image-2": "/v1/images/generations",
    "family-b-opus-4-6": "/v1/messages",
    "family-b-opus-4-7": "/v1/messages",
    "family-b-opus-4-8": "/v1/messages",
    "family-b-sonnet-4-6": "/v1/messages",
    "family-b-haiku-4-5-20251001": "/v1/messages",
}


async def test_list_models_shows_every_model_with_its_endpoint(channel, secret):
    models = await model_service_pb2_grpc.ModelServiceStub(channel).ListModels(
        model_pb2.ListModelsRequest(), metadata=bearer(secret)
    )
    assert models.object == "list"
    assert {m.id: m.endpoint for m in models.data} == ALL_MODELS
    assert all(m.object == "model" and m.created > 0 and m.owned_by for m in models.data)


async def test_list_models_shows_only_granted_models(channel, running):
    secret = (await running.store.create("b-only", all_models=False, models=["family-b-sonnet-4-6"]))[1]
    stub = model_service_pb2_grpc.ModelServiceStub(channel)
    models = await stub.ListModels(model_pb2.ListModelsRequest(), metadata=bearer(secret))
    assert [m.id for m in models.data] == ["family-b-sonnet-4-6"]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GetModel(model_pb2.GetModelRequest(model="family-a-5.5"), metadata=bearer(secret))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_anthropic_models_page_only_granted_models(channel, running):
    granted = ["family-b-sonnet-4-6", "family-b-opus-4-8", "family-a-5.4"]
    secret = (await running.store.create("three", all_models=False, models=granted))[1]
    stub = anthropic_model_service_pb2_grpc.AnthropicModelServiceStub(channel)
    page = await stub.ListAnthropicModels(anthropic_model_pb2.ListAnthropicModelsRequest(limit=2),
                                          metadata=bearer(secret))
    assert [m.id for m in page.data] == ["family-b-opus-4-8", "family-b-sonnet-4-6"] and page.has_more
    assert (page.first_id.string_value, page.last_id.string_value) == ("family-b-opus-4-8", "family-b-sonnet-4-6")
    rest = await stub.ListAnthropicModels(
        anthropic_model_pb2.ListAnthropicModelsRequest(limit=2, after_id=page.last_id.string_value),
        metadata=bearer(secret))
    assert [m.id for m in rest.data] == ["family-a-5.4"] and not rest.has_more
    # A model the key was not granted is no cursor, exactly like one that does not exist.
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ListAnthropicModels(anthropic_model_pb2.ListAnthropicModelsRequest(after_id="family-a-5.5"),
                                       metadata=bearer(secret))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_details(caught.value).error.param == "after_id"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.GetAnthropicModel(anthropic_model_pb2.GetAnthropicModelRequest(model_id="family-a-5.5"),
                                     metadata=bearer(secret))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_key_service_needs_an_admin_key(channel, secret):
    stub = key_service_pb2_grpc.KeyServiceStub(channel)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ListKeys(key_pb2.ListKeysRequest(), metadata=bearer(secret))
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert error_details(caught.value).error.code == "permission_denied"
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await stub.ListKeys(key_pb2.ListKeysRequest())
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_admin_creates_and_revokes_keys_and_revocation_takes_effect_within_2s(channel, admin_secret):
    keys = key_service_pb2_grpc.KeyServiceStub(channel)
    chat = chat_service_pb2_grpc.ChatServiceStub(channel)
    created = await keys.CreateKey(
        key_pb2.CreateKeyRequest(name="temp", models=["family-a-5.5"], limits={"requests_per_minute": 5}),
        metadata=bearer(admin_secret),
    )
    assert created.secret.startswith("pk-") and created.key.limits.requests_per_minute == 5
    listed = await keys.ListKeys(key_pb2.ListKeysRequest(), metadata=bearer(admin_secret))
    assert created.key.id in {k.id for k in listed.keys}
    assert created.secret not in str(listed)
    await chat.CreateChatCompletion(chat_request(max_tokens=1), metadata=bearer(created.secret))

    revoked = await keys.RevokeKey(key_pb2.RevokeKeyRequest(id=created.key.id), metadata=bearer(admin_secret))
    assert revoked.key.revoked_at > 0
    await asyncio.sleep(2.0)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await chat.CreateChatCompletion(chat_request(max_tokens=1), metadata=bearer(created.secret))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED


def portico_services() -> set[str]:
    """Every service the protos of portico.v1 declare."""
    modules = (importlib.import_module(f"portico.v1.{m.name}") for m in pkgutil.iter_modules(portico.v1.__path__)
               if m.name.endswith("_pb2"))
    return {service.full_name for module in modules for service in module.DESCRIPTOR.services_by_name.values()}


async def test_health_covers_the_server_and_every_portico_service(channel):
    stub = health_pb2_grpc.HealthStub(channel)
    assert len(portico_services()) >= 10
    for service in ("", *sorted(portico_services())):
        response = await stub.Check(health_pb2.HealthCheckRequest(service=service))
        assert response.status == health_pb2.HealthCheckResponse.SERVING, service


async def test_reflection_lists_every_service(channel):
    stub = reflection_pb2_grpc.ServerReflectionStub(channel)
    responses = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    async for response in responses:
        names = {s.name for s in response.list_services_response.service}
        break
    assert portico_services() | {"grpc.health.v1.Health"} <= names
