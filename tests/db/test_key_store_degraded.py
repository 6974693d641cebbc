"""The PostgreSQL key store degraded rather than down: a lock another session holds on the key tables, a read-only
database (a standby after a failover), connections cut under a busy pool (a restart, pg_terminate_backend), a DBA's
default isolation level. Lookups keep their documented outage behaviour, writes answer 503, never a 500 or a stall."""

from __future__ import annotations

import asyncio
import time

import pytest

from server.db import StoreSettings
from server.db.database import StoreUnavailable
from server.keys import Authenticator, KeyStore, hash_secret, open_key_store
from tests.helpers import bearer, lookups_held_up
from tests.postgres_support import PASSWORD_ENV


async def test_a_cached_key_is_not_held_up_again_and_again_behind_a_lock_on_the_keys_table(postgres_server):
    """A DBA's `LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE` (VACUUM FULL, a long ALTER, a migration waiting): every
    lookup waited its statement timeout, and a cached key past cache_seconds was served stale only after it. The
    readiness check's `SELECT 1` still answered, which ended the calls' fail-fast window every second, so the key's
    requests stalled the store timeout again and again (and /readyz said `"keys": "ok"`). The check now asks the
    key tables, as a lookup does."""
    url = postgres_server.new_database()
    settings = StoreSettings(url=url, password_env=PASSWORD_ENV, timeout_seconds=1)
    store = await open_key_store(settings)
    auth = Authenticator(store, cache_seconds=0.1, stale_seconds=60)
    key, secret = await store.create("cached", all_models=True)
    assert await auth.authenticate(bearer(secret)) == key
    pings: list[bool] = []

    async def readiness() -> None:  # as server/health.py checks the store
        while True:
            try:
                await store.ping()
                pings.append(True)
            except StoreUnavailable:
                pings.append(False)
            await asyncio.sleep(1)

    checks = asyncio.create_task(readiness())
    try:
        with postgres_server.connect(url.rsplit("/", 1)[1]) as dba, dba.transaction():
            dba.execute("LOCK TABLE api_keys IN ACCESS EXCLUSIVE MODE")
            pings.clear()
            slow = await lookups_held_up(auth, secret, key, 6)
        assert len(slow) <= 1, f"requests held up at {slow} s"
        assert pings and not any(pings), "readiness found the key store answering lookups it could not answer"
        deadline = time.monotonic() + 5
        while not await _answers(store):  # the lock gone: answered again at the next check
            assert time.monotonic() < deadline, "the key store did not recover"
            await asyncio.sleep(0.2)
    finally:
        checks.cancel()
        await store.close()


async def _answers(store: KeyStore) -> bool:
    try:
        await store.ping()
        return True
    except StoreUnavailable:
        return False


async def test_a_read_only_postgresql_answers_key_writes_503_and_lookups_as_ever(postgres_server):
    """The key store's database read-only (a failover that points the hosts at a standby not yet promoted, a DBA's
    `default_transaction_read_only` during maintenance): every admin write (create, update, rotate, revoke) was a 500
    `internal_error` and `portico keys create` printed a traceback, where operations.md promises 503 for an
    unavailable store. A refused write is StoreUnavailable; lookups, which need no write, go on being answered."""
    url = postgres_server.new_database()
    name = url.rsplit("/", 1)[1]
    store = await open_key_store(StoreSettings(url=url, password_env=PASSWORD_ENV, timeout_seconds=1))
    key, secret = await store.create("before", all_models=True)
    try:
        with postgres_server.connect() as dba:
            dba.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
            dba.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        writes = [lambda: store.create("during", all_models=True), lambda: store.update(key.id, name="renamed"),
                  lambda: store.rotate(key.id, grace_seconds=60), lambda: store.revoke(key.id)]
        for write in writes:
            with pytest.raises(StoreUnavailable, match="read-only"):
                await write()
        assert (await store.find_active(hash_secret(secret))).id == key.id  # lookups are answered at once
        with postgres_server.connect() as dba:
            dba.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
            dba.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        assert (await store.revoke(key.id)).revoked_at > 0
    finally:
        await store.close()


