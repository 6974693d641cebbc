"""The usage ledger's two sinks, real SQLite and real PostgreSQL: rows stored once, the same totals from the same
SQL, retention, a PostgreSQL outage survived by the writer, and a schema upgrade that keeps existing rows."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from server.db import StoreSettings
from server.db.database import StoreUnavailable
from server.usage import postgres_ledger
from server.usage.postgres_ledger import PostgresLedger
from server.usage.query import RowQuery, UsageQuery, aggregate_sql
from server.usage.settings import UsageSettings
from server.usage.sqlite_ledger import SqliteLedger
from server.usage.stores import open_ledger
from server.usage.writer import LedgerWriter
from tests.postgres_support import PASSWORD_ENV
from tests.unit.test_ledger_writer import NOW_MS, row


@pytest.fixture(params=["sqlite", "postgresql"])
def ledger(request, tmp_path):
    if request.param == "sqlite":
        settings = StoreSettings(sqlite_path=tmp_path / "keys.db")
    else:
        settings = StoreSettings(url=request.getfixturevalue("postgres_url"), password_env=PASSWORD_ENV)
    ledger = open_ledger(settings)
    yield ledger
    ledger.close()


def test_rows_are_stored_once_and_summed_by_bucket_and_group(ledger):
    t0 = NOW_MS - NOW_MS % 1000
    assert ledger.write([row(1, at_ms=t0), row(2, at_ms=t0 + 10, model="n", cost_micros=3, key_id="key_b")]) == 2
    # How many it stored: a row written again (a retry, a dead process's spool) is not counted twice in
    # portico_ledger_rows_written_total.
    assert ledger.write([row(2, at_ms=t0 + 10, model="n", cost_micros=3, key_id="key_b"),
                         row(3, at_ms=t0 + 1500, status=502, code="x")]) == 1
    assert [r.id for r in ledger.rows()] == ["r1", "r2", "r3"]
    totals = ledger.aggregate(UsageQuery(t0, t0 + 2000, 1000, group_by=("model", "api_key_id")))
    assert [(t.bucket, t.model, t.key_id, t.input_tokens, t.cost_micros, t.rows, t.errors) for t in totals] == [
        (0, "m", "key_a", 10, 7, 1, 0), (0, "n", "key_b", 10, 3, 1, 0), (1, "m", "key_a", 10, 7, 1, 1)]
    assert all(type(v) is int for t in totals for v in (t.bucket, t.cost_micros, t.rows))
    assert ledger.prune(t0 + 1000, 1) == 1  # at most a batch per statement
    assert ledger.prune(t0 + 1000, 10) == 1
    assert [r.id for r in ledger.rows()] == ["r3"]


def test_costs_equal_sql_over_the_rows_without_the_latency_histogram_only_completions_show(ledger):
    """The costs (and `portico usage`) totals: the same sums over the rows as ever, without the 15-bound latency
    histogram that only completions' percentiles use (it was about 40 % of a costs query's time)."""
    t0 = NOW_MS - NOW_MS % 60_000
    rows = [row(n, at_ms=t0 + n * 7_000, key_id=f"key_{n % 3}", model="mn"[n % 2], cost_micros=n * 1_001,
                input_tokens=n, output_tokens=2 * n, status=(200, 500, 429)[n % 3], upstream_attempts=int(n % 3 != 2),
                latency_ms=float(n * 40)) for n in range(30)]
    ledger.write(rows)
    costs = UsageQuery(t0, t0 + 240_000, 60_000, group_by=("api_key_id", "model"))
    assert "latency_ms" not in aggregate_sql(costs, "?")[0] and "latency_ms" in aggregate_sql(
        dataclasses.replace(costs, latency=True), "?")[0]
    expected = {}
    for r in rows:
        sums = expected.setdefault(((r.at_ms - t0) // 60_000, r.model, r.key_id), [0] * 5)
        for i, value in enumerate((r.cost_micros, r.input_tokens, r.output_tokens, 1, int(r.status >= 400))):
            sums[i] += value
    totals = ledger.aggregate(costs)
    assert {(t.bucket, t.model, t.key_id): [t.cost_micros, t.input_tokens, t.output_tokens, t.rows, t.errors]
            for t in totals} == expected
    assert all(t.latency == () for t in totals)
    timed = ledger.aggregate(dataclasses.replace(costs, latency=True))
    assert [dataclasses.replace(t, latency=()) for t in timed] == totals and all(t.latency for t in timed)


def test_a_filter_value_holding_a_nul_matches_no_row_in_either_store(ledger):
    """`?models=%00` on the usage API: PostgreSQL text holds no NUL and refuses to compare with one, which was a 500;
    like SQLite, such a value matches no row, and the filter's other values still do."""
    ledger.write([row(1, at_ms=NOW_MS), row(2, at_ms=NOW_MS, model="n", key_id="key_b")])
    usage = UsageQuery(0, NOW_MS + 1000, 3_600_000, group_by=("model",))
    assert ledger.aggregate(dataclasses.replace(usage, models=("\x00",))) == []
    [kept] = ledger.aggregate(dataclasses.replace(usage, models=("n\x00", "m"), envs=("prod", "\x00")))
    assert (kept.model, kept.rows) == ("m", 1)
    rows = RowQuery(0, NOW_MS + 1000, limit=10)
    assert ledger.recent(dataclasses.replace(rows, key_ids=("key_b\x00",))) == []
    assert [r.id for r in ledger.recent(dataclasses.replace(rows, key_ids=("\x00", "key_b")))] == ["r2"]


