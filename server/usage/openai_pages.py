"""OpenAI's usage and costs pages, from the ledger's totals: pure functions, no I/O.

A query's range is cut into buckets aligned to whole minutes, hours or UTC days; a page holds `limit` consecutive
buckets (empty ones included, with no results) and a `next_page` cursor naming the first bucket of the next page.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from server.errors import InvalidRequest
from server.keys import looks_like_secret
from server.usage.latency import quantile
from server.usage.ledger import LedgerRow
from server.usage.money import micros_to_usd
from server.usage.query import Totals

WIDTHS = {"1m": 60, "1h": 3_600, "1d": 86_400}
# Portico's bucket_width: one bucket from start_time to end_time as given, so a period's totals per key or model take
# one result each, not one per day (a dashboard's table of 30 days by key and model was 30 times its rows).
WHOLE = "all"
DEFAULT_WIDTH = "1d"  # a bucket_width absent or empty
COMPLETIONS_LIMITS = {"1m": (60, 1_440), "1h": (24, 168), "1d": (7, 31), WHOLE: (1, 1)}  # width -> (default, max)
COSTS_LIMITS = {width: (7, 180) for width in WIDTHS} | {WHOLE: (1, 1)}
# group_by values each endpoint accepts -> the ledger grouping they mean (None: accepted, groups nothing here)
COMPLETIONS_GROUPS = {"model": "model", "api_key_id": "api_key_id", "project_id": "project_id", "user_id": None,
                      "batch": None}
COSTS_GROUPS = {"project_id": "project_id", "line_item": "model", "api_key_id": "api_key_id", "model": "model"}
# Times are unix seconds from 1970 to the year 10000: the ledger counts milliseconds in 64 bits, and SQLite refuses
# a bigger number where PostgreSQL would compare it, so both stores answer the same.
LAST_TIME = 253_402_300_800
# Distinct values per filter: each is a parameter of the query, and a gRPC caller's list has no URL to bound it (70,000
# were more than PostgreSQL's 65,535 parameters a statement, or SQLite's 32,766: a 503 "unreachable" to the caller).
MAX_FILTER_VALUES = 1_000


@dataclass(frozen=True, slots=True)
class Page:
    start: int  # unix seconds: the first bucket of the whole range
    end: int  # exclusive end of the range
    width: int  # seconds per bucket
    first: int  # the first bucket of this page
    buckets: int  # buckets on this page

    @property
    def stop(self) -> int:
        """Where this page's rows end."""
        return min(self.first + self.buckets * self.width, self.end)

    @property
    def next_page(self) -> str | None:
        following = self.first + self.buckets * self.width
        return cursor(following) if following < self.end else None


def cursor(bucket_start: int) -> str:
    return "page_" + base64.urlsafe_b64encode(str(bucket_start).encode()).decode().rstrip("=")


