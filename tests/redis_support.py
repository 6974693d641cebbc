"""A real redis-server for the tests: 127.0.0.1, a free port, no persistence, its files in a temporary directory."""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from gateway.envoy import free_ports


@dataclass
class RedisServer:
    port: int
    process: subprocess.Popen
    log_path: Path
    password: str | None = None  # Redis's requirepass; not in .url, so a test writes it there (or not) itself
    tls: tuple[int, Path] | None = None  # a TLS port too, with server.pem and server.key from this folder

    @property
    def tls_url(self) -> str:
        return f"rediss://127.0.0.1:{self.tls[0]}/0"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def restart(self) -> None:
        """Stop, then start again on the same port: empty, as a Redis without persistence comes back."""
        self.stop()
        self.process = _launch(self.port, self.log_path.parent, self.password, self.tls)
        _wait_until_it_answers(self)

    def stop(self) -> None:
        """Also a server a test froze (SIGSTOP) and an assertion left frozen: it is continued to take the SIGTERM."""
        self.process.send_signal(signal.SIGCONT)
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_redis(directory: Path, *, password: str | None = None, tls: Path | None = None) -> RedisServer:
    """`tls`: a folder with server.pem and server.key, served on a second port (RedisServer.tls_url)."""
    port, tls_port = free_ports(2)
    with_tls = (tls_port, tls) if tls else None
    server = RedisServer(port, _launch(port, directory, password, with_tls), directory / "redis.log", password,
                         with_tls)
    _wait_until_it_answers(server)
    return server


def _launch(port: int, directory: Path, password: str | None = None,
            tls: tuple[int, Path] | None = None) -> subprocess.Popen:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: apt-get install -y redis-server (make test does this)")
    return subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(directory), "--logfile", str(directory / "redis.log"), "--daemonize", "no",
         *(["--requirepass", password] if password else []),
         *(["--tls-port", str(tls[0]), "--tls-cert-file", str(tls[1] / "server.pem"), "--tls-key-file",
            str(tls[1] / "server.key"), "--tls-auth-clients", "no"] if tls else [])],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )


def _wait_until_it_answers(server: RedisServer) -> None:
    deadline = time.monotonic() + 10
    while not _answers_ping(server.port, server.password):
        if server.process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            log = server.log_path.read_text() if server.log_path.exists() else ""
            raise RuntimeError(f"redis-server did not start:\n{log}")
        time.sleep(0.02)


def _answers_ping(port: int, password: str | None = None) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            if password:
                sock.sendall(f"AUTH {password}\r\n".encode())
                if not sock.recv(16).startswith(b"+OK"):
                    return False
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False
