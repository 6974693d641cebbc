"""Wiring: build every part from the configuration and start the grpc.aio server. No globals."""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import logging
import os
import pkgutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from google.protobuf import descriptor_pool
from grpc_reflection.v1alpha import reflection, reflection_pb2

import portico.v1
from portico.v1 import chat_service_pb2_grpc, image_service_pb2_grpc, key_service_pb2_grpc
from portico.v1 import message_service_pb2_grpc, model_service_pb2_grpc, probe_service_pb2_grpc
from portico.v1 import anthropic_model_service_pb2_grpc, usage_service_pb2_grpc
from portico.v1 import console_service_pb2_grpc, limit_service_pb2_grpc, model_admin_service_pb2_grpc
from server.cache import MemoryStore, ResponseCache
from server.catalog import Catalog
from server.config import Config
from server.cutoff import Cutoff
from server.console import ConsoleFiles
from server.health import HealthServicer, Readiness
from server.image_store import ImageStore
from server.keys import Authenticator, KeyAdmin, KeyStore, open_key_store
from server.limits import Limiter, LimitStore, MemoryLimitStore
from server.observability import Telemetry
from server.observability.access_log import AccessLog
from server.observability.grpc_logs import redact_grpc_metadata_logs
from server.pipeline import Pipeline
from server.providers import Provider
from server.providers.build import build_providers
from server.providers.health import HEALTH_FILE_ENV, Board
from server.providers.router import Router
from server.services.chat import ChatServicer
from server.services.console import ConsoleServicer
from server.services.images import MAX_MESSAGE_BYTES, ImageServicer
from server.services.interceptor import ErrorInterceptor
from server.services.keys import KeyServicer
from server.services.limits import LimitServicer
from server.services.model_admin import ModelAdminServicer
from server.services.messages import MessageServicer
from server.services.models import AnthropicModelServicer, ModelServicer
from server.services.probes import ProbeServicer
from server.services.usage import UsageServicer
from server.usage.sqlite_ledger import SqliteLedger
from server.usage.stores import open_ledger
from server.usage.spool import LedgerSpool
from server.usage.writer import LedgerWriter

if TYPE_CHECKING:
    from server.usage.postgres_ledger import PostgresLedger

MAX_METADATA_BYTES = 128 * 1024  # Envoy accepts 60 KiB of request headers (envoy.yaml max_request_headers_kb)
# Above the 8 MiB cap on request bodies (Envoy's for REST, server/services/undecodable.py's for gRPC), so that a
# message between the two reaches undecodable.py and gets its 413 error object; grpc refuses bigger messages itself
# (RESOURCE_EXHAUSTED).
MAX_RECEIVE_BYTES = 16 * 1024 * 1024
# Calls that arrived but that the event loop has not yet picked up. grpc-core cancels them at random above 1,000
# and all of them above 3,000 (its defaults): a burst of new streams while the loop is busy (5,000 streams opened
# in 2 s) lost ~1,600 calls that way. Envoy caps the connections (overload_manager in envoy.yaml).
MAX_PENDING_CALLS = 50_000
# After a drain's cut (server/cutoff.py), how long the cut calls have to send their error before grpc cancels what is
# still running: writing one last event takes milliseconds, unless the caller has stopped reading.
CUT_SECONDS = 1.0
SERVER_OPTIONS = (
    ("grpc.max_receive_message_length", MAX_RECEIVE_BYTES),
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    # Above Envoy's header limit (plus what Envoy adds), so Envoy alone refuses big headers, with a 431.
    ("grpc.max_metadata_size", MAX_METADATA_BYTES),
    ("grpc.absolute_max_metadata_size", MAX_METADATA_BYTES),
    ("grpc.server.max_pending_requests", MAX_PENDING_CALLS),
    ("grpc.server.max_pending_requests_hard_limit", MAX_PENDING_CALLS),
)

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Core:
    """What serves a request below the RPC layer: the pipeline and the parts it is built from."""

    store: KeyStore
    telemetry: Telemetry
    limiter: Limiter
    providers: tuple[Provider, ...]  # each once, though several models may share one
    pipeline: Pipeline
    ledger: LedgerWriter
    usage: SqliteLedger | PostgresLedger
    health: Board  # passive health of the deployments (server/providers/health.py)
    images: ImageStore  # the images behind `url` answers, swept once a minute
    cache: ResponseCache | None = None  # answers of the models with `cache:` (server/cache)

    async def close(self) -> None:
        for provider in self.providers:
            await provider.close()
        await self.limiter.close()
        await self.ledger.close()  # after the drain: every request has ended, so every row is queued
        await self.images.close()
        self.usage.close()
        self.health.close()
        if self.cache is not None:
            await self.cache.close()
        await self.pipeline.authenticator.close()
        await self.store.close()
        await asyncio.to_thread(self.telemetry.close)  # sends the spans still queued, waiting at most ~2 s


