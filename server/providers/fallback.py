"""A model's fallback chain: when its provider fails in a retryable way (after its own retries) before anything
reached the caller, the next model of its `fallbacks` list is tried, in order.

Each model in the chain is asked with its own provider, so with its own upstream model name. Fallbacks that cannot
honour the request (say, it needs tool calls and the fallback is the embedded model) are skipped. The caller's
limits stay with the model it asked for: the pipeline reserves and settles for that one, with what was used.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from contextlib import aclosing

from server.domain import GeneratedImage, GenerationEvent, GenerationRequest, ImageRequest
from server.errors import PorticoError
from server.observability import UpstreamRecorder
from server.providers import Provider, token_counter_of, unsupported
from server.providers.images import ImageProvider
from server.providers.retry import Delivery

_logger = logging.getLogger(__name__)


class FallbackProvider:
    def __init__(self, chain: Sequence[tuple[str, Provider]], *, recorder: UpstreamRecorder | None = None) -> None:
        """`chain`: (model id, provider) pairs, the model itself first."""
        self._chain = tuple(chain)
        self._recorder = recorder
        self.capabilities = chain[0][1].capabilities
        # The reservation counts the prompt as the model itself would (the embedded model counts exactly).
        self.token_counter = token_counter_of(chain[0][1])

    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        failure: PorticoError | None = None
        for model_id, provider in self._chain:
            if failure is not None and unsupported(request, provider.capabilities) is not None:
                continue
            if failure is not None:
                _falling_back(self._chain[0][0], failure, model_id, self._recorder)
            delivery = Delivery()
            try:
                async with aclosing(delivery.relay(provider.stream(request))) as events:
                    async for event in events:
                        yield event
                return
            except PorticoError as error:
                if delivery.delivered or not error.retryable:
                    raise
                failure = error
        assert failure is not None
        raise failure

    async def close(self) -> None:
        """Only the model's own provider: every fallback is some other model's own provider, closed with it."""
        await self._chain[0][1].close()


class FallbackImageProvider:
    def __init__(self, chain: Sequence[tuple[str, ImageProvider]], *, recorder: UpstreamRecorder | None = None) -> None:
        self._chain = tuple(chain)
        self._recorder = recorder

    async def generate(self, request: ImageRequest) -> list[GeneratedImage]:
        failure: PorticoError | None = None
        for model_id, provider in self._chain:
            if failure is not None:
                _falling_back(self._chain[0][0], failure, model_id, self._recorder)
            try:
                return await provider.generate(request)
            except PorticoError as error:
                if not error.retryable:
                    raise
                failure = error
        assert failure is not None
        raise failure

    async def close(self) -> None:
        await self._chain[0][1].close()


def _falling_back(model_id: str, failure: PorticoError, fallback: str, recorder: UpstreamRecorder | None) -> None:
    _logger.warning("%s failed (%s: %s); falling back to %s", model_id, failure.kind.code, failure.message, fallback)
    if recorder is not None:
        recorder.fallback(model_id, fallback)
