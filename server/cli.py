"""`portico serve` runs the gateway (gRPC server + supervised Envoy); `portico keys ...` administers keys."""

from __future__ import annotations

import argparse
import asyncio
import functools
import logging
import sys
from pathlib import Path

from server.config import Config, ConfigError, load_config
from server.domain import KeyLimits
from server.errors import PorticoError
from server.keys import KeyStore
from server.serving import run_worker, serve

_logger = logging.getLogger("portico")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config).with_overrides(data_dir=args.data_dir)
        if args.command == "serve":
            config = config.with_overrides(host=args.host, port=args.port, envoy_admin_port=args.admin_port)
            if args.workers < 1:
                print("portico: --workers must be at least 1", file=sys.stderr)
                return 2
            if args.workers > 1 and config.limits.store == "memory":
                print(f"portico: --workers {args.workers} needs a shared rate-limit store: set limits.store to a "
                      "redis:// URL in the configuration (with the in-process store every worker would admit the "
                      "whole limit on its own).", file=sys.stderr)
                return 2
            command = functools.partial(_worker_command, args, config)
            return asyncio.run(serve(config, workers=args.workers, worker_command=command))
        if args.command == "worker":
            return asyncio.run(run_worker(config.with_overrides(host=args.host, port=args.port), args.socket))
        return keys_command(args, config)
    except ConfigError as exc:
        print(f"portico: configuration error: {exc}", file=sys.stderr)
        return 2
    except PorticoError as exc:
        print(f"portico: {exc.message}", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="portico", description="Portico text-generation gateway")
    parser.add_argument("--config", type=Path, help="YAML configuration (default: the built-in server/default.yaml)")
    parser.add_argument("--data-dir", type=Path, help="where the key store lives (default from the configuration)")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the gateway: Envoy on --port, the gRPC server behind it")
    serve.add_argument("--host", help="listen address (default 127.0.0.1)")
    serve.add_argument("--port", type=int, help="HTTP and gRPC port (default 8080)")
    serve.add_argument("--admin-port", type=int, help="Envoy admin port on 127.0.0.1 (default 9901)")
    serve.add_argument("--workers", type=int, default=1,
                       help="gRPC server processes behind Envoy (default 1; more need limits.store: redis://...)")
    worker = commands.add_parser("worker", help="(internal) one of `serve --workers N`'s server processes")
    worker.add_argument("--socket", type=Path, required=True)
    worker.add_argument("--host")
    worker.add_argument("--port", type=int)

    keys = commands.add_parser("keys", help="create, list and revoke API keys").add_subparsers(
        dest="keys_command", required=True
    )
    create = keys.add_parser("create", help="create a key; its secret is printed on the last line, once")
    create.add_argument("--name", required=True)
    grant = create.add_mutually_exclusive_group(required=True)
    grant.add_argument("--all-models", action="store_true", help="grant every model, including ones added later")
    grant.add_argument("--models", help="comma-separated model ids")
    create.add_argument("--rpm", type=int, help="requests per minute")
    create.add_argument("--tpm", type=int, help="tokens per minute")
    create.add_argument("--concurrency", type=int, help="concurrent requests")
    create.add_argument("--daily-tokens", type=int, help="tokens per UTC day")
    create.add_argument("--daily-requests", type=int, help="requests per UTC day")
    create.add_argument("--env", default="", help="environment or business line label, e.g. prod")
    create.add_argument("--admin", action="store_true", help="may call the admin KeyService")
    keys.add_parser("list", help="list keys (ids, names, grants; never secrets)")
    revoke = keys.add_parser("revoke", help="revoke a key by id or by its secret")
    revoke.add_argument("key", metavar="ID_OR_SECRET")
    return parser


def keys_command(args: argparse.Namespace, config: Config) -> int:
    store = KeyStore(config.data_dir / "keys.db")
    try:
        if args.keys_command == "create":
            models = [m.strip() for m in (args.models or "").split(",") if m.strip()]
            known = {entry.id for entry in config.models}
            unknown = [m for m in models if m not in known]
            if unknown:
                print(f"portico: unknown model(s): {', '.join(unknown)}", file=sys.stderr)
                return 2
            limits = KeyLimits(args.rpm, args.tpm, args.concurrency, args.daily_tokens, args.daily_requests)
            key, secret = store.create(
                args.name, all_models=args.all_models, models=models, limits=limits, env=args.env, admin=args.admin
            )
            print(f"Created key {key.id} ({key.name}). Its secret is shown once:")
            print(secret)
        elif args.keys_command == "list":
            for key in store.list():
                grants = "all models" if key.all_models else ",".join(sorted(key.models))
                state = "revoked" if key.revoked_at else "active"
                admin = " admin" if key.admin else ""
                print(f"{key.id}\t{key.name}\t{state}{admin}\t{key.env or '-'}\t{grants}")
        elif args.keys_command == "revoke":
            key = store.revoke(args.key)
            print(f"Revoked key {key.id} ({key.name}).")
        return 0
    finally:
        store.close()


def _worker_command(args: argparse.Namespace, config: Config, socket: Path) -> list[str]:
    """How `serve` starts a worker: the same configuration file, data dir and public address as itself."""
    command = [sys.executable, "-m", "server.cli"]
    if args.config:
        command += ["--config", str(Path(args.config).resolve())]
    command += ["--data-dir", str(config.data_dir.resolve()), "worker", "--socket", str(socket),
                "--host", config.host, "--port", str(config.port)]
    return command


if __name__ == "__main__":
    sys.exit(main())
