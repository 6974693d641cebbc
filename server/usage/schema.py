"""The usage ledger's schema, as migrations (server/db/migrations.py) for SQLite and PostgreSQL. Append a migration
to change it; never edit a released one. Version 1 uses IF NOT EXISTS, so a ledger made before schema versions
existed is adopted with its rows."""

from server.db.migrations import Migration

COMPONENT = "usage"


def _table(real: str) -> str:
    return (
        "CREATE TABLE IF NOT EXISTS usage_ledger (id TEXT PRIMARY KEY, at_ms BIGINT NOT NULL, "
        "request_id TEXT NOT NULL, key_id TEXT NOT NULL, env TEXT NOT NULL, endpoint TEXT NOT NULL, "
        "model TEXT NOT NULL, upstream TEXT NOT NULL, status INTEGER NOT NULL, code TEXT NOT NULL, "
        "input_tokens BIGINT NOT NULL, output_tokens BIGINT NOT NULL, cached_input_tokens BIGINT NOT NULL, "
        "images INTEGER NOT NULL, cost_micros BIGINT NOT NULL, upstream_attempts INTEGER NOT NULL, "
        f"latency_ms {real} NOT NULL, first_token_ms {real})"
    )


_INDEXES = (
    "CREATE INDEX IF NOT EXISTS usage_ledger_at ON usage_ledger (at_ms)",
    "CREATE INDEX IF NOT EXISTS usage_ledger_key_at ON usage_ledger (key_id, at_ms)",
)

MIGRATIONS: tuple[Migration, ...] = (
    Migration(
        COMPONENT, 1, "usage_ledger: one row per admitted request",
        sqlite=(_table("REAL"), *_INDEXES),
        postgresql=(_table("DOUBLE PRECISION"), *_INDEXES),
    ),
    Migration(
        COMPONENT, 2, "usage_ledger.deployment: which deployment of the model answered",
        sqlite=("ALTER TABLE usage_ledger ADD COLUMN deployment TEXT NOT NULL DEFAULT ''",),
        postgresql=("ALTER TABLE usage_ledger ADD COLUMN deployment TEXT NOT NULL DEFAULT ''",),
    ),
)
