"""Internal GenerationRequest -> the Messages body sent to an Anthropic upstream.

A request that arrived as an Anthropic message passes through: its own body, every field kept, with the upstream's
model name, `max_tokens` as the integer it was read as (a caller may write 8.0) and `stream` (as the caller asked:
a caller that does not stream gets the upstream's one JSON answer) put in. Any other request (a chat completion) is
built from the internal values.
"""

from __future__ import annotations

import hashlib
import re

from server.domain import (
    AnthropicMessagesSource, GenerationRequest, Json, OpenAIChatSource, Role, ToolChoice, ToolChoiceMode, Turn,
)
from server.translate.field_rules import GENERATION_ONLY
from server.translate.internal_to_anthropic import tool_input
from server.translate.structured import chat_format_param
from server.translate.thinking import THINKING_BLOCK_TYPES, thinking_block

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
    body["max_tokens"] = request.most_output_tokens  # a chat request's default limit, with room for its thinking
    body["stream"] = request.stream
    return body


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
    if request.reasoning is not None and request.reasoning.budget_tokens is not None and not _continues_unthought(body):
        body["thinking"] = {"type": "enabled", "budget_tokens": request.reasoning.budget_tokens}
    if request.output_format is not None and request.output_format.schema is not None:  # any other is refused
        body["output_config"] = {"format": {"type": "json_schema", "schema": request.output_format.schema}}
    if request.end_user:
        body["metadata"] = {"user_id": request.end_user}
    if request.tools:
        body["tools"] = [
            {"name": t.name, **({"description": t.description} if t.description else {}),
             "input_schema": {"type": "object", **t.parameters},  # OpenAI's may leave the type out; Anthropic's not
             **({"strict": t.strict} if t.strict is not None else {})}
            for t in request.tools
        ]
        if request.tool_choice is not None:
            body["tool_choice"] = _tool_choice(request.tool_choice)
    return body


def _continues_unthought(body: dict) -> bool:
    """The final assistant message is one Anthropic refuses with thinking on unless it starts with the signed
    thinking block the model wrote (the caller's `thinking_blocks`; `reasoning_content` has no signature): one with
    tool_use blocks (a tool loop's next step) or the last message (a prefill). Without that block such a request is
    sent without thinking; the next user turn thinks again."""
    messages = body["messages"]
    final = next((m for m in reversed(messages) if m["role"] == "assistant"), None)
    if final is None or not isinstance(final["content"], list):
        return final is not None and final is messages[-1]
    if final["content"] and final["content"][0]["type"] in THINKING_BLOCK_TYPES:  # signed: _blocks sends no other
        return False
    return final is messages[-1] or any(block["type"] == "tool_use" for block in final["content"])


def _messages(turns: tuple[Turn, ...]) -> list[dict]:
    messages = [message for message, _ in _placed_messages(turns)]
    for message in messages:  # the plain form for a single text block, as most callers write it
        if len(message["content"]) == 1 and message["content"][0]["type"] == "text":
            message["content"] = message["content"][0]["text"]
    return messages


def _placed_messages(turns: tuple[Turn, ...]) -> list[tuple[dict, list[int]]]:
    """Turns -> messages, each with the index of the turn each of its blocks was made from. Anthropic wants user
    and assistant to alternate and all results of a turn's calls in the next user message, so consecutive turns of
    one role (OpenAI's separate `tool` messages) are merged."""
    placed: list[tuple[dict, list[int]]] = []
    for i, turn in enumerate(turns):
        if turn.role is Role.SYSTEM:
            continue
        blocks = _blocks(turn)
        if turn.role is Role.ASSISTANT and blocks == [{"type": "text", "text": ""}]:
            continue  # says nothing, and Anthropic refuses an empty text block
        if placed and placed[-1][0]["role"] == turn.role.value:
            placed[-1][0]["content"] += blocks
            placed[-1][1].extend([i] * len(blocks))
        else:
            placed.append(({"role": turn.role.value, "content": blocks}, [i] * len(blocks)))
    return placed


