"""The one request pipeline every servicer goes through:

authenticate key -> resolve model (catalog, grants, path rule) -> provider -> usage, as typed values.
Servicers translate the wire request before calling in and render what comes out.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Mapping
from contextlib import aclosing
from dataclasses import dataclass

from server.catalog import Catalog
from server.config import ModelEntry
from server.domain import ApiKey, Completion, Finished, GenerationEvent, GenerationRequest, TextDelta
from server.errors import InternalError, InvalidRequest
from server.keys import Authenticator
from server.keys.auth import Metadata
from server.providers import Provider
from server.providers.images import ImageProvider


@dataclass(frozen=True, slots=True)
class Call:
    """An authenticated request for a model the key may use on this endpoint."""

    key: ApiKey
    model: ModelEntry
    provider: Provider | ImageProvider


class Pipeline:
    def __init__(
        self, *, authenticator: Authenticator, catalog: Catalog, providers: Mapping[str, Provider | ImageProvider]
    ) -> None:
        self._authenticator = authenticator
        self._catalog = catalog
        self._providers = providers

    @property
    def authenticator(self) -> Authenticator:
        return self._authenticator

    @property
    def catalog(self) -> Catalog:
        return self._catalog

    def begin(self, metadata: Metadata, model_id: str, endpoint: str, *, allow_x_api_key: bool = False) -> Call:
        key = self._authenticator.authenticate(metadata, allow_x_api_key=allow_x_api_key)
        if not model_id:
            raise InvalidRequest("You must provide a model parameter.", param="model")
        model = self._catalog.resolve(key, model_id, endpoint)
        return Call(key=key, model=model, provider=self._providers[model.id])

    async def open_stream(self, call: Call, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Start generating and wait for the first event, so that a failure to start is raised here,
        while the caller can still answer with an error status instead of a half-sent stream."""
        events = call.provider.stream(request)
        try:
            first = await anext(events)
        except StopAsyncIteration:
            raise InternalError("The provider ended without a result.") from None
        except BaseException:
            await events.aclose()
            raise
        return _prepend(first, events)

    async def complete(self, call: Call, request: GenerationRequest) -> Completion:
        parts: list[str] = []
        async with aclosing(call.provider.stream(request)) as events:
            async for event in events:
                if isinstance(event, TextDelta):
                    parts.append(event.text)
                elif isinstance(event, Finished):
                    return Completion(text="".join(parts), finish=event)
        raise InternalError("The provider ended without a result.")


async def _prepend(first: GenerationEvent, rest: AsyncIterator[GenerationEvent]) -> AsyncIterator[GenerationEvent]:
    async with aclosing(rest):
        yield first
        async for event in rest:
            yield event
