"""One async interface to the control-plane database, two implementations: SQLite (its blocking calls run on one
dedicated thread, never on the event loop) and PostgreSQL (psycopg's async connections from a pool).

SQL is written once with `?` placeholders; the PostgreSQL side turns them into `%s`. Rows are mappings by column
name. A database that cannot answer (unreachable, timed out, locked too long) raises StoreUnavailable, which callers
turn into their outage policy; other errors are bugs and propagate as they are.
"""

from __future__ import annotations

import asyncio
import logging
import sqlite3
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import PoolClosed, PoolTimeout

from server.db.migrations import Migration, migrate_postgres, migrate_sqlite
from server.db.postgres import async_pool, connect, connect_async
from server.db.settings import StoreSettings
from server.db.sqlite import connect_sqlite
from server.errors import ServiceUnavailable

Params = Sequence[Any]
Step = tuple[str, Params]

# After a failure, calls fail at once for this long instead of each waiting for the timeout again; the readiness
# check's ping still tries, so recovery is seen within a second.
_FAIL_FAST_SECONDS = 1.0
RETRY_AFTER_SECONDS = 5.0

_logger = logging.getLogger(__name__)


class StoreUnavailable(ServiceUnavailable):
    """The database did not answer (down, unreachable, too slow). Answered as 503 service_unavailable with
    retry-after wherever it is not handled; `detail` (the driver's words, for logs) stays out of the answer."""

    def __init__(self, detail: str) -> None:
        super().__init__("The key store is unreachable; retry shortly.", retry_after=RETRY_AFTER_SECONDS)
        self.detail = detail

    def __str__(self) -> str:
        return self.detail


class Database(Protocol):
    async def fetch_one(self, sql: str, params: Params = ()) -> Mapping[str, Any] | None: ...
    async def fetch_all(self, sql: str, params: Params = ()) -> list[Mapping[str, Any]]: ...
    async def execute(self, sql: str, params: Params = ()) -> int:
        """Returns the number of rows changed."""
        ...
    async def transaction(self, steps: Sequence[Step]) -> None:
        """Run the statements in one transaction: all or none."""
        ...
    async def ping(self) -> None:
        """Raise StoreUnavailable unless the database answers now."""
        ...
    async def notify(self, channel: str, payload: str) -> None:
        """Tell every process listening on `channel` (other hosts); nothing to tell for a one-host database."""
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
        return await PostgresDatabase.open(settings, migrations)
    assert settings.sqlite_path is not None
    return await SqliteDatabase.open(settings.sqlite_path, migrations)


class SqliteDatabase:
    def __init__(self, db: sqlite3.Connection, thread: ThreadPoolExecutor) -> None:
        self._db = db
        self._thread = thread  # one thread: the connection is used by one thread at a time, in order
        self._closed = False

    @classmethod
    async def open(cls, path: Path, migrations: Sequence[Migration]) -> SqliteDatabase:
        thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite")

        def opened() -> sqlite3.Connection:
            db = connect_sqlite(path)
            db.row_factory = sqlite3.Row
            if migrations:
                migrate_sqlite(db, migrations)
            return db

        return cls(await asyncio.get_running_loop().run_in_executor(thread, opened), thread)

    async def _run(self, work: Callable[[sqlite3.Connection], Any]) -> Any:
        if self._closed:
            raise StoreUnavailable("SQLite: the key store is closed")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._thread, work, self._db)
        except sqlite3.OperationalError as exc:  # "database is locked" after busy_timeout, disk I/O, ...
            raise StoreUnavailable(f"SQLite: {exc}") from exc

    async def fetch_one(self, sql: str, params: Params = ()) -> Mapping[str, Any] | None:
        return await self._run(lambda db: db.execute(sql, params).fetchone())

    async def fetch_all(self, sql: str, params: Params = ()) -> list[Mapping[str, Any]]:
        return await self._run(lambda db: db.execute(sql, params).fetchall())

    async def execute(self, sql: str, params: Params = ()) -> int:
        return await self._run(lambda db: db.execute(sql, params).rowcount)

    async def transaction(self, steps: Sequence[Step]) -> None:
        def run(db: sqlite3.Connection) -> None:
            db.execute("BEGIN IMMEDIATE")
            try:
                for sql, params in steps:
                    db.execute(sql, params)
                db.execute("COMMIT")
            except BaseException:
                db.execute("ROLLBACK")
                raise

        await self._run(run)

    async def ping(self) -> None:
        await self.fetch_one("SELECT 1")

    async def notify(self, channel: str, payload: str) -> None:
        return None  # one host: its own cache is the only one, and the caller updates it

    async def listen(self, channel: str, on_message: Callable[[str | None], None]) -> None:
        return None

    async def close(self) -> None:
        if not self._closed:
            await self._run(lambda db: db.close())
            self._closed = True
            self._thread.shutdown(wait=True)


