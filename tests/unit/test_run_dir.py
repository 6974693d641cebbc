"""The run directory's sweep (server/run_dir.py) never takes a directory a serve may still use."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from server.run_dir import _sweep, run_directory

HOLD_LOCK = "import fcntl, os, sys, time; fcntl.flock(os.open(sys.argv[1], os.O_RDWR), fcntl.LOCK_EX); " \
            "print('held', flush=True); time.sleep(60)"


def _settled(path) -> None:
    old = time.time() - 120
    os.utime(path, (old, old))


def test_a_running_serves_directory_stays_and_is_swept_once_it_is_gone(tmp_path):
    running = tmp_path / "portico-running1"
    running.mkdir()
    (running / "serve.lock").touch()
    _settled(running / "serve.lock")
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(running / "serve.lock")], stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        _sweep(tmp_path)
        assert running.exists()  # its lock is held: its serve runs, however old the directory
    finally:
        holder.kill()
        holder.wait()
    _sweep(tmp_path)
    assert not running.exists()


def test_a_young_directory_and_one_without_a_lock_file_stay(tmp_path):
    young = tmp_path / "portico-young123"  # another serve's, made a moment ago and perhaps not locked yet
    young.mkdir()
    (young / "serve.lock").touch()
    older = tmp_path / "portico-olderver"  # an older Portico's, which has no lock file, may still be running
    older.mkdir()
    (older / "grpc.sock").touch()
    _sweep(tmp_path)
    assert young.exists() and older.exists()


def test_the_directory_is_locked_while_in_use_and_removed_after(tmp_path, monkeypatch):
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)  # read TMPDIR again
    with run_directory() as run_dir:
        _settled(run_dir / "serve.lock")
        _sweep(tmp_path)
        assert run_dir.exists()  # its own lock holds it (another process's flock would fail the same way)
    assert not run_dir.exists()
