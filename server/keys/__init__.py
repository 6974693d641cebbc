"""API keys: the store (SQLite or PostgreSQL), the authenticator that caches lookups for a bounded time, and the
one key-admin service behind KeyService and `portico keys`."""

from server.keys.admin import KeyAdmin
from server.keys.auth import Authenticator
from server.keys.store import KeyStore, hash_secret, looks_like_secret, open_key_store, open_sqlite_key_store

__all__ = ["Authenticator", "KeyAdmin", "KeyStore", "hash_secret", "looks_like_secret", "open_key_store",
           "open_sqlite_key_store"]
