"""Typed internal values that flow through the pipeline, independent of any wire dialect."""

from __future__ import annotations

import enum
import json
import math
from collections.abc import Iterator, Mapping
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
        """The size of everything the model reads, estimated when nobody counts it exactly: the PROMPT_FIELDS too,
        or a 34 kB schema (~8,500 tokens) was reserved and settled as the few words of its messages."""
        return estimate_tokens(sum(map(len, self._prompt_texts())) + len(self._unread_prompt_json()))

    def most_prompt_tokens(self) -> int:
        """At most how many tokens the model reads, when nobody counts them exactly (a budget's worst case): no
        byte-level BPE tokenizer (GPT's, Claude's, Llama's) makes more tokens of a text than it has UTF-8 bytes, and
        a chat template adds at most TEMPLATE_TOKENS around each turn and tool. Parts the internal values do not
        read (Unread: images, files) are not in it."""
        return (sum(map(utf8_size, self._prompt_texts())) + utf8_size(self._unread_prompt_json())
                + TEMPLATE_TOKENS * (len(self.turns) + len(self.tools) + 1))

    def _unread_prompt_json(self) -> str:
        """The JSON of the PROMPT_FIELDS the caller's body holds ("" for none): a 30 kB schema read as ~8,000 prompt
        tokens once took a budget of a cent twenty times over, reserved as the few words of its messages."""
        if self.source is None:
            return ""
        fields = {name: self.source.body[name] for name in PROMPT_FIELDS if self.source.body.get(name) is not None}
        return json.dumps(fields, ensure_ascii=False, separators=(",", ":")) if fields else ""

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
