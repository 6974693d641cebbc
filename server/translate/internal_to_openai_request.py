"""Internal GenerationRequest -> the chat-completions body sent to an OpenAI-compatible upstream.

A request that arrived as a chat completion passes through: its own body, every field kept, with only what the
gateway decides put in: the upstream's model name, the token limit the gateway resolved (in the field this upstream
understands), and whether to stream. A caller that streams gets a stream with usage (so the limits are settled with
real counts); one that does not gets the upstream's one JSON answer, which always carries usage (and must not carry
stream_options: OpenAI refuses them without `stream`). Any other request (an Anthropic Messages one) is built from
the internal values.
"""

from __future__ import annotations

import re

from server.domain import (
    AnthropicMessagesSource, GenerationRequest, Json, OpenAIChatSource, Role, ToolChoice, ToolChoiceMode, Turn,
    tool_loop_start,
)
from server.translate.structured import FORMAT_NAME, messages_format_param

_TOKEN_FIELDS = ("max_tokens", "max_completion_tokens")


def openai_body(request: GenerationRequest, *, model: str, max_tokens_field: str = "max_tokens") -> dict:
    source = request.source
    if isinstance(source, OpenAIChatSource):
        body = dict(source.body)  # a copy: the caller's body is never edited
    else:
        body = _built(request)
    for field in _TOKEN_FIELDS:
        body.pop(field, None)
    body[max_tokens_field] = request.params.max_tokens
    body["model"] = model
    if request.stream:
        body["stream"] = True
        body["stream_options"] = {**(body.get("stream_options") or {}), "include_usage": True}
    else:
        body["stream"] = False
        body.pop("stream_options", None)
    return body


def _built(request: GenerationRequest) -> dict:
    params = request.params
    body: dict[str, Json] = {"messages": [message for _, message in _turn_messages(request)]}
    if params.temperature is not None:
        body["temperature"] = params.temperature
    if params.top_p is not None:
        body["top_p"] = params.top_p
    if params.stop:
        body["stop"] = list(params.stop)
    if params.seed is not None:
        body["seed"] = params.seed
    # top_k has no OpenAI field: OpenAI itself refuses unknown fields, so it is left out.
    if request.reasoning is not None and request.reasoning.effort is not None:
        body["reasoning_effort"] = request.reasoning.effort
    if request.output_format is not None and request.output_format.schema is not None:  # any other is refused
        # strict: OpenAI's guarantee that the answer matches, which Anthropic's output always gives
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": FORMAT_NAME, "schema": request.output_format.schema, "strict": True}}
    if request.end_user:
        body["user"] = request.end_user
    if request.tools:
        body["tools"] = [
            {"type": "function",
             "function": {"name": t.name, "description": t.description, "parameters": dict(t.parameters),
                          **({"strict": t.strict} if t.strict is not None else {})}}
            for t in request.tools
        ]
    if request.tool_choice is not None:
        _put_tool_choice(body, request.tool_choice, has_tools=bool(request.tools))
    return body


def _turn_messages(request: GenerationRequest) -> list[tuple[int, dict]]:
    """Each message of the built body, with the index of the turn it was made from."""
    # Reasoning servers want their reasoning back in the current tool loop (DeepSeek's thinking mode refuses a
    # loop's next step without it; Qwen3's and Kimi's templates read it) and nowhere earlier (older DeepSeek servers
    # refuse it there).
    loop_start = tool_loop_start(request.turns)
    return [(i, message) for i, turn in enumerate(request.turns)
            for message in _messages(turn, with_reasoning=i >= loop_start)]


# The Messages field each top-level chat field of a built body was made from (the others: messages, tools).
_MESSAGES_FIELDS = {"model": "model", "max_tokens": "max_tokens", "max_completion_tokens": "max_tokens",
                    "stream": "stream", "temperature": "temperature", "top_p": "top_p", "stop": "stop_sequences",
                    "tool_choice": "tool_choice", "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
                    "user": "metadata.user_id"}
_TOOL_MEMBERS = {".function.parameters": ".input_schema", ".function.name": ".name",
                 ".function.description": ".description"}
