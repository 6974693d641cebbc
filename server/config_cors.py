"""The `cors:` section: which web apps on other origins may call the model API from a browser. Off unless set (a
browser caller holds its key, so the operator names the origins). Read by server/config.py; gateway/envoy.py renders
it as Envoy's CORS filter."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any
from urllib.parse import SplitResult

from server.config_providers import ConfigError, known_settings, mapping, number, url_parts

# What a preflight allows: the methods of the paths CORS covers (HEAD, like GET, needs no preflight) ...
ALLOW_METHODS = ("GET", "POST")
# ... the request headers the openai and anthropic JS SDKs send in a browser (a preflight's list cannot say
# `x-stainless-*`: each is named; the anthropic SDK sends `user_profile_id` and `workspace_id` as headers), the ids
# and trace context Portico reads, and the response cache's refusal (Cache-Control, Pragma) ...
ALLOW_HEADERS = (
    "authorization", "x-api-key", "content-type", "accept", "user-agent", "x-request-id", "traceparent", "tracestate",
    "cache-control", "pragma", "idempotency-key", "openai-organization", "openai-project", "openai-beta",
    "anthropic-version", "anthropic-beta", "anthropic-dangerous-direct-browser-access", "anthropic-user-profile-id",
    "anthropic-workspace-id", "x-stainless-lang", "x-stainless-package-version", "x-stainless-os",
    "x-stainless-arch", "x-stainless-runtime", "x-stainless-runtime-version", "x-stainless-retry-count",
    "x-stainless-timeout", "x-stainless-read-timeout", "x-stainless-helper", "x-stainless-helper-method",
    "x-stainless-stream-helper", "x-stainless-async", "x-stainless-poll-helper", "x-stainless-custom-poll-interval",
)
# ... and the answer's headers a page may read: what Portico sends that the SDKs read (request ids; retry hints,
# by which they decide to retry; the limits) and the response cache's verdict.
EXPOSE_HEADERS = (
    "x-request-id", "request-id", "retry-after", "retry-after-ms", "x-should-retry",
    "x-ratelimit-limit-requests", "x-ratelimit-remaining-requests", "x-ratelimit-reset-requests",
    "x-ratelimit-limit-tokens", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-tokens", "x-portico-cache",
    # Anthropic's names for the same limits, on the answers of /v1/messages models (api.md, Rate limits).
    "anthropic-ratelimit-requests-limit", "anthropic-ratelimit-requests-remaining",
    "anthropic-ratelimit-requests-reset", "anthropic-ratelimit-tokens-limit", "anthropic-ratelimit-tokens-remaining",
    "anthropic-ratelimit-tokens-reset",
)
MAX_AGE_SECONDS = 7200  # how long a browser may reuse a preflight's answer (Chromium's own cap)
_TOKEN = re.compile(r"[!#$%&'*+.^_`|~0-9a-z-]+")  # an HTTP field name (RFC 9110), in lower case
_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://[^/?#@*\s]+")  # no pattern (`*.example.com`): Envoy compares exactly
_USERINFO = re.compile(r"//[^/@]*@")  # `user:password@` after the scheme, kept out of messages
_DEFAULT_PORTS = {"http": 80, "https": 443}


@dataclass(frozen=True, slots=True)
class CorsSettings:
    allow_origins: tuple[str, ...]  # exact origins, or ("*",) for any
    allow_headers: tuple[str, ...] = ALLOW_HEADERS  # ("*",): whatever the preflight asks for
    expose_headers: tuple[str, ...] = EXPOSE_HEADERS
    max_age_seconds: int = MAX_AGE_SECONDS
    allow_methods: tuple[str, ...] = ALLOW_METHODS  # not a setting: the methods of the paths CORS covers


def parse_cors(raw: Any, where: str) -> CorsSettings | None:
    """None (no CORS, the default) when the section is absent or left empty."""
    if raw is None:
        return None
    raw = mapping(raw, where)
    known_settings(raw, ("allow_origins", "allow_headers", "expose_headers", "max_age_seconds"), where)
    if "allow_origins" not in raw:
        raise ConfigError(f"{where}.allow_origins: required: the origins of the web apps that may call the gateway "
                          "from a browser (https://app.example.com), or `*` for any")
    return CorsSettings(
        allow_origins=_origins(raw["allow_origins"], f"{where}.allow_origins"),
        allow_headers=_names(raw.get("allow_headers", list(ALLOW_HEADERS)), f"{where}.allow_headers"),
        expose_headers=_names(raw.get("expose_headers", list(EXPOSE_HEADERS)), f"{where}.expose_headers"),
        max_age_seconds=number(raw, "max_age_seconds", MAX_AGE_SECONDS, where, integer=True, low=0, high=86_400),
    )


def _listed(value: Any, where: str, what: str) -> list[str]:
    values = [value] if isinstance(value, str) else value
    if not isinstance(values, list) or not values or not all(isinstance(v, str) for v in values):
        raise ConfigError(f"{where}: a non-empty list of {what}, not {value!r}")
    if "*" in values and len(values) > 1:
        raise ConfigError(f"{where}: `*` (any) stands alone, not in a list with others")
    return values


def _origins(value: Any, where: str) -> tuple[str, ...]:
    """Exact origins as a browser sends them in `Origin` (compared byte for byte): `https://app.example.com` with
    no path or trailing slash, in lower case, without the scheme's default port."""
    origins = _listed(value, where, "origins")
    for origin in origins:
        if origin == "*":
            continue
        parts = url_parts(origin) if _ORIGIN.fullmatch(origin) else None
        if parts is None or not parts.hostname or origin != origin.lower():
            # Shown without a `user:password@`: browsers send none, and the message goes to logs.
            raise ConfigError(f"{where}: {_USERINFO.sub('//', origin, count=1)!r} is not an origin as a browser sends "
                              "it: scheme://host[:port], in lower case, no user or password, no path, not even a "
                              "trailing `/`, no pattern (https://app.example.com), or `*` for any")
        if parts.port is not None and parts.port == _DEFAULT_PORTS.get(parts.scheme):
            raise ConfigError(f"{where}: {origin!r} names its scheme's default port, which browsers leave out of "
                              f"the origin they send: write {origin.rpartition(':')[0]}")
        sent = _as_sent(parts)
        if origin != sent:
            raise ConfigError(f"{where}: {origin!r} is not spelled as browsers send it (a host in ASCII, its "
                              f"punycode form; a port without leading zeros): write {sent}")
    return tuple(dict.fromkeys(origins))


def _as_sent(parts: SplitResult) -> str:
    """The origin as a browser serializes it: an international host in punycode (`bücher.example` ->
    `xn--bcher-kva.example`), the port in plain digits."""
    host = parts.netloc.rpartition(":")[0] if parts.port is not None else parts.netloc  # no `user@`: _ORIGIN
    if not host.isascii():
        try:
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            pass  # no ASCII form: the message's `write` then repeats the host, which still says why
    return f"{parts.scheme}://{host}" + (f":{parts.port}" if parts.port is not None else "")


def _names(value: Any, where: str) -> tuple[str, ...]:
    """HTTP header names, each written out: a preflight's lists take no patterns (`x-stainless-*`); `*` alone is any
    (Envoy answers a preflight with the headers it asks for)."""
    names = [name.lower() if isinstance(name, str) else name for name in _listed(value, where, "header names")]
    for name in names:
        if name != "*" and ("*" in name or not _TOKEN.fullmatch(name)):
            raise ConfigError(f"{where}: {name!r} is not a header name (each is written out: a pattern such as "
                              "`x-stainless-*` is not understood; `*` alone is any)")
    return tuple(dict.fromkeys(names))
