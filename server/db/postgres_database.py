"""The control-plane database on PostgreSQL (server/db/database.py has the interface and the SQLite side): psycopg's
async connections from a pool, a sync connection in a thread for migrations, LISTEN/NOTIFY between hosts."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine, Mapping, Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import PoolClosed, PoolTimeout

from server.db.database import Params, Step, StoreUnavailable
from server.db.migrations import Migration, NewerSchema, SchemaError, migrate_postgres
from server.db.postgres import async_pool, connect, connect_async, one_line, unavailable
from server.db.settings import StoreSettings

# After a failure, calls fail at once for this long (plus the longest a call may wait, below) instead of each waiting
# for the timeout again. The readiness check's ping still tries every second: a failure extends the window before it
# runs out, so a hung database holds no further caller up, and an answer ends it, so recovery is seen within a second.
_FAIL_FAST_SECONDS = 1.0

_logger = logging.getLogger(__name__)


class PostgresDatabase:
    def __init__(self, settings: StoreSettings, migrations: Sequence[Migration]) -> None:
        self._settings = settings
        self._migrations = migrations
        self._pool = async_pool(settings)
        self._migrated = not migrations
        self._migrating = asyncio.Lock()
        self._newer: NewerSchema | None = None  # the database turned out newer than this code: unusable to it
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
        except BaseException:
            # A database newer than this code: nobody will close this pool, and its tasks, left running, retry a
            # cancelled connect for ever, so the process refusing to start would hang on exit instead.
            await database.close()
            raise
        return database

    async def _migrate(self) -> None:
        async with self._migrating:
            if self._migrated:
                return
            try:
                # A sync connection in a thread: migrations also run from the CLI, and take the lock themselves.
                await asyncio.to_thread(self._migrate_now)
            except psycopg.OperationalError as exc:
                raise unavailable(exc) from exc
            self._migrated = True

    async def _migrate_late(self) -> None:
        """The schema of a database first reached after start-up (it was down then). Found newer than this code, the
        store is unavailable to this host (503, not a 500 per request), said once in the log, never asked again; a
        migration refused is asked again at the next call."""
        if self._newer is None:
            try:
                await self._migrate()
            except NewerSchema as exc:
                _logger.error("the key store %s cannot be used: %s", self._settings.url, exc)
                self._newer = exc
            except SchemaError as exc:
                # Refused (a grant not made yet, a read-only database): asked again at the next call, as a DBA may
                # mend it; logged as an outage is, once, by the key cache.
                raise StoreUnavailable(str(exc), permission_denied=isinstance(
                    exc.__cause__, psycopg.errors.InsufficientPrivilege)) from exc
        if self._newer is not None:
            raise StoreUnavailable(str(self._newer))

    def _migrate_now(self) -> None:
        with connect(self._settings, statement_timeout=False) as conn:
            migrate_postgres(conn, self._migrations, newer_ok=self._settings.newer_schema_ok)

    def _postgres_sql(self, sql: str) -> str:
        translated = self._sql.get(sql)
        if translated is None:
            translated = self._sql[sql] = sql.replace("?", "%s")
        return translated

    async def _run(self, work: Callable[[psycopg.AsyncConnection], Any], *, fail_fast: bool = True) -> Any:
        if fail_fast and time.monotonic() < self._failing_until:
            raise StoreUnavailable("PostgreSQL did not answer a moment ago")
        try:
            return await _within(self._settings.timeout_seconds * 2, self._attempt(work))
        except psycopg.errors.TransactionRollback as exc:
            # A deadlock or serialization failure among writers: the database answered, and is no reason to fail
            # everyone's calls fast (lookups included) as an outage is.
            raise unavailable(exc) from exc
        except (psycopg.OperationalError, PoolTimeout, PoolClosed, TimeoutError) as exc:
            self._failing_until = time.monotonic() + 2 * (self._settings.timeout_seconds + _FAIL_FAST_SECONDS)
            raise unavailable(exc) from exc
        except psycopg.errors.InsufficientPrivilege as exc:
            # The role may connect but not use the tables (REVOKE): the database answered, so no fail-fast, and
            # readiness says `permission_denied`; was a 500 for a lookup and a readiness check that never ended.
            raise unavailable(exc) from exc
        except psycopg.errors.ReadOnlySqlTransaction as exc:
            # A standby the hosts were pointed at by a failover, or a DBA's default_transaction_read_only: the store
            # cannot take writes for now, which is no bug of the caller's. Reads still work: no fail-fast for them.
            raise unavailable(exc) from exc

    async def _attempt(self, work: Callable[[psycopg.AsyncConnection], Any]) -> Any:
        if not self._migrated:
            await self._migrate_late()
        try:
            return await self._on_connection(work)
        except psycopg.errors.ReadOnlySqlTransaction:
            # default_transaction_read_only holds for the session it began in: pooled connections from before a
            # DBA's RESET refused writes until psycopg_pool replaced them (max_lifetime, an hour). Replaced now, and
            # the write (rolled back whole) tried once more on a new one, which has the database's setting of now.
            await self._pool.drain()
            return await self._on_connection(work)

    async def _on_connection(self, work: Callable[[psycopg.AsyncConnection], Any]) -> Any:
        async with self._pool.connection() as conn:
            conn.row_factory = dict_row
            return await work(conn)

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

    async def transaction(self, steps: Sequence[Step], *, notify: tuple[str, str] | None = None) -> None:
        # The notice inside the transaction: PostgreSQL delivers it at the commit, and never without it, so the other
        # hosts hear of every change made and of none that failed (a change answered with an error was not made).
        if notify is not None:
            steps = [*steps, ("SELECT pg_notify(?, ?)", notify)]

        async def work(conn: psycopg.AsyncConnection) -> None:
            async with conn.transaction():
                for sql, params in steps:
                    await conn.execute(self._postgres_sql(sql), params)

        await self._run(work)

    async def ping(self, sql: str = "SELECT 1") -> None:
        async def work(conn: psycopg.AsyncConnection) -> None:
            await conn.execute(sql)

        await self._run(work, fail_fast=False)
        self._failing_until = 0.0

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
                _logger.debug("listening on %s failed (%s); retrying", channel, one_line(str(exc)))
            await asyncio.sleep(_FAIL_FAST_SECONDS)

    async def close(self) -> None:
        await self._pool.close()


async def _within(seconds: float, work: Coroutine[Any, Any, Any]) -> Any:
    """A hard bound besides the pool's and libpq's timeouts, for a server that stops answering mid-query. The work
    goes on in the background past it: cancelled, psycopg asks the server to cancel the query and waits up to 10 s
    for that, which is no caller's wait."""
    task = asyncio.ensure_future(work)
    try:
        done, _ = await asyncio.wait({task}, timeout=seconds)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved: nobody else will
        raise TimeoutError
    return task.result()
