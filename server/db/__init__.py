"""The control-plane database: where keys (and the usage ledger) live, SQLite by default or PostgreSQL shared by
several hosts.

    settings     StoreSettings: the `keys.store` setting (and its password_env, timeouts, pool size)
    database     Database: the one async interface, and SqliteDatabase (on one dedicated thread); StoreUnavailable
    postgres_database   PostgresDatabase: psycopg's async pool, LISTEN/NOTIFY between hosts
    sqlite       connect_sqlite: one configured sqlite3 connection (WAL, busy timeout)
    postgres     psycopg 3 connections and pools (sync for the CLI and threads, async for the server)
    migrations   Migration and the runners that bring either database to the versions the code knows
"""

from server.db.migrations import Migration, SchemaError, migrate_postgres, migrate_sqlite
from server.db.settings import StoreSettings, parse_store

__all__ = ["Migration", "SchemaError", "StoreSettings", "migrate_postgres", "migrate_sqlite", "parse_store"]
