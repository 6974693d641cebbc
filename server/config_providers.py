"""The `provider:` of a model entry: which backend serves it, and for upstream model servers how to reach them
(base URL, the environment variable holding the key, timeouts, retries), parsed into the domain's ProviderSpec.
Read by server/config.py.

The key itself is never part of the configuration: only the name of the variable that holds it, read once at
start-up by `upstream_key`. Nothing here prints a key, so a mistake can be reported in full.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import SplitResult, urlsplit

from server.domain import Endpoint
from server.domain_models import ProviderSpec, RetrySettings, Timeouts, UpstreamSpec

# Which endpoints each kind of provider can serve; a chat model may be served by an Anthropic upstream and a
# messages model by an OpenAI-compatible one (the translators convert between the dialects).
KIND_ENDPOINTS = {
    "llamacpp": (Endpoint.CHAT, Endpoint.MESSAGES),
    "dev-image": (Endpoint.IMAGES,),
    "openai": (Endpoint.CHAT, Endpoint.MESSAGES, Endpoint.IMAGES),
    "anthropic": (Endpoint.CHAT, Endpoint.MESSAGES),
}
UPSTREAM_KINDS = ("openai", "anthropic")
MAX_TOKENS_FIELDS = ("max_tokens", "max_completion_tokens")
MAX_WHOLE = 2**31 - 1  # the largest count or size a setting takes (the limits' own bound)
MAX_SECONDS = 365 * 86_400  # a year: the longest upstream timeout, retry time or cache ttl
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# A run of 16 or more letters and digits holding a lower-case letter and a digit: a token (gsk_..., hf_..., a
# password without punctuation), not a variable's name (OPENAI_API_KEY, upstream_key_2), which such a value also is.
_TOKEN_RUN = re.compile(r"(?=[A-Za-z0-9]*[a-z])(?=[A-Za-z0-9]*[0-9])[A-Za-z0-9]{16,}")


def is_env_name(value: object) -> bool:
    """Whether `value` names an environment variable, not a secret pasted in the name's place: an error about that
    variable (unset, say) quotes its name, and must not quote a key or password."""
    return isinstance(value, str) and bool(_ENV_NAME.fullmatch(value)) and not _TOKEN_RUN.search(value)


class ConfigError(Exception):
    """A configuration mistake; start-up stops with its message."""


def parse_provider(raw: Any, where: str, endpoint: Endpoint) -> ProviderSpec:
    raw = mapping(raw, where)
    kind = raw.get("kind")
    if not isinstance(kind, str) or kind not in KIND_ENDPOINTS:  # `kind: [openai]` is no key of a dict
        raise ConfigError(f"{where}: kind must be one of {', '.join(KIND_ENDPOINTS)}, not {kind!r}")
    if endpoint not in KIND_ENDPOINTS[kind]:
        raise ConfigError(f"{where}: a provider of kind `{kind}` cannot serve {endpoint}; it serves "
                          f"{', '.join(KIND_ENDPOINTS[kind])}")
    if kind not in UPSTREAM_KINDS:
        if unknown := set(raw) - {"kind"}:
            raise ConfigError(f"{where}: a provider of kind `{kind}` takes no settings, "
                              f"got {setting_names(unknown)}")
        return ProviderSpec(kind=kind)
    return ProviderSpec(kind=kind, upstream=_upstream(raw, where, kind, endpoint))


def url_shown(url: str) -> str:
    """A refused URL as a message may quote it: without its query or fragment (`?key=...`), and not at all with a
    user or password."""
    if "@" in url:
        return "(not shown: it has a user or password)"
    base = re.split(r"[?#]", url, maxsplit=1)[0]
    return repr(base) + (" with a query or fragment (not shown)" if base != url else "")


def _upstream(raw: dict, where: str, kind: str, endpoint: Endpoint) -> UpstreamSpec:
    known = {"kind", "base_url", "model", "api_key_env", "timeouts", "retry", "max_connections", "max_tokens_field"}
    if kind == "anthropic":
        known.discard("max_tokens_field")
    known_settings(raw, sorted(known), where)
    for required in ("base_url", "model"):
        if not isinstance(raw.get(required), str) or not raw[required]:
            raise ConfigError(f"{where}: `{required}` is required (a string) for a provider of kind `{kind}`")
    base_url = raw["base_url"].rstrip("/")
    parts = url_parts(base_url)
    # `?` and `#` themselves, not urlsplit's parts: a bare one at the end is no query to it, yet the request path
    # would follow it. The message quotes the URL without a query or fragment (`?key=...`) or a user and password.
    if not parts or parts.scheme not in ("http", "https") or not parts.hostname or "?" in base_url or "#" in base_url:
        raise ConfigError(f"{where}.base_url: an http:// or https:// URL (a host, a port number if any, no query), "
                          f"not {url_shown(base_url)}")
    if parts.username is not None:  # never sent: the upstream would answer 401, for every request
        raise ConfigError(f"{where}.base_url: no user or password in the URL (they are not sent, and a secret does "
                          "not go in the configuration); name the key's environment variable in api_key_env")
    _check_request_path(base_url, parts.path, kind, endpoint, f"{where}.base_url")
    key_env = raw.get("api_key_env")
    if key_env is not None and not is_env_name(key_env):
        raise ConfigError(f"{where}.api_key_env: the name of an environment variable (the key itself never goes "
                          "in the configuration)")
    max_tokens_field = raw.get("max_tokens_field", "max_tokens")
    if max_tokens_field not in MAX_TOKENS_FIELDS:
        raise ConfigError(f"{where}.max_tokens_field: one of {', '.join(MAX_TOKENS_FIELDS)}")
    return UpstreamSpec(
        base_url=base_url,
        model=raw["model"],
        api_key_env=key_env,
        timeouts=_timeouts(optional_mapping(raw.get("timeouts"), f"{where}.timeouts"), f"{where}.timeouts"),
        retry=_retry(optional_mapping(raw.get("retry"), f"{where}.retry"), f"{where}.retry"),
        max_connections=_number(raw, "max_connections", 100, where, integer=True),
        max_tokens_field=max_tokens_field,
    )


def _check_request_path(base_url: str, path: str, kind: str, endpoint: Endpoint, where: str) -> None:
    """A base URL that already ends in the path Portico adds (the anthropic SDK's takes no /v1) sent every request to
    /v1/v1/messages: a 404 at request time that looked like an unknown model."""
    added = "/v1/messages" if kind == "anthropic" else (
        "/images/generations" if endpoint is Endpoint.IMAGES else "/chat/completions")
    taken = ("/v1", "/v1/messages") if kind == "anthropic" else ("/chat/completions", "/images/generations")
    if path.rstrip("/").endswith(taken):
        sdk = "without /v1" if kind == "anthropic" else "ending before /chat/completions, usually in /v1"
        raise ConfigError(f"{where}: as the {kind} SDK takes it ({sdk}): requests would go to {base_url}{added}")


def _timeouts(raw: Any, where: str) -> Timeouts:
    raw = mapping(raw, where)
    defaults = Timeouts()
    if "write" in raw:  # parsed and documented once, but no client has a separate send timeout
        raise ConfigError(f"{where}.write: there is no write timeout (a request is one small buffer, and an upstream "
                          "that does not take it does not answer within `read` either); remove it")
    known_settings(raw, ("connect", "read", "answer", "pool"), where)
    return Timeouts(**{name: _seconds(raw, name, getattr(defaults, name), where) for name in raw})


def _retry(raw: Any, where: str) -> RetrySettings:
    raw = mapping(raw, where)
    defaults = RetrySettings()
    known = ("attempts", "initial_backoff", "max_backoff", "total_seconds", "on_status")
    known_settings(raw, known, where)
    on_status = raw.get("on_status", list(defaults.on_status))
    if not isinstance(on_status, list) or not all(isinstance(s, int) and 400 <= s <= 599 for s in on_status):
        raise ConfigError(f"{where}.on_status: a list of HTTP statuses (400-599), e.g. [429, 500, 503]")
    settings = RetrySettings(
        attempts=_number(raw, "attempts", defaults.attempts, where, integer=True),
        initial_backoff=_seconds(raw, "initial_backoff", defaults.initial_backoff, where),
        max_backoff=_seconds(raw, "max_backoff", defaults.max_backoff, where),
        total_seconds=_seconds(raw, "total_seconds", defaults.total_seconds, where),
        on_status=tuple(on_status),
    )
    if settings.max_backoff < settings.initial_backoff:  # the first wait would silently be max_backoff
        default = "" if "max_backoff" in raw else " (its default)"
        raise ConfigError(f"{where}.max_backoff: at least initial_backoff ({settings.initial_backoff:.15g}), "
                          f"not {settings.max_backoff:.15g}{default}")
    return settings


def _number(raw: dict, name: str, default: float, where: str, *, integer: bool = False) -> Any:
    value = raw.get(name, default)
    valid = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not valid or not math.isfinite(value) or value <= 0:  # YAML has .nan and .inf
        raise ConfigError(f"{where}.{name}: a positive {'whole ' if integer else ''}number, not {value!r}")
    if integer and value > MAX_WHOLE:  # the bound of every count in the file (configuration.md)
        raise ConfigError(f"{where}.{name}: a positive whole number, at most {MAX_WHOLE}, not {value!r}")
    return value


def _seconds(raw: dict, name: str, default: float, where: str) -> float:
    """An upstream's timeout or retry time. Envoy's limit on a silent request is made of them (server/serving.py), and
    Envoy reads no duration past about 10**11 s: a year is more than any answer or retry needs."""
    value = raw.get(name, default)
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
            or not 0 < value <= MAX_SECONDS):
        raise ConfigError(f"{where}.{name}: a positive number of seconds, at most {MAX_SECONDS} (a year), "
                          f"not {value!r}")
    return value


def number(raw: Mapping[str, Any], name: str, default: float, where: str, *, integer: bool = False,
           low: float | None = None, high: float | None = None, positive: bool = False) -> Any:
    """A setting's number, its type and range (`low`, `high`: inclusive bounds; `positive`: more than 0) checked so
    that a mistake names its path (`int("eighty")` names nothing). `where` is the section ("c.yaml: listen"), or the
    file followed by ": " for a top-level setting."""
    value = raw.get(name, default)
    valid = isinstance(value, int) if integer else isinstance(value, (int, float))
    kind = f"a {'whole ' if integer else ''}number"
    path = f"{where}{name}" if where.endswith(": ") else f"{where}.{name}"
    if isinstance(value, bool) or not valid:
        raise ConfigError(f"{path}: {kind}, not {value!r}")
    if not math.isfinite(value):  # YAML's .nan passes every bound below, and .inf is no duration or size
        raise ConfigError(f"{path}: a finite number, not {value!r}")
    if positive:
        kind = f"a positive {'whole ' if integer else ''}number"
        if value <= 0:
            raise ConfigError(f"{path}: {kind}, not {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f" from {low} to {high}" if low is not None and high is not None else (
            f" of at least {low}" if low is not None else f", at most {high}")
        raise ConfigError(f"{path}: {kind}{bounds}, not {value!r}")
    if integer and high is None and value > MAX_WHOLE:  # a count past it broke a queue or a SQLite column
        raise ConfigError(f"{path}: {kind} of at least {low if low is not None else 1} and at most {MAX_WHOLE}, "
                          f"not {value!r}")
    return value


def url_parts(url: str) -> SplitResult | None:
    """urlsplit's parts, or None for a URL no client can use: a space or control character in it, or a port that is
    no port (urlsplit reads the port only when asked, and raises then: a traceback deep in start-up, or a 502 on
    every request)."""
    if any(char.isspace() or not char.isprintable() for char in url):
        return None
    try:
        parts = urlsplit(url)  # raises for a bracketed host that is no IPv6 address: `http://[::1/v1`
        port = parts.port
    except ValueError:
        return None
    return None if port == 0 else parts


def mapping(value: Any, where: str) -> dict:
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be a mapping")
    return value


def optional_mapping(value: Any, where: str) -> dict:
    """A section that may be absent or left empty (YAML's null: its defaults); any other value that is no mapping
    (`[]`, `0`, `false`) is a mistake, not an empty section."""
    return mapping({} if value is None else value, where)


def known_settings(raw: Mapping[str, Any], known: Iterable[str], where: str) -> None:
    """A setting nobody reads is a typo (`default_max_token: 64` would silently do nothing): refuse it by path."""
    known = tuple(known)
    if unknown := set(raw) - set(known):
        raise ConfigError(f"{where}: unknown setting(s) {setting_names(unknown)}; known: {', '.join(known)}")


def setting_names(names: Iterable[Any]) -> str:
    """Setting names for a one-line message, sorted. YAML reads a name such as `1:` or `on:` as a number or a truth
    value, which sorts with no string (a TypeError traceback), and a quoted name may hold a line break."""
    return ", ".join(sorted(repr(name) if isinstance(name, str) and not name.isprintable() else str(name)
                            for name in names))


def upstream_keys(models, environ: Mapping[str, str] = os.environ) -> dict[str, str | None]:
    """(model id, deployment name) -> its upstream's key, for every deployment served by an upstream; ConfigError
    if one is missing."""
    return {(m.id, d.name): upstream_key(d.provider.upstream, environ) for m in models for d in m.deployments
            if d.provider.upstream is not None}


def upstream_key(spec: UpstreamSpec, environ: Mapping[str, str] = os.environ) -> str | None:
    """The upstream's key from the variable `api_key_env` names (None when the upstream needs none)."""
    if spec.api_key_env is None:
        return None
    key = environ.get(spec.api_key_env, "")
    if not key:
        raise ConfigError(f"the environment variable {spec.api_key_env} (api_key_env of the upstream at "
                          f"{spec.base_url}) is not set or empty")
    if not key.isprintable() or not key.isascii():  # a line break would end the request's head early
        raise ConfigError(f"the environment variable {spec.api_key_env} (api_key_env of the upstream at "
                          f"{spec.base_url}) holds characters a key cannot have (a line break, say)")
    return key
