"""The response cache: a model may opt in (`cache:` in its entry), and a request then asked before is answered
with the answer given before, replayed through the same renderers.

The key is a SHA-256 over what shapes the answer: the model, the endpoint, whether the caller streams, the caller's
body as it arrived minus the fields that only label a request (`user`, `metadata`, `store`, `safety_identifier`,
`prompt_cache_key`), Anthropic beta headers, and, unless the model shares its cache across keys (`shared: true`),
the caller's key id, so an answer never reaches a key that did not ask for it. A field Portico does not know yet
shapes the key too: a new field can cost hits, never give a wrong answer. Only whole answers (a Finished event,
nothing failed) no larger than `max_entry_bytes` are stored; errors never are. `Cache-Control: no-cache` skips the
lookup (the fresh answer is stored), `no-store` skips both.
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing
from dataclasses import dataclass

from server import wire_json
from server.cache.codec import decode, encode
from server.cache.stores import CacheStore, MemoryStore
from server.domain import AnthropicMessagesSource, CacheSettings, Finished, GenerationEvent, GenerationRequest

__all__ = ["CacheStore", "Lookup", "MemoryStore", "ResponseCache"]

HEADER = "x-portico-cache"
# Fields that label a request for its caller's own records, and do not change the answer.
NOT_SHAPING = frozenset({"user", "metadata", "store", "safety_identifier", "prompt_cache_key", "stream"})


@dataclass(frozen=True, slots=True)
class Lookup:
    key: str
    settings: CacheSettings
    events: tuple[GenerationEvent, ...] | None  # the cached answer: a hit
    store_answer: bool  # False: the caller said no-store

    @property
    def header(self) -> tuple[str, str]:
        return HEADER, "hit" if self.events is not None else "miss"


class ResponseCache:
    def __init__(self, store: CacheStore) -> None:
        self._store = store

    async def lookup(self, model_id: str, endpoint: str, settings: CacheSettings | None, key_id: str,
                     request: GenerationRequest, metadata: Sequence[tuple[str, str | bytes]]) -> Lookup | None:
        """None when the model is not cached (or the request has no body to key on)."""
        if settings is None or request.source is None:
            return None
        directives = _cache_control(metadata)
        key = cache_key(model_id, endpoint, "" if settings.shared else key_id, request)
        found = None
        if not directives & {"no-cache", "no-store"}:
            found = await self._store.get(key)
        events = _decoded(found) if found is not None else None
        return Lookup(key, settings, events, store_answer="no-store" not in directives)

    async def recorded(self, lookup: Lookup, events: AsyncIterator[GenerationEvent]) -> AsyncIterator[GenerationEvent]:
        """Relays `events`, and stores them once the answer is whole (before its Finished event goes on, since a
        caller reading a JSON answer stops there)."""
        kept: list[GenerationEvent] | None = [] if lookup.store_answer else None
        async with aclosing(events):
            async for event in events:
                if kept is not None:
                    kept.append(event)
                    if isinstance(event, Finished):
                        data = encode(kept)
                        if len(data) <= lookup.settings.max_entry_bytes:
                            await self._store.put(lookup.key, data, lookup.settings.ttl_seconds)
                        kept = None
                yield event

    async def close(self) -> None:
        await self._store.close()


def cache_key(model_id: str, endpoint: str, scope: str, request: GenerationRequest) -> str:
    source = request.source
    body = {name: value for name, value in source.body.items() if name not in NOT_SHAPING}
    beta = source.beta if isinstance(source, AnthropicMessagesSource) else ()
    shape = [model_id, str(endpoint), request.stream, scope, list(beta), body]
    return hashlib.sha256(wire_json.dumps(shape, sort_keys=True)).hexdigest()


def _cache_control(metadata: Sequence[tuple[str, str | bytes]]) -> set[str]:
    directives: set[str] = set()
    for name, value in metadata:
        if name == "cache-control" and isinstance(value, str):
            directives.update(part.strip().lower() for part in value.split(","))
    return directives


def _decoded(data: bytes) -> tuple[GenerationEvent, ...] | None:
    try:
        return decode(data)
    except (ValueError, TypeError, IndexError, KeyError):  # written by another version: a miss, never an error
        return None
