"""Schema versions: each component (keys, usage, ...) owns a numbered list of migrations, applied in order at
start-up (and by the CLI) to bring the database to the versions this Portico knows.

What is applied is recorded in `schema_migrations` (component, version). Applying is one transaction that first takes
a lock, so two hosts (or processes) starting at once do not race: the first applies, the second waits and then finds
nothing left to do. PostgreSQL: a transaction-scoped advisory lock (DDL is transactional, so a failed migration leaves
nothing behind). SQLite: BEGIN IMMEDIATE (the database's write lock). A database newer than the code (a host not yet
upgraded) is refused with a clear message rather than used with a schema it does not know.

A migration's SQL is frozen once released: change a schema by appending a migration, never by editing one.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # psycopg itself is imported where PostgreSQL is configured (server/db/postgres.py)
    import psycopg

# Any fixed 64-bit number, the same in every Portico: the advisory lock the migrations of every component take.
ADVISORY_LOCK_ID = 0x706F727469636F  # "portico"

_logger = logging.getLogger(__name__)

_TABLE = (
    "CREATE TABLE schema_migrations (component TEXT NOT NULL, version INTEGER NOT NULL, "
    "description TEXT NOT NULL, applied_at BIGINT NOT NULL, PRIMARY KEY (component, version))"
)
# Whether it is there, asked first: PostgreSQL refuses even CREATE TABLE IF NOT EXISTS to a role without CREATE in the
# schema, and a least-privilege role (the owner migrates, the gateway reads and writes) must start when nothing is due.
_SQLITE_HAS_TABLE = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'schema_migrations'"
_POSTGRES_HAS_TABLE = "SELECT 1 WHERE to_regclass('schema_migrations') IS NOT NULL"


class SchemaError(Exception):
    """The database cannot be brought to this code's schema (it is newer, or a migration failed)."""


class NewerSchema(SchemaError):
    """The database is newer than this code: unlike a refused migration (a grant or a read-only database, which a DBA
    may mend while the process runs), for good."""


@dataclass(frozen=True, slots=True)
class Migration:
    component: str  # "keys", "usage", ...: versions count per component
    version: int  # 1, 2, 3, ... without gaps
    description: str
    sqlite: tuple[str, ...]  # statements, run in order (one statement each: no scripts)
    postgresql: tuple[str, ...]
    # SQLite only: a query finding the change made already, by a Portico from before schema versions (which made its
    # tables whole): the migration is then recorded without running, as its statements would fail there.
    sqlite_present: str = ""


def migrate_sqlite(db: sqlite3.Connection, migrations: Sequence[Migration], *, newer_ok: bool = False,
                   read_only: bool = False) -> list[int]:
    """Apply what is missing; returns the versions applied. `db` must be in autocommit mode (isolation_level=None).
    `newer_ok`: a database newer than this code is used as it is (logged), not refused
    (StoreSettings.newer_schema_ok). `read_only`: nothing may be applied, so a migration due is refused."""
    component = _check(migrations)
    if read_only:
        applied = {row[0] for row in db.execute("SELECT version FROM schema_migrations WHERE component = ?",
                                                (component,))} if list(db.execute(_SQLITE_HAS_TABLE)) else set()
        if _pending(component, applied, migrations, newer_ok):
            raise SchemaError(f"the database's {component} schema is older than this Portico's, and cannot be "
                              "brought up to date where it may not be written: run a command that writes (`portico "
                              "serve`, `portico keys create`) where it may")
        return []
    db.execute("BEGIN IMMEDIATE")
    try:
        applied = _apply(db.execute, "?", _SQLITE_HAS_TABLE, [m.sqlite for m in migrations], migrations,
                         [m.sqlite_present for m in migrations], newer_ok)
        db.execute("COMMIT")
    except BaseException:
        if db.in_transaction:  # SQLite rolls back by itself on a full disk: a ROLLBACK then hid the failure
            db.execute("ROLLBACK")
        raise
    return applied


def migrate_postgres(conn: psycopg.Connection, migrations: Sequence[Migration], *,
                     newer_ok: bool = False) -> list[int]:
    """Apply what is missing; returns the versions applied. `newer_ok`: as for migrate_sqlite."""
    import psycopg  # loaded already: `conn` is one of its connections

    component = _check(migrations)
    try:
        with conn.transaction():
            # Another host migrating is waited for however long it takes, whatever lock_timeout the DBA set; the
            # DBA's bound holds again for the tables' locks (a DDL queued behind a long transaction would hold up
            # every lookup queued behind it).
            conn.execute("SET LOCAL lock_timeout = 0")
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (ADVISORY_LOCK_ID,))
            conn.execute("SET LOCAL lock_timeout TO DEFAULT")
            return _apply(conn.execute, "%s", _POSTGRES_HAS_TABLE, [m.postgresql for m in migrations], migrations,
                          [""] * len(migrations), newer_ok)
    except psycopg.OperationalError:
        raise  # the database went away or timed out: unreachable, for the callers to say so
    except psycopg.Error as exc:  # refused (a role that may not change the schema, ...): rolled back whole
        words = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise SchemaError(f"the database's {component} schema could not be brought to this Portico's "
                          f"(nothing was changed): {words}") from exc


def _apply(execute: Callable[..., Any], placeholder: str, has_table: str, statements: Sequence[tuple[str, ...]],
           migrations: Sequence[Migration], present: Sequence[str], newer_ok: bool) -> list[int]:
    """Inside the caller's locked transaction: run each pending migration's statements (unless its `present` query
    finds their change made already) and record it."""
    component = migrations[0].component
    if not list(execute(has_table)):
        execute(_TABLE)
    applied = {row[0] for row in execute(
        f"SELECT version FROM schema_migrations WHERE component = {placeholder}", (component,))}
    pending = _pending(component, applied, migrations, newer_ok)
    for migration in pending:
        check = present[migration.version - 1]
        if not (check and list(execute(check))):
            for statement in statements[migration.version - 1]:
                execute(statement)
        execute(f"INSERT INTO schema_migrations VALUES ({', '.join([placeholder] * 4)})",
                (component, migration.version, migration.description, int(time.time())))
    return [m.version for m in pending]


def _check(migrations: Sequence[Migration]) -> str:
    """One component's list, numbered 1..n in order (a mistake here is the code's, caught by the first test)."""
    components = {m.component for m in migrations}
    if len(components) != 1:
        raise ValueError(f"one component's migrations at a time, not {sorted(components)}")
    if [m.version for m in migrations] != list(range(1, len(migrations) + 1)):
        raise ValueError(f"{components.pop()} migrations must be numbered 1, 2, 3, ... in order")
    return components.pop()


def _pending(component: str, applied: set[int], migrations: Sequence[Migration], newer_ok: bool) -> list[Migration]:
    newest = max(applied, default=0)
    if newest > len(migrations):
        newer = (f"the database's {component} schema is at version {newest}, newer than this Portico knows "
                 f"({len(migrations)}): upgrade Portico on this host")
        if not newer_ok:
            raise NewerSchema(newer)
        # Its siblings use it so already (a newer host migrated it while they ran): nothing of it is changed here.
        _logger.warning("%s (a restarted worker uses it as the other workers do)", newer)
        return []
    return [m for m in migrations if m.version not in applied]
