"""UsageService: the usage ledger in the shape of OpenAI's usage and costs API. Admin keys see every key's usage;
any other key only its own."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from google.api import httpbody_pb2
from google.protobuf import json_format

from portico.v1 import organization_usage_pb2 as pb
from portico.v1 import usage_service_pb2_grpc
from server.domain_keys import ApiKey
from server.errors import PermissionDenied
from server.keys import Authenticator
from server.render import json_body
from server.usage.openai_pages import (
    COMPLETIONS_GROUPS, COMPLETIONS_LIMITS, COSTS_GROUPS, COSTS_LIMITS, completions_page, costs_page, filter_values,
    groups_of, parse_row_cursor, plan_page, requests_page, rows_limit, time_range,
)
from server.usage.ledger import LedgerRow
from server.usage.query import TEXT_ENDPOINTS, RowQuery, Totals, UsageQuery


class UsageReader(Protocol):
    def aggregate(self, query: UsageQuery) -> list[Totals]: ...

    def recent(self, query: RowQuery) -> list[LedgerRow]: ...


class UsageServicer(usage_service_pb2_grpc.UsageServiceServicer):
    def __init__(self, ledger: UsageReader, authenticator: Authenticator,
                 clock: Callable[[], float] = time.time) -> None:
        self._ledger = ledger
        self._authenticator = authenticator
        self._clock = clock

    async def GetCompletionsUsage(self, request, context) -> pb.GetCompletionsUsageResponse:
        return json_format.ParseDict(await self._completions(request, context), pb.GetCompletionsUsageResponse())

    async def GetCompletionsUsageHttp(self, request, context) -> httpbody_pb2.HttpBody:
        return _json(await self._completions(request, context))

    async def GetCosts(self, request, context) -> pb.GetCostsResponse:
        return json_format.ParseDict(await self._costs(request, context, typed=True), pb.GetCostsResponse())

    async def GetCostsHttp(self, request, context) -> httpbody_pb2.HttpBody:
        return _json(await self._costs(request, context))

    async def ListRequests(self, request, context) -> pb.ListRequestsResponse:
        return json_format.ParseDict(await self._requests(request, context, typed=True), pb.ListRequestsResponse())

    async def ListRequestsHttp(self, request, context) -> httpbody_pb2.HttpBody:
        return _json(await self._requests(request, context))

    async def _requests(self, request: pb.ListRequestsRequest, context, *, typed: bool = False) -> dict:
        key = await self._authenticator.authenticate(context.invocation_metadata() or ())
        limit = rows_limit(_optional(request, "limit"))
        start, end = time_range(_optional(request, "start_time") or 0, _optional(request, "end_time"), self._clock())
        query = RowQuery(start * 1000, end * 1000, limit + 1,
                         key_ids=_visible(key, filter_values(request.api_key_ids, "api_key_ids")),
                         models=filter_values(request.models, "models"),
                         envs=filter_values(request.project_ids, "project_ids"), errors_only=request.errors_only,
                         before=parse_row_cursor(request.page))
        return requests_page(await asyncio.to_thread(self._ledger.recent, query), limit, typed=typed)

    async def _completions(self, request: pb.GetCompletionsUsageRequest, context) -> dict:
        key = await self._authenticator.authenticate(context.invocation_metadata() or ())
        page = plan_page(_optional(request, "start_time"), _optional(request, "end_time"), request.bucket_width,
                         _optional(request, "limit"), request.page, limits=COMPLETIONS_LIMITS, now=self._clock())
        columns, names = groups_of(request.group_by, COMPLETIONS_GROUPS)
        # Portico has no users and no batch API: asking for either matches nothing.
        nothing = bool(request.user_ids) or (request.HasField("batch") and request.batch)
        query = UsageQuery(page.first * 1000, page.stop * 1000, page.width * 1000, columns,
                           key_ids=_visible(key, filter_values(request.api_key_ids, "api_key_ids")),
                           models=filter_values(request.models, "models"),
                           envs=filter_values(request.project_ids, "project_ids"), endpoints=TEXT_ENDPOINTS)
        totals = [] if nothing else await asyncio.to_thread(self._ledger.aggregate, query)
        return completions_page(page, totals, names)

    async def _costs(self, request: pb.GetCostsRequest, context, *, typed: bool = False) -> dict:
        key = await self._authenticator.authenticate(context.invocation_metadata() or ())
        page = plan_page(_optional(request, "start_time"), _optional(request, "end_time"), request.bucket_width,
                         _optional(request, "limit"), request.page, limits=COSTS_LIMITS, now=self._clock())
        columns, names = groups_of(request.group_by, COSTS_GROUPS)
        query = UsageQuery(page.first * 1000, page.stop * 1000, page.width * 1000, columns,
                           key_ids=_visible(key, filter_values(request.api_key_ids, "api_key_ids")),
                           models=filter_values(request.models, "models"),
                           envs=filter_values(request.project_ids, "project_ids"))
        return costs_page(page, await asyncio.to_thread(self._ledger.aggregate, query), names, typed=typed)


def _optional(message, field: str) -> int | None:
    return getattr(message, field) if message.HasField(field) else None


def _visible(key: ApiKey, asked: Sequence[str]) -> tuple[str, ...]:
    """The key ids a caller may read: any for an admin key, else only its own."""
    if key.admin:
        return tuple(asked)
    if any(key_id != key.id for key_id in asked):
        raise PermissionDenied("A key can only read its own usage; admin keys read every key's.",
                               param="api_key_ids")
    return (key.id,)


def _json(body: dict) -> httpbody_pb2.HttpBody:
    return httpbody_pb2.HttpBody(content_type="application/json", data=json_body(body))
