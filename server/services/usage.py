"""UsageService: the usage ledger in the shape of OpenAI's usage and costs API. Admin keys see every key's usage;
any other key only its own.

A typed query holding a field these .proto files do not declare (a stub generated from newer ones: a filter added
later) is refused, as REST refuses a parameter it does not take: dropped, the filter's answer covered everything."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol, TypeVar

from google.api import httpbody_pb2
from google.protobuf import json_format

from portico.v1 import organization_usage_pb2 as pb
from portico.v1 import usage_service_pb2_grpc
from server.domain_keys import ApiKey
from server.errors import InvalidRequest, PermissionDenied
from server.keys import Authenticator
from server.render import json_body
from server.translate.values import refuse_undeclared
from server.usage.openai_pages import (
    COMPLETIONS_GROUPS, COMPLETIONS_LIMITS, COSTS_GROUPS, COSTS_LIMITS, Page, completions_page, costs_page,
    filter_values, groups_of, key_id_values, parse_row_cursor, plan_page, requests_page, rows_limit, time_range,
)
from server.usage.ledger import LedgerRow
from server.usage.query import TEXT_ENDPOINTS, RowQuery, Totals, UsageQuery

# Results a usage or costs page holds at most (~7 MB of JSON): a page ends before the bucket that would take it past
# this, so an answer (and the server's memory for it) does not grow with the keys and models in use. Unbounded, a
# quarter's costs by key and model of 2,200 keys took 800 MB and passed gRPC's 64 MiB message limit (a 429).
MAX_PAGE_RESULTS = 20_000
# Results of one bucket at most, answered whole when past MAX_PAGE_RESULTS (~34 MB of JSON): 210,000 of them (a day or
# bucket_width=all by key and model) were 71 MB, past gRPC's 64 MiB message limit, and the caller got a 429.
MAX_BUCKET_RESULTS = 100_000


_Q = TypeVar("_Q")
_T = TypeVar("_T")


class UsageReader(Protocol):
    def aggregate(self, query: UsageQuery) -> list[Totals]: ...

    def recent(self, query: RowQuery) -> list[LedgerRow]: ...


class UsageServicer(usage_service_pb2_grpc.UsageServiceServicer):
    def __init__(self, ledger: UsageReader, authenticator: Authenticator,
                 clock: Callable[[], float] = time.time) -> None:
        self._ledger = ledger
        # The ledger's reads take turns on its one connection, each up to 60 s (behind a DBA's lock on the table):
        # waiting in asyncio's default executor, whose few threads also count prompts and store images, a few
        # dashboard reads held up every chat request to the embedded model. Queued here, a caller gone drops its read.
        self._reads = ThreadPoolExecutor(1, thread_name_prefix="usage-reads")
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
        refuse_undeclared(request)
        limit = rows_limit(_optional(request, "limit"))
        start, end = time_range(_optional(request, "start_time") or 0, _optional(request, "end_time"), self._clock())
        query = RowQuery(start * 1000, end * 1000, limit + 1,
                         key_ids=_visible(key, key_id_values(request.api_key_ids, "api_key_ids")),
                         models=filter_values(request.models, "models"),
                         envs=filter_values(request.project_ids, "project_ids"), errors_only=request.errors_only,
                         before=parse_row_cursor(request.page))
        return requests_page(await self._read(self._ledger.recent, query), limit, typed=typed)

    async def _read(self, read: Callable[[_Q], _T], query: _Q) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._reads, read, query)

    async def _completions(self, request: pb.GetCompletionsUsageRequest, context) -> dict:
        key = await self._authenticator.authenticate(context.invocation_metadata() or ())
        refuse_undeclared(request)
        page = plan_page(_optional(request, "start_time"), _optional(request, "end_time"), request.bucket_width,
                         _optional(request, "limit"), request.page, limits=COMPLETIONS_LIMITS, now=self._clock())
        columns, names = groups_of(request.group_by, COMPLETIONS_GROUPS)
        # Portico has no users and no batch API: asking for either matches nothing.
        nothing = bool(request.user_ids) or (request.HasField("batch") and request.batch)
        query = UsageQuery(page.first * 1000, page.stop * 1000, page.width * 1000, columns,
                           key_ids=_visible(key, key_id_values(request.api_key_ids, "api_key_ids")),
                           models=filter_values(request.models, "models"),
                           envs=filter_values(request.project_ids, "project_ids"), endpoints=TEXT_ENDPOINTS,
                           latency=True)
        page, totals = (page, []) if nothing else await self._page_totals(page, query)
        return completions_page(page, totals, names)

    async def _costs(self, request: pb.GetCostsRequest, context, *, typed: bool = False) -> dict:
        key = await self._authenticator.authenticate(context.invocation_metadata() or ())
        refuse_undeclared(request)
        page = plan_page(_optional(request, "start_time"), _optional(request, "end_time"), request.bucket_width,
                         _optional(request, "limit"), request.page, limits=COSTS_LIMITS, now=self._clock())
        columns, names = groups_of(request.group_by, COSTS_GROUPS)
        query = UsageQuery(page.first * 1000, page.stop * 1000, page.width * 1000, columns,
                           key_ids=_visible(key, key_id_values(request.api_key_ids, "api_key_ids")),
                           models=filter_values(request.models, "models"),
                           envs=filter_values(request.project_ids, "project_ids"))
        page, totals = await self._page_totals(page, query)
        return costs_page(page, totals, names, typed=typed)

    async def _page_totals(self, page: Page, query: UsageQuery) -> tuple[Page, list[Totals]]:
        """The page's totals, the page cut before the bucket that takes them past MAX_PAGE_RESULTS (a first bucket
        past it alone: that bucket, whole). Read 1, 2, 4, ... buckets at a time, so that the database sums about
        the page's own range: the rest of the range, summed to be cut off, made each of a long answer's pages sum
        everything after it (a quarter by key and model, 31 pages: 46 s)."""
        totals: list[Totals] = []
        done, take = 0, 1  # buckets read; buckets the next read takes
        while done < page.buckets:
            start_ms = (page.first + done * page.width) * 1000
            end_ms = min(start_ms + take * page.width * 1000, page.stop * 1000)
            left = MAX_PAGE_RESULTS - len(totals)
            part = await self._read(self._ledger.aggregate, dataclasses.replace(
                query, start_ms=start_ms, end_ms=end_ms, limit=MAX_BUCKET_RESULTS + 1 if done == 0 else left + 1))
            if done == 0 and len(part) > MAX_BUCKET_RESULTS:  # a first bucket is answered whole: up to this
                raise InvalidRequest(
                    f"A bucket of this query holds more than {MAX_BUCKET_RESULTS} results (one per group), more than "
                    "an answer can carry: ask for narrower buckets (bucket_width), fewer group_by values or filters.",
                    param="bucket_width")
            if len(part) > left:
                whole = done + part[-1].bucket if done else 1  # buckets whole on the page (the limit may cut the last)
                totals += [dataclasses.replace(t, bucket=done + t.bucket) for t in part if done + t.bucket < whole]
                return dataclasses.replace(page, buckets=whole), totals
            totals += [dataclasses.replace(t, bucket=done + t.bucket) for t in part]
            done, take = done + take, take * 2
        return page, totals


def _optional(message, field: str) -> int | None:
    return getattr(message, field) if message.HasField(field) else None


def _visible(key: ApiKey, asked: Sequence[str]) -> tuple[str, ...]:
    """The key ids a caller may read: any for an admin key, else only its own. An empty value (`api_key_ids=key_x,`:
    a list joined with a trailing comma) names no key, so it asks for no one else's usage: it matches nothing, as
    for an admin key, rather than being refused."""
    if key.admin:
        return tuple(asked)
    if any(key_id not in (key.id, "") for key_id in asked):
        raise PermissionDenied("A key can only read its own usage; admin keys read every key's.",
                               param="api_key_ids")
    return tuple(asked) or (key.id,)


def _json(body: dict) -> httpbody_pb2.HttpBody:
    return httpbody_pb2.HttpBody(content_type="application/json", data=json_body(body))