@dataclass
class RunningServer:
    server: grpc.aio.Server
    port: int  # 0 when bound to a unix socket
    core: Core
    readiness: Readiness
    _stopping: asyncio.Future | None = field(default=None, init=False, repr=False)  # grpc's stop, once `stop` began

    @property
    def store(self) -> KeyStore:
        return self.core.store

    @property
    def limiter(self) -> Limiter:
        return self.core.limiter

    @property
    def providers(self) -> tuple[Provider, ...]:
        return self.core.providers

    @property
    def telemetry(self) -> Telemetry:
        return self.core.telemetry

    async def stop(self, grace: float | None = None) -> None:
        """Drain: report NOT_SERVING, refuse new RPCs, let those in flight finish for up to `grace` seconds, and the
        generations whose caller left too (server/cutoff.py). Then the model calls still running fail with a 503 that
        their callers see, and grpc cancels what is left CUT_SECONDS later."""
        await self.readiness.drain()
        grace = grace or 0.0
        cutoff = self.core.pipeline.cutoff
        stopping = self._stopping = asyncio.ensure_future(self.server.stop(grace + CUT_SECONDS))
        drained = asyncio.ensure_future(_drained(stopping, cutoff))
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(asyncio.shield(drained), grace)
        cutoff.cut()  # nothing left to cut when every RPC has ended
        await stopping
        with contextlib.suppress(asyncio.TimeoutError):  # the cut calls whose caller left fail at their next wait
            await asyncio.wait_for(drained, CUT_SECONDS)
        await self.readiness.close()
        await self.core.close()

    async def stop_now(self) -> None:
        """Cut short a `stop` in progress: the model calls still running fail with a 503 that their callers see,
        grpc cancels what is left within CUT_SECONDS (its reservations settle as for a caller that went away), and
        `stop` goes on with the clean-up."""
        self.core.pipeline.cutoff.cut()
        if self._stopping is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._stopping), CUT_SECONDS)
        await self.server.stop(0)


async def _drained(stopping: asyncio.Future, cutoff: Cutoff) -> None:
    """The calls grpc waits for, then the model calls whose caller left (server/cutoff.py): in that order, since a
    caller may leave at any moment of the drain, and grpc then waits for its call no more."""
    await asyncio.shield(stopping)
    await cutoff.ended()


def build_limit_store(config: Config) -> LimitStore:
    settings = config.limits
    if settings.store == "memory":
        return MemoryLimitStore(state_path=config.data_files.limits_daily)
    # Imported only when configured: redis-py costs every server process ~7 MB of memory.
    from server.limits.redis import RedisLimitStore

    return RedisLimitStore(
        settings.store, lease_seconds=settings.lease_seconds, timeout_seconds=settings.store_timeout_seconds
    )


