"""The response cache: a model may opt in (`cache:` in its entry), and a request then asked before is answered
with the answer given before, replayed through the same renderers.

The key is a SHA-256 over what shapes the answer: the model and what serves it (its upstreams), the endpoint,
whether the caller streams, the caller's body as it arrived minus the fields that only label a request (`user`,
`metadata`, `store`, `safety_identifier`, `prompt_cache_key`), the token limit sent upstream (the caller's, else
`default_max_tokens`), Anthropic beta headers, and, unless the model shares
its cache across keys (`shared: true`), the caller's key id, so an answer never reaches a key that did not ask for
it. A field Portico does not know yet shapes the key too: a new field can cost hits, never give a wrong answer. JSON
numbers are keyed by value (`1` and `1.0` are one request, as Portico reads them). Only whole answers (a Finished
event, nothing failed) no larger than `max_entry_bytes` are stored; errors never are. The caller's `Cache-Control`
is read as HTTP caches read it (RFC 9111): `no-cache` (or `max-age=0`, or `Pragma: no-cache` without a
Cache-Control) skips the lookup (the fresh answer is stored), `max-age=N` refuses answers stored more than N seconds
ago, `no-store` skips both. A request naming state the upstream holds (`thread`, `container`) is no cache question.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from server import wire_json
from server.wire_json import Json
from server.cache.codec import decode, encode_event, entry
from server.cache.stores import CacheStore, MemoryStore
from server.domain import AnthropicMessagesSource, GenerationRequest
from server.domain_answers import Finished, GenerationEvent
from server.domain_models import CacheSettings

__all__ = ["CacheStore", "Lookup", "MemoryStore", "ResponseCache"]

HEADER = "x-portico-cache"
# Fields that label a request for its caller's own records, and do not change the answer.
NOT_SHAPING = frozenset({"user", "metadata", "store", "safety_identifier", "prompt_cache_key", "stream"})
# Fields naming state the upstream holds (a conversation, a code-execution container): the same request is not the
# same question twice (a thread's next turn, a container's files since), so it is never looked up or stored.
STATEFUL = ("thread", "container")


@dataclass(frozen=True, slots=True)
class Lookup:
    key: str
    settings: CacheSettings
    events: tuple[GenerationEvent, ...] | None  # the cached answer: a hit
    store_answer: bool  # False: the caller said no-store

    @property
    def header(self) -> tuple[str, str]:
        return HEADER, "hit" if self.events is not None else "miss"


@dataclass(frozen=True, slots=True)
class CallerControl:
    """What the caller's request headers allow: a stored answer (no older than max_age seconds), storing this one."""

    lookup: bool = True
    max_age: int | None = None
    store: bool = True


