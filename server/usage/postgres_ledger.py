"""The ledger in PostgreSQL, beside the keys (keys.store: postgresql://...). One connection, used from worker threads
one call at a time; when it breaks (the database restarted or was unreachable) the next call opens a new one, so the
writer's retries recover by themselves. A call the database does not answer (or refuses the role) raises
StoreUnavailable, as the key store's do: a 503 with retry-after for the usage API, one line for `portico usage`."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Sequence

import psycopg

from server.db.database import StoreUnavailable
from server.db.migrations import NewerSchema, SchemaError, migrate_postgres
from server.db.postgres import connect, failure
from server.db.settings import StoreSettings
from server.usage.ledger import COLUMNS, STORE_NAME, LedgerRow, RowsRefused, values_of
from server.usage.query import RowQuery, Totals, UsageQuery, aggregate_sql, insert_sql, rows_sql, totals_of
from server.usage.schema import MIGRATIONS

_INSERT = insert_sql("%s", suffix=" ON CONFLICT (id) DO NOTHING")
# keys.store_timeout_seconds (2 s) bounds each statement, as key lookups need; a usage query over weeks of rows takes
# seconds (~4 s for 3 million), so reads get their own bound, and retention deletes a batch per statement.
READ_TIMEOUT_MS = 60_000
# The batch's ids as an array, not `id IN (SELECT ...)`: that is planned as a hash join over a sequential scan of the
# whole table (346 ms a batch on 1.5 million rows, against 15 ms through the primary key). ORDER BY at_ms has the
# batch read through the at_ms index: left to itself the planner scans the table until it has `limit` rows, which is
# the whole table once none is left (63-106 ms on 660,000 rows: every pass's last batch).
_PRUNE = ("DELETE FROM usage_ledger WHERE id = ANY(ARRAY("
          "SELECT id FROM usage_ledger WHERE at_ms < %s ORDER BY at_ms LIMIT %s))")


_CANCELLED = (psycopg.errors.QueryCanceled, psycopg.errors.LockNotAvailable)  # the database's answer, not a cut
# How libpq words an error the server sent (`FATAL:  too many connections for role ...`), where a connection that
# failed has no SQLSTATE; a server with a translated lc_messages words them otherwise, and is probed as before.
_SERVER_SEVERITIES = ("FATAL", "ERROR", "PANIC")


class PostgresLedger:
    def __init__(self, settings: StoreSettings) -> None:
        self._settings = settings
        self._lock = threading.Lock()
        self._conn: psycopg.Connection | None = None
        self._migrated = False
        self._newer: NewerSchema | None = None  # the database is newer than this code: never written or read here
        try:
            self._connection()  # migrate now when the database is up; later (first write) when it is not
        except psycopg.OperationalError:
            pass

    def _connection(self) -> psycopg.Connection:
        if self._conn is None or self._conn.closed or self._conn.broken:
            if self._newer is not None:
                raise self._newer
            if not self._migrated:
                with connect(self._settings, statement_timeout=False) as conn:
                    try:
                        migrate_postgres(conn, MIGRATIONS, newer_ok=self._settings.newer_schema_ok)
                    except NewerSchema as exc:  # a refusal is asked again at the next call: a DBA may mend it
                        self._newer = exc
                        raise
                self._migrated = True
            self._conn = connect(self._settings)
        return self._conn

    def _run(self, work, statement_ms: int | None = None):
        """`work` on the connection; `statement_ms`: how long its statement may run when that is longer than the
        store's timeout (a usage read)."""
        with self._lock:
            for _ in range(2):
                reused = self._conn is not None and not self._conn.closed and not self._conn.broken
                watchdog: threading.Thread | None = None
                cut, done = threading.Event(), threading.Event()
                try:
                    conn = self._connection()
                    # libpq has no query timeout of its own, and statement_timeout needs a server that answers: a
                    # hung one would hold this call (and the writer behind the lock) for as long as it hangs.
                    watchdog = threading.Thread(target=self._watch, args=(conn, cut, done, statement_ms),
                                                name="ledger-watchdog", daemon=True)
                    watchdog.start()
                    return work(conn)
                except psycopg.OperationalError as exc:
                    self._close()
                    # A connection kept from before may have been cut by a restart of a database that is up again:
                    # one more try, on a new connection, before the caller is told the ledger is unreachable. Every
                    # call is safe to repeat (a write stores each row id once). Not after a statement PostgreSQL
                    # cancelled (its statement or lock timeout ran out behind a lock): that was the database's answer,
                    # on a sound connection, and a second try only doubles the caller's wait.
                    if not reused or cut.is_set() or isinstance(exc, _CANCELLED):
                        raise StoreUnavailable(failure(exc), store=STORE_NAME) from exc
                except psycopg.errors.ReadOnlySqlTransaction as exc:
                    # default_transaction_read_only holds for the session it began in: a connection from before the
                    # DBA's RESET took no row for as long as it lived. A new one has the database's setting of now.
                    self._close()
                    if not reused:
                        raise StoreUnavailable(failure(exc), store=STORE_NAME) from exc
                except psycopg.errors.InsufficientPrivilege as exc:
                    # A DBA's REVOKE on the ledger's table: the database answered, so no new connection; for the usage
                    # API a 503 as in an outage (it was a 500), for the writer a failure whose rows wait.
                    raise StoreUnavailable(failure(exc), store=STORE_NAME, permission_denied=True) from exc
                except SchemaError as exc:  # first reached after start-up (it was down then): newer, or refused
                    raise StoreUnavailable(str(exc), store=STORE_NAME) from exc
                finally:
                    done.set()
            raise AssertionError("unreachable: the second try is always on a new connection")

    def _watch(self, conn: psycopg.Connection, cut: threading.Event, done: threading.Event,
               statement_ms: int | None) -> None:
        """Beside a call: while it has no answer, checks every store timeout, on a connection of its own, that the
        database still answers. One that does not (hung), or a call past twice its statement's bound, has its
        connection cut: a hung database is told from a slow usage read within about twice the store timeout."""
        step = self._settings.timeout_seconds
        deadline = time.monotonic() + 2 * max(step, (statement_ms or 0) / 1000)
        while not done.wait(step):
            if time.monotonic() > deadline or not self._answers(within=step):
                if not done.is_set():
                    _cut(conn, cut)
                return

    def _answers(self, within: float) -> bool:
        """Whether the database answers a new connection's query within `within` seconds (libpq's own connect
        timeout is whole seconds, at least 2: the probe is waited for here, and left to end by itself). A connection
        it refuses itself (the role's CONNECTION LIMIT or max_connections reached, a shutdown under way) is an answer:
        taken for a hung database, it had a slow usage read cut, the database answering all along."""
        answered = threading.Event()

        def probe() -> None:
            try:
                with connect(self._settings) as conn:
                    conn.execute("SELECT 1")
            except psycopg.Error as exc:
                if not any(f"{severity}:" in str(exc) for severity in _SERVER_SEVERITIES):
                    return  # no connection (refused, timed out): nothing said the database is there
            answered.set()

        threading.Thread(target=probe, name="ledger-probe", daemon=True).start()
        return answered.wait(within)

    def write(self, rows: Sequence[LedgerRow]) -> int:
        def insert(conn: psycopg.Connection) -> int:
            with conn.transaction(), conn.cursor() as cursor:
                cursor.executemany(_INSERT, [values_of(row) for row in rows])
                return cursor.rowcount  # summed over the rows: those stored before (ON CONFLICT) count 0

        try:
            return self._run(insert)
        except (psycopg.DataError, psycopg.IntegrityError) as exc:  # a value out of its column's range, NOT NULL
            raise RowsRefused(f"{type(exc).__name__}: {exc}") from exc

    def prune(self, before_ms: int, limit: int) -> int:
        """Up to `limit` of the rows before `before_ms`, in one statement (LedgerSink.prune)."""
        return self._run(lambda conn: conn.execute(_PRUNE, (before_ms, limit)).rowcount)

    def aggregate(self, query: UsageQuery) -> list[Totals]:
        return totals_of(query, self._read(*aggregate_sql(query, "%s")))

    def recent(self, query: RowQuery) -> list[LedgerRow]:
        return [LedgerRow(*row) for row in self._read(*rows_sql(query, "%s"))]

    def _read(self, sql: str, params: list) -> list:
        def read(conn: psycopg.Connection) -> list:
            with conn.transaction():
                conn.execute(f"SET LOCAL statement_timeout = {READ_TIMEOUT_MS}")
                return conn.execute(sql, params).fetchall()

        return self._run(read, READ_TIMEOUT_MS)

    def rows(self) -> list[LedgerRow]:
        """Every row, oldest first (tests and exports)."""
        return [LedgerRow(*row) for row in self._run(lambda conn: conn.execute(
            f"SELECT {', '.join(COLUMNS)} FROM usage_ledger ORDER BY at_ms, id").fetchall())]

    def _close(self) -> None:
        if self._conn is not None:
            self._conn.close()

    def close(self) -> None:
        with self._lock:
            self._close()


def _cut(conn: psycopg.Connection, cut: threading.Event) -> None:
    """Shut the connection's socket down under a call the database has not answered in time: the call then fails at
    once (OperationalError) instead of waiting on it."""
    cut.set()
    with contextlib.suppress(OSError, psycopg.Error):
        with socket.socket(fileno=os.dup(conn.pgconn.socket)) as sock:
            sock.shutdown(socket.SHUT_RDWR)
