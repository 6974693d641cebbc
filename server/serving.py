"""Running the gateway: `portico serve` (gRPC server(s) + supervised Envoy) and the hidden `portico worker`.

With one process (the default) the gRPC server runs inside the `portico serve` process. With `--workers N` it runs
in N worker processes (server/supervisor.py) and this process only supervises them and Envoy, and serves their
summed metrics.

Start: the server(s), the metrics listener, then Envoy, so nothing is reachable before it can answer. Stop
(SIGTERM, SIGINT or SIGHUP): Envoy stops accepting connections, the server(s) report NOT_SERVING, refuse new
requests and let those in flight (streams included) run for up to `drain_seconds`, then Envoy stops; a second
signal during the drain (Ctrl-C pressed again) cuts the requests still in flight and stops at once. If Envoy dies,
or the workers cannot be kept running, everything stops with exit code 1: never half-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import logging
import os
import resource
import shlex
import shutil
import signal
import sys
import tempfile
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from prometheus_client import CollectorRegistry

from gateway.descriptors import DESCRIPTOR_SET
from gateway.envoy import ADMIN_SOCKET, EnvoyError, EnvoyProcess, http_manager, load_template, render_config, repo_root
from server.app import start_server
from server.config import Config, ConfigError
from server.db.database import StoreUnavailable
from server.heap import settle_heap
from server.keys import open_key_store
from server.limits.settings import redacted
from server.observability import MetricsServer
from server.observability.metrics import MULTIPROCESS_ENV, aggregated_registry, mark_dead
from server.providers.health import HEALTH_FILE_ENV
from server.run_dir import run_directory
from server.supervisor import WorkerError, Workers, exit_text, socket_name

KILL_MARGIN_SECONDS = 5.0  # a worker still running this long after its drain period is killed
SOCKET_PATH_BYTES = 107  # a unix socket's path: sun_path is 108 bytes with its terminating NUL

_logger = logging.getLogger("portico")


@dataclass(frozen=True, slots=True)
class _Backend:
    """The gRPC server side, whichever the process layout."""

    upstreams: list[str]  # Envoy's endpoints
    registry: CollectorRegistry  # what GET /metrics serves
    stop: Callable[[], Awaitable[None]]  # drains
    stop_now: Callable[[], Awaitable[None]]  # during `stop`: cuts the requests still in flight
    failed: asyncio.Task | None = None  # ends (with an error) if the workers could not be kept running


def check_temp_dir(workers: int) -> None:
    """The run directory is made under the system temp dir (TMPDIR): its longest socket path must fit a unix socket,
    said in one line before anything starts rather than as grpc's bind failure after the model has loaded."""
    temp = tempfile.gettempdir()
    if (asked := os.environ.get("TMPDIR")) and os.path.abspath(asked) != temp:
        # Python passes over a TMPDIR it cannot write in for /tmp, unsaid: the operator's place (a private
        # RuntimeDirectory, a tmpfs of its own) would silently not be used.
        raise ConfigError(f"TMPDIR: {asked} is not a directory this user may write in ({_not_writable(asked)}): "
                          "make it one, or unset TMPDIR to use /tmp")
    name = max(socket_name(workers - 1 if workers > 1 else None), ADMIN_SOCKET, key=len)
    longest = Path(temp, "portico-XXXXXXXX", name)  # mkdtemp: 8 chars
    if len(os.fsencode(longest)) > SOCKET_PATH_BYTES:
        room = SOCKET_PATH_BYTES - (len(os.fsencode(longest)) - len(os.fsencode(temp)))
        raise ConfigError(f"TMPDIR: {temp} is too long for the run directory's unix sockets (at most {room} bytes "
                          "here): set TMPDIR to a shorter directory")


def _not_writable(path: str) -> str:
    """Why Python passed over `path`: it writes a few bytes there, which a full file system refuses as well as a
    closed directory does (a full tmpfs said 'permission denied' sent the operator to chmod)."""
    if not os.path.exists(path):
        return "no such directory"
    if not os.path.isdir(path):
        return "not a directory"
    try:
        with tempfile.TemporaryFile(dir=path) as probe:
            probe.write(b"portico")
            probe.flush()
    except OSError as exc:
        return (exc.strerror or "permission denied").lower()
    return "permission denied"


