"""Reading the ledger: totals per time bucket and group, computed by the database (both sinks share this SQL)."""

from __future__ import annotations

from dataclasses import dataclass

from server.db.database import storable
from server.domain import Endpoint
from server.usage.latency import histogram_sql
from server.usage.ledger import COLUMNS

# OpenAI's group_by names -> ledger columns (a Portico key's env is OpenAI's project).
GROUP_COLUMNS = {"model": "model", "api_key_id": "key_id", "project_id": "env"}
ERROR_CONDITION = "(status >= 400 OR code <> '')"  # the caller got an error (in-band after a 200 included)
TEXT_ENDPOINTS = (Endpoint.CHAT.value, Endpoint.MESSAGES.value)


@dataclass(frozen=True, slots=True)
class UsageQuery:
    start_ms: int  # inclusive; the first bucket starts here
    end_ms: int  # exclusive
    width_ms: int  # bucket width
    group_by: tuple[str, ...] = ()  # of GROUP_COLUMNS' keys
    key_ids: tuple[str, ...] = ()  # filters; empty: all
    models: tuple[str, ...] = ()
    envs: tuple[str, ...] = ()
    endpoints: tuple[str, ...] = ()
    limit: int | None = None  # the first this many totals (in bucket and group order); None: all
    # The latency histogram, for completions' percentiles: costs and `portico usage` show none, and its 15 sums were
    # about 40 % of a costs query's time.
    latency: bool = False


@dataclass(frozen=True, slots=True)
class Totals:
    """One group's sums in one bucket. A group field is None when the query did not group by it."""

    bucket: int  # index from the query's start
    model: str | None
    key_id: str | None
    env: str | None
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int
    images: int
    cost_micros: int
    model_requests: int  # rows whose request reached a model
    rows: int
    errors: int  # rows whose request ended with an error status (400 and above, 499 included)
    latency: tuple[int, ...] = ()  # latency histogram: cumulative counts per bound, then the count timed (latency.py);
    # () unless the query asked for it


def insert_sql(placeholder: str, *, verb: str = "INSERT", suffix: str = "", rows: int = 1) -> str:
    """`verb`/`suffix`: the dialect's way to skip a row whose id is stored already; `rows`: how many rows the one
    statement inserts (their values follow one another, in COLUMNS order)."""
    values = ", ".join([f"({', '.join([placeholder] * len(COLUMNS))})"] * rows)
    return f"{verb} INTO usage_ledger ({', '.join(COLUMNS)}) VALUES {values}{suffix}"


def _filter(where: list[str], params: list, column: str, values: tuple[str, ...]) -> None:
    """`column IN values`, when any. A value no row can hold (storable) matches nothing, so it is left out (the
    database would refuse it), and a filter of nothing else matches nothing."""
    if not values:
        return
    kept = [value for value in values if storable(value)]
    where.append(f"{column} IN ({', '.join(['{p}'] * len(kept))})" if kept else "1 = 0")
    params += kept


def aggregate_sql(query: UsageQuery, placeholder: str) -> tuple[str, list]:
    groups = [GROUP_COLUMNS[g] for g in query.group_by]
    where, params = ["at_ms >= {p}", "at_ms < {p}"], [query.start_ms, query.end_ms]
    for column, values in (("key_id", query.key_ids), ("model", query.models), ("env", query.envs),
                           ("endpoint", query.endpoints)):
        _filter(where, params, column, values)
    grouped = "".join(f", {g}" for g in groups)
    sql = (
        "SELECT (at_ms - {p}) / {p} AS bucket" + grouped + ", SUM(input_tokens), SUM(output_tokens), "
        "SUM(cached_input_tokens), SUM(images), SUM(cost_micros), "
        "SUM(CASE WHEN upstream_attempts > 0 THEN 1 ELSE 0 END), COUNT(*), "
        f"SUM(CASE WHEN {ERROR_CONDITION} THEN 1 ELSE 0 END)" + (f", {histogram_sql()}" if query.latency else "")
        + " FROM usage_ledger WHERE "
        + " AND ".join(where) + " GROUP BY bucket" + grouped + " ORDER BY bucket"  # groups: totals_of orders them
        + (" LIMIT {p}" if query.limit is not None else "")
    )
    limit = [] if query.limit is None else [query.limit]
    return sql.replace("{p}", placeholder), [query.start_ms, query.width_ms, *params, *limit]


@dataclass(frozen=True, slots=True)
class RowQuery:
    """Rows newest first: those before `before` ((at_ms, id) of the last row of the previous page), if given."""

    start_ms: int
    end_ms: int
    limit: int
    key_ids: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    envs: tuple[str, ...] = ()
    errors_only: bool = False
    before: tuple[int, str] | None = None


def rows_sql(query: RowQuery, placeholder: str) -> tuple[str, list]:
    where, params = ["at_ms >= {p}", "at_ms < {p}"], [query.start_ms, query.end_ms]
    for column, values in (("key_id", query.key_ids), ("model", query.models), ("env", query.envs)):
        _filter(where, params, column, values)
    if query.errors_only:
        where.append(ERROR_CONDITION)
    if query.before is not None:
        where.append("(at_ms < {p} OR (at_ms = {p} AND id < {p}))")
        params += [query.before[0], query.before[0], query.before[1]]
    sql = (f"SELECT {', '.join(COLUMNS)} FROM usage_ledger WHERE " + " AND ".join(where)
           + " ORDER BY at_ms DESC, id DESC LIMIT {p}")
    return sql.replace("{p}", placeholder), [*params, query.limit]


_SUMS = 8  # the sums aggregate_sql selects before the latency histogram


def totals_of(query: UsageQuery, rows) -> list[Totals]:
    result = []
    for row in rows:
        row = list(row)
        bucket, named, sums = row[0], dict(zip([GROUP_COLUMNS[g] for g in query.group_by], row[1:])), row[1:]
        sums = [int(v or 0) for v in sums[len(query.group_by):]]
        counted, latency = sums[:_SUMS], tuple(sums[_SUMS:])
        result.append(Totals(int(bucket), named.get("model"), named.get("key_id"), named.get("env"), *counted,
                             latency=latency))
    # A bucket's groups by their values' code points, as SQLite compares text: ordered by the database, they came in
    # the collation of PostgreSQL's database (en-US: a_b, a-b, claude, GPT-4o), another order for the same rows.
    fields = [GROUP_COLUMNS[g] for g in query.group_by]  # the ledger's columns are Totals' field names
    result.sort(key=lambda t: (t.bucket, *(getattr(t, f) for f in fields)))
    return result
