"""The key store: keys in SQLite (`<data_dir>/keys.db`, the default) or PostgreSQL (`keys.store: postgresql://...`,
shared by several hosts), through one async Database (server/db/database.py), so no call blocks the event loop.

Secrets are stored only as SHA-256 hashes: they are 256-bit random, so a fast hash is safe."""

from __future__ import annotations

import dataclasses
import hashlib
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from server.db.database import Database, open_database, storable
from server.db.settings import StoreSettings
from server.domain_keys import (
    KEY_LIMIT_NAMES, MAX_COUNT_LIMIT, MAX_SPEND_LIMIT, SPEND_LIMIT_NAMES, ApiKey, KeyLimits, new_key_id,
)
from server.errors import InvalidRequest, NotFound
from server.keys.schema import COMPONENT, MIGRATIONS
from server.usage.money import usd_text

SECRET_PREFIX = "pk-"
CHANGES_CHANNEL = "portico_key_changes"  # PostgreSQL NOTIFY channel: the id of each key changed
_PING = ("SELECT 1 FROM api_keys WHERE secret_hash = '' UNION ALL "
         "SELECT 1 FROM retired_secrets WHERE secret_hash = ''")


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def looks_like_secret(text: str) -> bool:
    return text.startswith(SECRET_PREFIX)


async def open_key_store(settings: StoreSettings) -> KeyStore:
    """The configured store, its schema brought up to date (server/keys/schema.py)."""
    return KeyStore(await open_database(settings, MIGRATIONS))


async def open_sqlite_key_store(path: Path) -> KeyStore:
    return await open_key_store(StoreSettings(sqlite_path=path))


