"""The `limits:` section of the configuration, as the limiter reads it."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from server.domain_keys import KeyLimits


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
_QUERY_SECRET = re.compile(r"((?:^|&)(?:password|sslpassword)=)[^&#]*")
# `scheme://user:` (the user may be empty), then everything to the last `@`: the password, whatever it holds.
_USERINFO_PASSWORD = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*://[^:@/?#]*:).*@", re.DOTALL)


def redacted(url: str) -> str:
    """The URL as written but for its password (in its user part or its query), for logs and messages. The user
    part's password runs to the URL's last `@`: a generated one may hold `/`, `?` or `#` unencoded (base64's `/`),
    where urlsplit ends the host part, reading the password short and leaving the rest of it in the text. (An `@` in
    the query, with no password before it, hides the port too: more than needed, never less.)"""
    try:
        urlsplit(url)
    except ValueError:  # a bracketed host that is no IPv6 address: where its password is cannot be told
        return "(not a URL)"
    head, mark, query = _USERINFO_PASSWORD.sub(r"\1***@", url, count=1).partition("?")
    return head + mark + _QUERY_SECRET.sub(r"\1***", query)
