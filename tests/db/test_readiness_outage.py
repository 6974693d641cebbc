"""Readiness while the PostgreSQL key store does not answer (operations.md, Several hosts): a host that had reached
it stays ready for keys.stale_seconds, since its cached keys may still be served; a host that never reached it has
nothing cached to serve, so it is not ready (a load balancer would send it callers it can only answer 503)."""

from __future__ import annotations

from grpc_health.v1 import health

from gateway.envoy import free_ports
from server.db.settings import StoreSettings
from server.health import Readiness
from server.keys import KeyStore, open_key_store
from server.limits import Limiter, LimitSettings, MemoryLimitStore
from tests.postgres_support import PASSWORD_ENV


async def readiness_for(settings: StoreSettings) -> tuple[Readiness, KeyStore]:
    store = await open_key_store(settings)
    limiter = Limiter(MemoryLimitStore(), LimitSettings())
    return Readiness(health.aio.HealthServicer(), store, limiter, LimitSettings(), key_stale_seconds=300), store


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
