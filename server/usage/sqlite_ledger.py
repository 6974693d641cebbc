"""The ledger in SQLite, in the key store's database file (WAL: the server's writer thread, other worker processes
and `portico usage` can use it at once)."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Sequence
from dataclasses import astuple
from pathlib import Path

from server.usage.ledger import COLUMNS, LedgerRow
from server.usage.query import CREATE_TABLE, Totals, UsageQuery, aggregate_sql, insert_sql, totals_of

_INSERT = insert_sql("?", verb="INSERT OR IGNORE")


class SqliteLedger:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(CREATE_TABLE)
        self._lock = threading.Lock()  # the writer's thread and readers' threads share the connection

    def write(self, rows: Sequence[LedgerRow]) -> None:
        with self._lock, self._db:
            self._db.execute("BEGIN")
            self._db.executemany(_INSERT, [astuple(row) for row in rows])

    def prune(self, before_ms: int) -> int:
        with self._lock:
            return self._db.execute("DELETE FROM usage_ledger WHERE at_ms < ?", (before_ms,)).rowcount

    def aggregate(self, query: UsageQuery) -> list[Totals]:
        sql, params = aggregate_sql(query, "?")
        with self._lock:
            return totals_of(query, self._db.execute(sql, params).fetchall())

    def rows(self) -> list[LedgerRow]:
        """Every row, oldest first (tests and exports)."""
        with self._lock:
            return [LedgerRow(*row) for row in self._db.execute(
                f"SELECT {', '.join(COLUMNS)} FROM usage_ledger ORDER BY at_ms, id")]

    def close(self) -> None:
        self._db.close()
