"""Typed internal values that flow through the pipeline, independent of any wire dialect."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field, fields


class Role(str, enum.Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"


@dataclass(frozen=True, slots=True)
class Turn:
    """One conversation turn, reduced to text (tool turns are folded to text by the translators)."""

    role: Role
    text: str


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What a provider is asked to do. `model` is the provider's own model name."""

    model: str
    turns: tuple[Turn, ...]
    params: SamplingParams


class FinishReason(str, enum.Enum):
    END_TURN = "end_turn"  # the model ended its answer
    MAX_TOKENS = "max_tokens"  # max_tokens or the context window was reached
    STOP_SEQUENCE = "stop_sequence"  # one of the stop strings was produced (it is not included in the text)


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.input_tokens + other.input_tokens, self.output_tokens + other.output_tokens)


@dataclass(frozen=True, slots=True)
class Started:
    """Optional first event: the provider accepted the prompt, which is this many tokens."""

    input_tokens: int


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class Finished:
    reason: FinishReason
    usage: Usage
    stop_sequence: str | None = None


GenerationEvent = Started | TextDelta | Finished


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole generation, collected from its events."""

    text: str
    finish: Finished


@dataclass(frozen=True, slots=True)
class ResponseHeader:
    """What every object of one response repeats: its id, creation time and the model name the caller used."""

    id: str
    created: int
    model: str


@dataclass(frozen=True, slots=True)
class KeyLimits:
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    concurrent_requests: int | None = None
    daily_tokens: int | None = None
    daily_requests: int | None = None


KEY_LIMIT_NAMES = tuple(f.name for f in fields(KeyLimits))


@dataclass(frozen=True, slots=True)
class ApiKey:
    """A stored key. The secret is never held here: only its hash is stored."""

    id: str
    name: str
    all_models: bool
    models: frozenset[str]
    limits: KeyLimits = field(default_factory=KeyLimits)
    env: str = ""
    admin: bool = False
    created: int = 0
    revoked_at: int = 0

    def may_use(self, model_id: str) -> bool:
        return self.all_models or model_id in self.models
