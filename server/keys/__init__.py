"""API keys: the SQLite store and the authenticator that caches lookups for a bounded time."""

from server.keys.auth import Authenticator
from server.keys.store import KeyStore, hash_secret, looks_like_secret

__all__ = ["Authenticator", "KeyStore", "hash_secret", "looks_like_secret"]