async def test_a_row_either_store_refuses_is_left_out_and_the_rest_written(ledger):
    """A value beyond the column's 64 bits is refused by SQLite (in the driver) and PostgreSQL (by the server) as
    RowsRefused, which the writer takes row by row: the others are stored, not retried behind it forever."""
    writer = LedgerWriter(ledger, UsageSettings(flush_seconds=30, batch_rows=10, buffer_rows=10))
    for n in range(3):
        writer.append(row(n, input_tokens=2**64 if n == 1 else 10))
    assert await writer.flush()
    assert sorted(r.id for r in ledger.rows()) == ["r0", "r2"]
    assert writer.pending == 0


async def test_the_writer_waits_out_a_postgresql_outage(postgres_server, postgres_url):
    ledger = PostgresLedger(StoreSettings(url=postgres_url, password_env=PASSWORD_ENV, timeout_seconds=1.0))
    dropped = []
    writer = LedgerWriter(ledger, UsageSettings(flush_seconds=0.05, batch_rows=2, buffer_rows=10),
                          on_dropped=dropped.append)
    writer.start()
    writer.append(row(1))
    await asyncio.sleep(0.3)
    assert [r.id for r in ledger.rows()] == ["r1"]
    postgres_server.stop()
    try:
        for n in range(2, 5):
            writer.append(row(n))
        await asyncio.sleep(0.5)
        assert writer.pending == 3  # waiting, not lost
    finally:
        postgres_server.start()
    for _ in range(300):
        if writer.pending == 0:
            break
        await asyncio.sleep(0.05)
    await writer.close()
    assert [r.id for r in ledger.rows()] == ["r1", "r2", "r3", "r4"] and dropped == []
    ledger.close()



def test_the_first_read_after_a_postgresql_restart_is_answered(postgres_server, postgres_url):
    """PostgreSQL restarted while the ledger's connection was idle: the next usage read was a 503 (`The usage ledger
    is unreachable`) although the database was up again; a connection found broken is replaced before giving up."""
    ledger = PostgresLedger(StoreSettings(url=postgres_url, password_env=PASSWORD_ENV, timeout_seconds=1.0))
    ledger.write([row(1)])
    postgres_server.stop()
    postgres_server.start()
    try:
        assert [r.id for r in ledger.recent(RowQuery(0, NOW_MS + 1000, limit=10))] == ["r1"]
        ledger.write([row(2)])
        assert [r.id for r in ledger.rows()] == ["r1", "r2"]
    finally:
        ledger.close()


@pytest.mark.usefixtures("no_collector_pauses")
def test_a_postgresql_that_stops_answering_is_unavailable_within_about_the_store_timeout(postgres_server, postgres_url):
    """A hung database (connections accepted, nothing answered): a usage read hung for as long as the database did,
    holding the ledger's one connection, and the writer behind it; it is a 503 (StoreUnavailable) within about
    twice store_timeout_seconds, as the key store's calls are."""
    ledger = PostgresLedger(StoreSettings(url=postgres_url, password_env=PASSWORD_ENV, timeout_seconds=1.0))
    ledger.write([row(1)])
    reading = ThreadPoolExecutor(1)
    try:
        with postgres_server.paused():
            started = time.monotonic()
            read = reading.submit(ledger.aggregate, UsageQuery(0, NOW_MS + 1000, 60_000))
            with pytest.raises(StoreUnavailable):
                read.result(timeout=10)
            assert time.monotonic() - started < 2 * 1.0 + 1.0
        assert [r.id for r in ledger.rows()] == ["r1"]  # and answered again once the database is
    finally:
        reading.shutdown(wait=True)
        ledger.close()