_PARAM = re.compile(r"([A-Za-z_]+)(?:\[(\d+)\])?(.*)", re.DOTALL)


def caller_param(request: GenerationRequest, param: str, *, max_tokens_field: str = "max_tokens") -> str | None:
    """The caller's field that an upstream's error `param` (a path into the body sent) was made from. A chat body
    passed through is the caller's own, but for the token limit, which the gateway put in `max_tokens_field` in place
    of the caller's `max_completion_tokens` or `max_tokens`. For a Messages caller: `stop` is `stop_sequences`, a
    system message `system`, `messages[4]` the caller's message it came from (one message may make several),
    `tools[0].function.parameters` `tools[0].input_schema`, `response_format` `output_config.format`,
    `reasoning_effort` `output_config.effort` (else `thinking`); None when no field the caller sent made it (a path into
    a body the caller never saw would mislead)."""
    source = request.source
    if isinstance(source, OpenAIChatSource):
        return (request.token_limit_field or param) if param == max_tokens_field else param
    if not isinstance(source, AnthropicMessagesSource):
        return param
    match = _PARAM.fullmatch(param)
    if match is None:
        return None
    name, index, rest = match.group(1), match.group(2), match.group(3)
    if name in ("messages", "tools") and index is None:
        return name
    if name == "messages":
        made = _turn_messages(request)
        if int(index) >= len(made):
            return "messages"
        turn = made[int(index)][0]
        if request.turns[turn].role is Role.SYSTEM:
            return "system"
        system_turns = 1 if request.turns[0].role is Role.SYSTEM else 0
        return f"messages[{turn - system_turns}]"  # the parts inside differ between the dialects
    if name == "tools":
        for member, own in _TOOL_MEMBERS.items():
            if rest == member or rest.startswith((member + ".", member + "[")):
                return f"tools[{index}]{own}{rest.removeprefix(member)}"
        return f"tools[{index}]"
    if name == "response_format" and index is None:
        return messages_format_param(rest)
    if name == "reasoning_effort" and index is None and not rest:  # the effort, when given, is what was sent
        config = source.body.get("output_config")
        return "output_config.effort" if isinstance(config, dict) and config.get("effort") is not None else "thinking"
    if name in _MESSAGES_FIELDS and (index is None or name == "stop"):
        return _MESSAGES_FIELDS[name] + (f"[{index}]" if index is not None else "")
    return None


# Before a failed tool's result: OpenAI's tool messages have no is_error flag (the embedded model reads it too).
TOOL_ERROR_MARKER = "Error: "


def _messages(turn: Turn, *, with_reasoning: bool) -> list[dict]:
    """One turn -> OpenAI messages: tool results become `tool` messages (first, since they answer the calls of
    the turn before), then the text. `with_reasoning`: an assistant turn's unsigned thinking, which an
    OpenAI-compatible server's own `reasoning_content` became on its way to the caller, goes back in that field
    (signed thinking is Anthropic's, for Anthropic's API alone)."""
    out: list[dict] = [
        {"role": "tool", "tool_call_id": r.call_id, "content": TOOL_ERROR_MARKER + r.text if r.is_error else r.text}
        for r in turn.tool_results
    ]
    if turn.role is Role.ASSISTANT:
        if not (turn.text or turn.tool_calls):  # thinking alone: OpenAI refuses an assistant message of neither
            return out
        message: dict = {"role": "assistant", "content": turn.text or None}
        if turn.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in turn.tool_calls
            ]
        reasoning = "".join(t.text for t in turn.thoughts if not t.signature and not t.redacted)
        if with_reasoning and reasoning:
            message["reasoning_content"] = reasoning
        out.append(message)
    elif turn.text or not turn.tool_results:
        out.append({"role": turn.role.value, "content": turn.text})
    return out


def _put_tool_choice(body: dict, choice: ToolChoice, *, has_tools: bool) -> None:
    if not has_tools:
        return  # OpenAI refuses tool_choice without tools; with none, nothing can be called anyway
    if choice.mode is ToolChoiceMode.TOOL:
        body["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        body["tool_choice"] = choice.mode.value  # auto, none, required
    if not choice.parallel:
        body["parallel_tool_calls"] = False
