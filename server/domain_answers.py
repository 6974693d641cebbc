"""The answer side of text generation's values: the events a generation streams (the upstream's own objects among
them), how it finished and what it used, the whole completion collected from them, and the header of the caller's
answer. Built on server/domain.py (the request side), as the pipeline reads them in that order."""

from __future__ import annotations

import enum
import secrets
import string
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from server.domain import Dialect, Json, Thought, ToolCall


class FinishReason(str, enum.Enum):
    END_TURN = "end_turn"  # the model ended its answer
    MAX_TOKENS = "max_tokens"  # max_tokens was reached (or a window an upstream does not name: OpenAI's `length`)
    CONTEXT_WINDOW = "model_context_window_exceeded"  # the context window was full before max_tokens was reached
    STOP_SEQUENCE = "stop_sequence"  # one of the stop strings was produced (it is not included in the text)
    TOOL_USE = "tool_use"  # the model called tools and waits for their results
    REFUSAL = "refusal"  # the upstream withheld the answer (OpenAI: content_filter)


def turn_end(reason: FinishReason, *, calls: bool) -> FinishReason:
    """An upstream's plain end or tool end, made to say whether the turn waits for tool results: `tool_use` exactly
    when it holds calls. Upstreams end a forced call with `stop` (OpenAI, vLLM) or `end_turn` (some Anthropic-compatible
    bridges), and some end a turn of no call with `tool_use` / `tool_calls`; a caller's tool loop reads the reason."""
    if reason is FinishReason.END_TURN and calls:
        return FinishReason.TOOL_USE
    if reason is FinishReason.TOOL_USE and not calls:
        return FinishReason.END_TURN
    return reason


@dataclass(frozen=True, slots=True)
class Usage:
    input_tokens: int = 0  # every prompt token, those read from or written to a prompt cache included
    output_tokens: int = 0
    cached_input_tokens: int = 0  # the part of input_tokens read from the provider's prompt cache (priced lower)
    cache_write_tokens: int = 0  # the part written to it (Anthropic's cache_creation_input_tokens, priced higher)
    cache_write_1h_tokens: int = 0  # of cache_write_tokens, those written for an hour (priced higher again)
    web_searches: int = 0  # searches by an upstream's web search tool (Anthropic's server tool), billed each

    @property
    def total_tokens(self) -> int:
        return self.input_tokens + self.output_tokens

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.input_tokens + other.input_tokens, self.output_tokens + other.output_tokens,
                     self.cached_input_tokens + other.cached_input_tokens,
                     self.cache_write_tokens + other.cache_write_tokens,
                     self.cache_write_1h_tokens + other.cache_write_1h_tokens,
                     self.web_searches + other.web_searches)


@dataclass(frozen=True, slots=True)
class Started:
    """Optional first event: the provider accepted the prompt, which is this many tokens (as Usage counts them:
    every prompt token, of which `cached_input_tokens` were read from the provider's prompt cache and
    `cache_write_tokens` written to it, `cache_write_1h_tokens` of them for an hour, when it says so before the answer,
    as Anthropic's message_start does)."""

    input_tokens: int
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    cache_write_1h_tokens: int = 0


@dataclass(frozen=True, slots=True)
class TextDelta:
    text: str


@dataclass(frozen=True, slots=True)
class ReasoningDelta:
    """The next piece of the model's reasoning before (or between) its answer: Anthropic's thinking, an
    OpenAI-compatible server's `reasoning_content`. Not the answer's text: a caller of the other dialect gets it in
    its own API's place for reasoning (redacted thinking, which has no text, makes none)."""

    text: str


@dataclass(frozen=True, slots=True)
class ToolCallStart:
    """The model began a tool call; `index` numbers the calls of one answer from 0."""

    index: int
    id: str
    name: str


# The id of call `index` of an answer whose upstream sent that call without one (some compatible servers do). The
# upstream readers take one from their caller, so they stay pure: numbered ids in tests, random ones when serving.
CallIds = Callable[[int], str]