def test_a_ledger_from_before_schema_versions_keeps_its_rows(tmp_path):
    """The first ledger (before migrations) created its table itself; version 1 adopts it as it is."""
    db = sqlite3.connect(tmp_path / "keys.db")
    db.executescript(
        "CREATE TABLE usage_ledger (id TEXT PRIMARY KEY, at_ms BIGINT NOT NULL, request_id TEXT NOT NULL, "
        "key_id TEXT NOT NULL, env TEXT NOT NULL, endpoint TEXT NOT NULL, model TEXT NOT NULL, upstream TEXT NOT "
        "NULL, status INTEGER NOT NULL, code TEXT NOT NULL, input_tokens BIGINT NOT NULL, output_tokens BIGINT NOT "
        "NULL, cached_input_tokens BIGINT NOT NULL, images INTEGER NOT NULL, cost_micros BIGINT NOT NULL, "
        "upstream_attempts INTEGER NOT NULL, latency_ms DOUBLE PRECISION NOT NULL, first_token_ms DOUBLE PRECISION);"
        f"INSERT INTO usage_ledger VALUES ('old', {NOW_MS}, 'req', 'key_a', '', '/v1/messages', 'm', 'm', 200, '', "
        "1, 2, 0, 0, 9, 1, 5.0, NULL);"
    )
    db.close()
    ledger = SqliteLedger(tmp_path / "keys.db")
    ledger.write([row(1)])
    assert [(r.id, r.cost_micros) for r in ledger.rows()] == [("old", 9), ("r1", 7)]
    ledger.close()


def test_recent_rows_newest_first_after_a_cursor(ledger):
    ledger.write([row(1, at_ms=NOW_MS), row(2, at_ms=NOW_MS + 5), row(3, at_ms=NOW_MS + 5, status=429, code="x"),
                  row(4, at_ms=NOW_MS + 9, key_id="key_b")])
    window = dict(start_ms=NOW_MS, end_ms=NOW_MS + 10)
    assert [r.id for r in ledger.recent(RowQuery(**window, limit=10, key_ids=("key_a",)))] == ["r3", "r2", "r1"]
    assert [r.id for r in ledger.recent(RowQuery(**window, limit=10, before=(NOW_MS + 5, "r3")))] == ["r2", "r1"]
    assert [r.id for r in ledger.recent(RowQuery(**window, limit=1, errors_only=True))] == ["r3"]


def test_results_come_in_the_same_order_from_either_store_whatever_the_databases_collation(postgres_server,
                                                                                           tmp_path):
    """The usage API's results within a bucket came in the database's collation order: the same rows answered
    `GPT-4o, Zeta, a-b, a_b, claude` from SQLite and `a_b, a-b, claude, gpt-4o, GPT-4o, Zeta` from a PostgreSQL
    database made with an en-US locale (as most are). Now both answer in the order of the values' code points."""
    url = postgres_server.url("usage_en_us")
    with postgres_server.connect() as conn:
        conn.execute("CREATE DATABASE usage_en_us TEMPLATE template0 LOCALE_PROVIDER icu ICU_LOCALE 'en-US' "
                     "LOCALE 'C.utf8'")
    names = ["gpt-4o", "GPT-4o", "claude", "Zeta", "a-b", "a_b", "é"]
    rows = [row(n, model=name, key_id=f"key_{name}", env=name.upper()) for n, name in enumerate(names)]
    stores = [SqliteLedger(tmp_path / "keys.db"), PostgresLedger(StoreSettings(url=url, password_env=PASSWORD_ENV))]
    try:
        answers = []
        for store in stores:
            store.write(rows)
            answers.append([store.aggregate(UsageQuery(NOW_MS, NOW_MS + 10, 10, group_by=groups))
                            for groups in (("model",), ("api_key_id",), ("project_id",), ("project_id", "model"))])
    finally:
        for store in stores:
            store.close()
    assert [t.model for t in answers[0][0]] == sorted(names)
    assert answers[0] == answers[1]


