"""LimitService: where a key's rate limits stand now, for admin keys."""

from __future__ import annotations

from collections.abc import Callable

from portico.v1 import limit_pb2, limit_service_pb2_grpc
from server.domain_keys import is_key_id
from server.errors import ServiceUnavailable
from server.keys import Authenticator, KeyStore
from server.limits import Limiter
from server.limits.core import LimitStoreUnavailable, Reading
from server.translate.values import refuse_undeclared
from server.usage.money import micros_to_usd


class LimitServicer(limit_service_pb2_grpc.LimitServiceServicer):
    def __init__(self, store: KeyStore, authenticator: Authenticator, limiter: Limiter,
                 acts_on: Callable[[str], None] = lambda key_id: None) -> None:
        """`acts_on(key_id)`: the key a call reads (telemetry puts it in the access log, as KeyServicer's)."""
        self._store = store
        self._authenticator = authenticator
        self._limiter = limiter
        self._acts_on = acts_on

    async def GetKeyLimitStatus(self, request, context) -> limit_pb2.GetKeyLimitStatusResponse:
        await self._authenticator.authenticate_admin(context.invocation_metadata())
        refuse_undeclared(request)  # a stub generated from newer .proto files: refused, as KeyService's calls
        key_id = request.id.strip()  # an id pasted with space around it is taken as the id (KeyStore.get)
        if is_key_id(key_id):
            self._acts_on(key_id)
        key = await self._store.get(request.id)
        try:
            readings = await self._limiter.standing(key)
        except LimitStoreUnavailable as exc:
            raise ServiceUnavailable("The limit store is unreachable, so limits cannot be read now.",
                                     retry_after=1.0) from exc
        return limit_pb2.GetKeyLimitStatusResponse(key_id=key.id, limits=[_status(r) for r in readings])


def _status(reading: Reading) -> limit_pb2.LimitStatus:
    dimension = reading.dimension
    # Budgets are counted in micro-dollars and shown in US dollars, like every API shows them.
    scale, unit = (micros_to_usd, "usd") if dimension.counts_spend else (float, dimension.header_kind or "requests")
    return limit_pb2.LimitStatus(
        limit=dimension.value, model=reading.scope.id.partition("|")[2], unit=unit, value=scale(reading.limit),
        used=scale(reading.used), remaining=scale(max(0, reading.limit - reading.used)),
        reset_seconds=round(reading.wait, 3),
    )
