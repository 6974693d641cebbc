"""`portico serve` runs the gateway (server/serving.py); `portico keys ...` administers keys in the SQLite store."""

from __future__ import annotations

import argparse
import asyncio
import errno
import functools
import logging
import os
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import uvloop

from server.config import Config, ConfigError, listen_host, load_config, read_config_text
from server.config_providers import upstream_keys
from server.domain_keys import SPEND_LIMIT_NAMES, ApiKey, KeyLimits
from server.errors import InvalidRequest, PorticoError
from server.db.database import StoreUnavailable
from server.db.migrations import SchemaError
from server.keys import KeyAdmin, open_key_store
from server.observability.access_log import AccessLog
from server.private_files import make_data_dir, make_private, take_others_access
from server.serving import check_temp_dir, run_worker, serve, wants_development_key
from server.usage.money import usd_text, usd_to_micros
from server.usage.report import add_arguments as add_usage_arguments
from server.usage.report import query_of as usage_query
from server.usage.report import table as usage_table
from server.usage.stores import open_ledger

# Each worker serves on one event loop, so one per CPU uses the host; a few more may cover an embedded model's
# threads or a loop blocked a moment, beyond that a worker only costs its memory (a whole gateway each).
MAX_WORKERS_PER_CPU = 4

_logger = logging.getLogger("portico")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        text = read_config_text(args.config) if args.config else None  # serve hands this very text to its workers
        config = load_config(args.config, text).with_overrides(data_dir=args.data_dir)
        make_private(config.data_dir)
        if args.command == "serve":
            config = config.with_overrides(host=args.host, port=args.port, envoy_admin_port=args.admin_port,
                                           metrics_port=args.metrics_port)
            _check_ports(config)
            if taken := _taken_port(config):
                print(f"portico: {taken}", file=sys.stderr)
                return 1
            upstream_keys(config.models)  # a missing upstream key stops start-up before anything is created
            _check_access_log(config.access_log)
            if args.workers < 1:
                print("portico: --workers must be at least 1", file=sys.stderr)
                return 2
            if args.workers > (most := MAX_WORKERS_PER_CPU * len(os.sched_getaffinity(0))):
                print(f"portico: --workers {args.workers} is more than {most} ({MAX_WORKERS_PER_CPU} per CPU this "
                      "process may use): a worker serves on one event loop, so workers beyond the CPUs only cost "
                      "memory and start-up time.", file=sys.stderr)
                return 2
            if args.workers > 1 and config.limits.store == "memory":
                print(f"portico: --workers {args.workers} needs a shared rate-limit store: set limits.store to a "
                      "redis:// URL in the configuration (with the in-process store every worker would admit the "
                      "whole limit on its own).", file=sys.stderr)
                return 2
            check_temp_dir(args.workers)
            _check_data_dir(config.data_dir)  # the last check: a mistake found before it leaves nothing behind
            command = functools.partial(_worker_command, args, config, text)
            # uvloop: the event loop's own work (callbacks, sockets) is a large share of every request's CPU.
            development_key = wants_development_key(config, asked=args.dev_key)
            return uvloop.run(serve(config, workers=args.workers, worker_command=command,
                                    development_key=development_key, config_path=args.config))
        if args.command == "worker":
            return uvloop.run(run_worker(config.with_overrides(host=args.host, port=args.port), args.socket))
        _quiet_store_diagnostics(args.log_level)
        if not config.key_store.is_postgres and args.command != "usage":  # <data_dir>/keys.db; usage makes none
            if args.keys_command != "create" and not (path := config.key_database.sqlite_path).exists():
                # A store made here would list no keys (a mistyped --data-dir, a relative data_dir read from
                # another directory): only `create` (and `serve`) may make the first one.
                print(f"portico: no key store at {path}: give the --data-dir (or --config) that `portico serve` "
                      "uses", file=sys.stderr)
                return 1
            _check_data_dir(config.data_dir)
        return _printing(usage_command if args.command == "usage" else keys_command, args, config)
    except ConfigError as exc:
        print(f"portico: configuration error: {exc}", file=sys.stderr)
        return 2
    except StoreUnavailable as exc:  # at start: which store, where, and the driver's words (no key is in them)
        return _unreachable(f"the {exc.store} in {config.key_database.described}", exc)
    except PorticoError as exc:
        print(f"portico: {exc.message}", file=sys.stderr)
        return 1
    except SchemaError as exc:  # a database newer than this code, or a migration it refused: one line, no traceback
        print(f"portico: {exc}", file=sys.stderr)
        return 1


