"""The `limits:` section of the configuration, as the limiter reads it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from server.domain import KeyLimits


@dataclass(frozen=True, slots=True)
class LimitSettings:
    """The `limits:` section."""

    defaults: KeyLimits = field(default_factory=KeyLimits)  # for each value a key leaves unset; None = unlimited
    models: Mapping[str, KeyLimits] = field(default_factory=dict)  # model id -> limits for each key on that model
    store: str = "memory"  # or a redis:// (rediss://, unix://) URL: counters shared by every process using it
    on_store_error: str = "closed"  # the store cannot answer: "closed" refuses with 503, "open" admits uncounted
    lease_seconds: float = 30.0  # Redis: a crashed process's concurrency slots are freed within this time
    store_timeout_seconds: float = 0.5  # Redis: connect and command timeout


def redacted(url: str) -> str:
    """The URL without its password, for logs and messages: in `:password@`, or in the query, where redis-py reads
    it too (the way to give one to a unix:// socket)."""
    password = urlsplit(url).password
    head, mark, query = url.partition("?")
    if password is not None:
        head = head.replace(f":{password}@", ":***@", 1)
    return head + mark + _QUERY_PASSWORD.sub(r"\1***", query)


_QUERY_PASSWORD = re.compile(r"(?i)((?:^|&)password=)[^&#]*")
