"""`portico usage`: the same totals as GET /v1/organization/usage/completions and /v1/organization/costs, as a
table read straight from the ledger."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from datetime import datetime, timezone

from server.errors import InvalidRequest
from server.usage.money import usd_text
from server.usage.openai_pages import LAST_TIME, WIDTHS, filter_values, key_id_values
from server.usage.query import Totals, UsageQuery

GROUPS = {"model": "model", "api_key_id": "key_id", "project_id": "env"}  # --group-by name -> Totals field


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--start", type=_time, help="UTC date (2026-11-01 or 20261101), date and time "
                        "(2026-11-01T12:00) or unix seconds; default: 7 days before the end")
    parser.add_argument("--end", type=_time, help="exclusive, same forms; default now")
    parser.add_argument("--bucket", choices=tuple(WIDTHS), default="1d", help="bucket width (default 1d)")
    parser.add_argument("--group-by", default="", help="comma-separated: model, api_key_id, project_id (the env)")
    parser.add_argument("--key", action="append", default=[], metavar="ID",
                        help="only this key (repeatable, or comma-separated)")
    parser.add_argument("--model", action="append", default=[], help="only this model (repeatable, or comma-separated)")
    parser.add_argument("--project", action="append", default=[], metavar="ENV",
                        help="only this env (repeatable, or comma-separated)")


def _time(text: str) -> int:
    # Eight digits are a date written without dashes (ISO 8601's basic form, 20261101): as unix seconds they would
    # be a moment in 1970, long before any ledger.
    if text.isdigit() and len(text) != 8:
        return int(text)
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a date, date and time, or unix seconds: {text!r}") from None
    return int((when if when.tzinfo else when.replace(tzinfo=timezone.utc)).timestamp())


def query_of(args: argparse.Namespace, now: float | None = None) -> UsageQuery:
    now = time.time() if now is None else now
    width = WIDTHS[args.bucket]
    end = args.end if args.end is not None else int(now) + 1
    # The week that ends where asked, from 1970 at the earliest (an --end in 1970's first week is not wrong).
    start = args.start if args.start is not None else max(0, end - 7 * 86_400)
    # The API's rules (openai_pages.time_range), in the command's words.
    for option, value in (("--end", end), ("--start", start)):  # the end first: a default start follows it
        if not 0 <= value <= LAST_TIME:
            raise argparse.ArgumentTypeError(f"{option} must lie between 1970 and the year 10000")
    if end <= start:
        raise argparse.ArgumentTypeError("--end must be after --start (the end is exclusive)" if args.end is not None
                                         else "--start must be before now (the default --end)")
    start -= start % width
    groups = tuple(dict.fromkeys(g.strip() for g in args.group_by.split(",") if g.strip()))  # once each, as the API
    for group in groups:
        if group not in GROUPS:
            raise argparse.ArgumentTypeError(f"--group-by: {group!r} is not one of {', '.join(GROUPS)}")
    try:  # comma-separated, as --group-by and the API's filters (`--model a,b` is `--model a --model b`)
        filters = [read(values, option) for values, option, read in
                   ((args.key, "--key", key_id_values), (args.model, "--model", filter_values),
                    (args.project, "--project", filter_values))]
    except InvalidRequest as exc:
        raise argparse.ArgumentTypeError(exc.message) from None
    return UsageQuery(start * 1000, end * 1000, width * 1000, groups, key_ids=filters[0], models=filters[1],
                      envs=filters[2])


def table(query: UsageQuery, totals: Sequence[Totals]) -> list[str]:
    """One line per bucket and group that has usage, then the total."""
    head = ["bucket (UTC)", *query.group_by, "requests", "model requests", "errors", "input tokens", "cached",
            "output tokens", "images", "cost"]
    rows = [[_bucket(query, t.bucket), *(getattr(t, GROUPS[g]) or "-" for g in query.group_by), *_numbers(t)]
            for t in totals]
    total = Totals(0, None, None, None, *(sum(getattr(t, f) for t in totals) for f in _SUMMED))
    rows.append(["total", *("" for _ in query.group_by), *_numbers(total)])
    widths = [max(len(str(row[i])) for row in [head, *rows]) for i in range(len(head))]
    text_columns = 1 + len(query.group_by)
    return ["  ".join(str(cell).ljust(w) if i < text_columns else str(cell).rjust(w)
                      for i, (cell, w) in enumerate(zip(row, widths))).rstrip() for row in [head, *rows]]


_SUMMED = ("input_tokens", "output_tokens", "cached_input_tokens", "images", "cost_micros", "model_requests", "rows",
           "errors")


def _numbers(t: Totals) -> list:
    return [t.rows, t.model_requests, t.errors, t.input_tokens, t.cached_input_tokens, t.output_tokens, t.images,
            usd_text(t.cost_micros)]


def _bucket(query: UsageQuery, index: int) -> str:
    start = (query.start_ms + index * query.width_ms) / 1000
    shape = "%Y-%m-%d" if query.width_ms >= 86_400_000 else "%Y-%m-%d %H:%M"
    return datetime.fromtimestamp(start, timezone.utc).strftime(shape)