def test_postgresql_keys_and_ledger_upgrade_in_place_keeping_rows(postgres_url):
    """A database at keys version 1 (before budgets) with a key in it: opening the ledger and upgrading the keys
    schema keeps the key, adds the budget columns, and the ledger's rows are kept across a reopen."""
    from server.db import migrate_postgres
    from server.db.postgres import connect
    from server.keys.schema import MIGRATIONS as KEY_MIGRATIONS

    settings = StoreSettings(url=postgres_url, password_env=PASSWORD_ENV)
    with connect(settings) as conn:
        migrate_postgres(conn, KEY_MIGRATIONS[:1])
        conn.execute("INSERT INTO api_keys (id, name, secret_hash, all_models, models, created) "
                     "VALUES ('key_1', 'old', 'h', TRUE, '', 1)")
    ledger = PostgresLedger(settings)
    ledger.write([row(1)])
    ledger.close()
    with connect(settings) as conn:
        assert migrate_postgres(conn, KEY_MIGRATIONS) == [2]
        conn.execute("UPDATE api_keys SET max_spend_day = 5000000")
        assert conn.execute("SELECT name, max_spend_day FROM api_keys").fetchall() == [("old", 5_000_000)]
    reopened = PostgresLedger(settings)
    assert [r.id for r in reopened.rows()] == ["r1"]
    reopened.close()


def test_a_postgresql_retention_batch_reads_the_rows_it_deletes_not_the_whole_ledger(postgres_server, postgres_url):
    """`DELETE ... WHERE id IN (SELECT id ... LIMIT n)` was planned as a hash join over a sequential scan of the whole
    table: each batch of 10,000 read every row (346 ms on 1.5 million rows, a full pass of the table per batch, so
    the retention pass grew with the square of the ledger). The batch's ids now reach the primary key's index."""
    PostgresLedger(StoreSettings(url=postgres_url, password_env=PASSWORD_ENV)).close()  # the schema
    with postgres_server.connect(postgres_url.rsplit("/", 1)[1]) as db:
        db.execute("INSERT INTO usage_ledger SELECT 'r' || g, g, 'req', 'key_' || (g % 7), 'e', "
                   "'/v1/chat/completions', 'm', 'm', 200, '', 10, 5, 0, 0, 3, 1, 12.5, 3.0, 'd' "
                   "FROM generate_series(1, 200000) g")
        db.execute("ANALYZE usage_ledger")
        plan = "\n".join(row[0] for row in db.execute(
            "EXPLAIN " + postgres_ledger._PRUNE.replace("%s", "{}").format(100_000, 10_000)))
    assert "Seq Scan" not in plan, plan


def test_a_big_postgresql_ledger_is_read_and_pruned_past_the_store_timeout(postgres_server, postgres_url,
                                                                          monkeypatch):
    """keys.store_timeout_seconds (2 s) bounds key lookups; the ledger used it for every statement, so on a few
    million rows a month's usage query was cancelled (a 503 "unreachable" to dashboards) and the hourly retention
    pass failed every hour, the ledger growing for ever. Here the same with a 0.1 s timeout on 700,000 rows (a read
    of ~0.2 s). Not smaller: the watchdog's probe connects within the store timeout, which a loaded machine misses
    at 20 ms, and a healthy database's read was cut. The last batch, which finds nothing left to delete, was a scan
    of the whole table (63-106 ms here): cut by the timeout, it failed the pass."""
    ledger = PostgresLedger(StoreSettings(url=postgres_url, password_env=PASSWORD_ENV, timeout_seconds=0.1))
    with postgres_server.connect(postgres_url.rsplit("/", 1)[1]) as fill:  # in SQL: 700,000 rows in ~2.5 s
        fill.execute("INSERT INTO usage_ledger SELECT 'r' || g, g, 'req', 'key_' || (g % 7), 'e', "
                     "'/v1/chat/completions', 'm', 'm', 200, '', 10, 5, 0, 0, 3, 1, 12.5, 3.0, 'd' "
                     "FROM generate_series(1, 700000) g")
    (total,) = ledger.aggregate(UsageQuery(0, 1_000_000, 1_000_000, group_by=()))
    assert (total.rows, total.cost_micros) == (700_000, 2_100_000)
    deleted = [ledger.prune(40_001, 500) for _ in range(81)]  # as the writer's passes do, a batch each
    assert sum(deleted) == 40_000 and deleted[-2:] == [500, 0]
    (total,) = ledger.aggregate(UsageQuery(0, 1_000_000, 1_000_000, group_by=()))
    assert total.rows == 660_000
    ledger.close()


