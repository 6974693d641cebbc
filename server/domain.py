"""Typed internal values that flow through the pipeline, independent of any wire dialect."""

from __future__ import annotations

import enum
import json
import math
import secrets
import string
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

Json = Any  # a JSON value as orjson reads and writes it: dict, list, str, int, float, bool or None

CHARS_PER_TOKEN = 4  # a common rough estimate for English text and code


# What a chat template adds around each message (role markers, separators) and the request (the reply's opening),
# at most, in the templates of GPT, Claude, Llama, Qwen and SmolLM: OpenAI counts 3 a message and 3 a reply.
TEMPLATE_TOKENS = 8

# Top-level fields an upstream of the caller's dialect reads as prompt tokens though the internal values do not hold
# them, so they reach it passed through unread: a structured output's JSON schema (OpenAI's `response_format`,
# Anthropic's `output_config` and older `output_format`) and OpenAI's deprecated `functions`. A budget's worst case
# counts their JSON's bytes.
PROMPT_FIELDS = ("response_format", "functions", "output_format", "output_config")


def estimate_tokens(chars: int) -> int:
    """How many tokens `chars` characters are, when nobody counts them exactly (prompts for upstreams, for rate
    limits; answers of upstreams that report no usage)."""
    return math.ceil(chars / CHARS_PER_TOKEN)


def utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())


