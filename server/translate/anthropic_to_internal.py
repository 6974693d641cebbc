"""Anthropic Messages request -> internal GenerationRequest, validating every value it reads.

Like the OpenAI translator, it leaves what a request needs from a model (tool calls) to the pipeline's check of the
provider's capabilities.
"""

from __future__ import annotations

from dataclasses import dataclass

import orjson
from google.protobuf import struct_pb2

from portico.v1 import message_pb2
from server.domain import (
    Dialect, GenerationRequest, Role, SamplingParams, SourceRequest, ToolCall, ToolChoice, ToolChoiceMode,
    ToolResult, ToolSpec, Turn,
)
from server.errors import InvalidRequest
from server.translate.values import check_range, is_set, plain, text_or_parts

_ROLES = {"user": Role.USER, "assistant": Role.ASSISTANT}
_TOOL_CHOICES = {"auto": ToolChoiceMode.AUTO, "none": ToolChoiceMode.NONE, "any": ToolChoiceMode.REQUIRED,
                 "tool": ToolChoiceMode.TOOL}
# Extended-thinking blocks in earlier assistant turns: an Anthropic upstream receives them untouched (the request
# passes through); other models do not need them for context, so they are left out of the internal turns.
_SKIPPED_BLOCKS = ("thinking", "redacted_thinking")


@dataclass(frozen=True, slots=True)
class MessagePlan:
    generation: GenerationRequest
    stream: bool


def message_request(request: message_pb2.CreateMessageRequest, *, upstream_model: str,
                    always_stream: bool = False) -> MessagePlan:
    """`always_stream`: the RPC streams whatever `stream` says (the typed StreamMessage)."""
    if not request.HasField("max_tokens"):
        raise InvalidRequest("max_tokens: Field required", param="max_tokens")
    if request.max_tokens < 1:
        raise InvalidRequest(f"max_tokens: must be at least 1, got {request.max_tokens}.", param="max_tokens")
    if not request.messages:
        raise InvalidRequest("messages: at least one message is required.", param="messages")
    turns = []
    if is_set(request, "system"):
        turns.append(Turn(Role.SYSTEM, text_or_parts(request.system, "system")))
    turns += [_turn(message, f"messages[{i}]") for i, message in enumerate(request.messages)]
    check_range(request, "temperature", 0.0, 1.0)
    check_range(request, "top_p", 0.0, 1.0)
    if request.HasField("top_k") and request.top_k < 0:
        raise InvalidRequest(f"top_k: must be at least 0, got {request.top_k}.", param="top_k")
    for i, stop in enumerate(request.stop_sequences):
        if not stop:
            raise InvalidRequest("stop_sequences: entries must be non-empty strings.", param=f"stop_sequences[{i}]")
    params = SamplingParams(
        max_tokens=request.max_tokens,
        temperature=request.temperature if request.HasField("temperature") else None,
        top_p=request.top_p if request.HasField("top_p") else None,
        top_k=request.top_k if request.HasField("top_k") and request.top_k > 0 else None,
        stop=tuple(request.stop_sequences),
    )
    tools = tuple(_tool(tool, f"tools[{i}]") for i, tool in enumerate(request.tools))
    stream = always_stream or (request.stream if request.HasField("stream") else False)
    generation = GenerationRequest(
        model=upstream_model, turns=tuple(turns), params=params, tools=tools,
        tool_choice=_tool_choice(request, tools), source=SourceRequest(Dialect.ANTHROPIC, request), stream=stream,
    )
    return MessagePlan(generation=generation, stream=stream)


