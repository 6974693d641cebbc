"""Keys written by an older Portico, served by this one after an in-place upgrade (the data dir kept).

Up to 2026-11-26 a key's own limits had no upper bound; KeyService carries them as int32, so such a key made the whole
key list (and the console's keys page) a 500 once upgraded. The keys.db here is built with the released migrations'
own SQL (the schema is unchanged since keys v2), holding what that Portico stored.
"""

from __future__ import annotations

import dataclasses
import sqlite3

import grpc
import pytest

from portico.v1 import key_pb2, key_service_pb2_grpc
from server.app import start_server
from server.config import load_config
from server.db import migrate_sqlite
from server.domain_keys import MAX_COUNT_LIMIT
from server.keys.schema import MIGRATIONS as KEY_MIGRATIONS
from server.keys.store import hash_secret
from tests.helpers import bearer

ADMIN_SECRET = "pk-admin-secret-of-an-older-portico"
_COLUMNS = ("id", "name", "secret_hash", "all_models", "models", "env", "admin", "created", "requests_per_minute",
            "tokens_per_minute", "concurrent_requests", "daily_tokens", "daily_requests")


def _old_keys_db(path) -> None:
    """keys.db at schema keys v2 (2026-11-23 .. today) with the limits an older Portico accepted."""
    db = sqlite3.connect(path, isolation_level=None)
    migrate_sqlite(db, KEY_MIGRATIONS[:2])
    rows = [("key_admin", "admin", hash_secret(ADMIN_SECRET), 1, "", "", 1, 1, None, None, None, None, None),
            ("key_big", "big", hash_secret("pk-big"), 1, "", "prod", 0, 2, 3_000_000_000, 50_000, 3, 10**10, 40)]
    db.executemany(f"INSERT INTO api_keys ({', '.join(_COLUMNS)}) VALUES ({', '.join('?' * len(_COLUMNS))})", rows)
    db.close()


@pytest.fixture
async def keys(tmp_path):
    data_dir = tmp_path / "data"
    data_dir.mkdir(mode=0o700)
    _old_keys_db(data_dir / "keys.db")
    config = load_config()
    config = dataclasses.replace(config, data_dir=data_dir, access_log=str(tmp_path / "access.log"),
                                 models=tuple(m for m in config.models if m.provider.kind == "dev-image"))
    server = await start_server(config, "127.0.0.1:0")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield key_service_pb2_grpc.KeyServiceStub(channel)
    await server.stop(0)


async def test_a_limit_past_int32_from_an_older_portico_is_listed_at_the_most_a_key_may_have(keys):
    listed = await keys.ListKeys(key_pb2.ListKeysRequest(), metadata=bearer(ADMIN_SECRET))
    big = next(key for key in listed.keys if key.id == "key_big")
    assert (big.limits.requests_per_minute, big.limits.daily_tokens) == (MAX_COUNT_LIMIT, MAX_COUNT_LIMIT)
    assert (big.limits.tokens_per_minute, big.limits.concurrent_requests, big.limits.daily_requests) == (50_000, 3, 40)
    got = await keys.GetKey(key_pb2.GetKeyRequest(id="key_big"), metadata=bearer(ADMIN_SECRET))
    assert got.key == big
    updated = await keys.UpdateKey(key_pb2.UpdateKeyRequest(id="key_big", name="renamed"),
                                   metadata=bearer(ADMIN_SECRET))
    assert (updated.key.name, updated.key.limits) == ("renamed", big.limits)