def raise_open_files_limit() -> None:
    """Each caller's stream and upstream exchange holds a descriptor: the soft limit a shell or a unit leaves (often
    1,024, where the hard one is far higher) made a busy gateway answer 503 and leave Envoy's new connections to it
    unanswered. Raised to the hard limit, as Go's runtime does, for this process and the workers and Envoy it starts."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):  # refused (a sandbox): the soft limit stays as it was
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def serve(config: Config, *, workers: int = 1, worker_command: Callable[[Path], Sequence[str]],
                development_key: bool = False, config_path: Path | None = None) -> int:
    """`development_key`: on a first start with an empty key store, create and print an all-models key (else say
    how to make one, with `config_path`, the file this serve read)."""
    raise_open_files_limit()
    # From the start: a stop signal while the model loads or workers start would otherwise kill the process by
    # its default action (exit -15, nothing drained, no "Portico stopped."). It is acted on once all is up.
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    # SIGHUP too: its default action (the terminal or ssh session closed) killed Portico without a drain.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        loop.add_signal_handler(sig, stop.set)
    with run_directory() as run_dir:
        return await _serve(config, run_dir, workers, worker_command, stop, development_key, config_path)


async def _serve(config: Config, run_dir: Path, workers: int, worker_command, stop: asyncio.Event,
                 development_key: bool, config_path: Path | None) -> int:
    try:
        backend = await _start_backend(config, run_dir, workers, worker_command)
    except WorkerError as exc:
        _logger.error("%s; stopping Portico.", exc)
        return 1
    try:
        metrics = MetricsServer.start(config.metrics_port, backend.registry) if config.metrics_port else None
    except OSError as exc:
        _logger.error("cannot serve metrics on 127.0.0.1:%d (%s); stopping Portico.", config.metrics_port, exc)
        await _stop_backend(backend)
        return 1
    envoy = EnvoyProcess(_envoy_config(config, backend.upstreams, run_dir), run_dir,
                         log_path=config.data_files.envoy_log)
    try:
        await envoy.start()
    except EnvoyError as exc:
        _logger.error("Envoy did not start: %s", exc)
        await _stop_backend(backend)
        if metrics:
            metrics.close()
        return 1
    # Its socket's path changes with each start: said here for an operator who must change something in Envoy.
    _logger.info("Envoy's admin interface: reads on http://127.0.0.1:%d, changes through the socket %s",
                 envoy.admin_port, envoy.admin_socket)
    # Only now: a start that fails (a port taken) must not use up the one showing of the key's secret.
    await _first_key(config, create=development_key, config_path=config_path)
    _say(f"Portico is listening on {config.listen_url} (REST /v1 and gRPC). Ctrl-C or SIGTERM stops it, after "
         f"up to {config.drain_seconds:g} s for the requests in flight.")

    exit_code = await _run_until_stopped(envoy, backend, config, stop)
    await _drain(_stop_backend(backend), backend.stop_now)  # Envoy must still be up to carry the answers in flight
    await envoy.stop()
    if metrics:
        metrics.close()
    _say("Portico stopped.")
    return exit_code


async def _start_backend(config: Config, run_dir: Path, workers: int, worker_command) -> _Backend:
    if workers == 1:
        socket_path = run_dir / socket_name(None)
        running = await start_server(config, f"unix:{socket_path}")
        settle_heap()
        return _Backend([f"unix:{socket_path}"], running.telemetry.metrics.registry,
                        lambda: running.stop(grace=config.drain_seconds), running.stop_now)
    _say(f"Starting {workers} server processes; they share rate limits in {redacted(config.limits.store)}")
    metrics_dir = run_dir / "metrics"
    metrics_dir.mkdir()
    # The workers share one deployment health board (server/providers/health.py), a file in the run directory.
    env = {MULTIPROCESS_ENV: str(metrics_dir), HEALTH_FILE_ENV: str(run_dir / "health")}
    pool = Workers(
        workers, run_dir, worker_command, env=env,
        stop_grace_s=config.drain_seconds + KILL_MARGIN_SECONDS, hang_s=config.worker_hang_seconds,
        on_exit=lambda pid: mark_dead(metrics_dir, pid),
    )
    await pool.start()
    return _Backend(pool.upstreams, aggregated_registry(metrics_dir), pool.stop, pool.stop_now,
                    asyncio.create_task(pool.supervise()))


async def _run_until_stopped(envoy: EnvoyProcess, backend: _Backend, config: Config, stop: asyncio.Event) -> int:
    """Wait for a stop signal (then start draining: exit code 0) or a failure (exit code 1)."""
    envoy_exit = asyncio.create_task(envoy.wait())
    stop_requested = asyncio.create_task(stop.wait())
    watched = {envoy_exit, stop_requested} | ({backend.failed} if backend.failed else set())
    await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
    stop_requested.cancel()
    if envoy_exit.done():
        # Never half-up: without Envoy nobody can reach the server, so the whole gateway goes down loudly.
        _logger.error("Envoy %s; stopping Portico.\n%s", exit_text(envoy_exit.result()), envoy.log_tail())
        return 1
    envoy_exit.cancel()
    if backend.failed and backend.failed.done():
        _logger.error("%s; stopping Portico.", backend.failed.exception())
        return 1
    if not await envoy.drain_listeners():
        _logger.warning("Envoy did not confirm that its listeners are closed")
    _logger.warning("stopping: no new connections; requests in flight have %gs to finish", config.drain_seconds)
    return 0


async def _drain(drain: Awaitable[None], stop_now: Callable[[], Awaitable[None]]) -> None:
    """Await `drain`. A second SIGINT or SIGTERM meanwhile (Ctrl-C pressed again, an impatient process manager)
    runs `stop_now`, which cuts the requests still in flight, and the drain ends at once."""
    loop = asyncio.get_running_loop()
    cutting: list[asyncio.Task] = []

    def on_second_signal() -> None:
        if not cutting:
            _logger.warning("second stop signal: ending the requests in flight now")
            cutting.append(loop.create_task(stop_now()))

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_second_signal)
    await drain
    if cutting:
        await cutting[0]


async def _stop_backend(backend: _Backend) -> None:
    if backend.failed:
        backend.failed.cancel()
    await backend.stop()


def _envoy_config(config: Config, upstreams: list[str], run_dir: Path) -> dict:
    template = load_template()
    return render_config(
        template,
        listen_host=config.host,
        listen_port=config.port,
        admin_port=config.envoy_admin_port,
        upstreams=upstreams,
        admin_socket=run_dir / ADMIN_SOCKET,
        descriptor_set=DESCRIPTOR_SET,
        lua_dir=repo_root() / "gateway" / "lua",
        access_log_path=_envoy_access_log(config),
        stream_idle_timeout_s=_stream_idle_seconds(config, template),
        cors=config.cors,
    )


def _stream_idle_seconds(config: Config, template: dict) -> float:
    """Envoy's limit on a silent request (envoy.yaml: 300 s), or longer when a model may be silent longer: a
    non-streamed answer says nothing until the model has finished (`timeouts.answer`, 600 s by default), and Envoy cut
    such answers at 300 s with a 504, half-way through the time their model had. Enough for one model's tries (a try
    starts within `retry.total_seconds`), and 5 s more, so the server's own timeout answers first."""
    silences = [max(spec.timeouts.answer, spec.timeouts.read) + spec.retry.total_seconds
                for model in config.models for deployment in model.deployments
                if (spec := deployment.provider.upstream) is not None]
    return max(float(http_manager(template)["stream_idle_timeout"].removesuffix("s")), max(silences, default=0) + 5)


