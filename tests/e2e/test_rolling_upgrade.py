"""A rolling upgrade of several hosts (operations.md, Several hosts: "upgrade hosts forward"): the first upgraded host
migrates the shared PostgreSQL, and the hosts not yet upgraded go on serving with it. One of those with --workers N
lost a worker meanwhile (a crash, the OOM killer): its replacement refused the newer schema, as a fresh start does,
and the supervisor, finding a worker that could not start again, stopped the whole host, its healthy worker and the
requests in flight on it included. A worker restarted after a crash now uses the schema its siblings use."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from importlib import resources

import httpx
import psycopg
import yaml

from server.keys.schema import MIGRATIONS as KEY_MIGRATIONS
from server.usage.schema import MIGRATIONS as USAGE_MIGRATIONS
from tests.e2e.conftest import running_gateway
from tests.postgres_support import PASSWORD_ENV

HI = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


def _workers(serve: subprocess.Popen) -> list[int]:
    """The worker processes `serve` started (its other child is Envoy)."""
    listing = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(serve.pid)], capture_output=True,
                             text=True)
    return [int(line.split()[0]) for line in listing.stdout.splitlines() if " worker " in line]


def test_a_worker_that_dies_after_another_host_migrated_is_restarted_not_the_host_stopped(
        tmp_path, postgres_server, redis_server):
    url = postgres_server.new_database()
    raw = yaml.safe_load((resources.files("server") / "default.yaml").read_text())
    raw["keys"] = {**(raw.get("keys") or {}), "store": url, "password_env": PASSWORD_ENV}
    raw["limits"] = {**(raw.get("limits") or {}), "store": redis_server.url}
    config = tmp_path / "portico.yaml"
    config.write_text(yaml.safe_dump(raw))
    with running_gateway(tmp_path / "old-host", "--workers", "2", config=config) as host:
        headers = {"authorization": f"Bearer {host.secret}"}
        assert httpx.post(f"{host.base_url}/v1/chat/completions", json=HI, headers=headers, timeout=60).is_success
        # A newer Portico started on another host and migrated the shared database past this code's versions.
        with psycopg.connect(url, password=os.environ[PASSWORD_ENV], autocommit=True) as conn:
            for component, known in (("keys", len(KEY_MIGRATIONS)), ("usage", len(USAGE_MIGRATIONS))):
                conn.execute("INSERT INTO schema_migrations VALUES (%s, %s, 'a newer Portico', 0)",
                             (component, known + 1))
        workers = _workers(host.process)
        assert len(workers) == 2
        os.kill(workers[0], signal.SIGKILL)
        deadline = time.monotonic() + 30
        while len(fresh := set(_workers(host.process)) - set(workers)) == 0:
            assert host.process.poll() is None, "the host stopped: " + host.log_path.read_text()[-600:]
            assert time.monotonic() < deadline, "the worker was not restarted"
            time.sleep(0.2)
        time.sleep(3)  # past the replacement's start: a replacement that could not start stopped the host by now
        assert host.process.poll() is None, "the host stopped: " + host.log_path.read_text()[-600:]
        statuses = {httpx.post(f"{host.base_url}/v1/chat/completions", json=HI, headers=headers,
                               timeout=60).status_code for _ in range(8)}
        assert statuses == {200}
        assert len(_workers(host.process)) == 2 and fresh