def _printing(command: Callable[[argparse.Namespace, Config], int], args: argparse.Namespace, config: Config) -> int:
    """A command whose output may go to a reader that stops early (`portico usage | head`): a traceback under
    the lines it asked for would only alarm."""
    try:
        code = command(args, config)
        sys.stdout.flush()  # in here: a pipe's buffered lines are otherwise written, and refused, at exit
        return code
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit would fail again
        return 1


def _listeners(config: Config) -> list[tuple[str, str, int, str]]:
    """Portico's own TCP listeners as serve will open them (the file's values and serve's options together): each
    one's setting, host, port and the serve option that moves it."""
    listeners = [("listen.port", config.host, config.port, "--port"),
                 ("envoy_admin_port", "127.0.0.1", config.envoy_admin_port, "--admin-port")]
    if config.metrics_port:  # 0: no metrics listener
        listeners.append(("metrics_port", "127.0.0.1", config.metrics_port, "--metrics-port"))
    return listeners


def _check_ports(config: Config) -> None:
    """Portico's own listeners on one port: Envoy's `Address already in use` would blame some other program, after
    start-up had begun."""
    seen: dict[int, str] = {}
    for setting, _, port, option in _listeners(config):
        name = f"{setting} ({option})"
        if port in seen:
            raise ConfigError(f"{seen[port]} and {name} must differ: both are {port}")
        seen[port] = name


def _taken_port(config: Config) -> str | None:
    """A port another program listens on (or an address not of this machine, a port that needs root), said before the
    model loads and naming the option that moves it: Envoy's own bind failure came after start-up, in five lines of
    its log. SO_REUSEADDR as Envoy binds: a port with only closed connections in TIME_WAIT (a gateway just stopped)
    is free."""
    for _, host, port, option in _listeners(config):
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if ":" in host:  # Envoy's `::` is IPv6 only: an IPv4 listener on the port does not stop it
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                probe.bind((host, port))
            except OSError as exc:
                where = f"cannot bind '[{host}]:{port}'" if ":" in host else f"cannot bind '{host}:{port}'"
                if exc.errno == errno.EADDRINUSE:
                    return (f"{where}: {exc.strerror}: another program (or another Portico) listens there; stop it, "
                            f"or choose another with {option} N")
                if exc.errno == errno.EADDRNOTAVAIL:  # only --host names an address of its own
                    return (f"{where}: {exc.strerror}: no network interface of this machine has the address {host}; "
                            "choose another with --host")
                if exc.errno == errno.EACCES:
                    return (f"{where}: {exc.strerror}: a port below 1024 needs root (or CAP_NET_BIND_SERVICE); "
                            f"choose another with {option} N")
    return None


def _check_data_dir(data_dir: Path) -> None:
    """The data dir (the SQLite store, images, Envoy's logs) made now: a path that cannot be a directory (a file is
    there, a parent is a file, no permission) is one line naming it, not the store's traceback later."""
    make_data_dir(data_dir)


def _check_access_log(target: str) -> None:
    """A file access log every server process will append to: one that cannot be opened (a missing directory, no
    permission) is a mistake in the configuration, said before anything starts rather than as a traceback."""
    try:
        AccessLog(target).close()
        if target not in ("stderr", "stdout", "off"):
            take_others_access(Path(target))  # key ids and envs: as private as the data dir's files
    except OSError as exc:
        raise ConfigError(f"access_log: cannot open {target} ({exc.strerror})") from None