def _envoy_access_log(config: Config) -> str | None:
    """Where Envoy writes the lines of replies the server never saw: into Portico's access-log file (both append
    whole lines), else `<data_dir>/envoy-access.log` (Envoy's own stdout and stderr are envoy.log)."""
    if config.access_log == "off":
        return None
    if config.access_log in ("stderr", "stdout"):
        return str(config.data_files.envoy_access_log.resolve())
    return str(Path(config.access_log).resolve())


async def run_worker(config: Config, socket_path: Path) -> int:
    """One of `--workers N` server processes: serve on `socket_path` until SIGTERM, then drain (a second SIGTERM
    ends the drain at once)."""
    running = await start_server(config, f"unix:{socket_path}")
    settle_heap()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    try:
        await asyncio.wait_for(_drain(running.stop(grace=config.drain_seconds), running.stop_now),
                               config.drain_seconds + KILL_MARGIN_SECONDS)
    except asyncio.TimeoutError:
        # A worker must never outlive its gateway, e.g. after the parent was killed mid-drain (its death signal
        # arrives as SIGTERM): a stop that hangs past the drain period ends the process without further cleanup.
        _logger.error("worker did not stop within %gs of SIGTERM; exiting now", config.drain_seconds)
        os._exit(1)
    return 0


def wants_development_key(config: Config, *, asked: bool) -> bool:
    """A development key is for trying Portico out on its own models: when every model runs in the gateway (the
    embedded default configuration), or when asked for (`serve --dev-key`). Never by itself in front of upstreams,
    where an all-models key would spend real money."""
    return asked or all(d.provider.upstream is None for entry in config.models for d in entry.deployments)


