"""Schema migrations on both stores: applied once, in order, atomically, refused on a newer database, and safe when
several hosts start at once."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import sqlite3
import subprocess
import sys
import threading

import pytest

from server.db import Migration, SchemaError, StoreSettings, migrate_postgres, migrate_sqlite
from server.db.migrations import ADVISORY_LOCK_ID
from server.db.database import open_database
from server.db.postgres import connect
from server.db.sqlite import connect_sqlite
from server.keys import open_key_store
from server.keys.schema import MIGRATIONS as KEY_MIGRATIONS
from server.usage.postgres_ledger import PostgresLedger
from server.usage.schema import MIGRATIONS as USAGE_MIGRATIONS
from tests.postgres_support import PASSWORD_ENV


def _migrations(*extra_postgres: str, failing: bool = False) -> tuple[Migration, ...]:
    bad = ("INSERT INTO nowhere VALUES (1)",) if failing else ()
    return (
        Migration("widgets", 1, "widgets", sqlite=("CREATE TABLE widgets (id INTEGER PRIMARY KEY)",),
                  postgresql=("CREATE TABLE widgets (id INTEGER PRIMARY KEY)", *extra_postgres)),
        Migration("widgets", 2, "widget names", sqlite=("ALTER TABLE widgets ADD COLUMN name TEXT", *bad),
                  postgresql=("ALTER TABLE widgets ADD COLUMN name TEXT", *bad)),
    )


class SqliteBackend:
    def __init__(self, tmp_path):
        self.path = tmp_path / "keys.db"

    def connect(self):
        return connect_sqlite(self.path)

    def migrate(self, migrations, newer_ok=False):
        with _closing(self.connect()) as db:
            return migrate_sqlite(db, migrations, newer_ok=newer_ok)

    def tables(self):
        with _closing(self.connect()) as db:
            return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}

    def columns(self, table):
        with _closing(self.connect()) as db:
            return {r[1] for r in db.execute(f"PRAGMA table_info({table})")}


class PostgresBackend:
    def __init__(self, url):
        self.settings = StoreSettings(url=url, password_env=PASSWORD_ENV)

    def connect(self):
        return connect(self.settings, statement_timeout=False)

    def migrate(self, migrations, newer_ok=False):
        with self.connect() as conn:
            return migrate_postgres(conn, migrations, newer_ok=newer_ok)

    def tables(self):
        with self.connect() as conn:
            return {r[0] for r in conn.execute("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")}

    def columns(self, table):
        with self.connect() as conn:
            return {r[0] for r in conn.execute(
                "SELECT column_name FROM information_schema.columns WHERE table_name = %s", (table,))}


class _closing:
    def __init__(self, db):
        self.db = db

    def __enter__(self):
        return self.db

    def __exit__(self, *exc):
        self.db.close()


@pytest.fixture(params=["sqlite", "postgresql"])
def backend(request, tmp_path):
    if request.param == "sqlite":
        return SqliteBackend(tmp_path)
    return PostgresBackend(request.getfixturevalue("postgres_url"))


def test_migrations_apply_in_order_once(backend):
    assert backend.migrate(_migrations()) == [1, 2]
    assert {"widgets", "schema_migrations"} <= backend.tables()
    assert backend.columns("widgets") == {"id", "name"}
    assert backend.migrate(_migrations()) == []  # a restart, or a second host: nothing left to do


def test_an_upgrade_applies_only_the_new_migrations(backend):
    assert backend.migrate(_migrations()[:1]) == [1]
    assert backend.columns("widgets") == {"id"}
    assert backend.migrate(_migrations()) == [2]
    assert backend.columns("widgets") == {"id", "name"}


def test_a_failed_migration_leaves_nothing_behind(backend):
    with pytest.raises((sqlite3.Error, SchemaError)):  # PostgreSQL's error, as the one line a start ends with
        backend.migrate(_migrations(failing=True))
    assert "widgets" not in backend.tables()
    assert backend.migrate(_migrations()) == [1, 2]  # fixed code migrates cleanly afterwards


def test_a_database_newer_than_the_code_is_refused(backend):
    backend.migrate(_migrations())
    with pytest.raises(SchemaError, match="widgets schema is at version 2, newer than this Portico knows"):
        backend.migrate(_migrations()[:1])


def test_a_restarted_worker_uses_a_database_newer_than_its_code_as_it_is(backend):
    """tests/e2e/test_rolling_upgrade.py: its siblings use it already; nothing is changed or recorded."""
    backend.migrate(_migrations())
    assert backend.migrate(_migrations()[:1], newer_ok=True) == []
    assert backend.columns("widgets") == {"id", "name"}


def test_components_keep_their_own_versions(backend):
    backend.migrate(_migrations())
    assert backend.migrate(KEY_MIGRATIONS) == [m.version for m in KEY_MIGRATIONS]
    assert {"api_keys", "retired_secrets", "widgets"} <= backend.tables()


def test_misnumbered_migrations_are_a_programming_error(backend):
    first, second = _migrations()
    with pytest.raises(ValueError, match="numbered 1, 2, 3"):
        backend.migrate((second, first))


def test_hosts_starting_at_once_migrate_once(postgres_url):
    """Four "hosts" migrate the same database at the same moment; the slow first migration makes them overlap.
    Without the lock, the losers would fail on CREATE TABLE or record versions twice."""
    backend = PostgresBackend(postgres_url)
    migrations = _migrations("SELECT pg_sleep(0.3)")
    results, errors, barrier = [], [], threading.Barrier(4)

    def host():
        barrier.wait()
        try:
            results.append(backend.migrate(migrations))
        except Exception as exc:  # noqa: BLE001 - the test reports any failure
            errors.append(exc)

    threads = [threading.Thread(target=host) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sorted(results) == [[], [], [], [1, 2]]
    with backend.connect() as conn:
        assert conn.execute("SELECT count(*) FROM schema_migrations WHERE component = 'widgets'").fetchone()[0] == 2


def test_sqlite_keys_db_made_before_schema_versions_is_adopted(tmp_path):
    """A keys.db written by Portico before migrations existed keeps its keys."""
    db = sqlite3.connect(tmp_path / "keys.db")
    db.executescript(
        "CREATE TABLE api_keys (id TEXT PRIMARY KEY, name TEXT NOT NULL, secret_hash TEXT NOT NULL UNIQUE, "
        "all_models INTEGER NOT NULL, models TEXT NOT NULL, env TEXT NOT NULL DEFAULT '', admin INTEGER NOT NULL "
        "DEFAULT 0, created INTEGER NOT NULL, revoked_at INTEGER NOT NULL DEFAULT 0, requests_per_minute INTEGER, "
        "tokens_per_minute INTEGER, concurrent_requests INTEGER, daily_tokens INTEGER, daily_requests INTEGER);"
        "CREATE TABLE retired_secrets (secret_hash TEXT PRIMARY KEY, key_id TEXT NOT NULL, expires_at INTEGER NOT "
        "NULL);"
        "INSERT INTO api_keys (id, name, secret_hash, all_models, models, created) VALUES ('key_1', 'old', 'h', 1, "
        "'', 1);"
    )
    db.close()
    backend = SqliteBackend(tmp_path)
    assert backend.migrate(KEY_MIGRATIONS) == [m.version for m in KEY_MIGRATIONS]
    with _closing(backend.connect()) as db:
        assert db.execute("SELECT name FROM api_keys").fetchall() == [("old",)]


def test_a_keys_db_from_before_budgets_gets_the_budget_columns(tmp_path):
    """Upgraded in place: the old keys stay, and budgets can be set on them."""
    test_sqlite_keys_db_made_before_schema_versions_is_adopted(tmp_path)
    with _closing(connect_sqlite(tmp_path / "keys.db")) as db:
        db.execute("UPDATE api_keys SET max_spend_day = 5000000 WHERE id = 'key_1'")
        assert db.execute("SELECT name, max_spend_day FROM api_keys").fetchall() == [("old", 5000000)]


def test_a_read_only_keys_db_is_checked_not_migrated(tmp_path):
    """A command that only reads a keys.db it may not write (connect_sqlite(read_only=True)) applies nothing: a
    schema this code can read is used, one that needs a migration is refused in words saying how to bring it up."""
    path = tmp_path / "keys.db"
    with _closing(connect_sqlite(path)) as db:
        migrate_sqlite(db, _migrations()[:1])
    with _closing(connect_sqlite(path, read_only=True)) as db:
        assert migrate_sqlite(db, _migrations()[:1], read_only=True) == []
        with pytest.raises(SchemaError, match=r"widgets schema is older than this Portico's.*`portico serve`"):
            migrate_sqlite(db, _migrations(), read_only=True)
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            db.execute("INSERT INTO widgets VALUES (1)")
    with _closing(connect_sqlite(path)) as db:
        assert db.execute("SELECT max(version) FROM schema_migrations").fetchone() == (1,)


@pytest.mark.parametrize("command", [("keys", "list"), ("serve",)])
def test_a_keys_db_newer_than_the_code_stops_the_cli_with_one_line(tmp_path, command):
    """An operator who rolled back saw a traceback; the message alone says what to do."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    with _closing(connect_sqlite(data_dir / "keys.db")) as db:
        migrate_sqlite(db, KEY_MIGRATIONS)
        db.execute("INSERT INTO schema_migrations VALUES ('keys', 99, 'from a newer Portico', 0)")
        db.commit()
    # A private TMPDIR: serve sweeps the run directories that killed serves left there, and says so (one more line)
    done = subprocess.run([sys.executable, "-m", "server.cli", "--data-dir", str(data_dir), *command],
                          capture_output=True, text=True, timeout=60, env={**os.environ, "TMPDIR": str(tmp_path)})
    assert done.returncode == 1
    assert done.stderr.splitlines() == [
        "portico: the database's keys schema is at version 99, newer than this Portico knows "
        f"({KEY_MIGRATIONS[-1].version}): upgrade Portico on this host"]


