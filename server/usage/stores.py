"""The ledger lives with the keys: SQLite (keys.db) or PostgreSQL, as `keys.store` says."""

from __future__ import annotations

from typing import TYPE_CHECKING

from server.db.settings import StoreSettings
from server.usage.sqlite_ledger import SqliteLedger

if TYPE_CHECKING:
    from server.usage.postgres_ledger import PostgresLedger


def open_ledger(settings: StoreSettings) -> SqliteLedger | PostgresLedger:
    if settings.is_postgres:
        # Imported only when configured: psycopg costs every server process ~11 MB of memory.
        from server.usage.postgres_ledger import PostgresLedger

        return PostgresLedger(settings)
    assert settings.sqlite_path is not None
    return SqliteLedger(settings.sqlite_path, newer_ok=settings.newer_schema_ok, read_only=settings.read_only)
