"""Providers turn a GenerationRequest into a stream of GenerationEvents, behind one narrow interface."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from server.domain import GenerationEvent, GenerationRequest


class Provider(Protocol):
    def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Yield TextDelta events, then exactly one Finished. Raise a PorticoError on failure.

        Closing the iterator early (the caller went away) must stop the work promptly.
        """
        ...

    async def close(self) -> None: ...