async def test_key_writes_are_taken_again_as_soon_as_the_read_only_setting_is_reset(postgres_server):
    """`default_transaction_read_only` for the database, then its RESET, without a restart: each pooled connection
    kept the setting of the session it began in until the pool replaced it (psycopg_pool's max_lifetime, an hour), so
    admin writes (`POST /v1/admin/keys`, `portico keys` on a host) went on answering 503 for up to an hour. A write
    refused as read-only has the pool's connections replaced and is tried once more, on a new one."""
    url = postgres_server.new_database()
    name = url.rsplit("/", 1)[1]
    store = await open_key_store(StoreSettings(url=url, password_env=PASSWORD_ENV, timeout_seconds=1))
    try:
        key, secret = await store.create("before", all_models=True)
        with postgres_server.connect() as dba:
            dba.execute(f'ALTER DATABASE "{name}" SET default_transaction_read_only = on')
            dba.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (name,))
        # A busy host: every pooled connection (keys.pool_size, 4 by default) begun while it was read-only.
        await asyncio.gather(*(store._db.fetch_one("SELECT pg_sleep(0.2)") for _ in range(4)))
        with pytest.raises(StoreUnavailable, match="read-only"):
            await store.create("during", all_models=True)
        with postgres_server.connect() as dba:
            dba.execute(f'ALTER DATABASE "{name}" RESET default_transaction_read_only')
        await asyncio.gather(*(store._db.fetch_one("SELECT pg_sleep(0.2)") for _ in range(4)))
        for n in range(4):  # whichever pooled connection each is given
            created, _ = await store.create(f"after-{n}", all_models=True)
            assert created.name == f"after-{n}"
        assert (await store.revoke(key.id)).revoked_at > 0
    finally:
        await store.close()


@pytest.mark.parametrize("cut", ["restart", "terminate"])
@pytest.mark.usefixtures("no_collector_pauses")
async def test_the_first_lookup_after_the_pools_connections_were_cut_is_answered_at_once(postgres_server, cut):
    """PostgreSQL restarted (or a DBA's pg_terminate_backend) while a busy host's pool held several connections: the
    pool checks a connection as it hands it out, and at the second dead one psycopg_pool waited ~1 s before the
    next (2 s at the third...), so the first lookups after a restart took a second or more, or were refused 503
    (`couldn't get a connection`) with the store timeout at 1 s, the database up all along. One dead connection now
    has the pool check the rest at once."""
    url = postgres_server.new_database()
    store = await open_key_store(StoreSettings(url=url, password_env=PASSWORD_ENV, timeout_seconds=1))
    try:
        key, secret = await store.create("k", all_models=True)
        # A busy host: four lookups at once fill the pool (keys.pool_size, 4 by default).
        await asyncio.gather(*(store._db.fetch_one("SELECT pg_sleep(0.2)") for _ in range(4)))
        if cut == "restart":
            postgres_server.stop()
            postgres_server.start()
        else:
            with postgres_server.connect() as dba:
                dba.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s",
                            (url.rsplit("/", 1)[1],))
        started = time.monotonic()
        assert (await store.find_active(hash_secret(secret))).id == key.id
        assert time.monotonic() - started < 0.5
    finally:
        await store.close()


@pytest.mark.parametrize("isolation", ["repeatable read", "serializable"])
async def test_a_dba_default_isolation_level_neither_fails_concurrent_key_writes_nor_lookups(postgres_server,
                                                                                            isolation):
    """A DBA's `default_transaction_isolation` above READ COMMITTED on the role or database: two admins rotating or
    updating one key at once got 503s (`could not serialize access due to concurrent update`), where the writes are
    made for READ COMMITTED (a rotation waits for the one beside it, then retires the secret it made), and each such
    conflict failed every call fast for seconds, uncached keys' lookups included, the database healthy. Portico's
    sessions now say the isolation they are written for."""
    url = postgres_server.new_database()
    with postgres_server.connect() as dba:
        dba.execute(f"ALTER DATABASE \"{url.rsplit('/', 1)[1]}\" SET default_transaction_isolation = '{isolation}'")
    settings = StoreSettings(url=url, password_env=PASSWORD_ENV, timeout_seconds=2)
    hosts = [await open_key_store(settings) for _ in range(3)]
    try:
        key, _ = await hosts[0].create("shared", all_models=True)
        _, other_secret = await hosts[0].create("other", all_models=True)
        rotated = await asyncio.gather(*(host.rotate(key.id, grace_seconds=60) for host in hosts for _ in range(2)))
        assert len({secret for _, secret, _ in rotated}) == 6
        await asyncio.gather(*(host.update(key.id, name=f"renamed-{n}") for n, host in enumerate(hosts)))
        assert (await hosts[1].find_active(hash_secret(other_secret))).name == "other"
    finally:
        for host in hosts:
            await host.close()


async def test_a_database_that_stops_answering_is_named_as_a_timeout_in_the_log_not_an_empty_reason(postgres_server):
    """A hung PostgreSQL (SIGSTOP here: connections accepted, nothing answered) made the key store's error read
    `PostgreSQL: ` and nothing more in the log ("the key store is unreachable (PostgreSQL: ): cached keys are
    served..."): the reason fell back to the exception's name only when the exception object was false, which it never
    is, so an empty TimeoutError gave an empty reason. The operator now reads what went wrong."""
    url = postgres_server.new_database()
    store = await open_key_store(StoreSettings(url=url, password_env=PASSWORD_ENV, timeout_seconds=1))
    try:
        await store.ping()
        with postgres_server.paused():
            with pytest.raises(StoreUnavailable) as caught:
                await store.find_active(hash_secret("pk-never-made"))
        assert str(caught.value) == "PostgreSQL: TimeoutError"
    finally:
        await store.close()
