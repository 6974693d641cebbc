"""The `portico` command: `serve` runs the gateway (server/serving.py); `keys ...` and `usage` work on the stores
(server/cli_stores.py)."""

from __future__ import annotations

import argparse
import errno
import functools
import ipaddress
import logging
import os
import socket
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import uvloop

from server.cli_stores import (add_store_commands, discard_stdout, flush_stdout, keys_command, unreachable,
                                usage_arguments_refused, usage_command)
from server.config import Config, ConfigError, listen_host, load_config, read_config_text
from server.config_providers import upstream_keys
from server.errors import PorticoError, holds_secret, redact_secrets
from server.db.database import StoreUnavailable
from server.db.migrations import SchemaError
from server.db.settings import StoreSettings
from server.observability.access_log import AccessLog
from server.private_files import act_as_owner, make_data_dir, make_private, take_others_access, user_name
from server.providers.proxies import proxy_problem
from server.serving import check_temp_dir, run_worker, serve, wants_development_key

# Each worker serves on one event loop, so one per CPU uses the host; a few more may cover an embedded model's
# threads or a loop blocked a moment, beyond that a worker only costs its memory (a whole gateway each).
MAX_WORKERS_PER_CPU = 4

_logger = logging.getLogger("portico")


def main(argv: list[str] | None = None) -> int:
    _open_standard_descriptors()
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        text = read_config_text(args.config) if args.config else None  # serve hands this very text to its workers
        config = load_config(args.config, text).with_overrides(data_dir=args.data_dir)
        if args.command == "usage" and (refused := usage_arguments_refused(args)):
            return refused  # its own options first, as the usage API answers them
        if (missing := _missing_store(args, config)) is not None:
            print(missing, file=sys.stderr)
            return 1
        make_private(config.data_dir)
        if args.command == "serve":
            config = config.with_overrides(host=args.host, port=args.port, envoy_admin_port=args.admin_port,
                                           metrics_port=args.metrics_port)
            _check_ports(config)
            if taken := _taken_port(config):
                print(f"portico: {taken}", file=sys.stderr)
                return 1
            upstream_keys(config.models)  # a missing upstream key stops start-up before anything is created
            _check_proxies(config)
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
            if args.restarted:  # the schema its siblings use, whatever host migrated it since: never half-up
                config = config.with_overrides(key_store=replace(config.key_store, newer_schema_ok=True))
            return uvloop.run(run_worker(config.with_overrides(host=args.host, port=args.port), args.socket))
        _quiet_store_diagnostics(args.log_level)
        if not config.key_store.is_postgres:
            act_as_owner(config.data_dir)  # root's command on the service's SQLite store leaves no file of root's
        if not config.key_store.is_postgres and args.command != "usage":  # <data_dir>/keys.db; usage makes none
            _check_data_dir(config.data_dir)
        if _only_reads(args) and _unwritable(config.key_database):
            config = config.with_overrides(key_store=replace(config.key_store, read_only=True))
        return _printing(usage_command if args.command == "usage" else keys_command, args, config)
    except ConfigError as exc:
        print(f"portico: configuration error: {exc}", file=sys.stderr)
        return 2
    except StoreUnavailable as exc:  # at start: which store, where, and the driver's words (no key is in them)
        return unreachable(f"the {exc.store} in {config.key_database.described}", exc)
    except PorticoError as exc:
        print(f"portico: {exc.message}", file=sys.stderr)
        return 1
    except SchemaError as exc:  # a database newer than this code, or a migration it refused: one line, no traceback
        print(f"portico: {exc}", file=sys.stderr)
        return 1


def _open_standard_descriptors() -> None:
    """Descriptors 0, 1 and 2 open, on /dev/null where closed (`portico serve >&-`): else the first socket or file
    opened takes one, and uvloop aborts the gateway when it closes it (Assertion `fd > STDERR_FILENO'), Envoy
    too. Python's own sys.stdout stays None: what is printed to it is said to be lost (serving.py's _say)."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one, those below it being open


def _missing_store(args: argparse.Namespace, config: Config) -> str | None:
    """`usage` and every `keys` command but `create` read a SQLite store that must be there: a store made here would
    list no keys, or report nothing spent (a mistyped --data-dir, a relative data_dir read from another directory);
    only `create` (and `serve`) may make the first one. Said before anything there is changed: /srv named for
    /srv/portico, or a file, would otherwise have lost group and other access first (make_private)."""
    reads = args.command == "usage" or (args.command == "keys" and args.keys_command != "create")
    if config.key_store.is_postgres or not reads:
        return None
    path = config.key_database.sqlite_path
    try:
        if path.exists():
            return None
    except PermissionError:
        return None  # a directory on the path this user may not enter: make_private says so, naming it
    what = "usage ledger" if args.command == "usage" else "key store"
    return f"portico: no {what} at {path}: give the --data-dir (or --config) that `portico serve` uses"


def _only_reads(args: argparse.Namespace) -> bool:
    return args.command == "usage" or (args.command == "keys" and args.keys_command in ("list", "get"))


def _unwritable(store: StoreSettings) -> bool:
    """A SQLite keys.db, or its directory, that may not be written (a read-only volume or snapshot, a file system the
    kernel made read-only): a command that only reads opens it read-only, since SQLite would make its -wal and -shm
    files there. A store that may be written is opened as ever, so that `keys list` still migrates its schema."""
    path = store.sqlite_path
    return not store.is_postgres and path.exists() and not (os.access(path, os.W_OK) and os.access(path.parent,
                                                                                                   os.W_OK))


def _printing(command: Callable[[argparse.Namespace, Config], int], args: argparse.Namespace, config: Config) -> int:
    """A command whose output may go to a reader that stops early (`portico usage | head`) or to a file on a full
    disk: a traceback under the lines it asked for would only alarm."""
    try:
        code = command(args, config)
        flush_stdout()  # in here: a pipe's buffered lines are otherwise written, and refused, at exit
        return code
    except BrokenPipeError:
        discard_stdout()
        return 1
    except OSError as exc:  # `> file` on a full disk: one line, not a traceback
        discard_stdout()
        print(f"portico: cannot write the output ({exc.strerror})", file=sys.stderr)
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
            if ":" in host:  # as Envoy binds: `::` takes IPv4 callers too (ipv4_compat), so an IPv4 listener stops it
                probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0 if ipaddress.ip_address(host).is_unspecified
                                 else 1)
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
                if exc.errno == errno.EINVAL:  # only --host names an address of its own; Envoy fails on it the same
                    return (f"{where}: {exc.strerror}: no socket may listen on {host} (a multicast address, or a "
                            "link-local one without its interface: fe80::1%eth0); choose another with --host")
    return None


def _check_data_dir(data_dir: Path) -> None:
    """The data dir (the SQLite store, images, Envoy's logs) made now: a path that cannot be a directory (a file is
    there, a parent is a file, no permission) is one line naming it, not the store's traceback later."""
    make_data_dir(data_dir)


