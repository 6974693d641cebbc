"""The file system under the gateway fails as an operator's disk does: the data dir (or TMPDIR) on a small tmpfs of
its own that fills up, runs out of inodes or is read-only, at start and while serving, and then has room again.
Needs root (mount); skipped otherwise."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gateway.envoy import free_ports


@contextlib.contextmanager
def tmpfs(directory: Path, options: str = "size=4m") -> Iterator[Path]:
    """A tmpfs mounted at `directory` (made here) until the block ends; the test is skipped where mount is refused."""
    directory.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"mode=0700,{options}", "tmpfs", str(directory)],
                             capture_output=True, text=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs (root needed): {mounted.stderr.strip()}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", "-l", str(directory)], check=False)


def fill(directory: Path) -> Path:
    """A file that takes every byte left on `directory`'s file system."""
    filler = directory / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"\0" * 65536)
    except OSError:
        with contextlib.suppress(OSError):
            while True:
                os.write(fd, b"\0" * 512)
    finally:
        os.close(fd)
    return filler


def remount(directory: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(directory)], check=True)


def portico(data_dir: Path, *args: str, env: dict | None = None, timeout: float = 90) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "server.cli", "--data-dir", str(data_dir), *args],
                          capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def serve(data_dir: Path, env: dict | None = None) -> subprocess.CompletedProcess:
    port, admin_port = free_ports(2)
    return portico(data_dir, "serve", "--port", str(port), "--admin-port", str(admin_port), "--metrics-port", "0",
                   env=env)


def test_a_full_data_dir_at_start_is_one_line_that_says_the_disk_is_full(tmp_path):
    """A full disk said 'the key store ... cannot be reached: SQLite: disk I/O error': no word of the disk."""
    with tmpfs(tmp_path / "data") as data:
        assert portico(data, "keys", "create", "--name", "a", "--all-models").returncode == 0
        fill(data)
        started = serve(data)
        assert started.returncode == 1, started.stderr
        assert started.stderr.count("\n") == 1 and "Traceback" not in started.stderr, started.stderr
        assert f"{data}/keys.db" in started.stderr and "no space left" in started.stderr.lower(), started.stderr


def test_a_read_only_data_dir_is_said_so_by_serve_keys_and_usage(tmp_path):
    """A data dir remounted read-only (a file system the kernel made read-only after an error, a read-only volume)
    said 'SQLite: unable to open database file' to every command: nothing about why."""
    with tmpfs(tmp_path / "data") as data:
        assert portico(data, "keys", "create", "--name", "a", "--all-models").returncode == 0
        remount(data, "ro")
        for command in (("serve",), ("keys", "list"), ("usage",)):
            done = serve(data) if command == ("serve",) else portico(data, *command)
            assert done.returncode == 1, (command, done.stderr)
            assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr
            assert f"{data}/keys.db" in done.stderr and "read-only file system" in done.stderr, done.stderr


def test_a_full_tmpdir_is_said_to_be_full_not_closed_to_the_user(tmp_path):
    """TMPDIR on a full tmpfs of its own (the run directory's sockets and Envoy's config go there) was refused as
    'not a directory this user may write in (permission denied)', sending the operator to chmod."""
    with tmpfs(tmp_path / "run", "size=1m") as run:
        fill(run)
        started = serve(tmp_path / "data", env={"TMPDIR": str(run)})
    assert started.returncode == 2, started.stderr
    assert started.stderr.count("\n") == 1, started.stderr
    assert f"TMPDIR: {run}" in started.stderr and "(no space left on device)" in started.stderr, started.stderr
    assert "permission denied" not in started.stderr
