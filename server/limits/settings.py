"""The `limits:` section of the configuration, as the limiter reads it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import parse_qsl, urlsplit, urlunsplit

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


# Query parameters that hold a password: redis-py and libpq both read `password` there, libpq also `sslpassword`.
QUERY_SECRETS = frozenset({"password", "sslpassword"})


def redacted(url: str) -> str:
    """The URL without its password (in its user part or its query), for logs and messages."""
    try:
        parts = urlsplit(url)
    except ValueError:  # a bracketed host that is no IPv6 address: where its password is cannot be told
        return "(not a URL)"
    query = parse_qsl(parts.query, keep_blank_values=True)
    if parts.password is None and not any(name in QUERY_SECRETS for name, _ in query):
        return url  # as written: urlunsplit would also turn unix:///path into unix:/path
    if parts.password is not None:
        parts = parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1))
    return urlunsplit(parts._replace(query="&".join(f"{name}={'***' if name in QUERY_SECRETS else value}"
                                                    for name, value in query)))
