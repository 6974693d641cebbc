"""Readiness reports the embedded model's real state, not a fixed "loaded"."""

from __future__ import annotations

from grpc_health.v1 import health

from server.health import Readiness
from server.keys import KeyStore, open_sqlite_key_store
from server.limits import Limiter, LimitSettings, MemoryLimitStore
from server.providers.llamacpp import LlamaCppProvider


async def readiness(tmp_path, providers) -> tuple[Readiness, KeyStore]:
    store = await open_sqlite_key_store(tmp_path / "keys.db")
    limiter = Limiter(MemoryLimitStore(), LimitSettings())
    return Readiness(health.aio.HealthServicer(), store, limiter, LimitSettings(), providers), store


async def test_the_embedded_model_is_loaded_until_it_is_closed(tmp_path):
    model = LlamaCppProvider(LlamaCppProvider.default_model_path())
    probe, store = await readiness(tmp_path, [model])
    try:
        report = await probe.refresh()
        assert report.ready and report.checks["model"] == "loaded"
        await model.close()
        report = await probe.refresh()
        assert not report.ready and report.checks["model"] == "not_loaded"
        assert report.reasons() == "model not_loaded"
    finally:
        await model.close()
        await store.close()


async def test_without_an_embedded_model_nothing_claims_it_is_loaded(tmp_path):
    probe, store = await readiness(tmp_path, [])
    try:
        report = await probe.refresh()
        assert report.ready and report.checks["model"] == "none"
    finally:
        await store.close()
