"""OpenAI chat-completions request -> internal GenerationRequest, validating every value it reads."""

from __future__ import annotations

from dataclasses import dataclass

import orjson

from portico.v1 import chat_pb2
from server.domain import GenerationRequest, Role, SamplingParams, Turn
from server.errors import InvalidRequest
from server.translate.values import check_range, is_set, string_list, text_or_parts

_ROLES = {
    "system": Role.SYSTEM,
    "developer": Role.SYSTEM,
    "user": Role.USER,
    "assistant": Role.ASSISTANT,
    "tool": Role.USER,
    "function": Role.USER,
}


@dataclass(frozen=True, slots=True)
class ChatPlan:
    generation: GenerationRequest
    stream: bool
    include_usage: bool


def chat_request(
    request: chat_pb2.CreateChatCompletionRequest, *, upstream_model: str, default_max_tokens: int
) -> ChatPlan:
    if not request.messages:
        raise InvalidRequest("`messages` must contain at least one message.", param="messages")
    turns = tuple(_turn(message, f"messages[{i}]") for i, message in enumerate(request.messages))
    stream = request.stream if request.HasField("stream") else False
    if request.HasField("stream_options") and not stream:
        raise InvalidRequest("`stream_options` is only allowed when `stream` is true.", param="stream_options")
    return ChatPlan(
        generation=GenerationRequest(model=upstream_model, turns=turns, params=_sampling(request, default_max_tokens)),
        stream=stream,
        include_usage=stream and request.stream_options.include_usage,
    )


def _sampling(request: chat_pb2.CreateChatCompletionRequest, default_max_tokens: int) -> SamplingParams:
    check_range(request, "temperature", 0.0, 2.0)
    check_range(request, "top_p", 0.0, 1.0)
    check_range(request, "frequency_penalty", -2.0, 2.0)
    check_range(request, "presence_penalty", -2.0, 2.0)
    check_range(request, "top_logprobs", 0, 20)
    for name in ("max_completion_tokens", "max_tokens"):
        if request.HasField(name) and getattr(request, name) < 1:
            raise InvalidRequest(f"`{name}` must be at least 1, got {getattr(request, name)}.", param=name)
    if request.HasField("n") and request.n != 1:
        if request.n < 1 or request.n > 128:
            raise InvalidRequest(f"`n` must be between 1 and 128, got {request.n}.", param="n")
        raise InvalidRequest("This gateway generates one choice per request: `n` must be 1.", param="n")
    for token, bias in request.logit_bias.items():
        if not token.isdigit() or not -100 <= bias <= 100:
            raise InvalidRequest("`logit_bias` maps token ids to values between -100 and 100.", param="logit_bias")
    _check_response_format(request)
    _check_tool_choice(request)
    if request.HasField("max_completion_tokens"):
        max_tokens = request.max_completion_tokens
    elif request.HasField("max_tokens"):
        max_tokens = request.max_tokens
    else:
        max_tokens = default_max_tokens
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=request.temperature if request.HasField("temperature") else 1.0,
        top_p=request.top_p if request.HasField("top_p") else 1.0,
        stop=string_list(request.stop, "stop", max_items=4),
        seed=request.seed if request.HasField("seed") else None,
    )


def _turn(message: chat_pb2.ChatMessage, where: str) -> Turn:
    role = _ROLES.get(message.role)
    if role is None:
        raise InvalidRequest(
            f"`{where}.role` must be one of system, developer, user, assistant, tool; got {message.role[:40]!r}.",
            param=f"{where}.role",
        )
    if not is_set(message, "content") and not (message.role == "assistant" and message.tool_calls):
        raise InvalidRequest(f"`{where}.content` is required.", param=f"{where}.content")
    text = text_or_parts(message.content, f"{where}.content")
    # The embedded model has no tool protocol: tool traffic is kept as plain text so no context is lost.
    if message.role == "assistant" and message.tool_calls:
        calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls]
        text = (text + "\n" if text else "") + "Tool calls: " + orjson.dumps(calls).decode()
    elif message.role in ("tool", "function"):
        text = f"Result of tool call {message.tool_call_id or message.name}: {text}"
    return Turn(role=role, text=text)



def _check_response_format(request: chat_pb2.CreateChatCompletionRequest) -> None:
    if not is_set(request, "response_format"):
        return
    fields = request.response_format.struct_value.fields
    kind = fields["type"].string_value if "type" in fields else ""
    if kind != "text":
        raise InvalidRequest(
            f"`response_format` type {kind[:40]!r} is not supported by this model; only 'text' is.",
            param="response_format.type",
        )


def _check_tool_choice(request: chat_pb2.CreateChatCompletionRequest) -> None:
    """The embedded model never calls tools, so only choices it can honour are accepted."""
    if not is_set(request, "tool_choice"):
        return
    choice = request.tool_choice
    if choice.WhichOneof("kind") == "string_value" and choice.string_value in ("none", "auto"):
        return
    raise InvalidRequest(
        "This model cannot call tools: `tool_choice` may only be 'none' or 'auto'.", param="tool_choice"
    )
