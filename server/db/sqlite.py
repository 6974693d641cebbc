"""One configured SQLite connection. The key store and the usage ledger share the file `<data_dir>/keys.db`; WAL
lets the server, its worker processes and the CLI use it at once, and a writer waits (busy_timeout) instead of
failing while another one holds the lock."""

from __future__ import annotations

import sqlite3
from pathlib import Path

BUSY_TIMEOUT_MS = 5000


def connect_sqlite(path: Path) -> sqlite3.Connection:
    """Autocommit mode (isolation_level=None): transactions are explicit (BEGIN ... COMMIT). Usable from any one
    thread at a time (check_same_thread=False): callers serialise their use."""
    path.parent.mkdir(parents=True, exist_ok=True)
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute(f"PRAGMA busy_timeout={BUSY_TIMEOUT_MS}")
    return db
