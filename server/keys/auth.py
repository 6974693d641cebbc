"""Turns request metadata into an ApiKey, caching lookups so that most requests never reach the key store.

Two caches, apart, keyed by the secret's hash (secrets are not held longer than the request itself):
- positive (LRU, `cache_size`): a key found is used without asking the store for `cache_seconds`. That is also the
  longest a revocation, rotation or grant change made on another host takes to reach this one; with PostgreSQL it
  usually arrives at once (LISTEN/NOTIFY: `start` watches the store's changes and drops the changed key).
- negative (`negative_cache_size`, `cache_seconds`): a secret no key has. A flood of random secrets fills only this
  one, so it cannot push valid keys out.
When the store does not answer, a cached key keeps working until `stale_seconds` after it was last confirmed;
any other secret is answered 503 service_unavailable with retry-after, never a hang or a 500. Concurrent lookups of
one secret share one query.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Sequence

from cachetools import LRUCache, TTLCache

from server.db.database import RETRY_AFTER_SECONDS, StoreUnavailable
from server.domain_keys import ApiKey
from server.errors import AuthenticationFailed, PermissionDenied, ServiceUnavailable
from server.keys.store import SECRET_PREFIX, KeyStore, hash_secret

Metadata = Sequence[tuple[str, str | bytes]]

MISSING_KEY_MESSAGE = "You didn't provide an API key. Send it as `Authorization: Bearer YOUR_KEY`."
# Where the Anthropic SDK's header is taken too (/v1/messages, /v1/models), the message names it as well.
MISSING_KEY_MESSAGE_X_API_KEY = ("You didn't provide an API key. Send it as `x-api-key: YOUR_KEY` or "
                                 "`Authorization: Bearer YOUR_KEY`.")
# A key in x-api-key on a path that reads only Authorization: the caller did send one, in the wrong header.
X_API_KEY_NOT_READ_MESSAGE = ("x-api-key is read only on /v1/messages and /v1/models (the Anthropic SDK's paths): "
                              "send the key here as `Authorization: Bearer YOUR_KEY`.")
MORE_THAN_ONE_KEY_MESSAGE = "Only one API key may be sent with a request, in one key header."
# A key in the other header's form: said so, whether the key is right or not (the caller would otherwise check, or
# rotate, a key that may be fine). Never quoting the key.
X_API_KEY_WITH_SCHEME_MESSAGE = ("Malformed x-api-key header: it takes the key alone, without `Bearer `. Send it as "
                                 "`x-api-key: YOUR_KEY`.")
KEY_WITHOUT_SCHEME_MESSAGE = ("Malformed Authorization header: the key has no scheme before it. Send it as "
                              "`Authorization: Bearer YOUR_KEY`.")
# `Authorization: Bearer Bearer KEY`: the openai SDK given `api_key="Bearer pk-..."` (a value copied from a curl line).
BEARER_TWICE_MESSAGE = ("Malformed Authorization header: `Bearer ` is written twice, the second as part of the key. "
                        "Send it as `Authorization: Bearer YOUR_KEY`.")
# `Authorization: Bearer:KEY`, `Bearer=KEY`, `BearerKEY`: the scheme and the key run together.
KEY_GLUED_TO_SCHEME_MESSAGE = ("Malformed Authorization header: no space separates `Bearer` from the key. Send it as "
                               "`Authorization: Bearer YOUR_KEY`.")
KEY_WITH_OTHER_SCHEME_MESSAGE = ("Malformed Authorization header: the key's scheme is not Bearer. Send it as "
                                 "`Authorization: Bearer YOUR_KEY`.")  # the scheme is not quoted: it may be a key
# A key read with its quotes (`KEY="pk-..."` in a file `docker run --env-file` reads: it keeps them).
QUOTED_KEY_MESSAGES = {
    "authorization": ("Malformed Authorization header: quotes surround the key. Send it as "
                      "`Authorization: Bearer YOUR_KEY`."),
    "x-api-key": "Malformed x-api-key header: quotes surround the key. Send it as `x-api-key: YOUR_KEY`.",
}
# The form of the keys Portico makes (server/keys/store.py: `pk-`, an optional env, token_urlsafe).
_KEY_FORM = re.compile(rf"{re.escape(SECRET_PREFIX)}[A-Za-z0-9_-]+")
_QUOTED_KEY_FORM = re.compile(rf"([\"']){_KEY_FORM.pattern}\1")
_GLUED_KEY_FORM = re.compile(rf"(?i:bearer)[:=]? *{_KEY_FORM.pattern}")

_logger = logging.getLogger(__name__)


class Authenticator:
    def __init__(
        self,
        store: KeyStore,
        *,
        cache_seconds: float,
        stale_seconds: float = 300.0,
        cache_size: int = 10_000,
        negative_cache_size: int = 10_000,
        on_authenticated: Callable[[ApiKey], None] = lambda key: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._store = store
        self._on_authenticated = on_authenticated  # telemetry notes the key id (never the secret) on the request
        self._cache_seconds = cache_seconds
        self._stale_seconds = max(stale_seconds, cache_seconds)
        self._clock = clock
        self._keys: LRUCache[str, tuple[ApiKey, float]] = LRUCache(maxsize=cache_size)  # -> (key, confirmed at)
        self._unknown: TTLCache[str, bool] = TTLCache(maxsize=negative_cache_size, ttl=cache_seconds, timer=clock)
        # One store query per secret at a time: its answer, when it was asked, and the change notices seen by then.
        self._lookups: dict[str, tuple[asyncio.Future[ApiKey | None], float, int]] = {}
        self._notices = 0  # change notices so far (forget): an answer asked for before the latest may predate it
        # Keys confirmed before this (a lost notice's forget) are asked for again at their next use.
        self._recheck_before = float("-inf")
        self._store_down_logged = False
        self._watch: asyncio.Task | None = None

    @property
    def stale_seconds(self) -> float:
        """How long a cached key is served after it was last confirmed, the store down: never less than the cache's
        own time, within which a key is served without asking the store (readiness holds as long)."""
        return self._stale_seconds

    def start(self) -> None:
        """Drop a key from the cache as soon as any host changes it (where the store can tell)."""
        self._watch = asyncio.create_task(self._store.watch_changes(self.forget))

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch

    def forget(self, key_id: str | None) -> None:
        """Ask the store again next time for this key (None: for every key).

        A key's own notice drops it: it changed. None only says notices may have been lost (the listener's
        connection broke, typically because the store went down), so every key is checked again at its next use
        but keeps its outage grace: clearing the cache would refuse cached keys exactly when the store is down.
        """
        if key_id is None:  # when each was confirmed stays as it was: the outage grace runs from it
            # Not a notice: an answer on its way is kept, and asked for again at its next use as the others are
            # (the listener says so at each connect, its first included: the first answers went uncached).
            self._recheck_before = self._clock()
            return
        self._notices += 1
        for digest in [digest for digest, (key, _) in self._keys.items() if key.id == key_id]:
            del self._keys[digest]

    async def authenticate(self, metadata: Metadata, *, allow_x_api_key: bool = False) -> ApiKey:
        secret = _secret_from(metadata, allow_x_api_key)
        if not secret:
            if allow_x_api_key:
                raise AuthenticationFailed(MISSING_KEY_MESSAGE_X_API_KEY)
            raise AuthenticationFailed(X_API_KEY_NOT_READ_MESSAGE if _has_x_api_key(metadata) else MISSING_KEY_MESSAGE)
        key = await self._key_for(hash_secret(secret))
        if key is None:
            raise AuthenticationFailed("Incorrect API key provided.")
        self._on_authenticated(key)
        return key

    async def authenticate_admin(self, metadata: Metadata) -> ApiKey:
        key = await self.authenticate(metadata)
        if not key.admin:
            raise PermissionDenied(f"Key {key.id} is not an admin key; the admin API (keys, limits, models) needs one.")
        return key

    async def _key_for(self, digest: str) -> ApiKey | None:
        if digest in self._unknown:
            return None
        cached = self._keys.get(digest)
        if cached is not None and 0 < cached[0].secret_expires <= time.time():
            # A rotated-out secret whose grace has ended: refused at its second, as the store refuses it, and
            # without asking the store (which may be down). It never works again.
            del self._keys[digest]
            self._unknown[digest] = True
            return None
        now = self._clock()
        if cached is not None and now - cached[1] < self._cache_seconds and cached[1] > self._recheck_before:
            return cached[0]
        try:
            key, asked, notices = await self._shared_lookup(digest)
        except StoreUnavailable as exc:
            self._log_store_down(exc)
            if cached is not None and now - cached[1] < self._stale_seconds:
                return cached[0]  # stale, within the configured bound: availability over freshness
            raise ServiceUnavailable(
                "The key store is unreachable, so this API key cannot be checked now. Retry shortly.",
                retry_after=RETRY_AFTER_SECONDS,
            ) from None
        self.store_checked(None)
        if key is None:
            self._keys.pop(digest, None)
            self._unknown[digest] = True
        elif notices == self._notices:
            # Confirmed when asked, not when answered: a change made meanwhile is bounded by cache_seconds too. An
            # answer asked for before a change notice is not kept at all (the change may have come after it).
            self._keys[digest] = (key, asked)
        return key

    async def _shared_lookup(self, digest: str) -> tuple[ApiKey | None, float, int]:
        """One store query per secret at a time: the requests that arrive meanwhile wait for its answer. Returns it
        with when it was asked for and the number of change notices seen by then."""
        shared = self._lookups.get(digest)
        if shared is None:
            lookup = asyncio.ensure_future(self._store.find_active(digest))
            shared = self._lookups[digest] = (lookup, self._clock(), self._notices)
            lookup.add_done_callback(lambda _: self._lookups.pop(digest, None))
        lookup, asked, notices = shared
        return await asyncio.shield(lookup), asked, notices  # a caller that goes away does not cancel the others

    def store_checked(self, failure: StoreUnavailable | None) -> None:
        """What a call to the store met (None: an answer). The readiness check's, every second, too: lookups alone
        reach the store only for keys not cached, so PostgreSQL's return went unsaid while cached keys were served,
        and the next outage had no line of its own."""
        if failure is not None:
            self._log_store_down(failure)
        elif self._store_down_logged:
            self._store_down_logged = False
            _logger.info("the key store answers again")

    def _log_store_down(self, exc: Exception) -> None:
        if not self._store_down_logged:
            self._store_down_logged = True
            _logger.error("the key store is unreachable (%s): cached keys are served for up to %gs after their "
                          "last check, other keys get 503", exc, self._stale_seconds)


def _has_x_api_key(metadata: Metadata) -> bool:
    """Whether an x-api-key holds anything (it is not read here: only said to be in the wrong header)."""
    return any(name == "x-api-key" and isinstance(value, str) and value.strip() for name, value in metadata)


def _secret_from(metadata: Metadata, allow_x_api_key: bool) -> str:
    """The request's one key. A key header sent twice, or an Authorization and an x-api-key naming two keys, is
    refused: which key served the request would depend on header order. The same key in both is one key."""
    bearers: list[str] = []
    x_api_keys: list[str] = []
    for name, value in metadata:
        if name == "authorization" and isinstance(value, str):
            # Spaces around a value are no part of it (RFC 9110, 5.5): HTTP/1.1's parser drops them for REST callers,
            # but over HTTP/2 (every gRPC caller) they arrive as sent.
            value = value.strip(" ")
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer":
                token = token.strip()
                if _QUOTED_KEY_FORM.fullmatch(token):
                    raise AuthenticationFailed(QUOTED_KEY_MESSAGES[name])
                again, _, key = token.partition(" ")
                if again.lower() == "bearer" and _KEY_FORM.fullmatch(key.strip()):
                    raise AuthenticationFailed(BEARER_TWICE_MESSAGE)
                bearers.append(token)
            elif _KEY_FORM.fullmatch(value.strip()):
                raise AuthenticationFailed(KEY_WITHOUT_SCHEME_MESSAGE)
            elif _GLUED_KEY_FORM.fullmatch(value):
                raise AuthenticationFailed(KEY_GLUED_TO_SCHEME_MESSAGE)
            elif _KEY_FORM.fullmatch(token.strip()):  # `Token KEY`, `Basic KEY`: a key, under another scheme
                raise AuthenticationFailed(KEY_WITH_OTHER_SCHEME_MESSAGE)
        elif name == "x-api-key" and allow_x_api_key and isinstance(value, str):
            value = value.strip()
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and _KEY_FORM.fullmatch(token.strip()):
                raise AuthenticationFailed(X_API_KEY_WITH_SCHEME_MESSAGE)
            if _QUOTED_KEY_FORM.fullmatch(value):
                raise AuthenticationFailed(QUOTED_KEY_MESSAGES[name])
            x_api_keys.append(value)
    keys = [key for key in bearers + x_api_keys if key]
    # Envoy joins a repeated Authorization header into one value, with a comma: no key has one.
    if len(bearers) > 1 or len(x_api_keys) > 1 or len(set(keys)) > 1 or any("," in key for key in keys):
        raise AuthenticationFailed(MORE_THAN_ONE_KEY_MESSAGE)
    return keys[0] if keys else ""
