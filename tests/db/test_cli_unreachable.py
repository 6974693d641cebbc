"""`portico keys` and `portico usage` with a PostgreSQL store that does not answer: one line naming the store, exit 1
(operations.md, Several hosts), not the connection pool's warnings and the server's start-up error besides."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from gateway.envoy import free_ports

_MODELS = "models: [{id: a, endpoint: /v1/chat/completions, provider: {kind: llamacpp}}]"


@pytest.mark.parametrize("command", [("keys", "list"), ("keys", "create", "--name", "x", "--all-models"),
                                     ("keys", "revoke", "key_0"), ("usage",)])
def test_an_unreachable_store_is_one_line_and_exit_1(tmp_path, command):
    (port,) = free_ports(1)  # nothing listens there
    config = tmp_path / "c.yaml"
    config.write_text(f"keys: {{store: 'postgresql://portico@127.0.0.1:{port}/portico', password_env: PG_PW,"
                      f" store_timeout_seconds: 1}}\n{_MODELS}\n")
    done = subprocess.run([sys.executable, "-m", "server.cli", "--config", str(config), "--data-dir",
                           str(tmp_path / "data"), *command], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PG_PW": "not-shown"})
    assert done.returncode == 1 and done.stdout == ""
    assert len(done.stderr.splitlines()) == 1, done.stderr
    assert done.stderr.startswith("portico: the ") and "cannot be reached" in done.stderr
    assert f"127.0.0.1:{port}" in done.stderr and "not-shown" not in done.stderr


@pytest.mark.parametrize("query", ["password=hunter2", "sslmode=disable&password=hunter2", "sslpassword=hunter2"])
def test_a_password_in_the_urls_query_is_refused_without_showing_it(tmp_path, query):
    """libpq reads a password from the URL's query too: such a store was accepted, and every message naming the
    store (an unreachable one, the server's log) printed the password. It is refused as one in the user part is."""
    config = tmp_path / "c.yaml"
    config.write_text(f"keys: {{store: 'postgresql://portico@127.0.0.1:1/portico?{query}'}}\n{_MODELS}\n")
    done = subprocess.run([sys.executable, "-m", "server.cli", "--config", str(config), "--data-dir",
                           str(tmp_path / "data"), "keys", "list"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "hunter2" not in done.stdout + done.stderr
    assert len(done.stderr.splitlines()) == 1 and "keys.password_env" in done.stderr, done.stderr


@pytest.mark.parametrize("command", [("keys", "list"), ("usage",), ("serve",)])
def test_a_keys_db_that_is_no_sqlite_database_is_one_line_and_exit_1(tmp_path, command):
    """A keys.db that is not a database (damaged, or another program's file) was sqlite3's traceback."""
    data = tmp_path / "data"
    data.mkdir()
    (data / "keys.db").write_bytes(b"not a database, " * 400)
    if command == ("serve",):
        port, admin_port, metrics_port = free_ports(3)
        command += ("--port", str(port), "--admin-port", str(admin_port), "--metrics-port", str(metrics_port))
    done = subprocess.run([sys.executable, "-m", "server.cli", "--data-dir", str(data), *command],
                          capture_output=True, text=True, timeout=90)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    (line,) = [line for line in done.stderr.splitlines() if "keys.db" in line]
    assert line.endswith("SQLite: file is not a database"), line
