"""SQLite key store. Secrets are stored only as SHA-256 hashes: they are 256-bit random, so a fast hash is safe."""

from __future__ import annotations

import hashlib
import secrets
import sqlite3
import time
from collections.abc import Iterable
from pathlib import Path

from server.domain import KEY_LIMIT_NAMES, ApiKey, KeyLimits
from server.errors import InvalidRequest, NotFound

SECRET_PREFIX = "pk-"

_SCHEMA = f"""
CREATE TABLE IF NOT EXISTS api_keys (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    secret_hash TEXT NOT NULL UNIQUE,
    all_models INTEGER NOT NULL,
    models TEXT NOT NULL,          -- comma-separated model ids
    env TEXT NOT NULL DEFAULT '',
    admin INTEGER NOT NULL DEFAULT 0,
    created INTEGER NOT NULL,
    revoked_at INTEGER NOT NULL DEFAULT 0,
    {", ".join(f"{c} INTEGER" for c in KEY_LIMIT_NAMES)}
);
"""


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def looks_like_secret(text: str) -> bool:
    return text.startswith(SECRET_PREFIX)


class KeyStore:
    """Keys in `<data_dir>/keys.db`. Safe to open from the server and the CLI at once (WAL mode)."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA busy_timeout=5000")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        self._db.close()

    def create(
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
        models = sorted(set(models))
        if not name:
            raise InvalidRequest("A key needs a name.", param="name")
        if not all_models and not models:
            raise InvalidRequest("Grant the key some models, or all of them.", param="models")
        for column in KEY_LIMIT_NAMES:
            value = getattr(limits, column)
            if value is not None and value < 1:
                raise InvalidRequest(f"{column} must be at least 1.", param=column)
        env_part = f"{env}-" if env else ""
        secret = f"{SECRET_PREFIX}{env_part}{secrets.token_urlsafe(32)}"
        key = ApiKey(
            id=f"key_{secrets.token_hex(8)}",
            name=name,
            all_models=all_models,
            models=frozenset(models),
            limits=limits,
            env=env,
            admin=admin,
            created=int(time.time()),
        )
        self._db.execute(
            f"INSERT INTO api_keys (id, name, secret_hash, all_models, models, env, admin, created, "
            f"{', '.join(KEY_LIMIT_NAMES)}) VALUES ({', '.join('?' * (8 + len(KEY_LIMIT_NAMES)))})",
            (key.id, name, hash_secret(secret), int(all_models), ",".join(models), env, int(admin), key.created,
             *(getattr(limits, c) for c in KEY_LIMIT_NAMES)),
        )
        return key, secret

    def list(self) -> list[ApiKey]:
        return [_row_to_key(row) for row in self._db.execute("SELECT * FROM api_keys ORDER BY created, id")]

    def count(self) -> int:
        return self._db.execute("SELECT count(*) FROM api_keys").fetchone()[0]

    def get(self, key_id: str) -> ApiKey:
        row = self._db.execute("SELECT * FROM api_keys WHERE id = ?", (key_id,)).fetchone()
        if row is None:
            raise NotFound(f"No key with id {key_id[:40]!r}.", param="id")
        return _row_to_key(row)

    def find_active(self, secret_hash: str) -> ApiKey | None:
        """The unrevoked key whose secret hashes to `secret_hash`."""
        row = self._db.execute(
            "SELECT * FROM api_keys WHERE secret_hash = ? AND revoked_at = 0", (secret_hash,)
        ).fetchone()
        return None if row is None else _row_to_key(row)

    def revoke(self, id_or_secret: str) -> ApiKey:
        """Revoke by key id or by the secret itself; revoking twice keeps the first time."""
        if looks_like_secret(id_or_secret):
            row = self._db.execute(
                "SELECT id FROM api_keys WHERE secret_hash = ?", (hash_secret(id_or_secret),)
            ).fetchone()
            if row is None:
                raise NotFound("No key has that secret.", param="id")
            key_id = row["id"]
        else:
            key_id = id_or_secret
        self._db.execute(
            "UPDATE api_keys SET revoked_at = ? WHERE id = ? AND revoked_at = 0", (int(time.time()), key_id)
        )
        return self.get(key_id)


def _row_to_key(row: sqlite3.Row) -> ApiKey:
    return ApiKey(
        id=row["id"],
        name=row["name"],
        all_models=bool(row["all_models"]),
        models=frozenset(m for m in row["models"].split(",") if m),
        limits=KeyLimits(**{c: row[c] for c in KEY_LIMIT_NAMES}),
        env=row["env"],
        admin=bool(row["admin"]),
        created=row["created"],
        revoked_at=row["revoked_at"],
    )
