"""Readiness while the PostgreSQL key store does not answer (operations.md, Several hosts): a host that had reached
it stays ready for keys.stale_seconds, since its cached keys may still be served; a host that never reached it has
nothing cached to serve, so it is not ready (a load balancer would send it callers it can only answer 503)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import grpc
import pytest
from grpc_health.v1 import health

from portico.v1 import image_pb2, image_service_pb2_grpc, probe_pb2, probe_service_pb2_grpc
from server.app import RunningServer, start_server
from server.config import load_config

from gateway.envoy import free_ports
from server.db.database import StoreUnavailable
from server.db.settings import StoreSettings
from server.health import Readiness
from server.keys import KeyStore, open_key_store
from server.limits import Limiter, LimitSettings, MemoryLimitStore
from tests.helpers import bearer
from tests.postgres_support import PASSWORD_ENV


async def readiness_for(settings: StoreSettings) -> tuple[Readiness, KeyStore]:
    store = await open_key_store(settings)
    limiter = Limiter(MemoryLimitStore(), LimitSettings())
    return Readiness(health.aio.HealthServicer(), store, limiter, LimitSettings(), key_stale_seconds=300), store


async def images_server_with_a_key(tmp_path, postgres_server, *, cache_seconds: float,
                                   stale_seconds: float) -> tuple[RunningServer, str]:
    """A server of the image models alone on a PostgreSQL key store of its own, and a key to call it with."""
    config = load_config()
    images = tuple(m for m in config.models if m.provider.kind == "dev-image")
    store = StoreSettings(url=postgres_server.new_database(), password_env=PASSWORD_ENV, timeout_seconds=1)
    config = dataclasses.replace(config, data_dir=tmp_path, models=images, key_store=store,
                                 key_cache_seconds=cache_seconds, key_stale_seconds=stale_seconds)
    # Made before the server listens for changes: made through it, the change notice of its creation could come
    # after the first request had asked for the key, and an answer asked for before a notice is not cached.
    maker = await open_key_store(store)
    try:
        secret = (await maker.create("cached", all_models=True))[1]
    finally:
        await maker.close()
    return await start_server(config, "127.0.0.1:0"), secret


async def test_a_host_that_never_reached_the_store_is_not_ready_until_it_does():
    (port,) = free_ports(1)  # nothing listens there
    probe, store = await readiness_for(StoreSettings(url=f"postgresql://portico@127.0.0.1:{port}/portico",
                                                     timeout_seconds=1))
    try:
        report = await probe.refresh()
        assert report.checks["keys"] == "unreachable"
        assert not report.ready and report.reasons() == "keys unreachable"
    finally:
        await store.close()


async def test_a_host_that_reached_the_store_stays_ready_through_an_outage(postgres_server):
    settings = StoreSettings(url=postgres_server.new_database(), password_env=PASSWORD_ENV, timeout_seconds=1)
    probe, store = await readiness_for(settings)
    try:
        assert (await probe.refresh()).ready
        postgres_server.stop()
        try:
            report = await probe.refresh()
            assert report.checks["keys"] == "unreachable" and report.ready
        finally:
            postgres_server.start()
    finally:
        await store.close()


async def test_readiness_holds_while_cached_keys_are_served_also_past_a_stale_seconds_below_cache_seconds(
        tmp_path, postgres_server):
    """keys.stale_seconds below keys.cache_seconds: a cached key is served for cache_seconds (the cache needs no
    store), so the host stays ready that long too, not only for stale_seconds."""
    # cache 30 s: room for a busy machine
    running, secret = await images_server_with_a_key(tmp_path, postgres_server, cache_seconds=30, stale_seconds=1)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            images_stub = image_service_pb2_grpc.ImageServiceStub(channel)
            request = image_pb2.CreateImageRequest(model="family-a-image-2", prompt="a buoy", size="256x256")
            await images_stub.CreateImage(request, metadata=bearer(secret))  # cached now
            assert (await running.readiness.refresh()).ready
            postgres_server.stop()
            try:
                assert (await running.readiness.refresh()).checks["keys"] == "unreachable"
                await asyncio.sleep(1.5)  # past stale_seconds, within cache_seconds
                await images_stub.CreateImage(request, metadata=bearer(secret))  # still served
                report = await running.readiness.refresh()
                assert report.checks["keys"] == "unreachable" and report.ready
            finally:
                postgres_server.start()
    finally:
        await running.stop(0)


async def test_a_store_that_refuses_the_password_is_reported_as_such_not_as_unreachable(tmp_path, postgres_server,
                                                                                        monkeypatch):
    """PostgreSQL answering but refusing the password (rotated on the server, not in the variable): /readyz said
    `keys unreachable`, as for a database that is down, so the operator looked for a network fault; the log alone
    said what PostgreSQL answered. The probe now says so, without the password."""
    monkeypatch.setenv("PORTICO_TEST_WRONG_PG_PW", "not-the-password-Qx7")
    config = load_config()
    images = tuple(m for m in config.models if m.provider.kind == "dev-image")
    store = StoreSettings(url=postgres_server.new_database(), password_env="PORTICO_TEST_WRONG_PG_PW",
                          timeout_seconds=1)
    running = await start_server(dataclasses.replace(config, data_dir=tmp_path, models=images, key_store=store),
                                 "127.0.0.1:0")
    try:
        report = await running.readiness.refresh()
        assert report.checks["keys"] == "authentication_failed" and not report.ready
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as unready:
                await probe_service_pb2_grpc.ProbeServiceStub(channel).GetReadiness(probe_pb2.GetReadinessRequest())
        assert unready.value.code() == grpc.StatusCode.UNAVAILABLE
        assert unready.value.details() == "Not ready: keys authentication_failed."
    finally:
        await running.stop(0)
    # A store that is down is still said to be unreachable.
    (port,) = free_ports(1)
    probe, down = await readiness_for(StoreSettings(url=f"postgresql://portico@127.0.0.1:{port}/portico",
                                                    password_env="PORTICO_TEST_WRONG_PG_PW", timeout_seconds=1))
    try:
        assert (await probe.refresh()).checks["keys"] == "unreachable"
    finally:
        await down.close()


async def test_a_role_without_rights_on_the_tables_is_reported_as_such_not_as_unreachable(postgres_server):
    """PostgreSQL letting the role connect but refusing it Portico's tables (a DBA's REVOKE, a role swapped for one
    not granted them: SQLSTATE 42501): /readyz said `keys unreachable`, as for a database that is down. The probe now
    says `permission_denied`, as it does for a Redis user its ACL refuses."""
    url = postgres_server.new_database()
    database = url.rsplit("/", 1)[1]
    with postgres_server.connect(database) as conn:
        conn.execute(f"CREATE ROLE {database}_app LOGIN PASSWORD '{postgres_server.password}'")
        conn.execute(f"GRANT ALL ON SCHEMA public TO {database}_app")
    probe, store = await readiness_for(StoreSettings(url=url.replace("postgres@", f"{database}_app@"),
                                                     password_env=PASSWORD_ENV, timeout_seconds=1))
    try:
        assert (await probe.refresh()).checks["keys"] == "ok"  # its own tables, made at its start
        with postgres_server.connect(database) as conn:
            conn.execute("ALTER TABLE api_keys OWNER TO postgres")
            conn.execute("ALTER TABLE retired_secrets OWNER TO postgres")
            conn.execute(f"REVOKE ALL ON api_keys, retired_secrets FROM {database}_app")
        # A host that had reached the store stays ready on its cached keys, as through an outage; a lookup of a key
        # not cached is the store's 503, not a 500 of psycopg's InsufficientPrivilege.
        report = await probe.refresh()
        assert report.checks["keys"] == "permission_denied" and report.ready
        with pytest.raises(StoreUnavailable) as refused:
            await store.find_active("0" * 64)
        assert refused.value.permission_denied and not refused.value.credentials_refused
        # One that never reached it is not ready, and says why.
        fresh, other = await readiness_for(StoreSettings(url=url.replace("postgres@", f"{database}_app@"),
                                                         password_env=PASSWORD_ENV, timeout_seconds=1))
        try:
            report = await fresh.refresh()
            assert report.checks["keys"] == "permission_denied" and not report.ready
            assert report.reasons() == "keys permission_denied"
        finally:
            await other.close()
    finally:
        await store.close()


async def test_a_host_refused_the_keys_schema_when_it_first_reaches_the_store_is_ready_once_granted(postgres_server):
    """A host started while PostgreSQL was unreachable checks the keys' schema when it first reaches it. Refused
    there (its role not granted `schema_migrations` yet, SQLSTATE 42501), the key store took the refusal for a
    database newer than its code: unusable until a restart, /readyz `keys unreachable` and every key not cached a
    503, the grant made long since. Only a newer database is for good; a refusal is `permission_denied`, and asked
    again at the next check."""
    url = postgres_server.new_database()
    database = url.rsplit("/", 1)[1]
    await (await open_key_store(StoreSettings(url=url, password_env=PASSWORD_ENV))).close()  # the owner migrates
    role = f"{database}_rw"
    with postgres_server.connect(database) as dba:
        dba.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{postgres_server.password}'")
    postgres_server.stop()
    try:
        probe, store = await readiness_for(StoreSettings(url=url.replace("postgres@", f"{role}@"),
                                                         password_env=PASSWORD_ENV, timeout_seconds=1))
    finally:
        postgres_server.start()
    try:
        report = await probe.refresh()
        assert report.checks["keys"] == "permission_denied" and not report.ready
        with postgres_server.connect(database) as dba:
            dba.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
        report = await probe.refresh()
        assert report.checks["keys"] == "ok" and report.ready
        assert (await store.create("after", all_models=True))[0].name == "after"
    finally:
        await store.close()


async def test_each_key_store_outage_has_its_own_lines_while_only_cached_keys_are_used(tmp_path, postgres_server,
                                                                                       caplog):
    """The key store logged its outage's first line at a lookup that failed and its recovery line at the next lookup
    that was answered; with cached keys only in between (within keys.cache_seconds), PostgreSQL's return went
    unsaid, and a second outage soon after had no line of its own. The readiness check, which asks the store every
    second, now tells the key cache what it found."""
    caplog.set_level(logging.INFO, logger="server.keys.auth")
    running, secret = await images_server_with_a_key(tmp_path, postgres_server, cache_seconds=120, stale_seconds=300)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            images_stub = image_service_pb2_grpc.ImageServiceStub(channel)
            request = image_pb2.CreateImageRequest(model="family-a-image-2", prompt="a buoy", size="256x256")
            await images_stub.CreateImage(request, metadata=bearer(secret))  # cached now
            for outage in (1, 2):
                postgres_server.stop()
                try:
                    with pytest.raises(grpc.aio.AioRpcError) as refused:  # a key not cached: the store is asked
                        await images_stub.CreateImage(request, metadata=bearer(f"pk-not-cached-{outage}"))
                    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                    await images_stub.CreateImage(request, metadata=bearer(secret))  # cached: served
                    assert (await running.readiness.refresh()).checks["keys"] == "unreachable"
                finally:
                    postgres_server.start()
                deadline = asyncio.get_running_loop().time() + 10
                while (await running.readiness.refresh()).checks["keys"] != "ok":
                    assert asyncio.get_running_loop().time() < deadline, "the key store did not recover"
                    await asyncio.sleep(0.2)
                await images_stub.CreateImage(request, metadata=bearer(secret))  # cached: the store is not asked
    finally:
        await running.stop(0)
    said = [("down" if "unreachable (" in m else "up") for r in caplog.records
            if (m := r.getMessage()).startswith(("the key store is unreachable (", "the key store answers again"))]
    assert said == ["down", "up", "down", "up"]
