"""Internal GenerationRequest -> the Messages body sent to an Anthropic upstream.

A request that arrived as an Anthropic message passes through: its own body, every field kept, with the upstream's
model name, `max_tokens` as the integer it was read as (a caller may write 8.0) and `stream` (as the caller asked:
a caller that does not stream gets the upstream's one JSON answer) put in. Any other request (a chat completion) is
built from the internal values.
"""

from __future__ import annotations

import hashlib
import re

from server.domain import AnthropicMessagesSource, GenerationRequest, Json, Role, ToolChoice, ToolChoiceMode, Turn
from server.translate.internal_to_anthropic import tool_input

ANTHROPIC_MAX_TEMPERATURE = 1.0  # OpenAI allows up to 2; Anthropic refuses more than 1

_CHOICE_TYPES = {ToolChoiceMode.AUTO: "auto", ToolChoiceMode.NONE: "none", ToolChoiceMode.REQUIRED: "any",
                 ToolChoiceMode.TOOL: "tool"}


def anthropic_body(request: GenerationRequest, *, model: str) -> dict:
    source = request.source
    if isinstance(source, AnthropicMessagesSource):
        body = dict(source.body)  # a copy: the caller's body is never edited
    else:
        body = _built(request)
    body["model"] = model
    body["max_tokens"] = request.params.max_tokens
    body["stream"] = request.stream
    return body


# What only shapes a generation, which Anthropic's count_tokens refuses ("Extra inputs are not permitted") and a
# count_tokens caller may still send (docs/api.md, Counting tokens): left out of the body an upstream counts.
GENERATION_ONLY = frozenset({"max_tokens", "stream", "stop_sequences", "temperature", "top_p", "top_k", "metadata",
                             "service_tier", "inference_geo", "container", "diagnostics"})


def count_body(request: GenerationRequest, *, model: str) -> dict:
    """The body of an upstream's /v1/messages/count_tokens: the caller's, every other field kept, without
    GENERATION_ONLY, with the upstream's model name."""
    source = request.source
    whole = source.body if isinstance(source, AnthropicMessagesSource) else _built(request)
    body = {name: value for name, value in whole.items() if name not in GENERATION_ONLY}
    body["model"] = model
    return body


def _built(request: GenerationRequest) -> dict:
    params = request.params
    body: dict[str, Json] = {"max_tokens": params.max_tokens, "messages": _messages(request.turns)}
    if system := "\n\n".join(t.text for t in request.turns if t.role is Role.SYSTEM and t.text):
        body["system"] = system
    if params.temperature is not None:
        body["temperature"] = min(params.temperature, ANTHROPIC_MAX_TEMPERATURE)
    if params.top_p is not None:
        body["top_p"] = params.top_p
    if params.top_k is not None:
        body["top_k"] = params.top_k
    if params.stop:
        body["stop_sequences"] = list(params.stop)
    # seed has no Anthropic field: it is left out.
    if request.end_user:
        body["metadata"] = {"user_id": request.end_user}
    if request.tools:
        body["tools"] = [
            {"name": t.name, **({"description": t.description} if t.description else {}),
             "input_schema": dict(t.parameters) or {"type": "object"}}
            for t in request.tools
        ]
        if request.tool_choice is not None:
            body["tool_choice"] = _tool_choice(request.tool_choice)
    return body


def _messages(turns: tuple[Turn, ...]) -> list[dict]:
    """Turns -> messages. Anthropic wants user and assistant to alternate and all results of a turn's calls in the
    next user message, so consecutive turns of one role (OpenAI's separate `tool` messages) are merged."""
    messages: list[dict] = []
    for turn in turns:
        if turn.role is Role.SYSTEM:
            continue
        blocks = _blocks(turn)
        if messages and messages[-1]["role"] == turn.role.value:
            messages[-1]["content"] += blocks
        else:
            messages.append({"role": turn.role.value, "content": blocks})
    for message in messages:  # the plain form for a single text block, as most callers write it
        if len(message["content"]) == 1 and message["content"][0]["type"] == "text":
            message["content"] = message["content"][0]["text"]
    return messages


def _blocks(turn: Turn) -> list[dict]:
    # tool_result blocks come first in a user message: Anthropic requires it.
    blocks: list[dict] = [
        {"type": "tool_result", "tool_use_id": _tool_id(r.call_id), "content": r.text,
         **({"is_error": True} if r.is_error else {})}
        for r in turn.tool_results
    ]
    if turn.text or not (turn.tool_results or turn.tool_calls):
        blocks.append({"type": "text", "text": turn.text})
    blocks += [{"type": "tool_use", "id": _tool_id(c.id), "name": c.name, "input": tool_input(c)}
               for c in turn.tool_calls]
    return blocks


_NOT_IN_TOOL_ID = re.compile(r"[^a-zA-Z0-9_-]")


def _tool_id(call_id: str) -> str:
    """Anthropic takes tool ids of [a-zA-Z0-9_-] only; other servers' models make others (Kimi's
    `functions.weather:0`). Rewritten the same way in a call and its result, so they still match, with a digest of
    the id so that two ids differing only in replaced characters stay apart."""
    if not _NOT_IN_TOOL_ID.search(call_id):
        return call_id
    digest = hashlib.sha256(call_id.encode()).hexdigest()[:12]
    return f"{_NOT_IN_TOOL_ID.sub('_', call_id)}_{digest}"


def _tool_choice(choice: ToolChoice) -> dict:
    out: dict[str, Json] = {"type": _CHOICE_TYPES[choice.mode]}
    if choice.mode is ToolChoiceMode.TOOL:
        out["name"] = choice.name
    if not choice.parallel and choice.mode is not ToolChoiceMode.NONE:
        out["disable_parallel_tool_use"] = True
    return out
