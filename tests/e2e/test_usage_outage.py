"""The usage ledger in PostgreSQL, and PostgreSQL stopped: the usage API answers 503 service_unavailable with
retry-after (operations.md "Several hosts"), never a 500 with a traceback, and `portico usage` says so in one line.
The PostgreSQL here is the module's own, since the test stops it."""

from __future__ import annotations

import itertools
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from importlib import resources

import httpx
import pytest
import yaml

from tests.e2e.conftest import running_gateway
from tests.postgres_support import start_postgres

PASSWORD_ENV = "PORTICO_TEST_LEDGER_PG_PASSWORD"  # not the session cluster's variable: this cluster is private
PATHS = ("/v1/organization/usage/completions", "/v1/organization/costs", "/v1/organization/requests")
HI = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def outage(tmp_path_factory):
    """(the gateway, its configuration, an admin key, the PostgreSQL it uses)."""
    postgres = start_postgres()
    os.environ[PASSWORD_ENV] = postgres.password
    directory = tmp_path_factory.mktemp("usage-outage")
    raw = yaml.safe_load((resources.files("server") / "default.yaml").read_text())
    raw["keys"] = {**(raw.get("keys") or {}), "store": postgres.new_database(), "password_env": PASSWORD_ENV,
                   "store_timeout_seconds": 1}
    config = directory / "portico.yaml"
    config.write_text(yaml.safe_dump(raw))
    try:
        with running_gateway(directory / "host", config=config) as gateway:
            created = cli(gateway, config, "keys", "create", "--name", "ops", "--all-models", "--admin")
            admin = created.stdout.split()[-1]
            yield gateway, config, admin, postgres
    finally:
        postgres.destroy()
        os.environ.pop(PASSWORD_ENV, None)


def cli(gateway, config, *args: str) -> subprocess.CompletedProcess:
    """`portico` with the gateway's configuration (Gateway.cli does not pass it)."""
    return subprocess.run([sys.executable, "-m", "server.cli", "--config", str(config), "--data-dir",
                           str(gateway.data_dir), *args], capture_output=True, text=True, timeout=60)


