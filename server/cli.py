"""`portico serve` runs the gateway (gRPC server + supervised Envoy); `portico keys ...` administers keys."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import shutil
import signal
import sys
import tempfile
from pathlib import Path

from gateway.descriptors import DESCRIPTOR_SET
from gateway.envoy import EnvoyError, EnvoyProcess, load_template, render_config, repo_root
from server.app import start_server
from server.config import Config, ConfigError, load_config
from server.domain import KeyLimits
from server.errors import PorticoError
from server.keys import KeyStore

_logger = logging.getLogger("portico")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        config = load_config(args.config).with_overrides(data_dir=args.data_dir)
        if args.command == "serve":
            config = config.with_overrides(host=args.host, port=args.port, envoy_admin_port=args.admin_port)
            return asyncio.run(serve(config))
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


async def serve(config: Config) -> int:
    # Unix socket paths are limited to ~108 bytes, so the run directory lives under the system temp dir.
    run_dir = Path(tempfile.mkdtemp(prefix="portico-"))
    socket_path = run_dir / "grpc.sock"
    running = await start_server(config, f"unix:{socket_path}")
    _print_development_key(running.store)
    envoy_config = render_config(
        load_template(),
        listen_host=config.host,
        listen_port=config.port,
        admin_port=config.envoy_admin_port,
        upstreams=[f"unix:{socket_path}"],
        descriptor_set=DESCRIPTOR_SET,
        lua_source=repo_root() / "gateway" / "error_shaper.lua",
    )
    envoy = EnvoyProcess(envoy_config, run_dir)
    try:
        await envoy.start()
    except EnvoyError as exc:
        _logger.error("Envoy did not start: %s", exc)
        await running.stop(0)
        return 1
    print(f"Portico is listening on http://{config.host}:{config.port} (REST /v1 and gRPC)", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    envoy_exit = asyncio.create_task(envoy.wait())
    stop_requested = asyncio.create_task(stop.wait())
    await asyncio.wait({envoy_exit, stop_requested}, return_when=asyncio.FIRST_COMPLETED)
    exit_code = 0
    if envoy_exit.done():
        # Never half-up: without Envoy nobody can reach the server, so the whole gateway goes down loudly.
        _logger.error("Envoy exited with %s; stopping Portico.\n%s", envoy_exit.result(), envoy.log_tail())
        exit_code = 1
    stop_requested.cancel()
    await envoy.stop()
    await running.stop(grace=5.0)
    with contextlib.suppress(OSError):
        shutil.rmtree(run_dir)
    return exit_code


def _print_development_key(store: KeyStore) -> None:
    """On the first start with an empty store, create one development key and show its secret this once."""
    if store.count() > 0:
        return
    key, secret = store.create("development", all_models=True, env="dev")
    print(f"Created development key {key.id}; its secret is shown only now:\n\n    {secret}\n", flush=True)


if __name__ == "__main__":
    sys.exit(main())