class PostgresDatabase:
    def __init__(self, settings: StoreSettings, migrations: Sequence[Migration]) -> None:
        self._settings = settings
        self._migrations = migrations
        self._pool = async_pool(settings)
        self._migrated = not migrations
        self._migrating = asyncio.Lock()
        self._failing_until = 0.0
        self._sql: dict[str, str] = {}

    @classmethod
    async def open(cls, settings: StoreSettings, migrations: Sequence[Migration]) -> PostgresDatabase:
        database = cls(settings, migrations)
        await database._pool.open(wait=False)  # not waiting: a host may start while PostgreSQL is down
        try:
            await database._migrate()
        except StoreUnavailable as exc:
            _logger.error("the key store %s is unreachable at start-up (%s); its schema will be checked when it "
                          "answers", settings.url, exc)
        return database

    async def _migrate(self) -> None:
        async with self._migrating:
            if self._migrated:
                return
            try:
                # A sync connection in a thread: migrations also run from the CLI, and take the lock themselves.
                await asyncio.to_thread(self._migrate_now)
            except psycopg.OperationalError as exc:
                raise StoreUnavailable(f"PostgreSQL: {exc}") from exc
            self._migrated = True

    def _migrate_now(self) -> None:
        with connect(self._settings, statement_timeout=False) as conn:
            migrate_postgres(conn, self._migrations)

    def _postgres_sql(self, sql: str) -> str:
        translated = self._sql.get(sql)
        if translated is None:
            translated = self._sql[sql] = sql.replace("?", "%s")
        return translated

    async def _run(self, work: Callable[[psycopg.AsyncConnection], Any], *, fail_fast: bool = True) -> Any:
        if fail_fast and time.monotonic() < self._failing_until:
            raise StoreUnavailable("PostgreSQL did not answer a moment ago")
        try:
            # A hard bound besides the pool's and libpq's timeouts: a server that stops answering mid-query.
            async with asyncio.timeout(self._settings.timeout_seconds * 2):
                if not self._migrated:
                    await self._migrate()
                async with self._pool.connection() as conn:
                    conn.row_factory = dict_row
                    return await work(conn)
        except (psycopg.OperationalError, PoolTimeout, PoolClosed, TimeoutError) as exc:
            self._failing_until = time.monotonic() + _FAIL_FAST_SECONDS
            raise StoreUnavailable(f"PostgreSQL: {exc or type(exc).__name__}") from exc

    async def fetch_one(self, sql: str, params: Params = ()) -> Mapping[str, Any] | None:
        async def work(conn: psycopg.AsyncConnection) -> Any:
            return await (await conn.execute(self._postgres_sql(sql), params)).fetchone()

        return await self._run(work)

    async def fetch_all(self, sql: str, params: Params = ()) -> list[Mapping[str, Any]]:
        async def work(conn: psycopg.AsyncConnection) -> Any:
            return await (await conn.execute(self._postgres_sql(sql), params)).fetchall()

        return await self._run(work)

    async def execute(self, sql: str, params: Params = ()) -> int:
        async def work(conn: psycopg.AsyncConnection) -> int:
            return (await conn.execute(self._postgres_sql(sql), params)).rowcount

        return await self._run(work)

    async def transaction(self, steps: Sequence[Step]) -> None:
        async def work(conn: psycopg.AsyncConnection) -> None:
            async with conn.transaction():
                for sql, params in steps:
                    await conn.execute(self._postgres_sql(sql), params)

        await self._run(work)

    async def ping(self) -> None:
        async def work(conn: psycopg.AsyncConnection) -> None:
            await conn.execute("SELECT 1")

        await self._run(work, fail_fast=False)
        self._failing_until = 0.0

    async def notify(self, channel: str, payload: str) -> None:
        await self.execute("SELECT pg_notify(?, ?)", (channel, payload))

    async def listen(self, channel: str, on_message: Callable[[str | None], None]) -> None:
        """LISTEN on a connection of its own (outside the pool), reconnecting after a failure."""
        while True:
            try:
                async with await connect_async(self._settings) as conn:
                    await conn.execute(f"LISTEN {channel}")
                    on_message(None)  # whatever was sent while not listening is unknown
                    async for message in conn.notifies():
                        on_message(message.payload)
            except psycopg.Error as exc:
                _logger.debug("listening on %s failed (%s); retrying", channel, exc)
            await asyncio.sleep(_FAIL_FAST_SECONDS)

    async def close(self) -> None:
        await self._pool.close()
