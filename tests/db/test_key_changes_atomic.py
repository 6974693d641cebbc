"""A key change and the NOTIFY that tells the other hosts are one transaction. They were two statements: when the
second failed (the database gone between them, or a role without EXECUTE on pg_notify), the admin got an error for a
change that had been made, and the other hosts heard of it only at their next lookup. A rotation so answered had
replaced the secret with one nobody was shown: the key died at the end of the grace period."""

from __future__ import annotations

import os

import pytest

from server.db import StoreSettings
from server.keys import hash_secret, open_key_store
from tests.postgres_support import PASSWORD_ENV

ROLE_PASSWORD_ENV = "PORTICO_TEST_APP_ROLE_PASSWORD"


@pytest.fixture
async def stores(postgres_server, postgres_url, monkeypatch):
    """The store as its owner (who migrated it), and as a role that may not NOTIFY."""
    owner = await open_key_store(StoreSettings(url=postgres_url, password_env=PASSWORD_ENV, timeout_seconds=2))
    database = postgres_url.rsplit("/", 1)[1]
    role = f"app_{database}"
    monkeypatch.setenv(ROLE_PASSWORD_ENV, "app-pw")
    with postgres_server.connect(database) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD 'app-pw'")
        conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
        conn.execute("REVOKE EXECUTE ON FUNCTION pg_notify(text, text) FROM PUBLIC")
    app = await open_key_store(StoreSettings(url=postgres_url.replace("postgres@", f"{role}@"),
                                             password_env=ROLE_PASSWORD_ENV, timeout_seconds=2))
    yield owner, app
    await app.close()
    await owner.close()


async def test_a_change_whose_notice_fails_is_not_made(stores):
    owner, app = stores
    key, secret = await owner.create("ci", all_models=True)
    with pytest.raises(Exception):
        await app.rotate(key.id, grace_seconds=60)
    found = await owner.find_active(hash_secret(secret))
    assert found is not None and found.secret_expires == 0, "the secret was rotated out though the rotation failed"
    with pytest.raises(Exception):
        await app.update(key.id, name="renamed")
    assert (await owner.get(key.id)).name == "ci"
    with pytest.raises(Exception):
        await app.revoke(key.id)
    assert (await owner.get(key.id)).revoked_at == 0