class ResponseCache:
    def __init__(self, store: CacheStore, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._clock = clock  # wall clock: an entry's age is judged by whichever process or host reads it

    async def lookup(self, model_id: str, endpoint: str, settings: CacheSettings | None, key_id: str,
                     request: GenerationRequest, metadata: Sequence[tuple[str, str | bytes]]) -> Lookup | None:
        """None when the model is not cached (or the request has no body to key on)."""
        if settings is None or request.source is None or any(name in request.source.body for name in STATEFUL):
            return None
        control = caller_control(metadata)
        key = _entry_key(model_id, endpoint, settings, key_id, request)
        found = await self._store.get(key) if control.lookup else None
        entry = _decoded(found) if found is not None else None
        events = None
        # Stored farther from now than max-age either way: an answer dated "from now" was stored before the clock was
        # stepped back (NTP), maybe long before, and read as younger than any max-age.
        if entry is not None and (control.max_age is None or abs(self._clock() - entry[0]) <= control.max_age):
            events = entry[1]
        return Lookup(key, settings, events, store_answer=control.store)

    async def recorded(self, lookup: Lookup, events: AsyncIterator[GenerationEvent]) -> AsyncIterator[GenerationEvent]:
        """Relays `events`, and stores them once the answer is whole (before its Finished event goes on, since a
        caller reading a JSON answer stops there)."""
        # Encoded into one buffer as they pass, and dropped once past max_entry_bytes: the events themselves, held
        # to the end, took ~2 kB a token (40 MB for a 20,000-token stream) whatever the bound; so would orjson's
        # output for each (4 kB however small).
        kept: bytearray | None = bytearray() if lookup.store_answer else None
        async with aclosing(events):
            async for event in events:
                if kept is not None:
                    if kept:
                        kept += b","
                    kept += encode_event(event)
                    if len(kept) > lookup.settings.max_entry_bytes:
                        kept = None
                    elif isinstance(event, Finished):
                        data = entry(kept, self._clock())
                        if len(data) <= lookup.settings.max_entry_bytes:
                            await self._store.put(lookup.key, data, lookup.settings.ttl_seconds)
                        kept = None
                yield event

    async def forget(self, model_id: str, endpoint: str, settings: CacheSettings | None, key_id: str,
                     request: GenerationRequest) -> None:
        """Drops the answer kept for `request`: one that could not be given to its caller after all."""
        if settings is not None and request.source is not None:
            await self._store.delete(_entry_key(model_id, endpoint, settings, key_id, request))

    async def close(self) -> None:
        await self._store.close()


def _entry_key(model_id: str, endpoint: str, settings: CacheSettings, key_id: str, request: GenerationRequest) -> str:
    """Where `request`'s answer is kept: per key unless the model shares its cache."""
    return cache_key(model_id, settings.serving, endpoint, "" if settings.shared else key_id, request)


def cache_key(model_id: str, serving: str, endpoint: str, scope: str, request: GenerationRequest) -> str:
    source = request.source
    body = {name: _by_value(value) for name, value in source.body.items() if name not in NOT_SHAPING}
    beta = source.beta if isinstance(source, AnthropicMessagesSource) else ()
    # The token limit as sent upstream: a chat request without one gets default_max_tokens, which an operator may
    # change (raised because answers were cut off), and a restarted process or another host must not give those.
    shape = [model_id, serving, str(endpoint), request.stream, scope, list(beta), body, request.params.max_tokens]
    return hashlib.sha256(wire_json.dumps(shape, sort_keys=True)).hexdigest()


def _by_value(value: Json) -> Json:
    """`value` with every whole float as an int: JSON has one number type, and Portico reads `5.0` as `5`."""
    if isinstance(value, float):
        return int(value) if value.is_integer() else value
    if isinstance(value, dict):
        return {name: _by_value(item) for name, item in value.items()}
    if isinstance(value, list):
        return [_by_value(item) for item in value]
    return value


def caller_control(metadata: Sequence[tuple[str, str | bytes]]) -> CallerControl:
    """The request's Cache-Control directives (names case-insensitive, RFC 9111 5.2.1); Pragma only without one."""
    directives: dict[str, str] = {}
    pragma = False
    for name, value in metadata:
        if not isinstance(value, str):
            continue
        if name == "cache-control":
            for part in value.split(","):
                directive, _, argument = part.partition("=")
                directives[directive.strip().lower()] = argument.strip().strip('"')
        elif name == "pragma":
            pragma = pragma or "no-cache" in (part.strip().lower() for part in value.split(","))
    if not directives and pragma:
        return CallerControl(lookup=False)
    age = directives.get("max-age", "")
    max_age = int(age) if age.isascii() and age.isdigit() else None  # not delta-seconds: ignored, as RFC 9111 asks
    return CallerControl(lookup="no-cache" not in directives and "no-store" not in directives and max_age != 0,
                         max_age=max_age, store="no-store" not in directives)


def _decoded(data: bytes) -> tuple[float, tuple[GenerationEvent, ...]] | None:
    try:
        return decode(data)
    except (ValueError, TypeError, IndexError, KeyError):  # written by another version: a miss, never an error
        return None