def _quiet_store_diagnostics(level: str) -> None:
    """`keys` and `usage` report a store that cannot be reached themselves, in one line: the connection pool's
    retries and the store's start-up error about the same outage would only repeat it (--log-level debug shows them)."""
    if level != "debug":
        for name in ("psycopg", "server.db"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def _global_options(parser: argparse.ArgumentParser, default) -> None:
    """--config, --data-dir and --log-level: before the command (`portico --config F serve`) or after it
    (`portico serve --config F`). After it they default to SUPPRESS, so that an absent one keeps the value given
    before."""
    parser.add_argument("--config", type=_config_file, default=default, metavar="FILE",
                        help="YAML configuration (default: the built-in server/default.yaml)")
    parser.add_argument("--data-dir", type=_data_dir, default=default, metavar="DIR",
                        help="the key store, images and logs (default: the configuration's data_dir)")
    parser.add_argument("--log-level", default="info" if default is None else default,
                        choices=["debug", "info", "warning", "error"], metavar="LEVEL",
                        help="debug, info, warning or error: diagnostic logs on stderr (default info); the access "
                             "log is separate (access_log)")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="portico", description="Portico text-generation gateway")
    _global_options(parser, None)
    after = argparse.ArgumentParser(add_help=False)
    _global_options(after, argparse.SUPPRESS)
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", parents=[after],
                                help="run the gateway: Envoy on --port, the gRPC server behind it")
    # Each default is the configuration's (a file of one's own may set another), not server/default.yaml's alone.
    serve.add_argument("--host", type=_host, metavar="H",
                       help="listen address, an IP address (default: the configuration's listen.host, 127.0.0.1 in "
                            "server/default.yaml)")
    serve.add_argument("--port", type=_port(1), metavar="P",
                       help="HTTP and gRPC port (default: the configuration's listen.port, 8080 in "
                            "server/default.yaml)")
    serve.add_argument("--admin-port", type=_port(1), metavar="P",
                       help="Envoy admin reads' port on 127.0.0.1 (default: the configuration's envoy_admin_port, 9901 "
                            "in server/default.yaml)")
    serve.add_argument("--metrics-port", type=_port(0), metavar="P",
                       help="Prometheus /metrics on 127.0.0.1, 0: none (default: the configuration's metrics_port, "
                            "9464 in server/default.yaml)")
    serve.add_argument("--dev-key", action="store_true",
                       help="with an empty key store, create and print an all-models development key even when "
                            "upstreams serve models (by default only when every model runs in the gateway)")
    serve.add_argument("--workers", type=int, default=1, metavar="N",
                       help="gRPC server processes behind Envoy (default 1, at most 4 per CPU; more than 1 need "
                            "limits.store: redis://...)")
    worker = commands.add_parser("worker", parents=[after],
                                 help="(internal) one of `serve --workers N`'s server processes")
    worker.add_argument("--socket", type=Path, required=True)
    worker.add_argument("--host")
    worker.add_argument("--port", type=int)

    usage = commands.add_parser("usage", parents=[after],
                                help="usage and spend per bucket (and model, key or env) from the ledger")
    add_usage_arguments(usage)
    keys = commands.add_parser("keys", help="create, update, rotate, list, get and revoke API keys").add_subparsers(
        dest="keys_command", required=True
    )
    create = keys.add_parser("create", parents=[after],
                             help="create a key; its secret is printed on the last line, once")
    create.add_argument("--name", required=True)
    grant = create.add_mutually_exclusive_group(required=True)
    grant.add_argument("--all-models", action="store_true", help="grant every model, including ones added later")
    grant.add_argument("--models", help="comma-separated model ids")
    _limit_options(create, "")
    create.add_argument("--env", default="", help="environment or business line label, e.g. prod")
    create.add_argument("--admin", action="store_true",
                        help="may call the admin API (keys, their limits, the catalog), sign in to the console and "
                             "read every key's usage")
    update = keys.add_parser("update", parents=[after],
                             help="change a key's limits, grants, name or label (0 removes a limit)")
    update.add_argument("key", metavar="ID")
    update.add_argument("--name")
    grant = update.add_mutually_exclusive_group()
    grant.add_argument("--all-models", action="store_true", help="grant every model")
    grant.add_argument("--models", help="grant exactly these comma-separated model ids")
    _limit_options(update, " (0: back to the configured default)")
    update.add_argument("--env", help="environment or business line label")
    rotate = keys.add_parser("rotate", parents=[after], help="give a key a new secret, printed on the last line, once")
    rotate.add_argument("key", metavar="ID")
    rotate.add_argument("--grace", type=int, metavar="SECONDS",
                        help="how long the current secret keeps working (default keys.rotation_grace_seconds)")
    keys.add_parser("list", parents=[after], help="list keys (ids, names, grants; never secrets)")
    get = keys.add_parser("get", parents=[after], help="one key as `list` shows it, then its own limits and budgets")
    get.add_argument("key", metavar="ID")
    revoke = keys.add_parser("revoke", parents=[after], help="revoke a key by id or by its secret")
    revoke.add_argument("key", metavar="ID_OR_SECRET")
    return parser


def _config_file(text: str) -> Path:
    """A path as argparse's type; "" (an unset variable, say) would be the working directory, "Is a directory"."""
    if not text:
        raise argparse.ArgumentTypeError("a file path, not ''")
    return Path(text)


