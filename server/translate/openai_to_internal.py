"""OpenAI chat-completions request -> internal GenerationRequest, validating every value it reads.

What a request needs from a model (tool calls, JSON output) is not judged here: the pipeline checks it against
the provider's capabilities, since an upstream can honour what the embedded model cannot.
"""

from __future__ import annotations

from dataclasses import dataclass

from portico.v1 import chat_pb2
from server.domain import (
    Dialect, GenerationRequest, Role, SamplingParams, SourceRequest, ToolCall, ToolChoice, ToolChoiceMode,
    ToolResult, ToolSpec, Turn,
)
from server.errors import InvalidRequest
from server.translate.values import check_range, is_set, plain, string_list, text_or_parts

_ROLES = {
    "system": Role.SYSTEM,
    "developer": Role.SYSTEM,
    "user": Role.USER,
    "assistant": Role.ASSISTANT,
    "tool": Role.USER,  # a tool's answer is the caller's turn (Anthropic's tool_result blocks)
    "function": Role.USER,
}
_RESPONSE_FORMATS = ("text", "json_object", "json_schema")
_TOOL_CHOICES = {"none": ToolChoiceMode.NONE, "auto": ToolChoiceMode.AUTO, "required": ToolChoiceMode.REQUIRED}


@dataclass(frozen=True, slots=True)
class ChatPlan:
    generation: GenerationRequest
    stream: bool
    include_usage: bool


def chat_request(
    request: chat_pb2.CreateChatCompletionRequest, *, upstream_model: str, default_max_tokens: int,
    always_stream: bool = False,
) -> ChatPlan:
    """`always_stream`: the RPC streams whatever `stream` says (the typed StreamChatCompletion)."""
    if not request.messages:
        raise InvalidRequest("`messages` must contain at least one message.", param="messages")
    turns = tuple(_turn(message, f"messages[{i}]") for i, message in enumerate(request.messages))
    stream = always_stream or (request.stream if request.HasField("stream") else False)
    if request.HasField("stream_options") and not stream:
        raise InvalidRequest("`stream_options` is only allowed when `stream` is true.", param="stream_options")
    tools = tuple(_tool(tool, f"tools[{i}]") for i, tool in enumerate(request.tools))
    generation = GenerationRequest(
        model=upstream_model,
        turns=turns,
        params=_sampling(request, default_max_tokens),
        tools=tools,
        tool_choice=_tool_choice(request, tools),
        json_output=_response_format(request) != "text",
        source=SourceRequest(Dialect.OPENAI, request),
        stream=stream,
    )
    return ChatPlan(generation=generation, stream=stream, include_usage=stream and request.stream_options.include_usage)


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
    if request.HasField("max_completion_tokens"):
        max_tokens = request.max_completion_tokens
    elif request.HasField("max_tokens"):
        max_tokens = request.max_tokens
    else:
        max_tokens = default_max_tokens
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=request.temperature if request.HasField("temperature") else None,
        top_p=request.top_p if request.HasField("top_p") else None,
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
    if message.role in ("tool", "function"):
        call_id = message.tool_call_id if message.role == "tool" else message.name
        if not call_id:
            field = "tool_call_id" if message.role == "tool" else "name"
            raise InvalidRequest(f"`{where}.{field}` is required.", param=f"{where}.{field}")
        return Turn(role, tool_results=(ToolResult(call_id=call_id, text=text),))
    calls = ()
    if message.role == "assistant":
        calls = tuple(_call(call, f"{where}.tool_calls[{i}]") for i, call in enumerate(message.tool_calls))
    return Turn(role, text, tool_calls=calls)


def _call(call: chat_pb2.ToolCall, where: str) -> ToolCall:
    if not call.id or not call.function.name:
        raise InvalidRequest(f"`{where}` needs an `id` and a `function.name`.", param=where)
    return ToolCall(id=call.id, name=call.function.name, arguments=call.function.arguments or "{}")


def _tool(tool: chat_pb2.ChatTool, where: str) -> ToolSpec:
    if tool.type != "function":
        raise InvalidRequest(f"`{where}.type`: only 'function' tools are supported, got {tool.type[:40]!r}.",
                             param=f"{where}.type")
    if not tool.function.name:
        raise InvalidRequest(f"`{where}.function.name` is required.", param=f"{where}.function.name")
    parameters = plain(tool.function.parameters) if tool.function.HasField("parameters") else {}
    return ToolSpec(name=tool.function.name, description=tool.function.description, parameters=parameters)


def _tool_choice(request: chat_pb2.CreateChatCompletionRequest, tools: tuple[ToolSpec, ...]) -> ToolChoice | None:
    parallel = request.parallel_tool_calls if request.HasField("parallel_tool_calls") else True
    if not is_set(request, "tool_choice"):
        return None if parallel else ToolChoice(parallel=False)
    choice = request.tool_choice
    kind = choice.WhichOneof("kind")
    if kind == "string_value" and choice.string_value in _TOOL_CHOICES:
        return ToolChoice(_TOOL_CHOICES[choice.string_value], parallel=parallel)
    if kind == "struct_value":
        fields = choice.struct_value.fields
        function = fields["function"].struct_value.fields if "function" in fields else {}
        name = function["name"].string_value if "name" in function else ""
        if "type" in fields and fields["type"].string_value == "function" and name:
            if name not in {tool.name for tool in tools}:
                raise InvalidRequest(f"`tool_choice` names the function {name[:40]!r}, which is not in `tools`.",
                                     param="tool_choice")
            return ToolChoice(ToolChoiceMode.TOOL, name=name, parallel=parallel)
    raise InvalidRequest(
        "`tool_choice` must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}.",
        param="tool_choice",
    )


def _response_format(request: chat_pb2.CreateChatCompletionRequest) -> str:
    if not is_set(request, "response_format"):
        return "text"
    fields = request.response_format.struct_value.fields
    kind = fields["type"].string_value if "type" in fields else ""
    if kind not in _RESPONSE_FORMATS:
        raise InvalidRequest(f"`response_format.type` must be one of {', '.join(_RESPONSE_FORMATS)}; "
                             f"got {kind[:40]!r}.", param="response_format.type")
    return kind
