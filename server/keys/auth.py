"""Turns request metadata into an ApiKey, caching lookups (hits and misses) for a bounded time."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from cachetools import TTLCache

from server.domain import ApiKey
from server.errors import AuthenticationFailed, PermissionDenied
from server.keys.store import KeyStore, hash_secret

Metadata = Sequence[tuple[str, str | bytes]]

MISSING_KEY_MESSAGE = "You didn't provide an API key. Send it as `Authorization: Bearer YOUR_KEY`."


class Authenticator:
    def __init__(
        self,
        store: KeyStore,
        *,
        cache_seconds: float,
        cache_size: int = 10_000,
        on_authenticated: Callable[[ApiKey], None] = lambda key: None,
    ) -> None:
        self._store = store
        self._on_authenticated = on_authenticated  # telemetry notes the key id (never the secret) on the request
        # Keyed by a hash so secrets are not held in plain text longer than the request itself.
        self._cache: TTLCache[str, ApiKey | None] = TTLCache(maxsize=cache_size, ttl=cache_seconds)

    def authenticate(self, metadata: Metadata, *, allow_x_api_key: bool = False) -> ApiKey:
        secret = _secret_from(metadata, allow_x_api_key)
        if not secret:
            raise AuthenticationFailed(MISSING_KEY_MESSAGE)
        digest = hash_secret(secret)
        try:
            key = self._cache[digest]
        except KeyError:
            key = self._store.find_active(digest)
            self._cache[digest] = key
        if key is None:
            raise AuthenticationFailed("Incorrect API key provided.")
        self._on_authenticated(key)
        return key

    def authenticate_admin(self, metadata: Metadata) -> ApiKey:
        key = self.authenticate(metadata)
        if not key.admin:
            raise PermissionDenied(f"Key {key.id} is not an admin key; KeyService needs one.")
        return key


def _secret_from(metadata: Metadata, allow_x_api_key: bool) -> str:
    x_api_key = ""
    for name, value in metadata:
        if name == "authorization" and isinstance(value, str):
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer":
                return token.strip()
        elif name == "x-api-key" and allow_x_api_key and isinstance(value, str):
            x_api_key = value.strip()
    return x_api_key
