"""Anthropic Messages request -> internal GenerationRequest, validating every value it reads."""

from __future__ import annotations

from dataclasses import dataclass

import orjson
from google.protobuf import json_format, struct_pb2

from portico.v1 import message_pb2
from server.domain import GenerationRequest, Role, SamplingParams, Turn
from server.errors import InvalidRequest
from server.translate.values import check_range, is_set, text_or_parts

_ROLES = {"user": Role.USER, "assistant": Role.ASSISTANT}


@dataclass(frozen=True, slots=True)
class MessagePlan:
    generation: GenerationRequest
    stream: bool


def message_request(request: message_pb2.CreateMessageRequest, *, upstream_model: str) -> MessagePlan:
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
    _check_tool_choice(request)
    params = SamplingParams(
        max_tokens=request.max_tokens,
        temperature=request.temperature if request.HasField("temperature") else 1.0,
        top_p=request.top_p if request.HasField("top_p") else 1.0,
        top_k=request.top_k if request.HasField("top_k") and request.top_k > 0 else None,
        stop=tuple(request.stop_sequences),
    )
    return MessagePlan(
        generation=GenerationRequest(model=upstream_model, turns=tuple(turns), params=params),
        stream=request.stream if request.HasField("stream") else False,
    )


def _turn(message: message_pb2.InputMessage, where: str) -> Turn:
    role = _ROLES.get(message.role)
    if role is None:
        raise InvalidRequest(
            f"{where}.role: must be 'user' or 'assistant', got {message.role[:40]!r}.", param=f"{where}.role"
        )
    content = message.content
    if not is_set(message, "content"):
        raise InvalidRequest(f"{where}.content: Field required", param=f"{where}.content")
    if content.WhichOneof("kind") == "list_value":
        return Turn(role, "\n".join(_block_text(b, f"{where}.content[{i}]")
                                    for i, b in enumerate(content.list_value.values)))
    return Turn(role, text_or_parts(content, f"{where}.content"))


def _block_text(block: struct_pb2.Value, where: str) -> str:
    """Text blocks as they are; tool traffic kept as plain text, since the embedded model has no tool protocol."""
    if block.WhichOneof("kind") != "struct_value":
        raise InvalidRequest(f"{where}: must be a content block object.", param=where)
    fields = block.struct_value.fields
    kind = fields["type"].string_value if "type" in fields else ""
    if kind == "text":
        text = fields.get("text")
        if text is None or text.WhichOneof("kind") != "string_value":
            raise InvalidRequest(f"{where}.text: must be a string.", param=f"{where}.text")
        return text.string_value
    if kind == "tool_use":
        call = {"name": fields["name"].string_value if "name" in fields else "",
                "input": json_format.MessageToDict(fields["input"]) if "input" in fields else {}}
        return "Tool call: " + orjson.dumps(call).decode()
    if kind == "tool_result":
        result = text_or_parts(fields["content"], f"{where}.content") if "content" in fields else ""
        tool_id = fields["tool_use_id"].string_value if "tool_use_id" in fields else ""
        return f"Result of tool call {tool_id}: {result}"
    raise InvalidRequest(
        f"{where}.type: content blocks of type {kind[:40]!r} are not supported by this model; "
        "supported: text, tool_use, tool_result.",
        param=f"{where}.type",
    )


def _check_tool_choice(request: message_pb2.CreateMessageRequest) -> None:
    """The embedded model never calls tools: only choices it can honour are accepted."""
    if not is_set(request, "tool_choice"):
        return
    fields = request.tool_choice.struct_value.fields
    kind = fields["type"].string_value if "type" in fields else ""
    if kind not in ("auto", "none"):
        raise InvalidRequest("tool_choice: this model cannot call tools; use 'auto' or 'none'.",
                             param="tool_choice")