def _data_dir(text: str) -> Path:
    """A path as argparse's type; "" (an unset variable, say) would be the working directory, made owner-only."""
    if not text:
        raise argparse.ArgumentTypeError("a directory path, not ''")
    return Path(text)


def _host(text: str) -> str:
    """An IP address as argparse's type: a host name is a one-line usage error (exit code 2), as in the file."""
    try:
        return listen_host(text, "listen.host")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _port(lowest: int) -> Callable[[str], int]:
    """A port number as argparse's type: out of range is a one-line usage error (exit code 2), as in the file."""
    def port(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = -1
        if not lowest <= value <= 65535:
            raise argparse.ArgumentTypeError(f"a port from {lowest} to 65535, not {text!r}")
        return value
    return port


# option -> KeyLimits field
_LIMIT_OPTIONS = {
    "rpm": ("requests_per_minute", "requests per minute"),
    "tpm": ("tokens_per_minute", "tokens per minute"),
    "concurrency": ("concurrent_requests", "concurrent requests"),
    "daily_tokens": ("daily_tokens", "tokens per UTC day"),
    "daily_requests": ("daily_requests", "requests per UTC day"),
    "max_spend_day": ("max_spend_day", "budget in US dollars per UTC day, e.g. 5 or 0.25"),
    "max_spend_month": ("max_spend_month", "budget in US dollars per UTC calendar month, e.g. 100"),
}


def _option_of(param: str | None) -> str | None:
    """The `keys` option that sets an API field (a refusal names the field: `requests_per_minute` is --rpm)."""
    options = {field: f"--{option.replace('_', '-')}" for option, (field, _) in _LIMIT_OPTIONS.items()}
    field = (param or "").removeprefix("limits.")  # the store names a limit by its place in the key's JSON
    return {**options, "name": "--name", "env": "--env", "grace_seconds": "--grace"}.get(field)


def _limit_options(parser: argparse.ArgumentParser, note: str) -> None:
    for option, (field, meaning) in _LIMIT_OPTIONS.items():
        kind = str if field in SPEND_LIMIT_NAMES else int  # budgets: read in _limits_given, checked like the rest
        parser.add_argument(f"--{option.replace('_', '-')}", type=kind, help=meaning + note)


def _limits_given(args: argparse.Namespace) -> dict[str, int]:
    """The limits given, budgets in micro-dollars. A budget that is no amount of dollars is refused in one line
    naming it (InvalidRequest), as a limit out of range is, not with argparse's usage text."""
    given = {}
    for option, (field, _) in _LIMIT_OPTIONS.items():
        if (value := getattr(args, option)) is not None:
            try:
                given[field] = usd_to_micros(value, field) if field in SPEND_LIMIT_NAMES else value
            except ValueError as exc:
                raise InvalidRequest(str(exc), param=field) from None
    return given


def usage_command(args: argparse.Namespace, config: Config) -> int:
    try:
        query = usage_query(args)
    except argparse.ArgumentTypeError as exc:
        print(f"portico: {exc}", file=sys.stderr)
        return 2
    if not config.key_store.is_postgres and not (path := config.key_database.sqlite_path).exists():
        # An empty ledger made here would report that nothing was spent (a relative data_dir read from another
        # directory, a mistyped --data-dir).
        print(f"portico: no usage ledger at {path}: give the --data-dir (or --config) that `portico serve` uses",
              file=sys.stderr)
        return 1
    try:
        ledger = open_ledger(config.key_database)
    except StoreUnavailable as exc:
        return _unreachable(f"the usage ledger in {config.key_database.described}", exc)
    try:
        print("\n".join(usage_table(query, ledger.aggregate(query))))
    except StoreUnavailable as exc:
        return _unreachable(f"the usage ledger in {config.key_database.described}", exc)
    finally:
        ledger.close()
    return 0


def _unreachable(what: str, exc: StoreUnavailable) -> int:
    """One line (libpq adds a hint on a line of its own), and a failing exit status."""
    print(f"portico: {what} cannot be reached: {str(exc).splitlines()[0]}", file=sys.stderr)
    return 1


def keys_command(args: argparse.Namespace, config: Config) -> int:
    """Against the configured store (keys.store): the same keys as every host using that configuration."""
    return asyncio.run(_keys_in_store(args, config))


async def _keys_in_store(args: argparse.Namespace, config: Config) -> int:
    try:
        store = await open_key_store(config.key_database)
    except StoreUnavailable as exc:
        return _unreachable(f"the key store {config.key_database.described}", exc)
    admin = KeyAdmin(store, [entry.id for entry in config.models],
                     rotation_grace_seconds=config.key_rotation_grace_seconds)
    try:
        return await _keys_command(args, admin)
    except InvalidRequest as exc:  # a mistake in the command's options, like argparse's own
        message = exc.message
        if (option := _option_of(exc.param)) is not None:
            message = f"{option}: {message}"
        if message.startswith("Unknown model"):  # a gateway started with --config may serve models this one lacks
            message += (f" The catalog checked is {args.config or 'server/default.yaml'}: give `keys` the --config "
                        "that `serve` runs with.")
        print(f"portico: {message}", file=sys.stderr)
        return 2
    except StoreUnavailable as exc:
        return _unreachable(f"the key store {config.key_database.described}", exc)
    finally:
        await store.close()


async def _keys_command(args: argparse.Namespace, admin: KeyAdmin) -> int:
    models = [m.strip() for m in (getattr(args, "models", None) or "").split(",") if m.strip()]
    if args.keys_command == "create":
        limits = KeyLimits(**_limits_given(args))
        key, secret = await admin.create(
            args.name, all_models=args.all_models, models=models, limits=limits, env=args.env, admin=args.admin
        )
        print(f"Created key {key.id} ({key.name}). Its secret is shown once:")
        print(secret)
    elif args.keys_command == "list":
        keys, _ = await admin.list()
        for key in keys:
            print(_row(key))
    elif args.keys_command == "get":
        key = await admin.get(args.key)
        print(_row(key))
        print(f"limits: {_limits_text(key)}")
    elif args.keys_command == "update":
        # --models given with no model in it is refused (as by create), not taken as "no change"
        grants = (args.all_models, models) if args.all_models or args.models is not None else None
        limits = {field: value or None for field, value in _limits_given(args).items()}  # 0 removes
        key = await admin.update(args.key, name=args.name, grants=grants, limits=limits, env=args.env)
        print(f"Updated key {key.id} ({key.name}): {_describe(key)}")
    elif args.keys_command == "rotate":
        key, secret, expires = await admin.rotate(args.key, grace_seconds=args.grace)
        when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(expires))
        # No grace: the gateways' key caches drop the previous secret within seconds (as after a revocation).
        previous = ("the previous secret stops working within seconds" if expires <= time.time() else
                    f"the previous secret works until {when}")
        print(f"Rotated key {key.id} ({key.name}); {previous}. The new secret is shown once:")
        print(secret)
    elif args.keys_command == "revoke":
        key = await admin.revoke(args.key)
        print(f"Revoked key {key.id} ({key.name}).")
    return 0


