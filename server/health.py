"""Readiness: one verdict, reported by grpc.health.v1 (for every service name) and by GET /readyz (ProbeService).

Ready means: the embedded model, if any model uses it, is loaded (`model`: "loaded"; "none" when upstreams serve
every model; "not_loaded" once it is closed), the key store answers (or, if this process had reached it, has been
unreachable for less than keys.stale_seconds, while cached keys are still served), and the limit store answers,
unless the policy is fail-open, under which an unreachable Redis costs exact limits but not availability. A draining server (after SIGTERM) is never ready.
A background task re-checks every second, so readiness follows Redis going away and coming back without traffic.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from grpc_health.v1 import health, health_pb2

from server.db.database import StoreUnavailable
from server.keys import KeyStore
from server.limits import Limiter, LimitSettings
from server.providers import LocalModel

CHECK_INTERVAL_SECONDS = 1.0
_GOOD_STATES = ("ok", "loaded", "none")

_logger = logging.getLogger(__name__)


class HealthServicer(health.aio.HealthServicer):
    """grpc's servicer with health.proto's List, which it leaves unimplemented although reflection shows it: a
    call got UNIMPLEMENTED and logged a traceback. List answers what Check would for every name ever set."""

    def __init__(self) -> None:
        super().__init__()
        self._names: dict[str, None] = {"": None}  # insertion-ordered
        self._final = False  # after enter_graceful_shutdown, set() changes nothing: a new name stays unknown

    async def set(self, service: str, status: health_pb2.HealthCheckResponse.ServingStatus) -> None:
        if not self._final:
            self._names[service] = None
        await super().set(service, status)

    async def enter_graceful_shutdown(self) -> None:
        self._final = True
        await super().enter_graceful_shutdown()

    async def List(self, request: health_pb2.HealthListRequest, context) -> health_pb2.HealthListResponse:
        statuses = {name: await self.Check(health_pb2.HealthCheckRequest(service=name), context)
                    for name in self._names}
        return health_pb2.HealthListResponse(statuses=statuses)


@dataclass(frozen=True, slots=True)
class ReadinessReport:
    status: str  # "ready", "not_ready" or "draining"
    checks: Mapping[str, str] = field(default_factory=dict)
    deployments: Mapping[str, str] = field(default_factory=dict)  # "model/deployment" -> its passive health state

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    def reasons(self) -> str:
        failing = [f"{name} {state}" for name, state in self.checks.items() if state not in _GOOD_STATES]
        return ", ".join(failing) or self.status


class Readiness:
    def __init__(
        self,
        health_servicer: HealthServicer,
        keys: KeyStore,
        limiter: Limiter,
        settings: LimitSettings,
        providers: Iterable[object] = (),
        deployments: Callable[[], Sequence[tuple[str, str, str]]] = tuple,
        *,
        key_stale_seconds: float = 0.0,
        on_keys_checked: Callable[[StoreUnavailable | None], None] = lambda failure: None,
    ) -> None:
        """`deployments`: (model, deployment, state) of the watched deployments now (server/providers/health.py).
        `on_keys_checked`: what each check of the key store met (None: an answer), for the key cache's log lines."""
        self._health = health_servicer
        self._names: tuple[str, ...] = ("",)  # "": the whole server; the services are named by start()
        self._keys = keys
        self._key_stale_seconds = key_stale_seconds
        self._on_keys_checked = on_keys_checked
        self._keys_down_since: float | None = None
        self._keys_reached = False  # has this process ever reached the key store (so may hold cached keys)?
        self._limiter = limiter
        self._settings = settings
        self._local_models = [p for p in providers if isinstance(p, LocalModel)]
        self._deployments = deployments
        self._draining = False
        self.report = ReadinessReport("not_ready")
        self._published: bool | None = None  # the readiness last given to the health servicer
        self._watch: asyncio.Task | None = None

    async def start(self, service_names: Sequence[str] = ()) -> None:
        """Publish the verdict, now and every second, for the whole server and each of `service_names`."""
        self._names = ("", *service_names)
        await self.refresh()
        self._watch = asyncio.create_task(self._watch_forever())

    async def refresh(self) -> ReadinessReport:
        checks = {"model": self._model_state(), "keys": await self._keys_state(), "limits": await self._limits_state()}
        limits_ok = checks["limits"] == "ok" or self._settings.on_store_error == "open"
        ready = checks["model"] != "not_loaded" and self._keys_ok(checks["keys"]) and limits_ok
        if self._draining:  # drain() has said NOT_SERVING for good
            return self.report
        deployments = self.deployment_states()
        report = ReadinessReport("ready" if ready else "not_ready", checks, deployments)
        if report.ready != self._published:
            if self._published is not None or not report.ready:
                level = logging.INFO if report.ready else logging.ERROR
                _logger.log(level, "readiness: %s", "ready" if report.ready else f"not ready ({report.reasons()})")
            status = health_pb2.HealthCheckResponse.SERVING if report.ready else (
                health_pb2.HealthCheckResponse.NOT_SERVING)
            for name in self._names:
                await self._health.set(name, status)
            self._published = report.ready
        self.report = report
        return report

    def deployment_states(self) -> dict[str, str]:
        """"model/deployment" -> its passive health state, read now (the shared board costs microseconds)."""
        return {f"{model}/{name}": state for model, name, state in self._deployments()}

    async def drain(self) -> None:
        """From now on never ready: grpc.health.v1 says NOT_SERVING for good, /readyz answers 503."""
        self._draining = True
        self.report = ReadinessReport("draining", self.report.checks)
        await self._health.enter_graceful_shutdown()

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch

    async def _watch_forever(self) -> None:
        while True:
            await asyncio.sleep(CHECK_INTERVAL_SECONDS)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - a failed check must not end the watching
                _logger.exception("readiness check failed")

    def _model_state(self) -> str:
        if not self._local_models:
            return "none"  # upstreams serve every model; their health shows in their answers, not here
        return "loaded" if all(model.loaded for model in self._local_models) else "not_loaded"

    async def _keys_state(self) -> str:
        try:
            await self._keys.ping()
        except StoreUnavailable as exc:
            self._on_keys_checked(exc)
            if self._keys_down_since is None:
                self._keys_down_since = time.monotonic()
            return _down_state(exc.credentials_refused, exc.permission_denied)
        self._on_keys_checked(None)
        self._keys_down_since = None
        self._keys_reached = True
        return "ok"

    def _keys_ok(self, state: str) -> bool:
        """An unreachable key store leaves the host ready while its cached keys may still be served (for
        keys.stale_seconds): every host shares that store, so taking them all out of the load balancer would refuse
        even the keys they can still answer. Beyond that, not ready; and a host that never reached the store has
        no cached key to serve, so it is not ready at all."""
        if state == "ok":
            return True
        assert self._keys_down_since is not None
        return self._keys_reached and time.monotonic() - self._keys_down_since < self._key_stale_seconds

    async def _limits_state(self) -> str:
        if not await self._limiter.check_store():  # which also logs an outage's start and end, traffic or none
            store = self._limiter.store
            return _down_state(store.credentials_refused, store.permission_denied)
        return "ok"


def _down_state(credentials_refused: bool, permission_denied: bool) -> str:
    """A store that did not serve the check, as /readyz names it (operations.md, Health): one that answered but
    refused the gateway's password, or its user or role the commands or tables, is not said to be unreachable."""
    if credentials_refused:
        return "authentication_failed"
    return "permission_denied" if permission_denied else "unreachable"
