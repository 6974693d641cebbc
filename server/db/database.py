"""One async interface to the control-plane database, two implementations: SQLite (its blocking calls run on one
dedicated thread, never on the event loop) and PostgreSQL (psycopg's async connections from a pool).

SQL is written once with `?` placeholders; the PostgreSQL side turns them into `%s`. Rows are mappings by column
name. A database that cannot answer (unreachable, timed out, locked too long) raises StoreUnavailable, which callers
turn into their outage policy; other errors are bugs and propagate as they are.
"""

from __future__ import annotations

import asyncio
import sqlite3
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from server.db.migrations import Migration, migrate_sqlite
from server.db.settings import StoreSettings
from server.db.sqlite import connect_sqlite, failure
from server.errors import ServiceUnavailable

Params = Sequence[Any]
Step = tuple[str, Params]

RETRY_AFTER_SECONDS = 5.0


def storable(text: str) -> bool:
    """Whether a text can be a stored value. PostgreSQL text holds no NUL and refuses to compare with one; no driver
    encodes a lone surrogate (what a command-line argument that is not UTF-8 becomes). No row holds such a text: a
    lookup of one finds nothing, without asking the database."""
    try:
        text.encode()
    except UnicodeEncodeError:
        return False
    return "\x00" not in text


class StoreUnavailable(ServiceUnavailable):
    """The database did not answer (down, unreachable, too slow). Answered as 503 service_unavailable with
    retry-after wherever it is not handled; `detail` (the driver's words, for logs) stays out of the answer."""

    def __init__(self, detail: str, *, store: str = "key store", credentials_refused: bool = False,
                 permission_denied: bool = False) -> None:
        super().__init__(f"The {store} is unreachable; retry shortly.", retry_after=RETRY_AFTER_SECONDS)
        self.detail = detail
        self.store = store
        self.credentials_refused = credentials_refused  # it answered, refusing who we are: readiness says so
        self.permission_denied = permission_denied  # it answered, refusing our role its tables: readiness says so

    def __str__(self) -> str:
        return self.detail


class Database(Protocol):
    async def fetch_one(self, sql: str, params: Params = ()) -> Mapping[str, Any] | None: ...
    async def fetch_all(self, sql: str, params: Params = ()) -> list[Mapping[str, Any]]: ...
    async def execute(self, sql: str, params: Params = ()) -> int:
        """Returns the number of rows changed."""
        ...
    async def transaction(self, steps: Sequence[Step], *, notify: tuple[str, str] | None = None) -> None:
        """Run the statements in one transaction: all or none. `notify` (channel, payload): tell every process
        listening on the channel (other hosts) when, and only if, the transaction commits; nothing to tell for a
        one-host database."""
        ...
    async def ping(self, sql: str = "SELECT 1") -> None:
        """Raise StoreUnavailable unless the database answers `sql` (a read) now. An answer ends PostgreSQL's
        fail-fast window, so a caller asks what its own calls need: tables another session has locked do not answer
        while `SELECT 1` does."""
        ...
    async def listen(self, channel: str, on_message: Callable[[str | None], None]) -> None:
        """Call `on_message` with each payload sent to `channel` until cancelled; None: messages may have been
        missed (a connection was lost). Returns at once where there is nobody else to hear from."""
        ...
    async def close(self) -> None: ...


async def open_database(settings: StoreSettings, migrations: Sequence[Migration]) -> Database:
    """The configured database, its schema migrated (PostgreSQL: if it is reachable; else at the first call that
    reaches it)."""
    if settings.is_postgres:
        # Imported only when configured: psycopg and its pool cost every server process ~11 MB of memory.
        from server.db.postgres_database import PostgresDatabase

        return await PostgresDatabase.open(settings, migrations)
    assert settings.sqlite_path is not None
    return await SqliteDatabase.open(settings.sqlite_path, migrations, newer_ok=settings.newer_schema_ok,
                                     read_only=settings.read_only)


class SqliteDatabase:
    def __init__(self, db: sqlite3.Connection, thread: ThreadPoolExecutor, path: Path) -> None:
        self._db = db
        self._path = path
        self._thread = thread  # one thread: the connection is used by one thread at a time, in order
        self._closed = False

    @classmethod
    async def open(cls, path: Path, migrations: Sequence[Migration], *, newer_ok: bool = False,
                   read_only: bool = False) -> SqliteDatabase:
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite")

        def opened() -> sqlite3.Connection:
            db = connect_sqlite(path, read_only=read_only)
            db.row_factory = sqlite3.Row
            try:
                if migrations:
                    migrate_sqlite(db, migrations, newer_ok=newer_ok, read_only=read_only)
            except BaseException:
                db.close()
                raise
            return db

        try:
            return cls(await asyncio.get_running_loop().run_in_executor(thread, opened), thread, path)
        # Its schema check met another process's write lock past busy_timeout, or the file is no database at all.
        except sqlite3.DatabaseError as exc:
            thread.shutdown(wait=False)
            raise StoreUnavailable(failure(path, exc)) from exc

    async def _run(self, work: Callable[[sqlite3.Connection], Any]) -> Any:
        if self._closed:
            raise StoreUnavailable("SQLite: the key store is closed")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, work, self._db)
        except sqlite3.OperationalError as exc:  # "database is locked" after busy_timeout, disk I/O, ...
            raise StoreUnavailable(failure(self._path, exc)) from exc

    async def fetch_one(self, sql: str, params: Params = ()) -> Mapping[str, Any] | None:
        return await self._run(lambda db: db.execute(sql, params).fetchone())

    async def fetch_all(self, sql: str, params: Params = ()) -> list[Mapping[str, Any]]:
        return await self._run(lambda db: db.execute(sql, params).fetchall())

    async def execute(self, sql: str, params: Params = ()) -> int:
        return await self._run(lambda db: db.execute(sql, params).rowcount)

    async def transaction(self, steps: Sequence[Step], *, notify: tuple[str, str] | None = None) -> None:
        # `notify` is not sent: one host, whose processes' key caches see a change once their entries expire
        # (keys.cache_seconds, 1 s), as docs/configuration.md says; PostgreSQL's hosts hear of it at once.
        def run(db: sqlite3.Connection) -> None:
            db.execute("BEGIN IMMEDIATE")
            try:
                for sql, params in steps:
                    db.execute(sql, params)
                db.execute("COMMIT")
            except BaseException:
                # SQLite has rolled back by itself after some failures (a full disk, an I/O error): a ROLLBACK then
                # raises 'no transaction is active', which hid the failure from the log.
                if db.in_transaction:
                    db.execute("ROLLBACK")
                raise

        await self._run(run)

    async def ping(self, sql: str = "SELECT 1") -> None:
        await self.fetch_one(sql)

    async def listen(self, channel: str, on_message: Callable[[str | None], None]) -> None:
        return None

    async def close(self) -> None:
        if not self._closed:
            await self._run(lambda db: db.close())
            self._closed = True
            self._thread.shutdown(wait=True)