class KeyStore:
    """Every method may raise StoreUnavailable when the database does not answer."""

    def __init__(self, db: Database) -> None:
        self._db = db

    async def close(self) -> None:
        await self._db.close()

    async def ping(self) -> None:
        """Whether a lookup can be answered: it reads both key tables (through their indexes, as find_active does),
        so a lock another session holds on either (VACUUM FULL, a long ALTER) fails the check as it fails lookups."""
        await self._db.ping(_PING)

    async def watch_changes(self, on_change: Callable[[str | None], None]) -> None:
        """Until cancelled: `on_change(key_id)` for each key revoked, rotated or updated by any host (None: changes
        may have been missed). PostgreSQL LISTEN/NOTIFY; SQLite returns at once."""
        await self._db.listen(CHANGES_CHANNEL, on_change)

    async def create(
        self,
        name: str,
        *,
        all_models: bool,
        models: Iterable[str] = (),
        limits: KeyLimits = KeyLimits(),
        env: str = "",
        admin: bool = False,
    ) -> tuple[ApiKey, str]:
        """Store a new key; returns it with its secret, which is not kept anywhere."""
        key, secret, columns, values = _new_key(name, all_models, models, limits, env, admin)
        await self._db.execute(f"INSERT INTO api_keys ({columns}) VALUES ({', '.join('?' * len(values))})", values)
        return key, secret

    async def create_first(self, name: str, *, env: str = "") -> tuple[ApiKey, str] | None:
        """An all-models key, stored only if the store has no key yet (a first start's development key); None if it
        has. Hosts starting together on an empty store make one between them: each first updates the same row, which
        PostgreSQL locks until the commit (SQLite's BEGIN IMMEDIATE serialises them anyway), so a later one's
        NOT EXISTS sees the key the first made."""
        key, secret, columns, values = _new_key(name, True, (), KeyLimits(), env, False)
        await self._db.transaction([
            ("UPDATE schema_migrations SET version = version WHERE component = ? AND version = 1", (COMPONENT,)),
            (f"INSERT INTO api_keys ({columns}) SELECT {', '.join('?' * len(values))} "
             "WHERE NOT EXISTS (SELECT 1 FROM api_keys)", values),
        ])
        made = await self._db.fetch_one("SELECT id FROM api_keys WHERE id = ?", (key.id,))
        return None if made is None else (key, secret)

    async def list(self, *, limit: int = 0, after: ApiKey | None = None) -> list[ApiKey]:
        """Keys oldest first (by created, then id): at most `limit` (0: every one), those listed after `after`."""
        where, args = ("WHERE created > ? OR (created = ? AND id > ?) ", (after.created, after.created, after.id)) \
            if after is not None else ("", ())
        bound, args = (" LIMIT ?", (*args, limit)) if limit else ("", args)
        rows = await self._db.fetch_all(f"SELECT * FROM api_keys {where}ORDER BY created, id{bound}", args)
        return [_row_to_key(row) for row in rows]

    async def count(self) -> int:
        row = await self._db.fetch_one("SELECT count(*) AS n FROM api_keys")
        return int(row["n"])

    async def get(self, key_id: str) -> ApiKey:
        # An id copied from a log line or a terminal comes with a space before it or a line's end after it: no id
        # holds whitespace, so it is not read (revoke does the same), else "No key with id ' key_...'".
        key_id = key_id.strip()
        if not key_id:  # a typed caller who left `id` unset (proto3's ""): no key is missing, the id is
            raise InvalidRequest("id is required: the key's id (key_...).", param="id")
        # "No key with id ..." read as "this secret is no key's" (a leaked one)
        if looks_like_secret(key_id):
            raise InvalidRequest("id takes a key id (key_...), not a key's secret (pk-...); only revoke takes a "
                                 "secret.", param="id")
        row = await self._db.fetch_one("SELECT * FROM api_keys WHERE id = ?", (key_id,)) if storable(key_id) else None
        if row is None:
            raise NotFound(f"No key with id {key_id[:40]!r}.", param="id")
        return _row_to_key(row)

    async def find_active(self, secret_hash: str) -> ApiKey | None:
        """The unrevoked key whose secret, or whose rotated-out secret still in its grace period, hashes to
        `secret_hash`."""
        row = await self._db.fetch_one(
            "SELECT * FROM api_keys WHERE secret_hash = ? AND revoked_at = 0", (secret_hash,)
        )
        if row is not None:
            return _row_to_key(row)
        row = await self._db.fetch_one(
            "SELECT api_keys.*, retired_secrets.expires_at AS secret_expires FROM retired_secrets "
            "JOIN api_keys ON api_keys.id = retired_secrets.key_id "
            "WHERE retired_secrets.secret_hash = ? AND retired_secrets.expires_at > ? AND revoked_at = 0",
            (secret_hash, int(time.time())),
        )
        return None if row is None else dataclasses.replace(_row_to_key(row), secret_expires=row["secret_expires"])

    async def update(
        self,
        key_id: str,
        *,
        name: str | None = None,
        grants: tuple[bool, Iterable[str]] | None = None,
        limits: Mapping[str, int | None] | None = None,
        env: str | None = None,
    ) -> ApiKey:
        """Change what is given: `grants` is (all_models, models); `limits` maps limit names to a new value, or to
        None to remove the key's own value (the configured default applies again)."""
        key = await self.get(key_id)
        changes: dict[str, object] = {}
        if name is not None:
            if not name:
                raise InvalidRequest("A key needs a name.", param="name")
            changes["name"] = name
        if grants is not None:
            all_models, models = grants[0], sorted(set(grants[1]))
            if not all_models and not models:
                raise InvalidRequest("Grant the key some models, or all of them.", param="models")
            changes["all_models"], changes["models"] = all_models, ",".join([] if all_models else models)
        for column, value in (limits or {}).items():
            if column not in KEY_LIMIT_NAMES:
                raise InvalidRequest(f"Unknown limit {column!r}.", param="limits")
            if value is not None:
                _check_limit(column, value, " (0 removes the key's own limit)")
            changes[column] = value
        if env is not None:
            changes["env"] = env
        if changes:
            assignments = ", ".join(f"{column} = ?" for column in changes)
            assignment = (f"UPDATE api_keys SET {assignments} WHERE id = ?", (*changes.values(), key.id))
            await self._db.transaction([assignment], notify=(CHANGES_CHANNEL, key.id))
        return await self.get(key.id)

    async def rotate(self, key_id: str, *, grace_seconds: int) -> tuple[ApiKey, str, int]:
        """Give the key a new secret; the current one stays valid for `grace_seconds`. Returns the key, the new
        secret (not kept anywhere) and when the previous secret stops working."""
        key = await self.get(key_id)
        if key.revoked_at:
            raise _revoked(key.id)
        now = int(time.time())
        secret, expires = _new_secret(key.env), now + max(0, grace_seconds)
        await self._db.transaction([  # the old secret is retired exactly when the new one takes over
            # The key's row, locked first: a rotation running beside this one (PostgreSQL; SQLite runs one at a time)
            # waits, then retires the secret this one made, not the same secret again (a duplicate, a 500).
            ("UPDATE api_keys SET secret_hash = secret_hash WHERE id = ?", (key.id,)),
            ("DELETE FROM retired_secrets WHERE expires_at <= ?", (now,)),
            # Only while the key is active: one revoked since it was read above (another admin) keeps its secrets.
            ("INSERT INTO retired_secrets (secret_hash, key_id, expires_at) "
             "SELECT secret_hash, id, ? FROM api_keys WHERE id = ? AND revoked_at = 0", (expires, key.id)),
            ("UPDATE api_keys SET secret_hash = ? WHERE id = ? AND revoked_at = 0", (hash_secret(secret), key.id)),
        ], notify=(CHANGES_CHANNEL, key.id))
        rotated = await self.get(key.id)
        # Revoked by now: before this rotation (its secret stored nowhere, and never to work: refused as a revoked
        # key's rotation is) or after it (the secret was made and shown; a rotation since may have retired it).
        if rotated.revoked_at and await self._db.fetch_one(
            "SELECT 1 FROM api_keys WHERE secret_hash = ? "
            "UNION ALL SELECT 1 FROM retired_secrets WHERE secret_hash = ?",
            (hash_secret(secret),) * 2,
        ) is None:
            raise _revoked(key.id)
        return rotated, secret, expires

    async def revoke(self, id_or_secret: str) -> ApiKey:
        """Revoke by key id or by the secret itself; revoking twice keeps the first time."""
        if looks_like_secret(id_or_secret):
            row = await self._db.fetch_one(
                "SELECT id FROM api_keys WHERE secret_hash = ? "
                "UNION SELECT key_id FROM retired_secrets WHERE secret_hash = ?",
                (hash_secret(id_or_secret),) * 2,
            ) if storable(id_or_secret) else None
            if row is None:
                raise NotFound("No key has that secret.", param="id")
            key_id = row["id"]
        else:
            key_id = (await self.get(id_or_secret)).id
        await self._db.transaction(
            [("UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at = 0", (int(time.time()), key_id))],
            notify=(CHANGES_CHANNEL, key_id),
        )
        return await self.get(key_id)