def numbered_call_ids(prefix: str) -> CallIds:
    """`call_0`, `call_1`, ...: the same in every answer, so only for tests."""
    return lambda index: f"{prefix}{index}"


def random_call_ids(prefix: str) -> CallIds:
    """`call_` (or `toolu_`) and 24 random letters and digits, as OpenAI's (Anthropic's) ids look: unique across
    answers, as numbered ones were not (`call_0` in every turn of a conversation, which Anthropic then refuses as
    'tool_use ids must be unique', and which leaves a caller unable to tell whose result is whose)."""
    return lambda index: prefix + "".join(secrets.choice(_BASE62) for _ in range(24))


_BASE62 = string.ascii_letters + string.digits


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """The next piece of call `index`'s JSON arguments."""

    index: int
    arguments: str


@dataclass(frozen=True, slots=True)
class Finished:
    reason: FinishReason
    usage: Usage
    stop_sequence: str | None = None
    # The upstream's own word for it ("stop", "pause_turn", ...): what a caller of its dialect is sent, the answer
    # being relayed; "" from the embedded model.
    upstream_reason: str = ""


@dataclass(frozen=True, slots=True)
class UpstreamObject:
    """An upstream's own answer object, before the internal events derived from it: one per streamed chunk or event,
    or one for a whole JSON answer. A caller of the same dialect gets it instead of an answer re-rendered from the
    internal events, which carry only text, tool calls, stop reason and usage (so `logprobs`, `system_fingerprint`,
    thinking blocks, citations and fields added later reach it too). Metering, limits, retries and fallbacks use the
    derived events. `content`: the object carries part of the answer that no derived event does (a thinking delta,
    say), so it counts as delivered content for the Router's retries (retry.Delivery); otherwise it is held back like
    Started."""

    dialect: Dialect
    payload: Mapping[str, Json]
    content: bool = False


@dataclass(frozen=True, slots=True)
class UpstreamAnswer:
    """What an upstream said of its own answer, or one part of it (a streamed chunk or event), as it said it: its id,
    the model it names, its finish reason, its token counts ("" or None: not in this part). For the attempt's span."""

    id: str = ""
    model: str = ""
    finish_reason: str = ""
    input_tokens: int | None = None  # the whole prompt, its prompt-cache parts included
    output_tokens: int | None = None


# A Thought among the events is a whole thinking block, after its ReasoningDeltas: what a chat caller gets back as
# `thinking_blocks` to send in its next turn.
GenerationEvent = (Started | UpstreamObject | TextDelta | ReasoningDelta | Thought | ToolCallStart | ToolCallDelta
                   | Finished)


@dataclass(frozen=True, slots=True)
class Completion:
    """A whole generation, collected from its events; `upstream` is the upstream's own whole answer, when one
    answered with JSON."""

    text: str
    finish: Finished
    tool_calls: tuple[ToolCall, ...] = ()
    upstream: UpstreamObject | None = None
    reasoning: str = ""  # the model's reasoning before its answer ("": none, or none it shows)
    thoughts: tuple[Thought, ...] = ()  # its thinking blocks, whole, as the upstream sent them (Anthropic's)


@dataclass(frozen=True, slots=True)
class TokenCount:
    """How many input tokens a prompt is (count_tokens); `upstream`: the upstream's own answer, when one counted."""

    input_tokens: int
    upstream: dict[str, Json] | None = None


@dataclass(frozen=True, slots=True)
class ResponseHeader:
    """What every object of one response repeats: its id, creation time and the model name the caller used.
    `upstream_id`: a same-dialect upstream's answer keeps its own id instead (a threaded message: the thread's next
    turn names it as `previous_message_id`, which only the upstream that holds the thread knows)."""

    id: str
    created: int
    model: str
    upstream_id: bool = False