async def test_a_postgres_database_newer_than_the_code_leaves_nothing_running(postgres_url):
    """A host older than the shared database refuses to start; the connection pool it had begun must be closed with
    it, or the process hangs on exit (asyncio waits for the pool's tasks, which retry a cancelled connect forever)."""
    settings = StoreSettings(url=postgres_url, password_env=PASSWORD_ENV)
    await (await open_database(settings, KEY_MIGRATIONS)).close()  # migrated by a newer Portico ...
    before = asyncio.all_tasks()
    with pytest.raises(SchemaError, match="keys schema is at version 2, newer than this Portico knows"):
        await open_database(settings, KEY_MIGRATIONS[:1])  # ... than this one, which knows only version 1
    await asyncio.sleep(0.1)
    assert [task for task in asyncio.all_tasks() - before if not task.done()] == []


async def test_a_database_found_newer_after_an_outage_is_unavailable_not_a_server_error(postgres_server):
    """A host that started while PostgreSQL was down checks the schema when it first reaches it. Found newer than the
    code, every key lookup, admin call and usage read was a 500 `internal_error` (and readiness a traceback a second);
    it is the store being unusable to this host: 503 with retry-after, the reason logged."""
    from server.db.database import StoreUnavailable
    from server.usage.postgres_ledger import PostgresLedger
    from server.usage.query import UsageQuery

    settings = StoreSettings(url=postgres_server.new_database(), password_env=PASSWORD_ENV, timeout_seconds=1)
    await (await open_database(settings, KEY_MIGRATIONS)).close()
    PostgresLedger(settings).close()
    with connect(settings) as conn:
        conn.execute("INSERT INTO schema_migrations VALUES ('keys', 99, 'from a newer Portico', 0)")
        conn.execute("INSERT INTO schema_migrations VALUES ('usage', 99, 'from a newer Portico', 0)")
    postgres_server.stop()
    try:
        database = await open_database(settings, KEY_MIGRATIONS)
        ledger = PostgresLedger(settings)
    finally:
        postgres_server.start()
    try:
        for _ in range(2):  # and again: not a migration attempt per request
            with pytest.raises(StoreUnavailable, match="keys schema is at version 99"):
                await database.fetch_one("SELECT 1")
            with pytest.raises(StoreUnavailable, match="usage schema is at version 99"):
                ledger.aggregate(UsageQuery(start_ms=0, end_ms=60_000, width_ms=60_000))
    finally:
        await database.close()
        ledger.close()