def _check_proxies(config: Config) -> None:
    """A proxy the environment names for an upstream that Portico cannot use (a SOCKS one) would be passed over: the
    upstream asked directly, where only the proxy may reach it."""
    for model in config.models:
        for deployment in model.deployments:
            upstream = deployment.provider.upstream
            if upstream is not None and (problem := proxy_problem(upstream.base_url)):
                scheme = upstream.base_url.partition("://")[0].upper()
                raise ConfigError(f"the proxy the environment names for {upstream.base_url} ({scheme}_PROXY or "
                                  f"ALL_PROXY, either case) is {problem}")


def _check_access_log(target: str) -> None:
    """A file access log every server process will append to: one that cannot be opened (a missing directory, no
    permission) is a mistake in the configuration, said before anything starts rather than as a traceback."""
    try:
        AccessLog(target).close()
        if target not in ("stderr", "stdout", "off"):
            take_others_access(Path(target))  # key ids and envs: as private as the data dir's files
    except PermissionError as exc:
        raise ConfigError(f"access_log: cannot open {target} ({exc.strerror}{_owned_by_another(target)})") from None
    except OSError as exc:
        raise ConfigError(f"access_log: cannot open {target} ({exc.strerror})") from None


def _owned_by_another(path: str) -> str:
    """A file access log an earlier run as another user (root) made, private to that user (umask 077): whose it
    is and how to give it over, else nothing more to say."""
    try:
        owner = os.stat(path).st_uid
    except OSError:
        return ""
    if owner == os.geteuid():
        return ""
    me = user_name(os.geteuid())
    return f": it belongs to {user_name(owner)}, and portico runs as {me} here: chown {me}: {path}"


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


class _Parser(argparse.ArgumentParser):
    """argparse's refusals quote what was typed (`unrecognized arguments: pk-...`, `invalid int value: 'pk-...'`):
    a secret pasted in the wrong place reads pk-[redacted], as in every other error of the command. The subcommands'
    parsers are of this class too (add_subparsers makes them of their parent's)."""

    def error(self, message: str):
        return super().error(redact_secrets(message))


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="portico", description="Portico text-generation gateway")
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
    worker.add_argument("--restarted", action="store_true", help="(internal) started again after a crash")

    add_store_commands(commands, after)
    return parser


def _config_file(text: str) -> Path:
    """A path as argparse's type; "" (an unset variable, say) would be the working directory, "Is a directory".
    `~/` is the home directory, as in the file's paths: a unit file or a container's args has no shell to expand it."""
    if not text:
        raise argparse.ArgumentTypeError("a file path, not ''")
    _refuse_secret(text)
    return Path(os.path.expanduser(text))  # as the file's paths: `~nobody-here/x` stays as written


def _data_dir(text: str) -> Path:
    """A path as argparse's type; "" (an unset variable, say) would be the working directory, made owner-only.
    `~/` is the home directory, as in the file's `data_dir`: taken as written, it was a directory named `~` under the
    working directory, with a new, empty key store."""
    if not text:
        raise argparse.ArgumentTypeError("a directory path, not ''")
    _refuse_secret(text)
    return Path(os.path.expanduser(text))  # as the file's paths: `~nobody-here/x` stays as written


def _refuse_secret(path: str) -> None:
    """A key's secret pasted as a path: quoted in "no key store at ..." and, for `keys create` or `serve`, made a
    directory (a key store inside), the secret kept on disk in plain text. Refused unquoted (_Parser.error)."""
    if holds_secret(path):
        raise argparse.ArgumentTypeError(f"{path!r} holds a key's secret, not a path")


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