def _limit_text(field: str, value: int) -> str:
    return usd_text(value) if field in SPEND_LIMIT_NAMES else str(value)


def _grants(key: ApiKey) -> str:
    return "all models" if key.all_models else ",".join(sorted(key.models))


def _row(key: ApiKey) -> str:
    """A key's line in `keys list` and `keys get`: id, name, state, env, grants (tab-separated)."""
    state = "revoked" if key.revoked_at else "active"
    role = " admin" if key.admin else ""
    return f"{key.id}\t{key.name}\t{state}{role}\t{key.env or '-'}\t{_grants(key)}"


def _limits_text(key: ApiKey) -> str:
    limits = ", ".join(f"{f}={_limit_text(f, value)}" for f, _ in _LIMIT_OPTIONS.values()
                       if (value := getattr(key.limits, f)) is not None)
    return limits or "configured defaults"


def _describe(key: ApiKey) -> str:
    return f"{_grants(key)}; limits: {_limits_text(key)}"


def _worker_command(args: argparse.Namespace, config: Config, text: str | None, socket: Path) -> list[str]:
    """How `serve` starts a worker: the same configuration, data dir and public address as itself. The configuration
    is the text serve read, kept in its private run directory: a worker restarted after a crash read the file again,
    which the operator may have edited for the next restart (another catalog than the other workers', or a mistake
    that stopped the gateway)."""
    command = [sys.executable, "-m", "server.cli", "--log-level", args.log_level]
    if text is not None:
        started_with = socket.parent / "config.yaml"
        started_with.write_text(text, encoding="utf-8")
        command += ["--config", str(started_with)]
    command += ["--data-dir", str(config.data_dir.resolve()), "worker", "--socket", str(socket),
                "--host", config.host, "--port", str(config.port)]
    return command


if __name__ == "__main__":
    sys.exit(main())
