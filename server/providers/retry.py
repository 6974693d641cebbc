"""Retries of an upstream provider: exponential backoff with full jitter, capped in attempts and in total time,
honouring the upstream's retry-after.

Only failures marked `retryable` (server/providers/upstream_errors.py) are retried, and only while nothing has
reached the caller: a Started event (a prompt count, no content) and the upstream's own objects that carry no content
(a role chunk, message_start, ping) are held back until the first content event, so an upstream that accepts a
request and then drops the stream is retried as if it had refused it.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing
from dataclasses import dataclass

from server.domain import (
    GeneratedImage, GenerationEvent, GenerationRequest, ImageRequest, RetrySettings, Started, UpstreamObject,
)
from server.errors import PorticoError
from server.observability import UpstreamRecorder
from server.providers import Provider
from server.providers.images import ImageProvider

_logger = logging.getLogger(__name__)


def backoff_delay(settings: RetrySettings, attempt: int, error: PorticoError, elapsed: float,
                  draw: Callable[[], float]) -> float | None:
    """Seconds to wait before attempt `attempt + 1`, or None to give up with `error`.

    `draw` returns a number in [0, 1) (the jitter). A retry-after longer than the time left gives up at once: the
    caller then gets the upstream's answer with the hint, instead of a wait that cannot end in a retry.
    """
    if not error.retryable or attempt >= settings.attempts:
        return None
    delay = draw() * min(settings.max_backoff, settings.initial_backoff * 2 ** (attempt - 1))
    delay = max(delay, error.retry_after)
    if elapsed + delay >= settings.total_seconds:
        return None
    return delay


@dataclass(slots=True)
class Delivery:
    """Whether any event of an attempt reached the consumer; once one has, the attempt can no longer be replaced."""

    delivered: bool = False

    async def relay(self, events: AsyncIterator[GenerationEvent]) -> AsyncIterator[GenerationEvent]:
        held: list[GenerationEvent] = []
        async with aclosing(events):
            async for event in events:
                if not self.delivered and _no_content(event):
                    held.append(event)
                    continue
                self.delivered = True
                for early in held:
                    yield early
                held.clear()
                yield event


def _no_content(event: GenerationEvent) -> bool:
    return isinstance(event, Started) or isinstance(event, UpstreamObject) and not event.content


class RetryingProvider:
    def __init__(self, inner: Provider, settings: RetrySettings, *, model_id: str,
                 recorder: UpstreamRecorder | None = None, rng: random.Random | None = None) -> None:
        self._inner = inner
        self._settings = settings
        self._model_id = model_id
        self._recorder = recorder
        self._draw = (rng or random.Random()).random
        self.capabilities = inner.capabilities

    async def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        loop = asyncio.get_running_loop()
        began = loop.time()
        attempt = 1
        while True:
            delivery = Delivery()
            try:
                async with aclosing(delivery.relay(self._inner.stream(request))) as events:
                    async for event in events:
                        yield event
                return
            except PorticoError as error:
                if delivery.delivered:
                    raise
                delay = backoff_delay(self._settings, attempt, error, loop.time() - began, self._draw)
                if delay is None:
                    raise
                _retrying(self._model_id, attempt, error, delay, self._recorder)
            await asyncio.sleep(delay)
            attempt += 1

    async def close(self) -> None:
        await self._inner.close()


def _retrying(model_id: str, attempt: int, error: PorticoError, delay: float, recorder: UpstreamRecorder | None):
    _logger.warning("%s: attempt %d failed (%s: %s); retrying in %.2f s", model_id, attempt, error.kind.code,
                    error.message, delay)
    if recorder is not None:
        recorder.retry(model_id, error.retry_reason or "other")


class RetryingImageProvider:
    """The same policy for image upstreams, whose answer is one JSON body: any retryable failure is retried."""

    def __init__(self, inner: ImageProvider, settings: RetrySettings, *, model_id: str,
                 recorder: UpstreamRecorder | None = None, rng: random.Random | None = None) -> None:
        self._inner = inner
        self._settings = settings
        self._model_id = model_id
        self._recorder = recorder
        self._draw = (rng or random.Random()).random

    async def generate(self, request: ImageRequest) -> list[GeneratedImage]:
        loop = asyncio.get_running_loop()
        began = loop.time()
        attempt = 1
        while True:
            try:
                return await self._inner.generate(request)
            except PorticoError as error:
                delay = backoff_delay(self._settings, attempt, error, loop.time() - began, self._draw)
                if delay is None:
                    raise
                _retrying(self._model_id, attempt, error, delay, self._recorder)
            await asyncio.sleep(delay)
            attempt += 1

    async def close(self) -> None:
        await self._inner.close()