def test_a_usage_read_behind_a_table_lock_is_refused_once_its_statement_timeout_runs_out(postgres_server,
                                                                                        postgres_url, monkeypatch):
    """A DBA's long `LOCK TABLE usage_ledger` (or a long transaction holding one): the usage API's read was cancelled
    by its 60 s statement timeout, then run again on a new connection as if a restart had cut the old one, and the
    dashboard waited 120 s for its 503. A statement PostgreSQL cancelled is its answer: one try. (The read's bound is
    made 2 s here.) The rows written while the lock was held are stored once it is released."""
    monkeypatch.setattr(postgres_ledger, "READ_TIMEOUT_MS", 2_000)
    ledger = PostgresLedger(StoreSettings(url=postgres_url, password_env=PASSWORD_ENV, timeout_seconds=1.0))
    ledger.write([row(1)])
    with postgres_server.connect(postgres_url.rsplit("/", 1)[1]) as locker:
        with locker.transaction():
            locker.execute("LOCK TABLE usage_ledger IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            with pytest.raises(StoreUnavailable):
                ledger.aggregate(UsageQuery(0, NOW_MS + 1000, 60_000))
            assert time.monotonic() - started < 2.0 + 1.5
            with pytest.raises(StoreUnavailable):  # a write waits its store timeout, then its batch is retried
                ledger.write([row(2)])
    ledger.write([row(2)])
    assert [r.id for r in ledger.rows()] == ["r1", "r2"]
    ledger.close()


def _role_of(postgres_server, url: str) -> tuple[str, str, str]:
    """A role that only reads and writes the tables of the (migrated) database at `url`: (its URL, the database's
    name, the role's name)."""
    database = url.rsplit("/", 1)[1]
    role = f"{database}_rw"
    with postgres_server.connect(database) as dba:
        dba.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{postgres_server.password}'")
        dba.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
    return url.replace("postgres@", f"{role}@"), database, role


def test_a_role_refused_the_ledger_is_unavailable_not_a_driver_error(postgres_server, postgres_url):
    """`REVOKE ... ON usage_ledger` (SQLSTATE 42501): psycopg's InsufficientPrivilege went up as it was, a 500 for the
    usage API and a traceback for `portico usage`. It is the ledger's StoreUnavailable (a 503 with retry-after, one
    line), saying the role was refused; the rows written meanwhile wait, and are stored once it is granted again."""
    PostgresLedger(StoreSettings(url=postgres_url, password_env=PASSWORD_ENV)).close()  # the owner migrates
    url, database, role = _role_of(postgres_server, postgres_url)
    ledger = PostgresLedger(StoreSettings(url=url, password_env=PASSWORD_ENV, timeout_seconds=1.0))
    ledger.write([row(1)])
    with postgres_server.connect(database) as dba:
        dba.execute(f"REVOKE SELECT, INSERT ON usage_ledger FROM {role}")
    for call in (lambda: ledger.aggregate(UsageQuery(0, NOW_MS + 1000, 60_000)),
                 lambda: ledger.recent(RowQuery(0, NOW_MS + 1000, limit=10)), lambda: ledger.write([row(2)])):
        with pytest.raises(StoreUnavailable, match="permission denied for table usage_ledger") as refused:
            call()
        assert refused.value.permission_denied and refused.value.store == "usage ledger"
    with postgres_server.connect(database) as dba:
        dba.execute(f"GRANT SELECT, INSERT ON usage_ledger TO {role}")
    assert ledger.write([row(2)]) == 1
    assert [r.id for r in ledger.recent(RowQuery(0, NOW_MS + 1000, limit=10))] == ["r2", "r1"]
    ledger.close()


async def test_rows_queued_while_postgresql_took_no_writes_are_stored_once_it_takes_them_again(postgres_server,
                                                                                              postgres_url):
    """`default_transaction_read_only` for the database (a DBA's maintenance; SQLSTATE 25006 for every INSERT), then
    RESET: the ledger's one connection kept the setting of the session it began in, for as long as it lived, so no row
    was written again until the gateway restarted (the buffer filled, and the rows after were dropped). A write refused
    as read-only is tried again on a new connection, which has the database's setting of now."""
    ledger = PostgresLedger(StoreSettings(url=postgres_url, password_env=PASSWORD_ENV, timeout_seconds=1.0))
    database = postgres_url.rsplit("/", 1)[1]
    dropped = []
    writer = LedgerWriter(ledger, UsageSettings(flush_seconds=0.05, batch_rows=2, buffer_rows=10),
                          on_dropped=dropped.append)
    writer.start()
    with postgres_server.connect() as dba:
        dba.execute(f'ALTER DATABASE "{database}" SET default_transaction_read_only = on')
        dba.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = %s", (database,))
    try:
        with pytest.raises(StoreUnavailable, match="read-only transaction"):
            ledger.write([row(1)])
        for n in range(1, 4):
            writer.append(row(n))
        await asyncio.sleep(0.5)
        assert writer.pending == 3  # waiting, not lost
    finally:
        with postgres_server.connect() as dba:
            dba.execute(f'ALTER DATABASE "{database}" RESET default_transaction_read_only')
    for _ in range(100):  # the writer's pause has grown to at most a second or two by now
        if writer.pending == 0:
            break
        await asyncio.sleep(0.05)
    assert writer.pending == 0
    await writer.close()
    assert [r.id for r in ledger.rows()] == ["r1", "r2", "r3"] and dropped == []
    ledger.close()


async def test_a_ledger_refused_its_schema_when_first_reached_after_start_up_writes_once_granted(postgres_server,
                                                                                               postgres_url):
    """A host started while PostgreSQL was unreachable checks the ledger's schema when it first reaches it. Refused
    there (a role not granted `schema_migrations` yet, a read-only database while a migration is due), the ledger
    took the refusal for a database newer than the code: never written or read again until a restart, the rows
    piling up until the buffer dropped them, and every usage read a 503, the grant made long since. Only a newer
    database is for good; a refusal is asked again at the next write, whose rows wait meanwhile."""
    PostgresLedger(StoreSettings(url=postgres_url, password_env=PASSWORD_ENV)).close()  # the owner migrates
    database = postgres_url.rsplit("/", 1)[1]
    role = f"{database}_rw"
    with postgres_server.connect(database) as dba:
        dba.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{postgres_server.password}'")
    postgres_server.stop()
    try:
        ledger = PostgresLedger(StoreSettings(url=postgres_url.replace("postgres@", f"{role}@"),
                                              password_env=PASSWORD_ENV, timeout_seconds=1.0))
    finally:
        postgres_server.start()
    dropped = []
    writer = LedgerWriter(ledger, UsageSettings(flush_seconds=30, batch_rows=10, buffer_rows=10),
                          on_dropped=dropped.append)
    writer.append(row(1))
    assert not await writer.flush()
    with pytest.raises(StoreUnavailable, match="could not be brought to this Portico's"):
        ledger.recent(RowQuery(0, NOW_MS + 1000, limit=10))
    with postgres_server.connect(database) as dba:
        dba.execute(f"GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA public TO {role}")
    writer.append(row(2))
    assert await writer.flush()
    assert [r.id for r in ledger.recent(RowQuery(0, NOW_MS + 1000, limit=10))] == ["r2", "r1"] and dropped == []
    ledger.close()


def test_a_slow_usage_read_is_not_cut_when_the_database_refuses_the_watchdog_a_connection(postgres_server,
                                                                                          postgres_url):
    """A usage read longer than the store timeout (here: behind another session's lock for ~2 s) has the watchdog
    ask, on a connection of its own, whether the database still answers. With the role at its `CONNECTION LIMIT`
    (or PostgreSQL at `max_connections`, a common incident), that connection was refused, which the watchdog took for
    a hung database: it cut the read, a 503 `The usage ledger is unreachable`, the database answering all along. A
    refusal is the database's answer; only silence is a hung one."""
    PostgresLedger(StoreSettings(url=postgres_url, password_env=PASSWORD_ENV)).close()  # the owner migrates
    url, database, role = _role_of(postgres_server, postgres_url)
    ledger = PostgresLedger(StoreSettings(url=url, password_env=PASSWORD_ENV, timeout_seconds=0.5))
    ledger.write([row(1)])
    with postgres_server.connect(database) as dba:
        dba.execute(f"ALTER ROLE {role} CONNECTION LIMIT 1")  # the ledger's own connection
    reading = ThreadPoolExecutor(1)
    try:
        with postgres_server.connect(database) as locker:
            with locker.transaction():
                locker.execute("LOCK TABLE usage_ledger IN ACCESS EXCLUSIVE MODE")
                read = reading.submit(ledger.aggregate, UsageQuery(0, NOW_MS + 1000, 60_000))
                time.sleep(2.0)
        (total,) = read.result(timeout=10)
        assert total.rows == 1
    finally:
        reading.shutdown(wait=True)
        ledger.close()
