"""KeyService UpdateKey and RotateKey over real stubs: new limits and grants take effect, a rotated key has a new
secret while the old one works for the grace period, and only admin keys may do either."""

from __future__ import annotations

import asyncio
import logging

import grpc
import pytest

from portico.v1 import key_pb2, key_service_pb2_grpc
from tests.helpers import bearer, chat_request, error_details


@pytest.fixture(scope="module")
def keys(channel) -> key_service_pb2_grpc.KeyServiceStub:
    return key_service_pb2_grpc.KeyServiceStub(channel)


async def create(keys, admin_secret, **fields) -> key_pb2.CreateKeyResponse:
    request = key_pb2.CreateKeyRequest(name="managed", all_models=True, **fields)
    return await keys.CreateKey(request, metadata=bearer(admin_secret))


async def test_update_limits_and_grants_take_effect(keys, chat, admin_secret):
    created = await create(keys, admin_secret, limits={"requests_per_minute": 5, "tokens_per_minute": 50_000})
    update = key_pb2.UpdateKeyRequest(id=created.key.id, limits={"requests_per_minute": 1, "tokens_per_minute": 0},
                                      models=["family-a-5.4"], name="narrowed")
    updated = (await keys.UpdateKey(update, metadata=bearer(admin_secret))).key
    assert (updated.name, updated.all_models, list(updated.models)) == ("narrowed", False, ["family-a-5.4"])
    assert updated.limits.requests_per_minute == 1 and not updated.limits.HasField("tokens_per_minute")
    await asyncio.sleep(1.1)  # keys.cache_seconds: lookups cached before the update are gone
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await chat.CreateChatCompletion(chat_request(max_tokens=1), metadata=bearer(created.secret))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND  # family-a-5.5 is no longer granted
    call = chat.CreateChatCompletion(chat_request(model="family-a-5.4", max_tokens=1), metadata=bearer(created.secret))
    headers = dict(await call.initial_metadata())
    await call
    assert (headers["x-ratelimit-limit-requests"], headers["x-ratelimit-limit-tokens"]) == ("1", "1000000")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await chat.CreateChatCompletion(chat_request(model="family-a-5.4", max_tokens=1),
                                        metadata=bearer(created.secret))
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


