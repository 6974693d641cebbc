"""The ledger lives with the keys: SQLite (keys.db) or PostgreSQL, as `keys.store` says."""

from __future__ import annotations

from server.db.settings import StoreSettings
from server.usage.postgres_ledger import PostgresLedger
from server.usage.sqlite_ledger import SqliteLedger


def open_ledger(settings: StoreSettings) -> SqliteLedger | PostgresLedger:
    if settings.is_postgres:
        return PostgresLedger(settings)
    assert settings.sqlite_path is not None
    return SqliteLedger(settings.sqlite_path)