def _turn(message: message_pb2.InputMessage, where: str) -> Turn:
    role = _ROLES.get(message.role)
    if role is None:
        raise InvalidRequest(
            f"{where}.role: must be 'user' or 'assistant', got {message.role[:40]!r}.", param=f"{where}.role"
        )
    content = message.content
    if not is_set(message, "content"):
        raise InvalidRequest(f"{where}.content: Field required", param=f"{where}.content")
    if content.WhichOneof("kind") != "list_value":
        return Turn(role, text_or_parts(content, f"{where}.content"))
    texts: list[str] = []
    calls: list[ToolCall] = []
    results: list[ToolResult] = []
    for i, block in enumerate(content.list_value.values):
        _read_block(block, f"{where}.content[{i}]", role, texts, calls, results)
    return Turn(role, "\n".join(texts), tool_calls=tuple(calls), tool_results=tuple(results))


def _read_block(block: struct_pb2.Value, where: str, role: Role, texts: list, calls: list, results: list) -> None:
    if block.WhichOneof("kind") != "struct_value":
        raise InvalidRequest(f"{where}: must be a content block object.", param=where)
    fields = block.struct_value.fields
    kind = _string(fields, "type")
    if kind == "text":
        text = fields.get("text")
        if text is None or text.WhichOneof("kind") != "string_value":
            raise InvalidRequest(f"{where}.text: must be a string.", param=f"{where}.text")
        texts.append(text.string_value)
    elif kind == "tool_use" and role is Role.ASSISTANT:
        if not _string(fields, "id") or not _string(fields, "name"):
            raise InvalidRequest(f"{where}: a tool_use block needs an `id` and a `name`.", param=where)
        arguments = orjson.dumps(plain(fields["input"]) if "input" in fields else {}).decode()
        calls.append(ToolCall(id=_string(fields, "id"), name=_string(fields, "name"), arguments=arguments))
    elif kind == "tool_result" and role is Role.USER:
        if not _string(fields, "tool_use_id"):
            raise InvalidRequest(f"{where}.tool_use_id: Field required", param=f"{where}.tool_use_id")
        text = text_or_parts(fields["content"], f"{where}.content") if "content" in fields else ""
        is_error = "is_error" in fields and fields["is_error"].bool_value
        results.append(ToolResult(call_id=_string(fields, "tool_use_id"), text=text, is_error=is_error))
    elif kind not in _SKIPPED_BLOCKS or role is not Role.ASSISTANT:
        raise InvalidRequest(
            f"{where}.type: content blocks of type {kind[:40]!r} are not supported here; supported: text, "
            "tool_use (assistant), tool_result (user), thinking (assistant).",
            param=f"{where}.type",
        )


def _tool(tool: message_pb2.MessageTool, where: str) -> ToolSpec:
    if tool.type not in ("", "custom"):
        raise InvalidRequest(f"{where}.type: only custom tools are supported, not {tool.type[:40]!r}.",
                             param=f"{where}.type")
    if not tool.name:
        raise InvalidRequest(f"{where}.name: Field required", param=f"{where}.name")
    schema = plain(tool.input_schema) if tool.HasField("input_schema") else {"type": "object"}
    return ToolSpec(name=tool.name, description=tool.description, parameters=schema)


def _tool_choice(request: message_pb2.CreateMessageRequest, tools: tuple[ToolSpec, ...]) -> ToolChoice | None:
    if not is_set(request, "tool_choice"):
        return None
    choice = request.tool_choice
    fields = choice.struct_value.fields if choice.WhichOneof("kind") == "struct_value" else {}
    mode = _TOOL_CHOICES.get(_string(fields, "type"))
    if mode is None:
        raise InvalidRequest("tool_choice.type: must be one of auto, any, tool, none.", param="tool_choice")
    name = _string(fields, "name") or None
    if mode is ToolChoiceMode.TOOL and name not in {tool.name for tool in tools}:
        raise InvalidRequest("tool_choice.name: must name one of `tools`.", param="tool_choice")
    parallel = not ("disable_parallel_tool_use" in fields and fields["disable_parallel_tool_use"].bool_value)
    return ToolChoice(mode, name=name if mode is ToolChoiceMode.TOOL else None, parallel=parallel)


def _string(fields, name: str) -> str:
    return fields[name].string_value if name in fields else ""