def _open_like_a_worker(path, barrier) -> None:
    """What each server process does with keys.db at start: the key store's connection, then the ledger's (a forked
    child: it imports nothing, as another thread of the test process may hold the import lock)."""
    barrier.wait()
    for migrations in (KEY_MIGRATIONS, USAGE_MIGRATIONS):
        with _closing(connect_sqlite(path)) as db:
            migrate_sqlite(db, migrations)


def test_worker_processes_starting_on_a_new_data_dir_all_open_keys_db(tmp_path):
    """`serve --workers 2` on a new data dir: both workers create keys.db at once. The switch to WAL met the other
    worker's lock, failed at once ("database is locked"), and one worker exited, so the gateway did not start (in
    about one start of three)."""
    context = multiprocessing.get_context("fork")
    for attempt in range(20):
        path = tmp_path / f"keys-{attempt}.db"
        barrier = context.Barrier(2)
        workers = [context.Process(target=_open_like_a_worker, args=(path, barrier)) for _ in range(2)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(timeout=60)
        assert [worker.exitcode for worker in workers] == [0, 0], f"start {attempt} failed"


@pytest.mark.parametrize("command", [("keys", "list"), ("usage",)])
def test_a_postgres_migration_that_fails_is_one_line_and_exit_1(postgres_server, tmp_path, command):
    """Upgrading with a role that may not change the schema (here: no CREATE in it) printed psycopg's traceback."""
    url = postgres_server.new_database()
    database = url.rsplit("/", 1)[1]
    with postgres_server.connect(database) as conn:
        migrate_postgres(conn, KEY_MIGRATIONS[:1])  # as an older Portico left them
        migrate_postgres(conn, USAGE_MIGRATIONS[:1])
        conn.execute(f"CREATE ROLE {database}_app LOGIN PASSWORD '{postgres_server.password}'")
        conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {database}_app")
        conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    config = tmp_path / "c.yaml"
    app_url = url.replace("postgres@", f"{database}_app@")
    config.write_text(f"keys: {{store: '{app_url}', password_env: {PASSWORD_ENV}}}\n"
                      "models: [{id: a, endpoint: /v1/chat/completions, provider: {kind: llamacpp}}]\n")
    done = subprocess.run([sys.executable, "-m", "server.cli", "--config", str(config), *command],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    table = "usage_ledger" if command == ("usage",) else "api_keys"  # the next migration alters it
    assert done.stderr.splitlines() == [
        f"portico: the database's {'usage' if command == ('usage',) else 'keys'} schema could not be brought "
        f"to this Portico's (nothing was changed): must be owner of table {table}"]


@pytest.mark.parametrize("command", [("keys", "list"), ("usage",)])
def test_a_role_without_create_serves_a_database_already_up_to_date(postgres_server, tmp_path, command):
    """Least privilege: the tables made by an owner, the gateway's role may only read and write them. Every start
    still ran `CREATE TABLE IF NOT EXISTS schema_migrations`, which PostgreSQL refuses without CREATE in the schema
    even when the table is there: such a role could never start Portico."""
    url = postgres_server.new_database()
    database = url.rsplit("/", 1)[1]
    with postgres_server.connect(database) as conn:
        migrate_postgres(conn, KEY_MIGRATIONS)
        migrate_postgres(conn, USAGE_MIGRATIONS)
        conn.execute(f"CREATE ROLE {database}_rw LOGIN PASSWORD '{postgres_server.password}'")
        conn.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {database}_rw")
        conn.execute("REVOKE CREATE ON SCHEMA public FROM PUBLIC")
    config = tmp_path / "c.yaml"
    store = url.replace("postgres@", f"{database}_rw@")
    config.write_text(f"keys: {{store: '{store}', password_env: {PASSWORD_ENV}}}\n"
                      "models: [{id: a, endpoint: /v1/chat/completions, provider: {kind: llamacpp}}]\n")
    done = subprocess.run([sys.executable, "-m", "server.cli", "--config", str(config), *command],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_a_keys_db_made_with_budgets_before_schema_versions_is_upgraded_in_place(tmp_path):
    """Portico between budgets (9c031ca) and schema versions (e65cf68) made api_keys with the budget columns already:
    migration 2, adding them, stopped every start and `portico keys` on such a data dir with 'duplicate column
    name: max_spend_day'. Now the columns found there are taken for migration 2, and the keys keep their budgets."""
    data_dir = tmp_path / "data"
    data_dir.mkdir()
    db = sqlite3.connect(data_dir / "keys.db")
    db.executescript(  # as server/keys/store.py at 9c031ca wrote it
        "CREATE TABLE api_keys (id TEXT PRIMARY KEY, name TEXT NOT NULL, secret_hash TEXT NOT NULL UNIQUE, "
        "all_models INTEGER NOT NULL, models TEXT NOT NULL, env TEXT NOT NULL DEFAULT '', admin INTEGER NOT NULL "
        "DEFAULT 0, created INTEGER NOT NULL, revoked_at INTEGER NOT NULL DEFAULT 0, requests_per_minute INTEGER, "
        "tokens_per_minute INTEGER, concurrent_requests INTEGER, daily_tokens INTEGER, daily_requests INTEGER, "
        "max_spend_day INTEGER, max_spend_month INTEGER);"
        "CREATE TABLE retired_secrets (secret_hash TEXT PRIMARY KEY, key_id TEXT NOT NULL, expires_at INTEGER NOT "
        "NULL);"
        "INSERT INTO api_keys (id, name, secret_hash, all_models, models, env, created, max_spend_day) VALUES "
        "('key_0123456789abcdef', 'old', 'h', 1, '', 'prod', 1, 5000000);"
    )
    db.close()
    done = subprocess.run([sys.executable, "-m", "server.cli", "--data-dir", str(data_dir), "keys", "list"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "key_0123456789abcdef" in done.stdout
    with _closing(connect_sqlite(data_dir / "keys.db")) as db:
        assert db.execute("SELECT max_spend_day FROM api_keys").fetchall() == [(5000000,)]
        assert {r[0] for r in db.execute("SELECT version FROM schema_migrations WHERE component = 'keys'")} == {
            m.version for m in KEY_MIGRATIONS}


async def test_a_dba_statement_and_lock_timeout_do_not_fail_a_host_waiting_for_another_hosts_migration(
        postgres_server, postgres_url):
    """A DBA set `statement_timeout` and `lock_timeout` on the database (or role): migrations, meant to go without a
    statement timeout, inherited them, so a host starting while another migrated (the advisory lock held a few
    seconds) logged the key store "unreachable" (`canceling statement due to lock timeout`) and answered 503; a
    migration longer than the DBA's bound would have failed on every start. The migrations' connection now waits."""
    name = postgres_url.rsplit("/", 1)[1]
    with postgres_server.connect() as admin:
        admin.execute(f'ALTER DATABASE "{name}" SET statement_timeout = 300')
        admin.execute(f'ALTER DATABASE "{name}" SET lock_timeout = 200')
    settings = StoreSettings(url=postgres_url, password_env=PASSWORD_ENV, timeout_seconds=2)
    with postgres_server.connect(name) as other_host:  # mid-migration: holds the migrations' lock for 1.5 s
        other_host.execute("SET statement_timeout = 0")
        with other_host.transaction():
            other_host.execute("SELECT pg_advisory_xact_lock(%s)", (ADVISORY_LOCK_ID,))
            opening = asyncio.create_task(open_key_store(settings))
            await asyncio.sleep(1.5)
            assert not opening.done()  # waiting for the other host's migration, not failed
    store = await opening
    try:
        assert (await store.create("after", all_models=True))[0].name == "after"
    finally:
        await store.close()
    ledger = PostgresLedger(settings)  # the ledger's migrations too
    try:
        assert ledger.rows() == []
    finally:
        ledger.close()
