"""OpenAI chat-completions request (the JSON body) -> internal GenerationRequest, validating every value it reads.

The body is read, never edited: it travels on as the request's source, so an OpenAI-compatible upstream receives it
whole. What a request needs from a model (tool calls, JSON output, parts and fields only its own API knows) is not
judged here: the pipeline checks it against the provider's capabilities, since an upstream can honour what the
embedded model cannot.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from server.domain import (
    CHAT_LIMIT_FIELDS, GenerationRequest, Json, OpenAIChatSource, Role, SamplingParams, ToolCall, ToolChoice,
    ToolChoiceMode, ToolResult, ToolSpec, Turn, Unread, limit_field_in,
)
from server.errors import InvalidRequest
from server.translate.field_rules import CHAT_FIELDS, check_fields
from server.translate.structured import chat_output_format
from server.translate.thinking import chat_reasoning, chat_thoughts
from server.translate.tool_rules import (
    OPENAI_NAME_LIMIT, OPENAI_TOOL_LIMIT, duplicate_unread, name_unread, schema_type_unread, too_many_unread,
)
from server.translate.values import (
    TEXT_PARTS, no_tools_to_call, opt_array, opt_bool, opt_int, opt_number, opt_object, opt_string, shown, string_list,
    text_parts, wrong_type,
)

_ROLES = {
    "system": Role.SYSTEM,
    "developer": Role.SYSTEM,
    "user": Role.USER,
    "assistant": Role.ASSISTANT,
    "tool": Role.USER,  # a tool's answer is the caller's turn (Anthropic's tool_result blocks)
    "function": Role.USER,
}
# Content parts read as text, by role (an assistant's refusal is what it said; other roles: TEXT_PARTS); parts of any
# other type (images, audio, files, and kinds the API adds later) are kept only for an upstream of this dialect.
_TEXT_PARTS = {"assistant": {**TEXT_PARTS, "refusal": "refusal"}}
_TOOL_CHOICES = {"none": ToolChoiceMode.NONE, "auto": ToolChoiceMode.AUTO, "required": ToolChoiceMode.REQUIRED}
_LONGEST_SAFETY_IDENTIFIER = 64  # OpenAI's API refuses a longer `safety_identifier`
# OpenAI's API refuses `metadata` of more pairs, or longer keys or values, than these.
_METADATA_PAIRS, _METADATA_KEY, _METADATA_VALUE = 16, 64, 512


@dataclass(frozen=True, slots=True)
class ChatPlan:
    generation: GenerationRequest
    stream: bool
    include_usage: bool


def chat_request(
    body: Mapping[str, Json], *, default_max_tokens: int, stream: bool | None = None,
) -> ChatPlan:
    """`stream`: what the RPC does whatever the body's `stream` says (the typed StreamChatCompletion streams,
    CreateChatCompletion answers once); None: as the body says."""
    unread = list(check_fields(body, CHAT_FIELDS))
    messages = opt_array(body, "messages")
    if not messages:
        raise InvalidRequest("`messages` must contain at least one message.", param="messages")
    turns = tuple(_turn(message, f"messages[{i}]", unread) for i, message in enumerate(messages))
    unread += _unpaired_tool_traffic(messages)
    asked = bool(opt_bool(body, "stream"))
    stream = asked if stream is None else stream
    stream_options = opt_object(body, "stream_options")
    if stream_options is not None and not (stream or asked):  # on the unary RPC, a body valid over REST stays so
        raise InvalidRequest("`stream_options` is only allowed when `stream` is true.", param="stream_options")
    include_usage = bool(opt_bool(stream_options or {}, "include_usage", "stream_options"))
    tools = _tools(body, unread)
    params = _sampling(body, default_max_tokens)
    if (stop := body.get("stop")) is not None:
        unread += _whitespace_stops(stop)
    unread += _long_safety_identifier(opt_string(body, "safety_identifier"))
    unread += _metadata_over_limits(body.get("metadata") or {})  # _sampling checked its type
    if body.get("top_logprobs") and body.get("logprobs") is not True:  # _sampling and check_fields checked them
        # OpenAI's API refuses it; the embedded model ignored it and an Anthropic upstream has no such field, so code
        # that worked there failed once the model was served by OpenAI (0 asks for nothing). An upstream of this
        # dialect judges it itself.
        unread.append(Unread("top_logprobs", "The 'top_logprobs' parameter is only allowed when 'logprobs' is "
                                             "enabled."))
    tool_choice = _tool_choice(body, tools, unread)
    reasoning, beside = chat_reasoning(body, params, tool_choice, limit_field_in(body, CHAT_LIMIT_FIELDS))
    unread += beside
    generation = GenerationRequest(
        turns=turns,
        params=params,
        tools=tools,
        tool_choice=tool_choice,
        output_format=chat_output_format(body, unread),
        end_user=opt_string(body, "user") or opt_string(body, "safety_identifier") or None,
        source=OpenAIChatSource(body, tuple(unread)),
        stream=stream,
        reasoning=reasoning,
    )
    return ChatPlan(generation=generation, stream=stream, include_usage=stream and include_usage)


def _whitespace_stops(stop: Json) -> list[Unread]:
    """Anthropic refuses stop sequences of whitespace only (`stop_sequences: each stop sequence must contain
    non-whitespace`): refused by name here, not by the upstream about a field the caller never sent."""
    stops = [stop] if isinstance(stop, str) else stop
    return [Unread("stop" if isinstance(stop, str) else f"stop[{i}]",
                   "This model takes no stop sequence of whitespace only (Anthropic refuses them).", embedded=False)
            for i, item in enumerate(stops) if not item.strip()]


def _long_safety_identifier(identifier: str | None) -> list[Unread]:
    """OpenAI's API refuses a `safety_identifier` over 64 characters (a raw e-mail address, an unhashed token). The
    embedded model ignored it and an Anthropic upstream takes it as a `metadata.user_id` of up to 256, so code that
    worked there failed once the model was served by OpenAI; an upstream of this dialect judges it itself."""
    if identifier is None or len(identifier) <= _LONGEST_SAFETY_IDENTIFIER:
        return []
    return [Unread("safety_identifier", "Invalid 'safety_identifier': string too long. Expected a string with maximum "
                   f"length {_LONGEST_SAFETY_IDENTIFIER}, but got a string with length {len(identifier)} instead.")]


def _metadata_over_limits(metadata: Mapping[str, str]) -> list[Unread]:
    """`metadata` is ignored (and left out for an Anthropic upstream, which has no such field), but OpenAI's API
    refuses more than 16 pairs, keys over 64 characters and values over 512: the embedded model answered them, so
    code that worked there failed once the model was served by OpenAI. An upstream of this dialect judges them."""
    if len(metadata) > _METADATA_PAIRS:
        return [Unread("metadata", "Invalid 'metadata': too many properties. Expected an object with at most "
                       f"{_METADATA_PAIRS} properties, but got an object with {len(metadata)} properties instead.")]
    for key, value in metadata.items():
        if len(key) > _METADATA_KEY:
            return [Unread("metadata", f"Invalid 'metadata': key {shown(key)} is too long. Expected a key with "
                           f"maximum length {_METADATA_KEY}, but got a key with length {len(key)} instead.")]
        if len(value) > _METADATA_VALUE:
            return [Unread(f"metadata.{key}", f"Invalid 'metadata.{key}': string too long. Expected a string with "
                           f"maximum length {_METADATA_VALUE}, but got a string with length {len(value)} instead.")]
    return []


def _sampling(body: Mapping[str, Json], default_max_tokens: int) -> SamplingParams:
    opt_int(body, "top_logprobs", 0, 20)
    n = opt_int(body, "n", 1, 128)
    if n is not None and n != 1:
        raise InvalidRequest("This gateway generates one choice per request: `n` must be 1.", param="n")
    biases = opt_object(body, "logit_bias") or {}
    for token in biases:
        if not (token.isascii() and token.isdigit()):  # '²' and '٣' are digits to str.isdigit(), no token ids
            raise InvalidRequest(f"`logit_bias` maps token ids to biases: {shown(token)} is not a token id.",
                                 param="logit_bias")
        opt_number(biases, token, -100.0, 100.0, "logit_bias")
    for name, value in (opt_object(body, "metadata") or {}).items():  # ignored, but OpenAI's shape: strings to strings
        if value is None:  # not an absent field: a pair whose value is no string, as OpenAI's API refuses it
            raise wrong_type(f"metadata.{name}", "a string", value)
        opt_string(body["metadata"], name, "metadata")
    max_completion = opt_int(body, "max_completion_tokens", 1)
    max_tokens = opt_int(body, "max_tokens", 1)
    top_k = opt_int(body, "top_k", -1)  # 0, and vLLM's -1: every token
    repetition_penalty = opt_number(body, "repetition_penalty", 0.0, 10.0)
    if repetition_penalty == 0:  # the penalty divides the logits; vLLM refuses 0 too
        raise InvalidRequest("`repetition_penalty` must be greater than 0, got 0.", param="repetition_penalty")
    return SamplingParams(
        max_tokens=max_completion or max_tokens or default_max_tokens,
        temperature=opt_number(body, "temperature", 0.0, 2.0),
        top_p=opt_number(body, "top_p", 0.0, 1.0),
        top_k=top_k if top_k and top_k > 0 else None,
        min_p=opt_number(body, "min_p", 0.0, 1.0),
        repetition_penalty=repetition_penalty,
        frequency_penalty=opt_number(body, "frequency_penalty", -2.0, 2.0),
        presence_penalty=opt_number(body, "presence_penalty", -2.0, 2.0),
        stop=string_list(body.get("stop"), "stop"),  # OpenAI takes 4, vLLM and llama.cpp more: the upstream judges
        seed=opt_int(body, "seed", -(2**63)),
    )


def _turn(message: Json, where: str, unread: list[Unread]) -> Turn:
    if not isinstance(message, dict):
        raise wrong_type(where, "an object", message)
    role_name = message.get("role")
    if not isinstance(role_name, str):
        raise InvalidRequest(f"`{where}.role` must be one of {', '.join(_ROLES)}; got {shown(role_name)}.",
                             param=f"{where}.role")
    role = _ROLES.get(role_name)
    if role is None:  # a role of a server's chat template (vLLM takes any: Llama's `ipython`): the upstream judges it
        # Each refusal names the roles its model takes: an Anthropic upstream refuses 'function' too.
        refused = f"Messages of role {shown(role_name)} are not supported by this model; supported: "
        unread.append(Unread(f"{where}.role", refused + ", ".join(_ROLES) + ".", other_dialect=False))
        unread.append(Unread(f"{where}.role", refused + ", ".join(_ROLES).removesuffix(", function") + ".",
                             embedded=False))
        role = Role.USER  # stands in for the gateway's own estimates of the prompt
    tool_calls = opt_array(message, "tool_calls", where) or []
    content = message.get("content")
    # An assistant's answer as the API returned it may have no content: a refusal, or a spoken answer (its audio id).
    refusal = opt_string(message, "refusal", where) if role_name == "assistant" else None
    audio = opt_object(message, "audio", where) if role_name == "assistant" else None
    function_call = opt_object(message, "function_call", where) if role_name == "assistant" else None
    if content is None and not (role_name == "assistant" and (tool_calls or function_call or refusal
                                                              or audio is not None)):
        if role_name not in _ROLES:  # an assistant's tool-call turn with its role misspelt: the role is what is wrong
            raise InvalidRequest(f"`{where}.role` must be one of {', '.join(_ROLES)} for a message without "
                                 f"`content`; got {shown(role_name)}.", param=f"{where}.role")
        raise InvalidRequest(f"`{where}.content` is required.", param=f"{where}.content")
    if audio is not None:
        unread.append(Unread(f"{where}.audio", "Audio answers are not supported by this model."))
    opt_string(message, "name", where)
    # Not read, but still type-checked: Anthropic takes thinking back only with its signature (`thinking_blocks`).
    opt_string(message, "reasoning_content", where)
    text, others = text_parts(refusal if content is None else content, f"{where}.content", part_types=None,
                              text_members=_TEXT_PARTS.get(role_name, TEXT_PARTS))
    for i in others:
        kind = content[i]["type"]
        unread.append(Unread(f"{where}.content[{i}].type",
                             f"Content parts of type {kind[:40]!r} are not supported by this model."))
    if role_name == "function":  # the deprecated function calling: its result answers no tool call id
        unread.append(Unread(f"{where}.role", "Messages of role 'function' (the deprecated function calling) are "
                             "not supported by this model: use `tools` and role 'tool'.", embedded=False))
    if role_name in ("tool", "function"):
        field = "tool_call_id" if role_name == "tool" else "name"
        call_id = _required(opt_string(message, field, where), f"{where}.{field}")
        return Turn(role, tool_results=(ToolResult(call_id=call_id, text=text),))
    calls = tuple(read for i, call in enumerate(tool_calls)
                  if (read := _call(call, f"{where}.tool_calls[{i}]", unread)) is not None)
    if function_call is not None:  # the deprecated function calling: the call its `function` message answers
        unread.append(Unread(f"{where}.function_call", "Function calls (the deprecated function calling) are not "
                             "supported by this model: use `tools` and `tool_calls`.", embedded=False))
        calls += (_function_call(function_call, f"{where}.function_call"),)
    if role is not Role.ASSISTANT:
        return Turn(role, text)
    return Turn(role, text, tool_calls=calls, thoughts=chat_thoughts(message, where, unread))


def _unpaired_tool_traffic(messages: list) -> list[Unread]:
    """OpenAI's API (and Anthropic's) refuses an assistant's `tool_calls` not each answered by the `tool` messages
    right after it, and a `tool` message that answers no call of the assistant message before them. The embedded
    model would answer such a conversation, which then fails once the model is served upstream; an upstream of this
    dialect judges it itself (vLLM takes it). The messages are read (_turn) already; the first fault is named."""
    calls: set[str] = set()  # the ids of the last assistant message's tool calls...
    unanswered: list[str] = []  # ...and those no `tool` message has answered yet
    caller = -1  # that assistant message's index; -1 while the `tool` messages would follow none
    for i, message in enumerate(messages):
        if message["role"] == "tool":
            call_id = message["tool_call_id"]
            if caller < 0:
                return [Unread(f"messages[{i}].role", "Invalid parameter: messages with role 'tool' must be a "
                               "response to a preceding message with 'tool_calls'.", other_dialect=False)]
            if call_id not in calls:
                return [Unread(f"messages[{i}].tool_call_id", f"Invalid parameter: 'tool_call_id' of "
                               f"{shown(call_id)} not found in 'tool_calls' of previous message.",
                               other_dialect=False)]
            unanswered = [waiting for waiting in unanswered if waiting != call_id]
            continue
        if unanswered:
            break
        tool_calls = (message.get("tool_calls") or []) if message["role"] == "assistant" else []
        ids = [call["id"] for call in tool_calls if isinstance(call.get("id"), str)]  # a custom tool's may have none
        calls, unanswered, caller = set(ids), list(dict.fromkeys(ids)), (i if tool_calls else -1)
    if not unanswered:
        return []
    return [Unread(f"messages[{caller}].tool_calls", "An assistant message with 'tool_calls' must be followed by tool "
                   "messages responding to each 'tool_call_id'. The following tool_call_ids did not have response "
                   f"messages: {', '.join(unanswered)[:200]}", other_dialect=False)]


def _call(call: Json, where: str, unread: list[Unread]) -> ToolCall | None:
    """A function call an assistant made; a call of another type (a custom tool's) is kept for an upstream of this
    dialect only."""
    if not isinstance(call, dict):
        raise wrong_type(where, "an object", call)
    kind = opt_string(call, "type", where)
    if kind not in (None, "function"):
        unread.append(Unread(f"{where}.type", f"Tool calls of type {kind[:40]!r} are not supported by this model."))
        return None
    function = _required(opt_object(call, "function", where), f"{where}.function")
    call_id = _required(opt_string(call, "id", where), f"{where}.id")
    name = _required(opt_string(function, "name", f"{where}.function"), f"{where}.function.name")
    arguments = opt_string(function, "arguments", f"{where}.function")
    return ToolCall(id=call_id, name=name, arguments=arguments or "{}")


def _function_call(call: dict, where: str) -> ToolCall:
    """Its id is the function's name, as its result's (a `function` message names the function it answers)."""
    name = _required(opt_string(call, "name", where), f"{where}.name")
    return ToolCall(id=name, name=name, arguments=opt_string(call, "arguments", where) or "{}")


def _required(value, param: str):
    """`value`, unless it is absent (null) or an empty string: a 400 naming `param`, as OpenAI's API names the
    missing member itself (`tools[0].function`, not a member inside it)."""
    if value is None or value == "":
        raise InvalidRequest(f"`{param}` is required.", param=param)
    return value


def _tools(body: Mapping[str, Json], unread: list[Unread]) -> tuple[ToolSpec, ...]:
    specs, names = [], set()
    tools = opt_array(body, "tools") or []
    if too_many := too_many_unread(tools, "tools", OPENAI_TOOL_LIMIT):
        unread.append(too_many)
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise wrong_type(where, "an object", tool)
        kind = tool.get("type")
        if not isinstance(kind, str):
            raise wrong_type(f"{where}.type", "a string ('function', 'custom', ...)", kind)
        if kind != "function":  # custom (free-form input) tools and kinds the API adds: an upstream of this dialect's
            unread.append(Unread(f"{where}.type", f"Tools of type {kind[:40]!r} are not supported by this model."))
            continue
        function = _required(opt_object(tool, "function", where), f"{where}.function")
        strict = opt_bool(function, "strict", f"{where}.function")
        name = _required(opt_string(function, "name", f"{where}.function"), f"{where}.function.name")
        parameters = opt_object(function, "parameters", f"{where}.function") or {}
        description = opt_string(function, "description", f"{where}.function") or ""
        unread += filter(None, (name_unread(name, f"{where}.function.name", OPENAI_NAME_LIMIT),
                                duplicate_unread(name, f"{where}.function.name", names),
                                schema_type_unread(parameters, f"{where}.function.parameters", type_required=False)))
        specs.append(ToolSpec(name=name, description=description, parameters=parameters, strict=strict))
    return tuple(specs)


def _tool_choice(body: Mapping[str, Json], tools: tuple[ToolSpec, ...], unread: list[Unread]) -> ToolChoice | None:
    parallel = opt_bool(body, "parallel_tool_calls")
    parallel = True if parallel is None else parallel
    choice = body.get("tool_choice")
    if choice is None:
        return None if parallel else ToolChoice(parallel=False)
    if choice == "required" and not body.get("tools"):
        raise no_tools_to_call()
    if isinstance(choice, str) and choice in _TOOL_CHOICES:
        return ToolChoice(_TOOL_CHOICES[choice], parallel=parallel)
    if isinstance(choice, dict):
        kind = choice.get("type")
        function = opt_object(choice, "function", "tool_choice") if kind == "function" else None
        name = opt_string(function, "name", "tool_choice.function") if function is not None else None
        if kind == "function" and not name:  # the missing part named, as a wrong-typed one is
            where = "tool_choice.function" if function is None else "tool_choice.function.name"
            raise InvalidRequest(f"`{where}` is required.", param=where)
        if kind == "function":
            if name not in {tool.name for tool in tools}:
                raise InvalidRequest(f"`tool_choice` names the function {name[:40]!r}, which is not in `tools`.",
                                     param="tool_choice")
            return ToolChoice(ToolChoiceMode.TOOL, name=name, parallel=parallel)
        if isinstance(kind, str) and kind != "function":  # `allowed_tools`, `custom`, kinds added later
            unread.append(Unread("tool_choice.type", f"`tool_choice` of type {shown(kind)} is not supported by "
                                                     "this model."))
            return None
    raise InvalidRequest(
        "`tool_choice` must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}.",
        param="tool_choice.type" if isinstance(choice, dict) else "tool_choice",
    )