async def build_core(config: Config) -> Core:
    store = await open_key_store(config.key_database)
    usage = open_ledger(config.key_database)  # beside the keys: keys.db, or the same PostgreSQL database
    telemetry = Telemetry(access_log=AccessLog(config.access_log), tracing=config.tracing)
    ledger = LedgerWriter(usage, config.usage, on_dropped=telemetry.metrics.ledger_dropped.inc,
                          on_written=telemetry.metrics.ledger_written.inc,
                          spool=LedgerSpool(config.data_files.ledger_spool))
    telemetry.ledger = ledger
    orphans = ledger.start()
    authenticator = Authenticator(
        store, cache_seconds=config.key_cache_seconds, stale_seconds=config.key_stale_seconds,
        cache_size=config.key_cache_size, negative_cache_size=config.key_negative_cache_size,
        on_authenticated=telemetry.identified,
    )
    authenticator.start()
    health_file = os.environ.get(HEALTH_FILE_ENV)  # set by `serve --workers N` for its workers
    cutoff = Cutoff()  # the pipeline's, which the upstream clients ask whether a generation outlives its caller
    providers, board = build_providers(config, telemetry, health_file=Path(health_file) if health_file else None,
                                       cutoff=cutoff)
    limiter = Limiter(build_limit_store(config), config.limits)
    # Not fatal: Redis may come up later. Until then the on_store_error policy decides (the limiter logs the outage).
    await limiter.check_store()
    limiter.settle_orphans(orphans)
    pipeline = Pipeline(
        authenticator=authenticator, catalog=Catalog(config.models), providers=providers, limiter=limiter,
        telemetry=telemetry, cache=(cache := build_response_cache(config)), cutoff=cutoff,
    )
    images = ImageStore(config.data_dir, base_url=config.base_url)
    images.start()
    return Core(store, telemetry, limiter, tuple(dict.fromkeys(providers.values())), pipeline, ledger, usage,
                board, images, cache)


def build_response_cache(config: Config) -> ResponseCache | None:
    """For models with `cache:`: in this process, or in Redis (shared by hosts) when the limits are there."""
    if not any(entry.cache is not None for entry in config.models):
        return None
    settings = config.limits
    if settings.store == "memory":
        return ResponseCache(MemoryStore())
    from server.cache.redis_store import RedisStore

    return ResponseCache(RedisStore(settings.store, timeout_seconds=settings.store_timeout_seconds))


def _load_service_descriptors() -> None:
    """Every portico.v1 service's own descriptor, for server reflection (grpcurl describe, Postman), which can
    describe only what the default descriptor pool holds: the *_pb2_grpc modules import their messages' files, not
    their service's. All of them, so a service added later is not forgotten."""
    for module in pkgutil.iter_modules(portico.v1.__path__):
        if module.name.endswith("_service_pb2"):
            importlib.import_module(f"portico.v1.{module.name}")


class _ReflectionPool:
    """The descriptor pool server reflection reads, which also finds a method's file (`grpcurl describe
    portico.v1.ChatService.CreateChatCompletion`): the reflection protocol names methods as symbols, and Python's pool
    looks up no method names, so such a describe was "not found". Everything else is the pool's own."""

    def __init__(self, pool: descriptor_pool.DescriptorPool) -> None:
        self._pool = pool

    def FindFileContainingSymbol(self, name: str):  # noqa: N802 - the pool's interface
        try:
            return self._pool.FindFileContainingSymbol(name)
        except KeyError:
            service_name, _, method = name.rpartition(".")
            try:
                service = self._pool.FindServiceByName(service_name)
            except KeyError:
                service = None
            if service is None or method not in service.methods_by_name:
                raise
            return service.file

    def __getattr__(self, name: str):
        return getattr(self._pool, name)


def _enable_reflection(server: grpc.aio.Server, names: list[str]) -> None:
    """Server reflection under both protocol names: grpc.reflection.v1, which current clients ask first (some ask
    only it), and v1alpha, the one grpcio-reflection implements. Their messages are the same on the wire, so one
    servicer answers both. v1 is not listed: grpcio-reflection has no descriptor of it to describe."""
    servicer = reflection.aio.ReflectionServicer(names, pool=_ReflectionPool(descriptor_pool.Default()))
    handler = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    for name in (reflection.SERVICE_NAME, "grpc.reflection.v1.ServerReflection"):
        methods = {"ServerReflectionInfo": handler}
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, methods),))


