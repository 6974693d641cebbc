"""PostgreSQL connections (psycopg 3): sync ones for the CLI, migrations and worker threads, an async pool for the
server's event loop. Both take the password from the environment variable the settings name, never from the URL."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool

from server.db.settings import StoreSettings

APPLICATION_NAME = "portico"
_RECONNECT_ATTEMPT_SECONDS = 2.0  # tries at 0, 1 and 2 s, then left to the next caller (async_pool)


def connection_kwargs(settings: StoreSettings, *, statement_timeout: bool = True) -> dict[str, Any]:
    """libpq parameters besides the URL. `statement_timeout`: a query that takes longer than the store timeout is
    cancelled by the server. Migrations go without one: an ALTER on a big table may rightly take longer, so they also
    set aside a `statement_timeout` the DBA gave the role or database (a session's options override those)."""
    kwargs: dict[str, Any] = {
        "connect_timeout": max(1, round(settings.timeout_seconds)),  # libpq counts whole seconds
        "application_name": APPLICATION_NAME,
        # A database host that vanishes without closing connections (a partition) is noticed within ~25 s, also by
        # an idle LISTEN connection.
        "keepalives": 1, "keepalives_idle": 10, "keepalives_interval": 5, "keepalives_count": 3,
    }
    password = settings.password()
    if password is not None:
        kwargs["password"] = password
    # The writes are made for READ COMMITTED (a rotation waits for one beside it, then sees what it made): a DBA's
    # default_transaction_isolation above it would answer concurrent admin writes with serialization failures.
    timeout_ms = int(settings.timeout_seconds * 1000) if statement_timeout else 0
    kwargs["options"] = rf"-c default_transaction_isolation=read\ committed -c statement_timeout={timeout_ms}"
    return kwargs


def connect(settings: StoreSettings, *, statement_timeout: bool = True, autocommit: bool = True) -> psycopg.Connection:
    return psycopg.connect(
        settings.url, autocommit=autocommit, **connection_kwargs(settings, statement_timeout=statement_timeout)
    )


async def connect_async(settings: StoreSettings, *, autocommit: bool = True) -> psycopg.AsyncConnection:
    return await psycopg.AsyncConnection.connect(settings.url, autocommit=autocommit, **connection_kwargs(settings))


def async_pool(settings: StoreSettings) -> AsyncConnectionPool:
    """Not opened yet: `await pool.open(wait=False)` starts it without waiting for the database, so a server can start
    while PostgreSQL is down (readiness reports it) and recover when it comes back. Each connection is checked as it
    is taken (one round trip), so connections cut by a restart are replaced instead of failing a lookup."""
    checking: asyncio.Task | None = None  # the one check of the whole pool under way, if any

    async def check(conn: psycopg.AsyncConnection) -> None:
        nonlocal checking
        try:
            await AsyncConnectionPool.check_connection(conn)
        except psycopg.Error:
            # Cut (a restart, a DBA's pg_terminate_backend): the pool's other idle connections most likely went with
            # it. psycopg_pool waits about a second before checking the next one it hands out, 2 s before the one
            # after...: a busy host's first lookups after a restart took seconds, or were refused. All are checked
            # now, so the caller's next one is sound or new. In a task of its own, shielded: a caller given up on
            # (its time bound) must not cancel it midway, which would lose the connections it took out to check.
            if checking is None or checking.done():
                checking = asyncio.create_task(pool.check())
            await asyncio.shield(checking)
            raise

    pool = AsyncConnectionPool(
        settings.url,
        kwargs={"autocommit": True, **connection_kwargs(settings)},
        min_size=1,
        max_size=settings.pool_size,
        timeout=settings.timeout_seconds,  # waiting for a connection: an outage answers within this
        # psycopg_pool spaces an attempt's retries ever wider (1, 2, 4, 8 s...): through a long outage its next try
        # could come minutes after the database is back. An attempt given up this soon is replaced by the next
        # caller's (readiness asks every second), so the pool keeps trying about every second while it is away.
        reconnect_timeout=_RECONNECT_ATTEMPT_SECONDS,
        check=check,
        name="portico-keys",
        open=False,
    )
    return pool
