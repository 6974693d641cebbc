"""The key store's schema, as migrations (server/db/migrations.py), the same for SQLite and PostgreSQL.

Append a migration to change it; never edit a released one. Version 1 creates the tables as Portico made them before
schema versions existed (IF NOT EXISTS), so a keys.db from then is adopted as it is.
"""

from server.db.migrations import Migration

COMPONENT = "keys"

_LIMIT_COLUMNS = "requests_per_minute {t}, tokens_per_minute {t}, concurrent_requests {t}, daily_tokens {t}, daily_requests {t}"

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        COMPONENT, 1, "api_keys and retired_secrets",
        sqlite=(
            "CREATE TABLE IF NOT EXISTS api_keys (id TEXT PRIMARY KEY, name TEXT NOT NULL, "
            "secret_hash TEXT NOT NULL UNIQUE, all_models INTEGER NOT NULL, models TEXT NOT NULL, "
            "env TEXT NOT NULL DEFAULT '', admin INTEGER NOT NULL DEFAULT 0, created INTEGER NOT NULL, "
            "revoked_at INTEGER NOT NULL DEFAULT 0, " + _LIMIT_COLUMNS.format(t="INTEGER") + ")",
            # Secrets replaced by a rotation, valid until expires_at (the grace period) unless the key is revoked.
            "CREATE TABLE IF NOT EXISTS retired_secrets (secret_hash TEXT PRIMARY KEY, key_id TEXT NOT NULL, "
            "expires_at INTEGER NOT NULL)",
        ),
        postgresql=(
            "CREATE TABLE IF NOT EXISTS api_keys (id TEXT PRIMARY KEY, name TEXT NOT NULL, "
            "secret_hash TEXT NOT NULL UNIQUE, all_models BOOLEAN NOT NULL, models TEXT NOT NULL, "
            "env TEXT NOT NULL DEFAULT '', admin BOOLEAN NOT NULL DEFAULT FALSE, created BIGINT NOT NULL, "
            "revoked_at BIGINT NOT NULL DEFAULT 0, " + _LIMIT_COLUMNS.format(t="BIGINT") + ")",
            "CREATE TABLE IF NOT EXISTS retired_secrets (secret_hash TEXT PRIMARY KEY, "
            "key_id TEXT NOT NULL REFERENCES api_keys (id), expires_at BIGINT NOT NULL)",
            "CREATE INDEX IF NOT EXISTS retired_secrets_key ON retired_secrets (key_id)",
        ),
    ),
)

# Budgets (issue 17): spend per UTC day and per UTC calendar month, in micro-dollars; NULL: the configured default.
MIGRATIONS += (
    Migration(
        COMPONENT, 2, "api_keys budgets: max_spend_day, max_spend_month",
        sqlite=("ALTER TABLE api_keys ADD COLUMN max_spend_day INTEGER",
                "ALTER TABLE api_keys ADD COLUMN max_spend_month INTEGER"),
        postgresql=("ALTER TABLE api_keys ADD COLUMN max_spend_day BIGINT",
                    "ALTER TABLE api_keys ADD COLUMN max_spend_month BIGINT"),
        # A keys.db from 9c031ca to 0bd0512 (budgets, not yet schema versions) has both columns from its start.
        sqlite_present="SELECT 1 FROM pragma_table_info('api_keys') WHERE name = 'max_spend_day'",
    ),
)
