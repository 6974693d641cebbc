"""The ledger in SQLite, in the key store's database file (WAL: the server's writer thread, other worker processes
and `portico usage` can use it at once)."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from functools import cache
from pathlib import Path

from server.db.database import StoreUnavailable
from server.db.migrations import migrate_sqlite
from server.db.sqlite import connect_sqlite, failure
from server.usage.ledger import COLUMNS, STORE_NAME, LedgerRow, RowsRefused, values_of
from server.usage.query import RowQuery, Totals, UsageQuery, aggregate_sql, insert_sql, rows_sql, totals_of
from server.usage.schema import MIGRATIONS

MAX_ROWS_PER_INSERT = 500
_PRUNE = "DELETE FROM usage_ledger WHERE rowid IN (SELECT rowid FROM usage_ledger WHERE at_ms < ? LIMIT ?)"


@cache
def _insert(rows: int) -> str:
    return insert_sql("?", verb="INSERT OR IGNORE", rows=rows)


def _chunks(rows: int, most: int) -> list[int]:
    """Statement sizes for a batch: full statements of `most` rows, then the rest in powers of two, so at most ten
    shapes are ever prepared. An INSERT of each batch's exact size was one more SQL text and prepared statement (both
    kept: functools.cache, sqlite3's statement cache) per size a batch ever had: +120 MiB of RSS once a gateway's
    batches had come in every size up to 500."""
    sizes = [most] * (rows // most)
    rest = rows % most
    while rest:
        sizes.append(1 << (rest.bit_length() - 1))
        rest -= sizes[-1]
    return sizes


class SqliteLedger:
    def __init__(self, path: Path, *, newer_ok: bool = False, read_only: bool = False) -> None:
        try:
            self._db = connect_sqlite(path, read_only=read_only)
        except sqlite3.DatabaseError as exc:  # a file that is no database: one line, not sqlite3's traceback
            raise StoreUnavailable(failure(path, exc), store=STORE_NAME) from exc
        self._path = path
        try:
            migrate_sqlite(self._db, MIGRATIONS, newer_ok=newer_ok, read_only=read_only)
        except sqlite3.DatabaseError as exc:  # another process held the write lock past busy_timeout, no database
            self._db.close()
            raise StoreUnavailable(failure(path, exc), store=STORE_NAME) from exc
        self._lock = threading.Lock()  # the writer's thread and readers' threads share the connection
        variables = self._db.getlimit(sqlite3.SQLITE_LIMIT_VARIABLE_NUMBER)
        self._rows_per_insert = max(1, min(MAX_ROWS_PER_INSERT, variables // len(COLUMNS)))

    def write(self, rows: Sequence[LedgerRow]) -> int:
        # Many rows per statement, not one: sqlite3 lets go of the GIL around each statement it runs and must take
        # it back after, from the busy event loop's thread (against executemany's statement per row: 3.6 -> 2.8 us
        # of CPU per row alone, JSON 1,923 -> 1,992 req/s in interleaved bench runs on top of full batches).
        stored = 0
        try:
            with self._lock, self._db:
                self._db.execute("BEGIN")
                start = 0
                for size in _chunks(len(rows), self._rows_per_insert):
                    chunk = rows[start:start + size]
                    start += size
                    stored += self._db.execute(_insert(size),
                                               [value for row in chunk for value in values_of(row)]).rowcount
        except (OverflowError, sqlite3.IntegrityError, sqlite3.DataError) as exc:  # an int beyond 64 bits, NOT NULL
            raise RowsRefused(f"{type(exc).__name__}: {exc}") from exc
        except sqlite3.OperationalError as exc:  # logged by the writer: a full disk said as one, with its directory
            raise StoreUnavailable(failure(self._path, exc), store=STORE_NAME) from exc
        return stored

    def prune(self, before_ms: int, limit: int) -> int:
        """Up to `limit` of the rows before `before_ms`, in one short statement (LedgerSink.prune)."""
        with self._lock:
            return self._db.execute(_PRUNE, (before_ms, limit)).rowcount

    def aggregate(self, query: UsageQuery) -> list[Totals]:
        return totals_of(query, self._read(*aggregate_sql(query, "?")))

    def recent(self, query: RowQuery) -> list[LedgerRow]:
        return [LedgerRow(*row) for row in self._read(*rows_sql(query, "?"))]

    def _read(self, sql: str, params: list) -> list:
        with self._lock:
            try:
                return self._db.execute(sql, params).fetchall()
            except sqlite3.OperationalError as exc:  # "database is locked" after busy_timeout, disk I/O, ...
                raise StoreUnavailable(failure(self._path, exc), store=STORE_NAME) from exc

    def rows(self) -> list[LedgerRow]:
        """Every row, oldest first (tests and exports)."""
        with self._lock:
            return [LedgerRow(*row) for row in self._db.execute(
                f"SELECT {', '.join(COLUMNS)} FROM usage_ledger ORDER BY at_ms, id")]

    def close(self) -> None:
        self._db.close()