# Anthropic's 400s have no `param`: their message starts with the path of the field (`messages.2.content.1: ...`).
_MESSAGE_PATH = re.compile(r"([a-z_]+(?:\.[A-Za-z0-9_]+)*): ")
# The chat field each top-level field of a built body was made from (the others: messages, system, tools, ...).
_CHAT_FIELDS = {"model": "model", "stream": "stream", "temperature": "temperature", "top_p": "top_p",
                "top_k": "top_k", "tool_choice": "tool_choice", "thinking": "reasoning_effort"}
_TOOL_MEMBERS = {"input_schema": "function.parameters", "name": "function.name", "description": "function.description"}


def caller_param(request: GenerationRequest, message: str) -> str | None:
    """The chat caller's field that an Anthropic 400 is about, read from the path its message starts with (a path
    into the body built for it): `system` is the first system message, `messages.2.content.1` the caller's message
    that block was made from (merged turns make one message), `stop_sequences.1` `stop[1]`,
    `output_config.format.schema` `response_format.json_schema.schema`. None without a path, or when no field the
    caller sent made it."""
    source = request.source
    match = _MESSAGE_PATH.match(message)
    if not isinstance(source, OpenAIChatSource) or match is None:
        return None
    name, *rest = match.group(1).split(".")
    if name == "messages":
        return _message_param(request, rest)
    if name == "system":
        return next((f"messages[{i}]" for i, turn in enumerate(request.turns) if turn.role is Role.SYSTEM), None)
    if name == "tools" and rest and rest[0].isdigit():
        members = rest[2:] if rest[1:2] == ["custom"] else rest[1:]  # Anthropic names the tool's kind in paths
        own = _TOOL_MEMBERS.get(members[0]) if members else None
        return ".".join([f"tools[{rest[0]}]", own, *members[1:]]) if own else f"tools[{rest[0]}]"
    if name == "max_tokens":  # without the caller's own limit, a thinking budget's room made it large: the effort
        room = request.reasoning is not None and request.reasoning.room
        return request.token_limit_field or ("reasoning_effort" if room else "max_tokens")
    if name == "stop_sequences":
        listed = rest and rest[0].isdigit() and isinstance(source.body.get("stop"), list)
        return f"stop[{rest[0]}]" if listed else "stop"
    if name == "metadata":
        return "user" if "user" in source.body else "safety_identifier"
    if name == "tool_choice" and rest == ["disable_parallel_tool_use"]:
        return "parallel_tool_calls"
    if name == "output_config":
        return chat_format_param(rest)
    return _CHAT_FIELDS.get(name)


def _message_param(request: GenerationRequest, path: list[str]) -> str:
    """`messages.N[.content.M...]` -> the chat message the block (or the message's first block) was made from."""
    placed = _placed_messages(request.turns)
    if not path or not path[0].isdigit() or int(path[0]) >= len(placed):
        return "messages"
    message, turns = placed[int(path[0])]
    block = int(path[2]) if path[1:2] == ["content"] and path[2:3] and path[2].isdigit() else 0
    if block >= len(turns):
        return f"messages[{turns[0]}]"
    if message["content"][block]["type"] in THINKING_BLOCK_TYPES:  # the caller's block: its turn's blocks start with them
        return f"messages[{turns[block]}].thinking_blocks[{block - turns.index(turns[block])}]"
    return f"messages[{turns[block]}]"


def _blocks(turn: Turn) -> list[dict]:
    # An assistant's thinking blocks come first, as the model wrote them (those Anthropic can take back: signed);
    # tool_result blocks come first in a user message: Anthropic requires both.
    blocks = [thinking_block(t) for t in turn.thoughts if t.redacted or t.signature]
    blocks += [
        {"type": "tool_result", "tool_use_id": _tool_id(r.call_id), "content": r.text,
         **({"is_error": True} if r.is_error else {})}
        for r in turn.tool_results
    ]
    if turn.text or not (turn.tool_results or turn.tool_calls or blocks):
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