def plan_page(start_time: int | None, end_time: int | None, bucket_width: str, limit: int | None, page: str,
              *, limits: dict[str, tuple[int, int]], now: float) -> Page:
    """The page a request asks for; InvalidRequest naming the parameter otherwise."""
    if start_time is None:
        raise InvalidRequest("Missing required parameter: 'start_time' (unix seconds).", param="start_time")
    width_name = bucket_width or DEFAULT_WIDTH
    if width_name not in limits:
        raise InvalidRequest(f"Invalid bucket_width {bucket_width!r}: use one of {', '.join(limits)}.",
                             param="bucket_width")
    start_time, end = time_range(start_time, end_time, now)
    whole = width_name == WHOLE
    width = end - start_time if whole else WIDTHS[width_name]
    default, maximum = limits[width_name]
    if limit is None:
        limit = default
    elif not 1 <= limit <= maximum:
        raise InvalidRequest(limit_refusal(width_name, maximum), param="limit")
    start = start_time if whole else start_time - start_time % width
    first = start if not page else _page_start(page, start, end, width)
    buckets = min(limit, -(-(end - first) // width))
    return Page(start, end, width, first, buckets)


def limit_refusal(width_name: str, maximum: int) -> str:
    """The 400's message for a usage or costs `limit` out of 1..maximum, the range of its bucket_width; Envoy's Lua
    filter says it too, of a whole number beyond the request's int32 (gateway/query_ranges.py takes it there)."""
    if width_name == WHOLE:
        return f"limit must be 1 for bucket_width {WHOLE} (one bucket)."
    return f"limit must be between 1 and {maximum} for bucket_width {width_name}."


def time_refusal(name: str) -> str:
    return f"{name} must be a unix time in seconds, from 0 to {LAST_TIME} (the year 10000)."


def time_range(start_time: int, end_time: int | None, now: float) -> tuple[int, int]:
    """(start, end) in unix seconds, `end` exclusive and now by default; InvalidRequest naming the parameter
    otherwise."""
    for name, value in (("start_time", start_time), ("end_time", end_time)):
        if value is not None and not 0 <= value <= LAST_TIME:
            raise InvalidRequest(time_refusal(name), param=name)
    end = min(int(now) + 1, LAST_TIME) if end_time is None else end_time
    if end <= start_time:
        raise InvalidRequest("start_time must be a unix time before end_time.",
                             param="end_time" if end_time is not None else "start_time")
    return start_time, end


def _page_start(page: str, start: int, end: int, width: int) -> int:
    try:
        encoded = page.removeprefix("page_")
        first = int(base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode())
    except (ValueError, binascii.Error, UnicodeDecodeError):
        first = -1
    if not page.startswith("page_") or first < start or first >= end or (first - start) % width:
        raise InvalidRequest("Invalid page cursor: pass a next_page value from an answer to the same query.",
                             param="page")
    return first


def filter_values(values: Iterable[str], param: str) -> tuple[str, ...]:
    """A filter's distinct values, in the order given; InvalidRequest naming it when there are too many. A value may
    also be comma-separated, as group_by's: no model id, key id or env holds a comma, so `models=a,b` matched
    nothing, an empty answer that read as no usage."""
    distinct = tuple(dict.fromkeys(part.strip() for value in values for part in value.split(",")))
    if len(distinct) > MAX_FILTER_VALUES:
        raise InvalidRequest(f"{param} takes at most {MAX_FILTER_VALUES} distinct values, not {len(distinct)}.",
                             param=param)
    return distinct


def key_id_values(values: Iterable[str], param: str) -> tuple[str, ...]:
    """filter_values for key ids. A secret there (a leaked one looked into) matches no row: the empty answer read as
    a key never used. Refused, unquoted, with InvalidRequest naming `param`."""
    key_ids = filter_values(values, param)
    if any(looks_like_secret(key_id) for key_id in key_ids):
        raise InvalidRequest(f"{param} takes key ids (key_...), not a key's secret (pk-...).", param=param)
    return key_ids


def groups_of(group_by: Iterable[str], accepted: dict[str, str | None]) -> tuple[tuple[str, ...], set[str]]:
    """(the ledger groupings, the names the caller asked for); values may also be comma-separated."""
    names = [name.strip() for value in group_by for name in value.split(",") if name.strip()]
    for name in names:
        if name not in accepted:
            raise InvalidRequest(f"Invalid group_by {name!r}: use any of {', '.join(accepted)}.", param="group_by")
    columns = tuple(dict.fromkeys(column for name in names if (column := accepted[name]) is not None))
    return columns, set(names)


def _buckets(page: Page, totals: Sequence[Totals], result) -> list[dict]:
    """`totals`' bucket indexes count from page.first."""
    by_bucket: dict[int, list[dict]] = {}
    for total in totals:
        by_bucket.setdefault(total.bucket, []).append(result(total))
    return [
        {"object": "bucket", "start_time": page.first + i * page.width,
         "end_time": page.first + (i + 1) * page.width, "results": by_bucket.get(i, [])}
        for i in range(page.buckets)
    ]


def _envelope(page: Page, data: list[dict]) -> dict:
    next_page = page.next_page
    return {"object": "page", "data": data, "has_more": next_page is not None, "next_page": next_page}


def completions_page(page: Page, totals: Sequence[Totals], names: set[str]) -> dict:
    def result(t: Totals) -> dict:
        fields = {
            "object": "organization.usage.completions.result",
            "input_tokens": t.input_tokens, "output_tokens": t.output_tokens,
            "input_cached_tokens": t.cached_input_tokens, "input_audio_tokens": 0, "output_audio_tokens": 0,
            "num_model_requests": t.model_requests,
            "project_id": (t.env or None) if "project_id" in names else None,
            "user_id": None,
            "api_key_id": t.key_id if "api_key_id" in names else None,
            "model": t.model if "model" in names else None,
            "batch": False if "batch" in names else None,
            "num_requests": t.rows, "num_errors": t.errors,
        }
        # Portico's own fields, absent (not null) when no request of the group reached a model: OpenAI's results
        # have no such fields, so a reader that knows them checks for them.
        if t.latency and (p50 := quantile(0.5, t.latency)) is not None:
            fields["latency_ms_p50"], fields["latency_ms_p95"] = p50, quantile(0.95, t.latency)
        return fields

    return _envelope(page, _buckets(page, totals, result))


def costs_page(page: Page, totals: Sequence[Totals], names: set[str], *, typed: bool = False) -> dict:
    """`typed`: for UsageService's message, which also holds the exact cost as an int64 (`amount_micros`); REST's
    JSON keeps its documented shape, `amount_microdollars` being that integer already."""
    def result(t: Totals) -> dict:
        fields = {
            "object": "organization.costs.result",
            "amount": {"value": micros_to_usd(t.cost_micros), "currency": "usd"},
            "line_item": t.model if "line_item" in names else None,
            "project_id": (t.env or None) if "project_id" in names else None,
            "api_key_id": t.key_id if "api_key_id" in names else None,
            "model": t.model if "model" in names else None,
            "amount_microdollars": t.cost_micros,
        }
        return (fields | {"amount_micros": t.cost_micros}) if typed else fields

    return _envelope(page, _buckets(page, totals, result))


REQUESTS_LIMITS = (100, 1_000)  # rows per page of GET /v1/organization/requests: default, maximum


def row_cursor(row: LedgerRow) -> str:
    return "page_" + base64.urlsafe_b64encode(f"{row.at_ms}:{row.id}".encode()).decode().rstrip("=")


def parse_row_cursor(page: str) -> tuple[int, str] | None:
    if not page:
        return None
    try:
        encoded = page.removeprefix("page_")
        at, _, row_id = base64.urlsafe_b64decode(encoded + "=" * (-len(encoded) % 4)).decode().partition(":")
        # Row ids are letters and digits (ReservationIds): anything else is no cursor of ours, and a NUL would
        # reach PostgreSQL, which refuses it.
        if page.startswith("page_") and row_id.isascii() and row_id.isalnum() and 0 <= int(at) <= LAST_TIME * 1000:
            return int(at), row_id
    except (ValueError, binascii.Error, UnicodeDecodeError):
        pass
    raise InvalidRequest("Invalid page cursor: pass a next_page value from an answer to the same query.",
                         param="page")


def rows_limit(limit: int | None) -> int:
    default, maximum = REQUESTS_LIMITS
    if limit is None:
        return default
    if not 1 <= limit <= maximum:
        raise InvalidRequest(rows_limit_refusal(), param="limit")
    return limit


def rows_limit_refusal() -> str:
    """The message for a requests `limit` out of range (said by Envoy's Lua filter too, as limit_refusal)."""
    return f"limit must be between 1 and {REQUESTS_LIMITS[1]}."


def requests_page(rows: Sequence[LedgerRow], limit: int, *, typed: bool = False) -> dict:
    """`rows`: up to limit + 1, newest first (one more than shown says whether there are more). `typed`: for
    UsageService's message, which also holds the exact cost as an int64 (`cost_micros`), as in costs_page."""
    shown = list(rows[:limit])
    more = len(rows) > limit
    return {
        "object": "list",
        "data": [_request(r, typed=typed) for r in shown],
        "has_more": more,
        "next_page": row_cursor(shown[-1]) if more else None,
    }


def _request(r: LedgerRow, *, typed: bool) -> dict:
    fields = {
        "object": "organization.request", "id": r.id, "request_id": r.request_id, "created": r.at_ms // 1000,
        "api_key_id": r.key_id, "project_id": r.env or None, "endpoint": r.endpoint, "model": r.model,
        "upstream": r.upstream or None, "deployment": r.deployment or None, "status": r.status, "code": r.code or None,
        "input_tokens": r.input_tokens,
        "output_tokens": r.output_tokens, "input_cached_tokens": r.cached_input_tokens, "images": r.images,
        "cost": {"value": micros_to_usd(r.cost_micros), "currency": "usd"}, "cost_microdollars": r.cost_micros,
        "latency_ms": r.latency_ms, "first_token_ms": r.first_token_ms,
    }
    return (fields | {"cost_micros": r.cost_micros}) if typed else fields
