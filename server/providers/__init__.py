"""Providers turn a GenerationRequest into a stream of GenerationEvents, behind one narrow interface."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol, runtime_checkable

from server.domain import GenerationEvent, GenerationRequest, Turn


class Provider(Protocol):
    def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Yield TextDelta events, then exactly one Finished. Raise a PorticoError on failure.

        Closing the iterator early (the caller went away) must stop the work promptly.
        """
        ...

    async def close(self) -> None: ...


@runtime_checkable
class TokenCounter(Protocol):
    """Providers that can count a prompt's tokens exactly (for rate-limit reservations) offer this too."""

    def count_tokens(self, turns: Sequence[Turn]) -> int:
        """May block for a moment (it runs in a worker thread); must be safe beside a running generation."""
        ...
