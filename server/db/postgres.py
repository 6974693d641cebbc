"""PostgreSQL connections (psycopg 3): sync ones for the CLI, migrations and worker threads, an async pool for the
server's event loop. Both take the password from the environment variable the settings name, never from the URL."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import psycopg
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from server.db.database import StoreUnavailable
from server.db.settings import StoreSettings

APPLICATION_NAME = "portico"
_RECONNECT_ATTEMPT_SECONDS = 2.0  # tries at 0, 1 and 2 s, then left to the next caller (async_pool)
_REASON_SECONDS = 10.0  # how long the pool's latest failed attempt explains a connection not given


def one_line(text: str) -> str:
    """libpq's messages put a hint on a line of their own ('\n\tIs the server running on that host...'), which in
    a log began a line with no time or level: joined here."""
    return " ".join(text.split())


# An attempt given up (the next caller's begins), a connection found cut (replaced): said by the stores' own lines.
_POOL_NOISE = frozenset({"reconnection attempt in pool %r failed after %s sec", "discarding broken connection: %s"})


class _PoolAttempts(logging.Filter):
    """psycopg_pool logs every failed attempt to connect (about one a second, idle or not, for as long as PostgreSQL
    is away), every attempt given up and every connection found cut; the key store and the usage ledger log an outage
    once when it begins and once when it ends. Those lines are held back, keeping why the latest attempt failed for
    the store's own line."""

    def __init__(self) -> None:
        super().__init__()
        self._reason = ""
        self._at = 0.0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "error connecting in %r: %s" and isinstance(record.args, tuple) and len(record.args) == 2:
            self._reason, self._at = one_line(str(record.args[1])), time.monotonic()
            return False
        return record.msg not in _POOL_NOISE

    def reason(self) -> str:
        return self._reason if time.monotonic() - self._at < _REASON_SECONDS else ""


_POOL_ATTEMPTS = _PoolAttempts()


def failure(exc: Exception) -> str:
    """A PostgreSQL failure for a StoreUnavailable (and so the log), on one line; a pool that gave no connection in
    time ('couldn't get a connection after 1.00 sec') adds what its latest attempt to connect met."""
    text = one_line(str(exc)) or type(exc).__name__
    if isinstance(exc, PoolTimeout) and (reason := _POOL_ATTEMPTS.reason()):
        text = f"{text}: {reason}"
    return f"PostgreSQL: {text}"


# libpq's and the server's words for a login refused (a password wrong or missing, an ident or certificate check
# failed, no pg_hba.conf line for this user): the server answered, so /readyz says that rather than `unreachable`.
# The server gives no SQLSTATE to a failed connection's client, only these words.
_CREDENTIALS_REFUSED = ("authentication failed", "no password supplied", "no pg_hba.conf entry")


def unavailable(exc: Exception) -> StoreUnavailable:
    """A PostgreSQL failure as the key store's StoreUnavailable (failure(), and whether the login was refused or the
    role refused the tables: SQLSTATE 42501, a DBA's REVOKE or a role never granted them)."""
    text = failure(exc)
    return StoreUnavailable(text, credentials_refused=any(words in text for words in _CREDENTIALS_REFUSED),
                            permission_denied=isinstance(exc, psycopg.errors.InsufficientPrivilege))


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
    logging.getLogger("psycopg.pool").addFilter(_POOL_ATTEMPTS)  # once, however many pools
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
