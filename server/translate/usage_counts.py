"""Token counts an upstream reports in its usage, read strictly: they settle rate limits, budgets and the ledger.

A count is a whole number from 0 to 2**31 - 1 (the int32 of CompletionUsage); null or absent is 0, "not said", as
before. Anything else (negative, fractional, a string, 1e30) is not the upstream's API: a negative count would hand
quota back, a huge one would fill a key's window and the stores' integers. It is an UpstreamError (a 502, not
retried: the same answer would come again), and the request is settled from what it sent. The caller is told not to
retry it either (`x-should-retry: false`; the SDKs retry a 502 twice by default): the upstream finished and billed
the answer, and its server counts so every time, so each retry would be billed for the same 502.
"""

from __future__ import annotations

from collections.abc import Mapping

from server import wire_json
from server.domain import Json
from server.errors import UpstreamError

MAX_TOKEN_COUNT = 2**31 - 1


def token_count(usage: Mapping[str, Json], name: str) -> int:
    value = usage.get(name)
    if value is None:
        return 0
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_TOKEN_COUNT:
        shown = wire_json.dumps(value).decode()
        raise not_a_count(f"The upstream's usage is not a token count: `{name}` is {shown}.")
    return value


def not_a_count(message: str) -> UpstreamError:
    """The 502 for a usage that is not the API's (see above): never asked for again, by the gateway or its caller."""
    error = UpstreamError(message)
    error.should_retry = False
    return error


def reported_count(usage: Mapping[str, Json], name: str) -> int | None:
    """A count as the upstream reported it; None when it did not (absent or null), where token_count says 0."""
    return None if usage.get(name) is None else token_count(usage, name)


def said_count(usage: Mapping[str, Json], name: str) -> int | None:
    """A count read for telemetry only: None when not reported or not a count, which fails nothing."""
    try:
        return reported_count(usage, name)
    except UpstreamError:
        return None
