"""Providers turn a GenerationRequest into a stream of GenerationEvents, behind one narrow interface."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from server.domain import Dialect, GenerationRequest, Turn
from server.domain_answers import GenerationEvent, TokenCount
from server.errors import ContextLengthExceeded, InvalidRequest


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a provider can honour beyond plain text. A request that needs more is refused with 400 before any
    model sees it, rather than silently answered without it."""

    tool_calls: bool = False  # can call tools, so tool_choice "required" / a named tool can be honoured
    json_output: bool = False  # can be held to JSON output (a GenerationRequest's output_format)
    # The APIs the provider speaks: a request in one of them reaches it whole, so it can honour everything the
    # caller sent. Empty (the embedded model): only what the internal values hold.
    dialects: frozenset[Dialect] = frozenset()


class Provider(Protocol):
    capabilities: Capabilities

    def stream(self, request: GenerationRequest) -> AsyncIterator[GenerationEvent]:
        """Yield TextDelta and tool-call events (an upstream also each of its own objects as an UpstreamObject, and
        any provider may start with a Started prompt count), then exactly one Finished. Raise a PorticoError on failure
        (upstream failures that another attempt may avoid carry a `retry_reason`).

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


@runtime_checkable
class PromptCounter(Protocol):
    """Providers whose upstream counts a prompt itself (an Anthropic upstream's count_tokens), and the Router that
    asks them through its deployments, retries and fallbacks."""

    async def count_prompt(self, request: GenerationRequest) -> TokenCount: ...


async def prompt_count(provider: object, request: GenerationRequest) -> TokenCount:
    """A prompt's input tokens as `provider` takes them: its upstream's own count, the embedded model's exact one, else
    Portico's estimate (the one that stands in when an upstream reports no usage)."""
    if isinstance(provider, PromptCounter):
        return await provider.count_prompt(request)
    if (counter := token_counter_of(provider)) is not None:
        return TokenCount(await asyncio.to_thread(counter.count_tokens, request.turns))
    return TokenCount(request.estimated_prompt_tokens())


@runtime_checkable
class LocalModel(Protocol):
    """Providers that run a model in this process (the embedded model) say whether it is loaded, for readiness."""

    @property
    def loaded(self) -> bool: ...


def context_overflow(prompt_tokens: int, window: int) -> ContextLengthExceeded | None:
    """The 400 for a prompt that leaves no room for an answer in a model's context window, or None."""
    return ContextLengthExceeded(prompt_tokens, window) if prompt_tokens >= window else None


def token_counter_of(provider: object) -> TokenCounter | None:
    """The exact prompt counter for a model: its provider itself, or for a Router (deployments, fallbacks) the
    counter of the provider it tries first, which it exposes as `token_counter`."""
    if isinstance(provider, TokenCounter):
        return provider
    return getattr(provider, "token_counter", None)


def capabilities_of(provider: object) -> Capabilities:
    """What a provider (or a Router, for the deployments it tries) can honour; the defaults if it does not say."""
    return getattr(provider, "capabilities", Capabilities())


def dialects_of(provider: object) -> frozenset[Dialect]:
    """The APIs a model's provider may send a request in: a Router's over its deployments and its fallbacks'."""
    return getattr(provider, "chain_dialects", None) or capabilities_of(provider).dialects


def unsupported(request: GenerationRequest, capabilities: Capabilities) -> InvalidRequest | None:
    """Why `capabilities` cannot honour `request`, or None when they can."""
    source = request.source
    if source is not None and source.dialect not in capabilities.dialects:
        embedded = not capabilities.dialects
        for item in source.unread:
            if item.embedded if embedded else item.other_dialect:
                details = {"error_code": item.error_code} if item.error_code else None
                return InvalidRequest(item.message, param=item.param, details=details)
    if request.tool_choice is not None and request.tool_choice.needs_tool_calls and not capabilities.tool_calls:
        return InvalidRequest(
            "This model cannot call tools: `tool_choice` may only be 'none' or 'auto'.", param="tool_choice"
        )
    if request.output_format is not None and not capabilities.json_output:
        return InvalidRequest(
            "This model cannot be held to JSON output: `response_format` may only be 'text'.",
            param="response_format.type",
        )
    return None
