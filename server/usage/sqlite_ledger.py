"""The ledger in SQLite, in the key store's database file (WAL: the server's writer thread, other worker processes
and `portico usage` can use it at once)."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path

from server.db.migrations import migrate_sqlite
from server.db.sqlite import connect_sqlite
from server.usage.ledger import COLUMNS, LedgerRow, values_of
from server.usage.query import RowQuery, Totals, UsageQuery, aggregate_sql, insert_sql, rows_sql, totals_of
from server.usage.schema import MIGRATIONS

_INSERT = insert_sql("?", verb="INSERT OR IGNORE")


class SqliteLedger:
    def __init__(self, path: Path) -> None:
        self._db = connect_sqlite(path)
        migrate_sqlite(self._db, MIGRATIONS)
        self._lock = threading.Lock()  # the writer's thread and readers' threads share the connection

    def write(self, rows: Sequence[LedgerRow]) -> None:
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.executemany(_INSERT, [values_of(row) for row in rows])

    def prune(self, before_ms: int) -> int:
        with self._lock:
            return self._db.execute("DELETE FROM usage_ledger WHERE at_ms < ?", (before_ms,)).rowcount

    def aggregate(self, query: UsageQuery) -> list[Totals]:
        sql, params = aggregate_sql(query, "?")
        with self._lock:
            return totals_of(query, self._db.execute(sql, params).fetchall())

    def recent(self, query: RowQuery) -> list[LedgerRow]:
        sql, params = rows_sql(query, "?")
        with self._lock:
            return [LedgerRow(*row) for row in self._db.execute(sql, params)]

    def rows(self) -> list[LedgerRow]:
        """Every row, oldest first (tests and exports)."""
        with self._lock:
            return [LedgerRow(*row) for row in self._db.execute(
                f"SELECT {', '.join(COLUMNS)} FROM usage_ledger ORDER BY at_ms, id")]

    def close(self) -> None:
        self._db.close()