def _new_key(name: str, all_models: bool, models: Iterable[str], limits: KeyLimits, env: str,
             admin: bool) -> tuple[ApiKey, str, str, tuple]:
    """A new key checked for storage, its secret, and the api_keys columns and values that store it."""
    models = sorted(set(models))
    if not name:
        raise InvalidRequest("A key needs a name.", param="name")
    if not all_models and not models:
        raise InvalidRequest("Grant the key some models, or all of them.", param="models")
    for column in KEY_LIMIT_NAMES:
        if (value := getattr(limits, column)) is not None:
            _check_limit(column, value)
    secret = _new_secret(env)
    key = ApiKey(id=new_key_id(), name=name, all_models=all_models, models=frozenset(models),
                 limits=limits, env=env, admin=admin, created=int(time.time()))
    columns = f"id, name, secret_hash, all_models, models, env, admin, created, {', '.join(KEY_LIMIT_NAMES)}"
    values = (key.id, name, hash_secret(secret), all_models, ",".join(models), env, admin, key.created,
              *(getattr(limits, c) for c in KEY_LIMIT_NAMES))
    return key, secret, columns, values


def _revoked(key_id: str) -> InvalidRequest:
    return InvalidRequest(f"Key {key_id} is revoked; a revoked key cannot be rotated.", param="id")


def _check_limit(column: str, value: int, removal: str = "") -> None:
    """Before storage: out of range, a value was a 500 (SQLite OverflowError, PostgreSQL bigint out of range)."""
    spend = column in SPEND_LIMIT_NAMES
    top = MAX_SPEND_LIMIT if spend else MAX_COUNT_LIMIT
    if not 1 <= value <= top:
        least, most = ("more than $0", usd_text(top)) if spend else ("at least 1", f"{top}")
        raise InvalidRequest(f"{column} must be {least}{removal} and at most {most}.", param=f"limits.{column}")


def _new_secret(env: str) -> str:
    env_part = f"{env}-" if env else ""
    return f"{SECRET_PREFIX}{env_part}{secrets.token_urlsafe(32)}"


def _row_to_key(row: Mapping[str, Any]) -> ApiKey:
    return ApiKey(
        id=row["id"],
        name=row["name"],
        all_models=bool(row["all_models"]),
        models=frozenset(m for m in row["models"].split(",") if m),
        limits=KeyLimits(**{c: _stored_limit(c, row[c]) for c in KEY_LIMIT_NAMES}),
        env=row["env"],
        admin=bool(row["admin"]),
        created=row["created"],
        revoked_at=row["revoked_at"],
    )


def _stored_limit(column: str, value: int | None) -> int | None:
    """Up to 2026-11-26 a key's own limits had no upper bound, and KeyService carries them as int32: one such key made
    every key list a 500. It counts as the most a key may have now, shown as enforced (read, not migrated: a schema
    version would stop hosts not yet upgraded from restarting)."""
    if value is None or column in SPEND_LIMIT_NAMES:
        return value
    return min(value, MAX_COUNT_LIMIT)
