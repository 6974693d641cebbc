"""A real redis-server for the tests: 127.0.0.1, a free port, no persistence, its files in a temporary directory."""

from __future__ import annotations

import shutil
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

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_redis(directory: Path) -> RedisServer:
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: apt-get install -y redis-server (make test does this)")
    (port,) = free_ports(1)
    log_path = directory / "redis.log"
    process = subprocess.Popen(
        [binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
         "--dir", str(directory), "--logfile", str(log_path), "--daemonize", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
    )
    server = RedisServer(port, process, log_path)
    deadline = time.monotonic() + 10
    while not _answers_ping(port):
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"redis-server did not start:\n{log_path.read_text() if log_path.exists() else ''}")
        time.sleep(0.02)
    return server


def _answers_ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False
