"""Running the gateway: `portico serve` (gRPC server(s) + supervised Envoy) and the hidden `portico worker`.

With one process (the default) the gRPC server runs inside the `portico serve` process. With `--workers N` it runs
in N worker processes (server/supervisor.py) and this process only supervises them and Envoy.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

from gateway.descriptors import DESCRIPTOR_SET
from gateway.envoy import EnvoyError, EnvoyProcess, load_template, render_config, repo_root
from server.app import start_server
from server.config import Config
from server.keys import KeyStore
from server.limits.redis import redacted
from server.supervisor import WorkerError, Workers

_logger = logging.getLogger("portico")


async def serve(config: Config, *, workers: int = 1, worker_command: Callable[[Path], Sequence[str]]) -> int:
    # Unix socket paths are limited to ~108 bytes, so the run directory lives under the system temp dir.
    run_dir = Path(tempfile.mkdtemp(prefix="portico-"))
    try:
        return await _serve(config, run_dir, workers, worker_command)
    finally:
        with contextlib.suppress(OSError):
            shutil.rmtree(run_dir)


async def _serve(config: Config, run_dir: Path, workers: int, worker_command) -> int:
    _print_development_key(config)
    supervision: asyncio.Task | None = None
    if workers == 1:
        socket_path = run_dir / "grpc.sock"
        running = await start_server(config, f"unix:{socket_path}")
        upstreams: list[str] = [f"unix:{socket_path}"]
        stop_backend: Callable[[], Awaitable[None]] = lambda: running.stop(grace=5.0)
    else:
        print(f"Starting {workers} server processes; they share rate limits in {redacted(config.limits.store)}",
              flush=True)
        pool = Workers(workers, run_dir, worker_command)
        try:
            await pool.start()
        except WorkerError as exc:
            _logger.error("%s; stopping Portico.", exc)
            return 1
        upstreams, stop_backend = pool.upstreams, pool.stop
        supervision = asyncio.create_task(pool.supervise())

    envoy = EnvoyProcess(_envoy_config(config, upstreams), run_dir)
    try:
        await envoy.start()
    except EnvoyError as exc:
        _logger.error("Envoy did not start: %s", exc)
        if supervision:
            supervision.cancel()
        await stop_backend()
        return 1
    print(f"Portico is listening on http://{config.host}:{config.port} (REST /v1 and gRPC)", flush=True)

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    envoy_exit = asyncio.create_task(envoy.wait())
    stop_requested = asyncio.create_task(stop.wait())
    watched = {envoy_exit, stop_requested} | ({supervision} if supervision else set())
    await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
    exit_code = 0
    if envoy_exit.done():
        # Never half-up: without Envoy nobody can reach the server, so the whole gateway goes down loudly.
        _logger.error("Envoy exited with %s; stopping Portico.\n%s", envoy_exit.result(), envoy.log_tail())
        exit_code = 1
    if supervision and supervision.done() and not supervision.cancelled():
        _logger.error("%s; stopping Portico.", supervision.exception())
        exit_code = 1
    stop_requested.cancel()
    if supervision:
        supervision.cancel()
    await envoy.stop()
    await stop_backend()
    return exit_code


def _envoy_config(config: Config, upstreams: list[str]) -> dict:
    return render_config(
        load_template(),
        listen_host=config.host,
        listen_port=config.port,
        admin_port=config.envoy_admin_port,
        upstreams=upstreams,
        descriptor_set=DESCRIPTOR_SET,
        lua_source=repo_root() / "gateway" / "error_shaper.lua",
    )


async def run_worker(config: Config, socket_path: Path) -> int:
    """One of `--workers N` server processes: serve on `socket_path` until SIGTERM, then drain for up to 5 s."""
    running = await start_server(config, f"unix:{socket_path}")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await running.stop(grace=5.0)
    return 0


def _print_development_key(config: Config) -> None:
    """On the first start with an empty store, create one development key and show its secret this once."""
    store = KeyStore(config.data_dir / "keys.db")
    try:
        if store.count() > 0:
            return
        key, secret = store.create("development", all_models=True, env="dev")
        print(f"Created development key {key.id}; its secret is shown only now:\n\n    {secret}\n", flush=True)
    finally:
        store.close()