class _Services:
    """The server as the generated `add_*Servicer_to_server` functions see it: it registers their handlers and keeps
    the names of the services, so that health and reflection cover what is served, not a list kept beside it."""

    def __init__(self, server: grpc.aio.Server) -> None:
        self._server = server
        self.names: list[str] = []

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self.names.extend(handler.service_name() for handler in handlers)
        self._server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service_name: str, method_handlers: dict) -> None:
        self._server.add_registered_method_handlers(service_name, method_handlers)


def _run_here(providers: Sequence[Provider]) -> list[Provider]:
    """The providers that run the models, a Router's deployments included: the embedded model behind fallbacks or
    beside an upstream is loaded (and closed) all the same, and readiness must see it."""
    return [own for provider in providers
            for own in (provider.own_providers if isinstance(provider, Router) else (provider,))]


def _deployment_states(core: Core) -> list[tuple[str, str, str]]:
    """Read every second by the readiness check, which shows them in /readyz and keeps their gauges current."""
    states = core.health.states()
    core.telemetry.deployment_states(states)
    return states


async def start_server(config: Config, address: str) -> RunningServer:
    """Start serving on `address` ("127.0.0.1:0", "unix:/path.sock", ...)."""
    redact_grpc_metadata_logs()
    core = await build_core(config)
    store, telemetry, limiter, pipeline = core.store, core.telemetry, core.limiter, core.pipeline
    server = grpc.aio.server(
        interceptors=[ErrorInterceptor(telemetry)],
        options=SERVER_OPTIONS,
    )
    served = _Services(server)  # every portico.v1 service is registered through it, so health covers them all
    chat_service_pb2_grpc.add_ChatServiceServicer_to_server(
        ChatServicer(pipeline, default_max_tokens=config.default_max_tokens), served
    )
    message_service_pb2_grpc.add_MessageServiceServicer_to_server(MessageServicer(pipeline), served)
    model_service_pb2_grpc.add_ModelServiceServicer_to_server(ModelServicer(pipeline), served)
    anthropic_model_service_pb2_grpc.add_AnthropicModelServiceServicer_to_server(
        AnthropicModelServicer(pipeline), served)
    image_service_pb2_grpc.add_ImageServiceServicer_to_server(ImageServicer(pipeline, core.images), served)
    admin = KeyAdmin(store, [entry.id for entry in config.models],
                     rotation_grace_seconds=config.key_rotation_grace_seconds)
    keys = KeyServicer(admin, pipeline.authenticator, acts_on=telemetry.acts_on)
    key_service_pb2_grpc.add_KeyServiceServicer_to_server(keys, served)
    console_service_pb2_grpc.add_ConsoleServiceServicer_to_server(ConsoleServicer(ConsoleFiles()), served)
    usage_service_pb2_grpc.add_UsageServiceServicer_to_server(UsageServicer(core.usage, pipeline.authenticator), served)
    limits = LimitServicer(store, pipeline.authenticator, limiter, acts_on=telemetry.acts_on)
    limit_service_pb2_grpc.add_LimitServiceServicer_to_server(limits, served)
    catalog = ModelAdminServicer(config.models, config.limits.models, pipeline.authenticator,
                                 states=core.health.states)
    model_admin_service_pb2_grpc.add_ModelAdminServiceServicer_to_server(catalog, served)
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    readiness = Readiness(health_servicer, store, limiter, config.limits, _run_here(core.providers),
                          deployments=lambda: _deployment_states(core),
                          key_stale_seconds=pipeline.authenticator.stale_seconds,
                          on_keys_checked=pipeline.authenticator.store_checked)
    probe_service_pb2_grpc.add_ProbeServiceServicer_to_server(ProbeServicer(readiness), served)
    _load_service_descriptors()
    _enable_reflection(server, [*served.names, health.SERVICE_NAME, reflection.SERVICE_NAME])
    port = server.add_insecure_port(address)
    await server.start()
    await readiness.start(served.names)  # providers are loaded above; the stores are checked now and every second
    # add_insecure_port returns the bound TCP port; for a unix socket it returns 1, which says nothing.
    where = address if address.startswith("unix:") else f"{address.rpartition(':')[0]}:{port}"
    _logger.info("gRPC server listening on %s", where)
    return RunningServer(server=server, port=port, core=core, readiness=readiness)
