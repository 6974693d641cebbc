"""A real PostgreSQL for the tests: a private cluster (Debian's `postgresql` binaries) initialised in a temporary
directory, listening on 127.0.0.1 on a free port, with a password (scram-sha-256 over TCP) so the tests go through
the same `keys.password_env` path as production. Stopped (and its directory removed) by the session fixture.

    postgres_server    the cluster (session); .url, .password, .stop(), .start() (same port, same data),
                       .paused() (a server that accepts connections and answers nothing: hung, not down)
    postgres_url       a fresh, empty database on it for one test: its postgresql:// URL (no password in it)
"""

from __future__ import annotations

import contextlib
import glob
import os
import signal
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psycopg

from gateway.envoy import free_ports

PASSWORD_ENV = "PORTICO_TEST_PG_PASSWORD"  # the environment variable the tests' configurations name
USER = "postgres"


def postgres_bin_dir() -> Path:
    """Debian installs the server binaries under /usr/lib/postgresql/<major>/bin, not on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parent.parent.name))
    if not found:
        raise RuntimeError("PostgreSQL is not installed: apt-get install -y postgresql (make test does this)")
    return Path(found[-1]).parent


@dataclass
class PostgresServer:
    directory: Path
    port: int
    password: str
    process: subprocess.Popen | None = None
    _databases: int = field(default=0)

    @property
    def data_dir(self) -> Path:
        return self.directory / "data"

    @property
    def log_path(self) -> Path:
        return self.directory / "postgres.log"

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://{USER}@127.0.0.1:{self.port}/{database}"

    def connect(self, database: str = "postgres") -> psycopg.Connection:
        return psycopg.connect(self.url(database), password=self.password, autocommit=True, connect_timeout=5)

    def new_database(self) -> str:
        """A fresh, empty database; returns its URL."""
        self._databases += 1
        name = f"t{os.getpid()}_{self._databases}"
        with self.connect() as conn:
            conn.execute(f'CREATE DATABASE "{name}"')
        return self.url(name)

    def start(self) -> None:
        """Start (or restart after `stop`) on the same port with the same data."""
        command = [str(postgres_bin_dir() / "postgres"), "-D", str(self.data_dir), "-p", str(self.port),
                   "-k", str(self.directory), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off",
                   "-c", "synchronous_commit=off", "-c", "full_page_writes=off", "-c", "max_connections=200"]
        log = open(self.log_path, "ab")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, **_as_postgres())
        log.close()
        deadline = time.monotonic() + 30
        while True:
            try:
                self.connect().close()
                return
            except psycopg.OperationalError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"postgres did not start:\n{self.log_path.read_text()[-3000:]}") from None
                time.sleep(0.05)

    def stop(self) -> None:
        """Fast shutdown (SIGINT): open connections are cut, as in an outage."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(2)
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """SIGSTOP the server and its backends for the block: the kernel still accepts connections and acknowledges
        what is sent, but nothing answers, as with a hung database."""
        assert self.process is not None
        children = subprocess.run(["pgrep", "-P", str(self.process.pid)], capture_output=True, text=True).stdout
        pids = [self.process.pid, *map(int, children.split())]
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # a backend that was just ending
                os.kill(pid, signal.SIGSTOP)
        try:
            yield
        finally:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.directory, ignore_errors=True)


def start_postgres() -> PostgresServer:
    # Not under pytest's tmp dirs: they are private to root, and the server runs as the `postgres` user.
    directory = Path(tempfile.mkdtemp(prefix="portico-pg-"))
    password = os.urandom(12).hex()
    (directory / "pwfile").write_text(password + "\n")
    if os.geteuid() == 0:
        shutil.chown(directory, USER)
        shutil.chown(directory / "pwfile", USER)
    (port,) = free_ports(1)
    initdb = [str(postgres_bin_dir() / "initdb"), "-D", str(directory / "data"), "-U", USER, "--no-sync",
              "-E", "UTF8", "--locale=C", "--auth-local=trust", "--auth-host=scram-sha-256",
              f"--pwfile={directory / 'pwfile'}"]
    result = subprocess.run(initdb, capture_output=True, text=True, **_as_postgres())
    if result.returncode != 0:
        shutil.rmtree(directory, ignore_errors=True)
        raise RuntimeError(f"initdb failed:\n{result.stdout}\n{result.stderr}")
    server = PostgresServer(directory, port, password)
    server.start()
    return server


def _as_postgres() -> dict:
    """initdb and postgres refuse to run as root: as root, run them as the `postgres` user (directly, not through
    runuser, so signals reach the server itself)."""
    return {"user": USER, "group": USER, "extra_groups": [], "cwd": "/"} if os.geteuid() == 0 else {}
