"""Whole-number query parameters whose range the Lua shaper checks (gateway/lua/query.lua, range_refusal), with
the server's own range and refusal message (pure).

The server refuses a value within its field's protobuf type (int32, uint32, int64) itself; the transcoder refused one
beyond it in protobuf's terms ("expected an integer from -2147483648 to 2147483647"), never the range the caller was
told. So the shaper refuses every whole number out of range with the server's words, taken here from the server's
constants and message functions, so that the two cannot drift apart.
"""

from __future__ import annotations

from collections.abc import Mapping

from gateway.query_parameters import lua_string
from server.catalog.pages import MOST_LIMIT, limit_refusal
from server.keys.admin import MAX_KEYS_PAGE, page_size_refusal
from server.usage.openai_pages import (
    COMPLETIONS_LIMITS, COSTS_LIMITS, DEFAULT_WIDTH, LAST_TIME, REQUESTS_LIMITS, rows_limit_refusal, time_refusal,
)
from server.usage.openai_pages import limit_refusal as usage_limit_refusal

# A whole-number query parameter's range and the server's message for a value out of it: (low, high, message), the
# message a Lua format whose `%s` is the value as sent. Or, where another parameter's value picks the range (usage's
# `bucket_width`), (that parameter, {its value: (low, high, message)}), "" standing for it absent or empty.
Range = tuple[int, int, str]
Ranges = dict[str, dict[str, Range | tuple[str, dict[str, Range]]]]

_VALUE = "\0"  # where a message says the value: `%s` once its own `%` are escaped


def _lua_format(message: str) -> str:
    return message.replace("%", "%%").replace(_VALUE, "%s")


def query_ranges() -> Ranges:
    """route -> parameter -> its range and refusal, from the server's own constants and messages."""
    def by_width(limits: Mapping[str, tuple[int, int]]) -> tuple[str, dict[str, Range]]:
        widths = {width: (1, most, _lua_format(usage_limit_refusal(width, most)))
                  for width, (_, most) in limits.items()}
        return "bucket_width", widths | {"": widths[DEFAULT_WIDTH]}

    times = {name: (0, LAST_TIME, _lua_format(time_refusal(name))) for name in ("start_time", "end_time")}
    return {
        "/v1/models": {"limit": (1, MOST_LIMIT, _lua_format(limit_refusal(_VALUE)))},  # the anthropic SDK's route
        "/v1/organization/usage/completions": {"limit": by_width(COMPLETIONS_LIMITS)} | times,
        "/v1/organization/costs": {"limit": by_width(COSTS_LIMITS)} | times,
        "/v1/organization/requests": {"limit": (1, REQUESTS_LIMITS[1], _lua_format(rows_limit_refusal()))} | times,
        "/v1/admin/keys": {"page_size": (0, MAX_KEYS_PAGE, _lua_format(page_size_refusal()))},
    }


def lua_ranges(ranges: Ranges) -> str:
    """`ranges` as the Lua shaper's QUERY_RANGES table constructor."""
    def one(low: int, high: int, message: str) -> str:
        return f"{{{low}, {high}, {lua_string(message)}}}"

    rows = []
    for route, names in sorted(ranges.items()):
        fields = []
        for name, spec in sorted(names.items()):
            if isinstance(spec[1], dict):
                by, cases = spec
                fields.append(f"[{lua_string(name)}] = {{by = {lua_string(by)}, " + ", ".join(
                    f"[{lua_string(value)}] = {one(*case)}" for value, case in sorted(cases.items())) + "}")
            else:
                fields.append(f"[{lua_string(name)}] = {one(*spec)}")
        rows.append(f"  [{lua_string(route)}] = {{{', '.join(fields)}}},\n")
    return "{\n" + "".join(rows) + "}"