def test_with_postgres_down_usage_reads_are_503_and_the_cli_says_so_in_one_line(outage):
    gateway, config, admin, postgres = outage
    headers = {"authorization": f"Bearer {admin}"}
    start = int(time.time())
    assert httpx.post(f"{gateway.base_url}/v1/chat/completions", json=HI, headers=headers,
                      timeout=60).status_code == 200
    for path in PATHS:  # the admin key is now in the gateway's key cache, which outlives the outage
        assert httpx.get(f"{gateway.base_url}{path}?start_time={start}", headers=headers, timeout=30).is_success
    assert cli(gateway, config, "usage").returncode == 0

    postgres.stop()
    try:
        for path in PATHS:
            answer = httpx.get(f"{gateway.base_url}{path}?start_time={start}", headers=headers, timeout=30)
            assert answer.status_code == 503, answer.text
            assert answer.json()["error"] | {"message": ""} == {
                "message": "", "type": "service_unavailable_error", "param": None, "code": "service_unavailable"}
            assert "usage ledger" in answer.json()["error"]["message"]
            assert int(answer.headers["retry-after"]) > 0
        printed = cli(gateway, config, "usage")
        assert printed.returncode == 1 and printed.stdout == ""
        assert len(printed.stderr.splitlines()) == 1, printed.stderr
        assert printed.stderr.startswith("portico: the usage ledger in ") and "cannot be reached" in printed.stderr
        assert postgres.password not in printed.stderr
        served = httpx.post(f"{gateway.base_url}/v1/chat/completions", json=HI, headers=headers, timeout=60)
        assert served.status_code == 200, served.text  # a cached key is served through the outage
    finally:
        postgres.start()
    assert "Traceback" not in gateway.log_path.read_text()
    answer = httpx.get(f"{gateway.base_url}{PATHS[0]}?start_time={start}", headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text  # the next read opens a new connection
    # operations.md: the ledger's rows waited in memory through the outage, and are written once PostgreSQL is back
    # (retried with a pause that grows up to 30 s: a short outage costs a few seconds)
    deadline = time.monotonic() + 20
    while served.headers["x-request-id"] not in ids(gateway, headers, start):
        assert time.monotonic() < deadline, "the row of the request served during the outage was never written"
        time.sleep(0.5)


def ids(gateway, headers, start: int) -> list[str]:
    rows = httpx.get(f"{gateway.base_url}{PATHS[2]}?start_time={start}", headers=headers, timeout=30).json()["data"]
    return [row["request_id"] for row in rows]


def await_rows(gateway, headers, start: int, served: list[str], when: str) -> None:
    """Every request id in `served` gets its ledger row within the writer's retry pauses."""
    deadline = time.monotonic() + 40
    while not set(served) <= set(ids(gateway, headers, start)):
        assert time.monotonic() < deadline, f"the rows of the requests served {when} were never written"
        time.sleep(0.5)


def chats(gateway, headers, count: int) -> list[str]:
    """The request ids of `count` chat requests, each answered."""
    served = []
    for _ in range(count):
        answer = httpx.post(f"{gateway.base_url}/v1/chat/completions", json=HI, headers=headers, timeout=60)
        assert answer.status_code == 200, answer.text
        served.append(answer.headers["x-request-id"])
    return served


def service_lines(text: str) -> list[str]:
    """The log's lines but the access log's (JSON) and debug ones."""
    return [line for line in text.splitlines() if not line.startswith("{") and " DEBUG " not in line]


def test_postgres_down_is_logged_once_on_whole_lines_with_why(outage):
    """While PostgreSQL was down, psycopg_pool's own 'error connecting in 'portico-keys': connection failed: ...'
    came about once a second for the whole outage, idle or not, each on two lines (libpq's hint 'Is the server running
    on that host...' began a line without timestamp or level), as did the usage ledger's line; the key store's one
    line said only 'couldn't get a connection after 1.0 sec', not why. Now the outage is the stores' own lines, each
    once, on one line, the key store's saying what the latest attempt met."""
    gateway, config, admin, postgres = outage
    headers = {"authorization": f"Bearer {admin}"}
    assert httpx.post(f"{gateway.base_url}/v1/chat/completions", json=HI, headers=headers, timeout=60).is_success
    # The key store learns PostgreSQL is back (after the test before stopped it) at a lookup of a key it has not
    # cached, once its pool has reconnected: until one is answered, this outage would not be logged as one of its own.
    deadline = time.monotonic() + 30
    for n in itertools.count():
        fresh = {"authorization": f"Bearer pk-unknown-before-the-outage-{n:020d}"}
        status = httpx.post(f"{gateway.base_url}/v1/chat/completions", json=HI, headers=fresh, timeout=60).status_code
        if status == 401 or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert status == 401
    with open(gateway.log_path, encoding="utf-8") as log:
        log.seek(0, 2)
        postgres.stop()
        try:
            for n in range(30):
                served = httpx.post(f"{gateway.base_url}/v1/chat/completions", json=HI, headers=headers, timeout=60)
                assert served.status_code == 200, served.text  # a cached key
                unknown = httpx.post(f"{gateway.base_url}/v1/chat/completions", json=HI, timeout=60,
                                     headers={"authorization": f"Bearer pk-unknown-{n:030d}"})
                assert unknown.status_code == 503, unknown.text
            time.sleep(6)  # idle: the pool goes on trying
        finally:
            postgres.start()
        lines = service_lines(log.read())
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+ [A-Z]+ ", line) for line in lines), lines
    assert not [line for line in lines if "psycopg" in line], lines
    store = [line for line in lines if "key store is unreachable" in line]
    assert len(store) == 1 and "Connection refused" in store[0], lines
    assert len(lines) <= 4, lines  # the key store's, the usage ledger's, readiness's


@pytest.fixture(scope="module")
def least_privilege(tmp_path_factory, postgres_server):
    """A gateway running as a role that only reads and writes the tables (operations.md, Several hosts), their owner
    having migrated them: (the gateway, an admin key, the database's name, the role's name)."""
    url = postgres_server.new_database()
    database = url.rsplit("/", 1)[1]
    role = f"{database}_rw"
    directory = tmp_path_factory.mktemp("least-privilege")
    raw = yaml.safe_load((resources.files("server") / "default.yaml").read_text())
    configs = {}
    for name, store in (("owner", url), ("role", url.replace("postgres@", f"{role}@"))):
        raw["keys"] = {**(raw.get("keys") or {}), "store": store, "password_env": "PORTICO_TEST_PG_PASSWORD",
                       "store_timeout_seconds": 1}
        configs[name] = directory / f"{name}.yaml"
        configs[name].write_text(yaml.safe_dump(raw))
    with postgres_server.connect(database) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{postgres_server.password}'")
    host = directory / "host"
    for command in (("keys", "list"), ("usage",)):  # the owner applies the migrations
        assert subprocess.run([sys.executable, "-m", "server.cli", "--config", str(configs["owner"]), "--data-dir",
                               str(host), *command], capture_output=True, timeout=60).returncode == 0
    with postgres_server.connect(database) as conn:
        conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
    with running_gateway(host, config=configs["role"]) as gateway:
        created = cli(gateway, configs["role"], "keys", "create", "--name", "ops", "--all-models", "--admin")
        assert created.returncode == 0, created.stderr
        yield gateway, created.stdout.split()[-1], database, role


def test_a_role_refused_the_ledger_answers_usage_reads_503_and_loses_no_row(least_privilege, postgres_server):
    """A DBA's `REVOKE SELECT, INSERT ON usage_ledger` while the gateway runs (SQLSTATE 42501): the usage API's reads
    were a 500 `internal_error`, with psycopg's InsufficientPrivilege and a traceback in the log for each. They are the
    ledger's 503 with retry-after, as in an outage; chat requests go on, /readyz stays ready (the key store answers),
    the writer says once that it cannot write, and once granted again every request's row is written."""
    gateway, admin, database, role = least_privilege
    headers = {"authorization": f"Bearer {admin}"}
    start = int(time.time())
    assert httpx.post(f"{gateway.base_url}/v1/chat/completions", json=HI, headers=headers, timeout=60).is_success
    with open(gateway.log_path, encoding="utf-8") as log:
        log.seek(0, 2)
        with postgres_server.connect(database) as dba:
            dba.execute(f"REVOKE SELECT, INSERT ON usage_ledger FROM {role}")
        try:
            served = chats(gateway, headers, 5)
            for path in PATHS:
                answer = httpx.get(f"{gateway.base_url}{path}?start_time={start}", headers=headers, timeout=30)
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["code"] == "service_unavailable"
                assert "usage ledger" in answer.json()["error"]["message"]
                assert int(answer.headers["retry-after"]) > 0
            ready = httpx.get(f"{gateway.base_url}/readyz", timeout=30)
            assert ready.status_code == 200 and ready.json()["checks"]["keys"] == "ok", ready.text
            time.sleep(3)  # the writer's retries
        finally:
            with postgres_server.connect(database) as dba:
                dba.execute(f"GRANT SELECT, INSERT ON usage_ledger TO {role}")
        await_rows(gateway, headers, start, served, "while refused")
        lines = service_lines(log.read())
    assert not [line for line in lines if "Traceback" in line or "unexpected error" in line], lines
    refused = [line for line in lines if "usage ledger: cannot write rows" in line]
    assert len(refused) == 1 and "permission denied for table usage_ledger" in refused[0], lines
    assert postgres_server.password not in "\n".join(lines)


def test_a_database_read_only_for_a_while_loses_no_row_and_takes_key_writes_again_at_its_reset(least_privilege,
                                                                                              postgres_server):
    """`default_transaction_read_only` on the database (a DBA's maintenance; the gateway's sessions renewed by a
    restart of PostgreSQL meanwhile), then `RESET`, the sessions left as they were: the key store's pooled connections
    and the ledger's kept the setting of the sessions they began in, so admin key writes answered 503 for up to an
    hour (the pool's max_lifetime), and no ledger row was written again until the gateway restarted. Meanwhile chat
    requests, lookups, usage reads and readiness go on; the key writes answer 503, and the writer says once that it
    cannot write. After the RESET, key writes are taken at once and every row is written."""
    gateway, admin, database, role = least_privilege
    headers = {"authorization": f"Bearer {admin}"}
    start = int(time.time())
    create = {"name": "during", "all_models": True}
    with open(gateway.log_path, encoding="utf-8") as log:
        log.seek(0, 2)
        with postgres_server.connect() as dba:
            dba.execute(f'ALTER DATABASE "{database}" SET default_transaction_read_only = on')
            dba.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (database,))
        try:
            served = chats(gateway, headers, 5)
            refused = httpx.post(f"{gateway.base_url}/v1/admin/keys", json=create, headers=headers, timeout=30)
            assert refused.status_code == 503, refused.text
            for path in PATHS:
                assert httpx.get(f"{gateway.base_url}{path}?start_time={start}", headers=headers,
                                 timeout=30).status_code == 200
            # A readiness check under way when the sessions were cut said `unreachable` until the next (every 1 s).
            deadline = time.monotonic() + 5
            while (ready := httpx.get(f"{gateway.base_url}/readyz", timeout=30)).json()["checks"]["keys"] != "ok":
                assert time.monotonic() < deadline, ready.text
                time.sleep(0.2)
            assert ready.status_code == 200, ready.text
            time.sleep(3)  # the writer's retries
        finally:
            with postgres_server.connect() as dba:
                dba.execute(f'ALTER DATABASE "{database}" RESET default_transaction_read_only')
        for n in range(3):
            created = httpx.post(f"{gateway.base_url}/v1/admin/keys", json={**create, "name": f"after-{n}"},
                                 headers=headers, timeout=30)
            assert created.status_code == 200, created.text
        await_rows(gateway, headers, start, served, "while read-only")
        lines = service_lines(log.read())
    assert not [line for line in lines if "Traceback" in line or "unexpected error" in line], lines
    cannot = [line for line in lines if "usage ledger: cannot write rows" in line]
    assert len(cannot) == 1 and "read-only transaction" in cannot[0], lines
    assert len([line for line in lines if "usage ledger: writing again" in line]) == 1, lines
    assert len(lines) <= 6, lines  # those two, the refused key write's, the usage ledger's, readiness's
    assert postgres_server.password not in "\n".join(lines)


