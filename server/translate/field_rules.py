"""What happens to each top-level request field when the model behind the path does not speak the caller's dialect.

An upstream of the caller's own dialect receives the body whole (every field, every level), with only what the
gateway owns put in. For the embedded model and for an upstream of the other dialect, each field the gateway knows
has a rule, in the tables below (docs/api.md shows them, rendered by `markdown_table`):

- ACT: read into the internal values and honoured (or translated into the other dialect's field);
- IGNORE: type-checked, then without effect (metadata, caching and routing hints, ...);
- REFUSE: the model cannot do what it asks, so the request is refused with a 400 naming it, unless its value is
  neutral (asks for nothing, e.g. a penalty of 0).

A field in neither table is refused by the embedded model and the other dialect (never silently dropped), and passed
through to an upstream of the caller's dialect, which judges it. Inside messages, content parts and tools, members
the gateway does not read (`reasoning_content`, `cache_control`, `input_examples`, ...) pass through to a
same-dialect upstream and are ignored elsewhere; content parts and tools of kinds the internal values cannot hold
(images, server tools) are refused elsewhere, by the translators.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from server.domain import Json, Unread
from server.translate.values import is_integer, is_number, wrong_type


class Rule(str, enum.Enum):
    ACT = "acted on"
    IGNORE = "ignored"
    REFUSE = "refused"


_CHECKS = {
    "string": (lambda v: isinstance(v, str), "a string"),
    "boolean": (lambda v: isinstance(v, bool), "a boolean"),
    "number": (is_number, "a number"),
    "integer": (is_integer, "an integer"),
    "object": (lambda v: isinstance(v, dict), "an object"),
    "array": (lambda v: isinstance(v, list), "an array"),
    "any": (lambda v: True, "any value"),
}


@dataclass(frozen=True, slots=True)
class FieldRule:
    """`json`: the field's JSON type, checked here for fields the translators do not read (null always passes).
    `neutral`: values that ask for nothing and so are never refused."""

    json: str
    embedded: Rule
    other: Rule
    neutral: tuple[Json, ...] = ()
    note: str = ""
    error_code: str | None = None  # a refusal's `details.error_code`

    def refused_by(self, value: Json, *, embedded: bool) -> bool:
        rule = self.embedded if embedded else self.other
        return rule is Rule.REFUSE and value is not None and value not in self.neutral


A, I, R = Rule.ACT, Rule.IGNORE, Rule.REFUSE

# POST /v1/chat/completions; "other": an Anthropic upstream.
CHAT_FIELDS: dict[str, FieldRule] = {
    "model": FieldRule("string", A, A),
    "messages": FieldRule("array", A, A, note="roles, text parts and tool traffic translated; an assistant "
                          "message's `thinking_blocks` (LiteLLM's) are its first blocks for Anthropic, ignored by the "
                          "embedded model"),
    "max_completion_tokens": FieldRule("integer", A, A, note="wins over `max_tokens`"),
    "max_tokens": FieldRule("integer", A, A),
    "temperature": FieldRule("number", A, A, note="0–2; capped at 1 for Anthropic"),
    "top_p": FieldRule("number", A, A),
    "stop": FieldRule("any", A, A, note="any number (OpenAI takes 4); → `stop_sequences`; Anthropic refuses "
                                        "whitespace-only ones"),
    "stream": FieldRule("boolean", A, A),
    "stream_options": FieldRule("object", A, A),
    "n": FieldRule("integer", A, A, note="1 only, on every model"),
    "tools": FieldRule("array", A, A, note="function tools (`parameters` → `input_schema`, `strict` → `strict`); "
                                          "the embedded model never calls them"),
    "tool_choice": FieldRule("any", A, A, note="embedded: `none`/`auto` only; `required` → `any`"),
    "parallel_tool_calls": FieldRule("boolean", I, A, note="`false` → `disable_parallel_tool_use`"),
    "response_format": FieldRule("object", A, A, note="embedded: `text` only; `json_schema` → `output_config.format` "
                                 "(its `schema` as sent, never rewritten; `name`, `description` and `strict` have no "
                                 "equivalent: the answer always matches); `json_object` is refused (Anthropic takes a "
                                 "schema only)"),
    "seed": FieldRule("integer", A, I, note="Anthropic has no seed; embedded: a request with a seed (or "
                                            "`temperature` 0) gets the same answer each time"),
    "top_k": FieldRule("integer", A, A, note="an extension (vLLM, llama.cpp, TGI); 0 or −1: every token"),
    "min_p": FieldRule("number", A, R, neutral=(0, 0.0), note="an extension; 0–1"),
    "repetition_penalty": FieldRule("number", A, R, neutral=(1, 1.0),
                                    note="an extension; above 0, at most 10; embedded: as the penalties"),
    "frequency_penalty": FieldRule("number", A, R, neutral=(0, 0.0),
                                   note="−2–2; embedded: over the whole answer so far, not the prompt"),
    "presence_penalty": FieldRule("number", A, R, neutral=(0, 0.0),
                                  note="−2–2; embedded: over the whole answer so far, not the prompt"),
    "logit_bias": FieldRule("object", I, R, neutral=({},), note="token ids to −100–100"),
    "logprobs": FieldRule("boolean", I, I, note="the answer's `logprobs` is null"),
    "top_logprobs": FieldRule("integer", I, I, note="0–20; above 0 only beside `logprobs: true`, as OpenAI takes it"),
    "user": FieldRule("string", I, A, note="→ `metadata.user_id`"),
    "safety_identifier": FieldRule("string", I, A, note="→ `metadata.user_id` when there is no `user`; at most "
                                                        "64 characters, as OpenAI takes it"),
    "prompt_cache_key": FieldRule("string", I, I),
    "prompt_cache_retention": FieldRule("string", I, I),
    "prompt_cache_options": FieldRule("object", I, I, note="a caching hint (`mode`, `ttl`)"),
    "service_tier": FieldRule("string", I, I),
    "store": FieldRule("boolean", I, I),
    "metadata": FieldRule("object", I, I, note="its values are strings; at most 16 pairs, keys of at most 64 "
                                                "characters and values of at most 512, as OpenAI takes them"),
    "modalities": FieldRule("array", I, I, note="text is the only output"),
    "reasoning_effort": FieldRule("string", I, A, note="→ `thinking` `enabled` with a `budget_tokens` of 1024 "
                                  "(`minimal`, `low`), 2048 (`medium`), 4096 (`high`), 8192 (`xhigh`), 16384 (`max`); "
                                  "`none`: no thinking; not sent while the last assistant message has `tool_calls` "
                                  "(a tool loop) or ends the messages (a prefill) without `thinking_blocks` first; "
                                  "refused beside what Anthropic "
                                  "refuses with thinking (a token limit not above the budget, a `temperature` other "
                                  "than 1, a `top_k`, a `top_p` under 0.95, a forced `tool_choice`); without a token "
                                  "limit, the budget is added to `default_max_tokens`"),
    "verbosity": FieldRule("string", I, I),
    "prediction": FieldRule("object", I, I, note="a latency hint"),
    "audio": FieldRule("object", R, R),
    "web_search_options": FieldRule("object", R, R),
    "moderation": FieldRule("object", R, R, note="OpenAI's moderation of the prompt and the answer"),
    "functions": FieldRule("array", I, R, note="deprecated form of `tools`"),
    "function_call": FieldRule("any", R, R, neutral=("none", "auto"),
                               note="embedded: naming a function asks for a call"),
    "chat_template_kwargs": FieldRule("object", R, R, note="an extension of vLLM and llama.cpp's server"),
}

# POST /v1/messages; "other": an OpenAI-compatible upstream.
MESSAGE_FIELDS: dict[str, FieldRule] = {
    "model": FieldRule("string", A, A),
    "max_tokens": FieldRule("integer", A, A),
    "messages": FieldRule("array", A, A, note="text, `tool_use`, `tool_result`; thinking blocks left out, but "
                          "those with an empty `signature` in the current tool loop → its assistant message's "
                          "`reasoning_content`; a `tool_result`'s `is_error: true` → its text starts with "
                          "`Error: ` (OpenAI: the `tool` message's content)"),
    "system": FieldRule("any", A, A, note="→ a system message"),
    "stop_sequences": FieldRule("array", A, A, note="→ `stop`; embedded: whitespace-only ones are refused, as "
                                                    "Anthropic refuses them"),
    "temperature": FieldRule("number", A, A, note="0–1"),
    "top_p": FieldRule("number", A, A),
    "top_k": FieldRule("integer", A, I, note="OpenAI refuses `top_k`"),
    "stream": FieldRule("boolean", A, A),
    "tools": FieldRule("array", A, A, note="custom tools (→ functions: `input_schema` → `parameters`, `strict` → "
                                          "`function.strict`; `input_examples`, `defer_loading` ignored); server "
                                          "tools are refused"),
    "tool_choice": FieldRule("object", A, A, note="embedded: `auto`/`none` only; `any` → `required`"),
    "metadata": FieldRule("object", I, A, note="its `user_id` (a string) → `user`; embedded: `user_id` only, "
                                                   "at most 256 characters, as Anthropic takes it"),
    "thinking": FieldRule("object", I, A, note="`enabled` → `reasoning_effort`: a `budget_tokens` of 1024–2047 "
                          "`low`, 2048–4095 `medium`, 4096 and up `high`; `disabled`, `adaptive` (the server's "
                          "default) and `between_tools` (thinking off) send none; `enabled` or `adaptive`: the "
                          "upstream's reasoning is a `thinking` block (empty `signature`) before the text, else (or "
                          "with a `display` of `omitted`) left out; what Anthropic's API refuses is refused (a `type` "
                          "other than `enabled`, `disabled`, `adaptive`, `between_tools`; `enabled` without "
                          "`budget_tokens`, or with one under 1024 or not under `max_tokens`; a `display` other than "
                          "`summarized`, `omitted`; beside `enabled` or `adaptive`, a `temperature` other than 1, a "
                          "`top_k`, a `top_p` under 0.95, a `tool_choice` of `any` or `tool`)"),
    "service_tier": FieldRule("string", I, I),
    "inference_geo": FieldRule("string", I, I),
    "speed": FieldRule("string", I, I),
    # The anthropic SDK sends these two as headers, which select among the accounts of the upstream's key: the
    # gateway's, so they are not passed on.
    "user_profile_id": FieldRule("string", I, I, note="the SDK sends it as the `anthropic-user-profile-id` header, "
                                                      "not passed on"),
    "workspace_id": FieldRule("string", I, I, note="the SDK sends it as the `anthropic-workspace-id` header, not "
                                                   "passed on"),
    "cache_control": FieldRule("object", I, I),
    "diagnostics": FieldRule("object", I, I),
    "output_config": FieldRule("object", R, A, neutral=({},),
                               note="`format` → `response_format` `json_schema` named `output`, its `schema` as sent, "
                               "`strict: true`; `effort` → `reasoning_effort` (`low`, `medium`, `high`; `xhigh` and "
                               "`max` → `high`), winning over a `thinking` budget's; other formats, efforts and "
                               "members are refused"),
    "container": FieldRule("any", R, R, note="Anthropic's code-execution container"),
    "mcp_servers": FieldRule("array", R, R, neutral=([],), note="beta; needs `anthropic-beta`"),
    "context_management": FieldRule("object", R, R, note="beta; needs `anthropic-beta`"),
    # The anthropic SDK's tool runner asks for a thread by default and, told `thread_unsupported_request`, sends the
    # whole conversation each turn instead.
    "thread": FieldRule("object", R, R, error_code="thread_unsupported_request",
                        note="beta: a conversation the server holds; `error.details.error_code` is "
                             "`thread_unsupported_request`"),
}


# What only shapes a generation, which Anthropic's count_tokens refuses ("Extra inputs are not permitted") and a
# count_tokens caller may still send (docs/api.md, Counting tokens): checked, then without effect on any model.
GENERATION_ONLY = frozenset({"max_tokens", "stream", "stop_sequences", "temperature", "top_p", "top_k", "metadata",
                             "service_tier", "inference_geo", "container", "diagnostics"})


def unknown_field(name: str) -> Unread:
    """A member no table names: passed only to an upstream of the request's own API, refused by any other model."""
    return Unread(name, f"`{name}` is not supported by this model (the gateway passes it only to an upstream of the "
                        "request's own API).", embedded=True, other_dialect=True)