class Role(str, enum.Enum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"


class Endpoint(enum.StrEnum):
    """A public model path. Every model is served at exactly one; `/v1/models` tells callers which."""

    CHAT = "/v1/chat/completions"
    MESSAGES = "/v1/messages"
    IMAGES = "/v1/images/generations"


class Dialect(str, enum.Enum):
    """The wire API a request arrived in, or an upstream speaks."""

    OPENAI = "openai"  # chat completions
    ANTHROPIC = "anthropic"  # messages


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A function call the model made. `arguments` is JSON text as the model wrote it (OpenAI's form; Anthropic's
    `input` object is serialised), so a call passes through unchanged even when the model wrote invalid JSON."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True, slots=True)
class ToolResult:
    """The caller's answer to one tool call."""

    call_id: str
    text: str
    is_error: bool = False


@dataclass(frozen=True, slots=True)
class Thought:
    """One block of the model's reasoning that a caller gives back in its history: Anthropic's thinking, its text
    and the signature that lets Anthropic check it ("" when an OpenAI-compatible server's reasoning made the
    block), or redacted thinking (`redacted`: its opaque data, no text). Among an answer's events: a whole block of
    Anthropic's that just ended (a chat caller's `thinking_blocks`)."""

    text: str = ""
    signature: str = ""
    redacted: str = ""


@dataclass(frozen=True, slots=True)
class Turn:
    """One conversation turn: text, and the tool traffic it carries (assistant turns make calls, user turns answer
    them; OpenAI's `tool` messages become user turns with results)."""

    role: Role
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_results: tuple[ToolResult, ...] = ()
    thoughts: tuple[Thought, ...] = ()  # an assistant turn's reasoning before its text and calls, in order
    # Anthropic's prefill: the request's last turn, an assistant's text that the answer continues (not a new turn).
    continued: bool = False


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """A function the model may call; `parameters` is its JSON schema."""

    name: str
    description: str = ""
    parameters: Mapping[str, Json] = field(default_factory=dict)
    # The caller's `strict` (both APIs: calls whose input follows the schema exactly); None: not said.
    strict: bool | None = None


class ToolChoiceMode(str, enum.Enum):
    AUTO = "auto"  # the model decides
    NONE = "none"  # no calls
    REQUIRED = "required"  # at least one call (Anthropic: "any")
    TOOL = "tool"  # a call of the named tool


@dataclass(frozen=True, slots=True)
class ToolChoice:
    mode: ToolChoiceMode = ToolChoiceMode.AUTO
    name: str | None = None  # for ToolChoiceMode.TOOL
    parallel: bool = True  # False: at most one call per answer

    @property
    def needs_tool_calls(self) -> bool:
        """Honouring this choice requires a model that can call tools."""
        return self.mode in (ToolChoiceMode.REQUIRED, ToolChoiceMode.TOOL)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    max_tokens: int
    temperature: float | None = None  # None: the caller did not say (upstreams use their own default)
    top_p: float | None = None
    top_k: int | None = None
    stop: tuple[str, ...] = ()
    seed: int | None = None
    # Extensions the embedded model (llama.cpp) honours; None: neutral.
    min_p: float | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None


@dataclass(frozen=True, slots=True)
class Unread:
    """Part of a caller's request the internal values do not hold (an image part, a server tool, a field only the
    caller's own API knows): an upstream of the caller's dialect receives it with the body; any other model must
    refuse the request, with this 400, rather than answer without it."""

    param: str
    message: str
    embedded: bool = True  # the embedded model refuses it
    other_dialect: bool = True  # an upstream of the other dialect refuses it
    error_code: str | None = None  # the refusal's `details.error_code`, where an SDK acts on it


@dataclass(frozen=True, slots=True)
class OpenAIChatSource:
    """A chat-completions request as the caller sent it (the parsed JSON body, never edited), so that an
    OpenAI-compatible upstream receives every field at every level, not only those the internal values express."""

    body: Mapping[str, Json]
    unread: tuple[Unread, ...] = ()
    dialect: ClassVar[Dialect] = Dialect.OPENAI


@dataclass(frozen=True, slots=True)
class AnthropicMessagesSource:
    """A Messages request as the caller sent it, and its `anthropic-beta` header values, which an Anthropic upstream
    needs for the beta fields of the body."""

    body: Mapping[str, Json]
    unread: tuple[Unread, ...] = ()
    beta: tuple[str, ...] = ()
    dialect: ClassVar[Dialect] = Dialect.ANTHROPIC


RequestSource = OpenAIChatSource | AnthropicMessagesSource


# A chat request's token-limit fields, the first given wins (openai_to_internal reads them so).
CHAT_LIMIT_FIELDS = ("max_completion_tokens", "max_tokens")


def tool_loop_start(turns: tuple[Turn, ...]) -> int:
    """The index of the turn after the caller's last own words (a user turn with text, not tool results alone):
    the assistant turns from there on are the current tool loop, the only place an OpenAI-compatible server is given
    reasoning back (server/translate/internal_to_openai_request.py)."""
    return next((i + 1 for i in range(len(turns) - 1, -1, -1) if turns[i].role is Role.USER and turns[i].text), 0)


def limit_field_in(body: Mapping[str, Json], fields: tuple[str, ...]) -> str | None:
    """The first of `fields` the caller sent (not null): the one that set the token limit."""
    return next((name for name in fields if body.get(name) is not None), None)


@dataclass(frozen=True, slots=True)
class Reasoning:
    """The caller asked the model to reason before it answers (chat's `reasoning_effort`, Messages' `thinking`
    enabled or adaptive), in both dialects' terms (server/translate/thinking.py): `effort` for an OpenAI-compatible
    upstream, `budget_tokens` for an Anthropic one (None: not said, the server's default; Anthropic's adaptive).
    `room`: tokens added to the token limit sent to an upstream that thinks within it (Anthropic), where the caller
    set none: the default limit is the answer's, the budget comes on top. `shown`: a Messages caller asked for
    thinking (enabled or adaptive), so gets the reasoning as a thinking block; False: only an effort
    (`output_config.effort` beside no thinking)."""

    effort: str | None = None
    budget_tokens: int | None = None
    room: int = 0
    shown: bool = True


@dataclass(frozen=True, slots=True)
class OutputFormat:
    """The caller asked for JSON output (chat's `response_format` json_object or json_schema, Messages'
    `output_config.format`): `schema`, the JSON schema the answer's text must match, as the caller wrote it (never
    rewritten); None: any JSON object (OpenAI's json_object, which Anthropic has no equivalent of)."""

    schema: Mapping[str, Json] | None = None


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """What a provider is asked to do. Which model is the provider's own business: an upstream provider sends its
    configured model name, and the caller's model id is on the call."""

    turns: tuple[Turn, ...]
    params: SamplingParams
    tools: tuple[ToolSpec, ...] = ()
    tool_choice: ToolChoice | None = None  # None: the caller did not say
    output_format: OutputFormat | None = None  # None: text, as the model likes
    # Who the caller's end user is, for an upstream's abuse monitoring (Anthropic's metadata.user_id, OpenAI's user).
    end_user: str | None = None
    source: RequestSource | None = None
    # The caller reads the answer as it is generated. False: it waits for the whole answer, so an upstream is asked
    # for one JSON answer instead of a stream; the provider's events are the same either way.
    stream: bool = True
    reasoning: Reasoning | None = None  # None: the caller asked for no reasoning (or said nothing)

    @property
    def most_output_tokens(self) -> int:
        """The most tokens the answer may take, thinking included: the token limit, and the room for a thinking
        budget an upstream is sent on top of a default limit."""
        return self.params.max_tokens + (self.reasoning.room if self.reasoning is not None else 0)

    @property
    def token_limit_field(self) -> str | None:
        """The caller's field that set the token limit, as openai_to_internal reads them (chat's
        `max_completion_tokens` wins over `max_tokens`); None when it sent neither (default_max_tokens)."""
        source = self.source
        if source is None:
            return None
        fields = CHAT_LIMIT_FIELDS if isinstance(source, OpenAIChatSource) else ("max_tokens",)
        return limit_field_in(source.body, fields)

    def estimated_prompt_tokens(self) -> int:
        """The size of everything the model reads, estimated when nobody counts it exactly."""
        return estimate_tokens(sum(map(len, self._prompt_texts())))

    def most_prompt_tokens(self) -> int:
        """At most how many tokens the model reads, when nobody counts them exactly (a budget's worst case): no
        byte-level BPE tokenizer (GPT's, Claude's, Llama's) makes more tokens of a text than it has UTF-8 bytes, and
        a chat template adds at most TEMPLATE_TOKENS around each turn and tool. Parts the internal values do not
        read (Unread: images, files) are not in it."""
        return (sum(map(utf8_size, self._prompt_texts())) + self._unread_prompt_bytes()
                + TEMPLATE_TOKENS * (len(self.turns) + len(self.tools) + 1))

    def _unread_prompt_bytes(self) -> int:
        """The JSON bytes of the PROMPT_FIELDS the caller's body holds: a 30 kB schema read as ~8,000 prompt tokens
        once took a budget of a cent twenty times over, reserved as the few words of its messages."""
        if self.source is None:
            return 0
        fields = {name: self.source.body[name] for name in PROMPT_FIELDS if self.source.body.get(name) is not None}
        return len(json.dumps(fields, ensure_ascii=False, separators=(",", ":")).encode()) if fields else 0

    def _prompt_texts(self) -> Iterator[str]:
        loop = tool_loop_start(self.turns)
        for i, turn in enumerate(self.turns):
            yield turn.text
            # Thinking given back is read (and billed) as input: signed, Anthropic's, wherever it is; unsigned, an
            # OpenAI-compatible server's reasoning, only within the current tool loop, the only place it is sent.
            for thought in turn.thoughts:
                if thought.signature or i >= loop:
                    yield thought.text
            for call in turn.tool_calls:
                yield call.name
                yield call.arguments
            for result in turn.tool_results:
                yield result.text
        for tool in self.tools:
            yield tool.name
            yield tool.description
            yield str(tool.parameters)


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