async def test_update_rejects_bad_values(keys, admin_secret):
    created = await create(keys, admin_secret)
    for request, param in [
        (key_pb2.UpdateKeyRequest(id=created.key.id, limits={"daily_tokens": -5}), "limits.daily_tokens"),
        (key_pb2.UpdateKeyRequest(id=created.key.id, all_models=False), "models"),
        (key_pb2.UpdateKeyRequest(id="key_nope", name="x"), "id"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await keys.UpdateKey(request, metadata=bearer(admin_secret))
        assert error_details(caught.value).error.param == param


async def test_a_negative_budget_is_refused_naming_its_bounds(keys, admin_secret):
    """A budget of -1 was told "must be a non-negative number of US dollars"; the 0 sent next was refused by
    CreateKey in turn. Now the message names the bounds, as for a negative count limit."""
    created = await create(keys, admin_secret)
    for call, request, name, bounds in [
        (keys.CreateKey, key_pb2.CreateKeyRequest(name="x", all_models=True, limits={"max_spend_day": -1}),
         "max_spend_day", "more than $0 and at most $1000000000.00"),
        (keys.UpdateKey, key_pb2.UpdateKeyRequest(id=created.key.id, limits={"max_spend_month": -0.5}),
         "max_spend_month", "more than $0 (0 removes the key's own limit) and at most $1000000000.00"),
    ]:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call(request, metadata=bearer(admin_secret))
        error = error_details(caught.value).error
        assert (error.param, error.message) == (f"limits.{name}", f"{name} must be {bounds}.")


async def test_rotation_with_grace_keeps_the_old_secret_working(keys, chat, admin_secret):
    created = await create(keys, admin_secret)
    rotated = await keys.RotateKey(key_pb2.RotateKeyRequest(id=created.key.id), metadata=bearer(admin_secret))
    assert rotated.secret.startswith("pk-") and rotated.secret != created.secret
    assert rotated.previous_secret_expires >= created.key.created + 86_000  # keys.rotation_grace_seconds
    for secret in (created.secret, rotated.secret):
        await chat.CreateChatCompletion(chat_request(max_tokens=1), metadata=bearer(secret))


async def test_rotation_without_grace_ends_the_old_secret(keys, chat, admin_secret):
    created = await create(keys, admin_secret)
    request = key_pb2.RotateKeyRequest(id=created.key.id, grace_seconds=0)
    rotated = await keys.RotateKey(request, metadata=bearer(admin_secret))
    await asyncio.sleep(1.1)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await chat.CreateChatCompletion(chat_request(max_tokens=1), metadata=bearer(created.secret))
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    await chat.CreateChatCompletion(chat_request(max_tokens=1), metadata=bearer(rotated.secret))


async def test_update_and_rotate_need_an_admin_key(keys, admin_secret, secret):
    created = await create(keys, admin_secret)
    for call in (keys.UpdateKey(key_pb2.UpdateKeyRequest(id=created.key.id, name="x"), metadata=bearer(secret)),
                 keys.RotateKey(key_pb2.RotateKeyRequest(id=created.key.id), metadata=bearer(secret))):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await call
        assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED


async def test_create_and_update_refuse_models_outside_the_catalog(keys, admin_secret):
    """KeyService and `portico keys` share one key-admin service: an unknown model id is refused, never stored."""
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await keys.CreateKey(key_pb2.CreateKeyRequest(name="typo", models=["family-a-5.9"]),
                             metadata=bearer(admin_secret))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_details(caught.value).error.param == "models" and "family-a-5.9" in caught.value.details()
    created = await create(keys, admin_secret)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await keys.UpdateKey(key_pb2.UpdateKeyRequest(id=created.key.id, models=["nope"]),
                             metadata=bearer(admin_secret))
    assert error_details(caught.value).error.param == "models"


async def test_create_and_update_refuse_all_models_together_with_a_list(keys, admin_secret):
    """all_models grants every model and models exactly those: both at once would store a grant the caller did not
    mean (every model), so it is a 400 naming `models`, and nothing is stored or changed."""
    before = len((await keys.ListKeys(key_pb2.ListKeysRequest(), metadata=bearer(admin_secret))).keys)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await keys.CreateKey(key_pb2.CreateKeyRequest(name="both", all_models=True, models=["family-a-5.5"]),
                             metadata=bearer(admin_secret))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_details(caught.value).error.param == "models"
    assert len((await keys.ListKeys(key_pb2.ListKeysRequest(), metadata=bearer(admin_secret))).keys) == before
    created = await keys.CreateKey(key_pb2.CreateKeyRequest(name="narrow", models=["family-a-5.5"]),
                                   metadata=bearer(admin_secret))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await keys.UpdateKey(key_pb2.UpdateKeyRequest(id=created.key.id, all_models=True, models=["family-a-5.4"]),
                             metadata=bearer(admin_secret))
    assert error_details(caught.value).error.param == "models"
    kept = (await keys.GetKey(key_pb2.GetKeyRequest(id=created.key.id), metadata=bearer(admin_secret))).key
    assert (kept.all_models, list(kept.models)) == (False, ["family-a-5.5"])


async def test_a_key_store_that_cannot_be_written_is_a_503_and_logged(keys, admin_secret, running, caplog):
    """A full disk under keys.db: the caller got 503 "The key store is unreachable" and the operator no line at all,
    so nothing said why. Now the driver's words are logged with the 503."""
    database = running.store._db
    await database.execute("PRAGMA max_page_count = 1")  # at most its size now: SQLite's own "disk is full"
    try:
        with caplog.at_level(logging.ERROR, logger="server.services.interceptor"):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                for _ in range(500):
                    await create(keys, admin_secret)
    finally:
        await database.execute("PRAGMA max_page_count = 1073741823")
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error_details(caught.value).error.code == "service_unavailable"
    assert "database or disk is full" in caplog.text and "CreateKey" in caplog.text
    await create(keys, admin_secret)  # room again: no restart needed