def check_fields(body: Mapping[str, Json], table: Mapping[str, FieldRule]) -> tuple[Unread, ...]:
    """Type-check the fields the translators do not read; return the fields the embedded model or an upstream of
    the other dialect must refuse (unknown fields included), for the pipeline's check of the provider."""
    unread: list[Unread] = []
    wrong: list[str] = []
    for name, value in body.items():  # the body's few members, not the table's many: this runs on every request
        rule = table.get(name)
        if rule is None:
            unread.append(unknown_field(name))
            continue
        if value is None:
            continue
        if rule.embedded is not Rule.ACT and not _CHECKS[rule.json][0](value):
            wrong.append(name)
            continue
        embedded, other = rule.refused_by(value, embedded=True), rule.refused_by(value, embedded=False)
        if embedded or other:
            unread.append(Unread(name, f"`{name}` is not supported by this model.", embedded=embedded,
                                 other_dialect=other, error_code=rule.error_code))
    if wrong or len(unread) > 1:
        # The first in the table's order, not the body's (unknown fields before all): a typed gRPC request arrives
        # in its proto's field order, and must be refused for the same field as the same body sent as JSON.
        order = {name: i for i, name in enumerate(table)}
        if wrong:
            name = min(wrong, key=order.__getitem__)
            raise wrong_type(name, _CHECKS[table[name].json][1], body[name])
        unread.sort(key=lambda item: order.get(item.param, -1))
    return tuple(unread)


def markdown_table(table: Mapping[str, FieldRule], other: str) -> str:
    """The table as docs/api.md shows it; a unit test keeps the two equal."""
    lines = [f"| field | JSON | embedded model | {other} upstream | note |", "| --- | --- | --- | --- | --- |"]
    for name, rule in table.items():
        lines.append(f"| `{name}` | {rule.json} | {rule.embedded.value} | {rule.other.value} | {rule.note} |")
    return "\n".join(lines)
