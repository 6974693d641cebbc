"""Key administration calls that meet on one key, against both stores (SQLite and a real PostgreSQL): what an
operator's automation is answered when a revocation or another change lands in the middle of its call."""

from __future__ import annotations

import asyncio

import pytest

from server.db import StoreSettings
from server.errors import InvalidRequest
from server.keys import KeyStore, hash_secret, open_key_store
from tests.postgres_support import PASSWORD_ENV


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(request, tmp_path) -> StoreSettings:
    if request.param == "sqlite":
        return StoreSettings(sqlite_path=tmp_path / "keys.db")
    return StoreSettings(url=request.getfixturevalue("postgres_url"), password_env=PASSWORD_ENV, timeout_seconds=2)


@pytest.fixture
async def store(settings) -> KeyStore:
    store = await open_key_store(settings)
    yield store
    await store.close()


async def test_a_key_revoked_while_it_is_rotated_is_refused_as_a_revoked_key_is(store, monkeypatch):
    """The rotation read the key, then a revocation (another admin, the console) landed before it wrote: it answered
    200 with a new secret for the revoked key, which never worked; api.md: a revoked key cannot be rotated (400)."""
    key, secret = await store.create("ci", all_models=True)
    read = store.get

    async def read_then_revoked(key_id: str):
        found = await read(key_id)
        monkeypatch.setattr(store, "get", read)
        await store.revoke(key_id)
        return found

    monkeypatch.setattr(store, "get", read_then_revoked)
    with pytest.raises(InvalidRequest, match="revoked") as refused:
        await store.rotate(key.id, grace_seconds=600)
    assert refused.value.param == "id"
    assert (await store.get(key.id)).revoked_at > 0
    assert await store.find_active(hash_secret(secret)) is None


async def test_two_updates_at_once_each_keep_what_the_other_changed(store):
    key, _ = await store.create("ci", all_models=True)
    await asyncio.gather(*(store.update(key.id, name=f"n{n}") for n in range(5)),
                         *(store.update(key.id, limits={"daily_requests": 100 + n}) for n in range(5)),
                         store.update(key.id, grants=(False, ["family-a-5.5"])))
    after = await store.get(key.id)
    assert after.name in {f"n{n}" for n in range(5)} and after.limits.daily_requests in range(100, 105)
    assert (after.all_models, after.models) == (False, frozenset({"family-a-5.5"}))