def test_usage_reads_held_behind_a_lock_on_the_ledger_hold_up_no_chat_request(least_privilege, postgres_server):
    """A DBA's `LOCK TABLE usage_ledger` (a VACUUM FULL, a long ALTER): each usage read waits for it, up to its 60 s
    bound, one at a time on the ledger's connection. They waited in the threads the server also counts prompts and
    stores images in (asyncio's default executor: 6 threads on 2 cores), so a dashboard's few reads held up every
    chat request to the embedded model for as long as the lock was held. The ledger's calls have a thread of their
    own: chat requests are answered meanwhile, and the reads once the lock is released."""
    gateway, admin, database, role = least_privilege
    headers = {"authorization": f"Bearer {admin}"}
    start = int(time.time())
    with postgres_server.connect(database) as dba, ThreadPoolExecutor(8) as callers:
        with dba.transaction():
            dba.execute("LOCK TABLE usage_ledger IN ACCESS EXCLUSIVE MODE")
            reads = [callers.submit(httpx.get, f"{gateway.base_url}{PATHS[n % 3]}?start_time={start}",
                                    headers=headers, timeout=120) for n in range(8)]
            time.sleep(1)
            asked = time.monotonic()
            answer = httpx.post(f"{gateway.base_url}/v1/chat/completions", json=HI, headers=headers, timeout=60)
            assert answer.status_code == 200, answer.text
            assert time.monotonic() - asked < 5, "a chat request waited for the usage reads held behind the lock"
            time.sleep(max(0.0, asked + 10 - time.monotonic()))  # the lock held ~10 s in all
        assert [read.result().status_code for read in reads] == [200] * 8