def _say(text: str, *, unsaid: str | None = None) -> None:
    """A line for the operator on stdout. One that cannot be written (`portico serve > out` on a full disk, a pipe
    closed) was a traceback that stopped the gateway at start: it goes to the diagnostic log instead, or `unsaid` for
    a line holding a secret, which never does. Written unbuffered: a line Python kept buffered would fail again,
    and at exit."""
    stream = sys.stdout
    try:
        if stream is None:  # `>&-`
            raise OSError(errno.EBADF, "stdout is closed")
        try:
            fd = stream.fileno()
        except io.UnsupportedOperation:  # not a file: a test's capture, a program that runs Portico in its process
            stream.write(f"{text}\n")
            stream.flush()
            return
        data = f"{text}\n".encode()
        while data:
            data = data[os.write(fd, data):]
    except OSError as exc:
        _logger.error("cannot write to stdout (%s): %s", exc.strerror or exc, unsaid or text)


def _portico() -> str:
    """`portico` as this shell can run it: by name when PATH finds this installation's, else by its path (make serve
    runs .venv/bin/portico, which PATH holds only in an activated venv)."""
    script = Path(sys.executable).parent / "portico"
    if not script.exists() or (found := shutil.which("portico")) and Path(found).resolve() == script.resolve():
        return "portico"
    return shlex.quote(str(script))


async def _first_key(config: Config, *, create: bool, config_path: Path | None = None) -> None:
    """On the first start with an empty store, create one development key and show its secret this once; or, where
    none is made by itself (upstreams serve models), say how to make one, as every request needs a key."""
    store = await open_key_store(config.key_database)
    try:
        if await store.count() > 0:
            return
        if not create:
            # Upstreams mean a configuration file of one's own: `keys` without it checks the default catalog. The
            # paths as this serve resolved them, so that the command works from any directory.
            options = f"--config {shlex.quote(str(config_path.resolve()))} " if config_path else ""
            options += f"--data-dir {shlex.quote(str(config.data_dir.resolve()))}"
            _say("The key store has no keys yet, and every request needs one: create one with "
                 f"`{_portico()} {options} keys create --name NAME --models MODEL,...` (or start with --dev-key for "
                 "an all-models development key).")
            return
        made = await store.create_first("development", env="dev")
        if made is None:
            return  # another host starting at the same time made it
        key, secret = made
        _say(f"Created development key {key.id}; its secret is shown only now:\n\n    {secret}\n",
             unsaid=f"created development key {key.id}, but its secret could not be shown: revoke it (portico keys "
                    f"revoke {key.id}) and create a key with portico keys create")
    except StoreUnavailable as exc:
        if create:
            _logger.error("no development key: the key store cannot be reached (%s)", exc)
    finally:
        await store.close()
