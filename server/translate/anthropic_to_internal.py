"""Anthropic Messages request (the JSON body) -> internal GenerationRequest, validating every value it reads.

Like the OpenAI translator, it reads the body without editing it (an Anthropic upstream receives it whole, with the
caller's `anthropic-beta` values) and leaves what a request needs from a model (tool calls, server tools, blocks
only Anthropic's API knows) to the pipeline's check of the provider's capabilities.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from server import wire_json
from server.domain import (
    AnthropicMessagesSource, GenerationRequest, Json, Role, SamplingParams, ToolCall, ToolChoice, ToolChoiceMode,
    Thought, ToolResult, ToolSpec, Turn, Unread,
)
from server.errors import InvalidRequest
from server.translate.field_rules import GENERATION_ONLY, MESSAGE_FIELDS, check_fields
from server.translate.structured import messages_output
from server.translate.thinking import LEAST_THINKING_BUDGET, THINKING_ON, beside_thinking, messages_reasoning
from server.translate.tool_rules import ANTHROPIC_NAME_LIMIT, duplicate_unread, name_unread, schema_type_unread
from server.translate.values import (
    no_tools_to_call, opt_array, opt_bool, opt_int, opt_number, opt_object, opt_string, shown, text_parts, wrong_type,
)

_ROLES = {"user": Role.USER, "assistant": Role.ASSISTANT}
_TOOL_CHOICES = {"auto": ToolChoiceMode.AUTO, "none": ToolChoiceMode.NONE, "any": ToolChoiceMode.REQUIRED,
                 "tool": ToolChoiceMode.TOOL}
# `between_tools`: thinking off, but for short progress notes between tool calls (the SDK has it since 2.x)
_THINKING_TYPES = ("enabled", "disabled", "adaptive", "between_tools")
_LONGEST_USER_ID = 256  # Anthropic's API refuses a longer metadata.user_id
_TOOL_USE_ID = re.compile(r"[a-zA-Z0-9_-]+")  # Anthropic's pattern for a tool_use block's id


@dataclass(frozen=True, slots=True)
class MessagePlan:
    generation: GenerationRequest
    stream: bool


def message_request(body: Mapping[str, Json], *, stream: bool | None = None,
                    beta: Sequence[str] = ()) -> MessagePlan:
    """`stream`: what the RPC does whatever the body's `stream` says (the typed StreamMessage streams,
    CreateMessage answers once); None: as the body says. `beta`: the caller's
    `anthropic-beta` header values."""
    generation = _generation(body, stream=stream, beta=beta, counting=False)
    return MessagePlan(generation=generation, stream=generation.stream)


def count_request(body: Mapping[str, Json], *, beta: Sequence[str] = ()) -> GenerationRequest:
    """A count_tokens body: read and checked as a Messages request, every value a 400 naming its path as there, but
    `max_tokens` may be left out. What only shapes a generation (max_tokens, stream, sampling) is checked, then
    without effect: the prompt is the same either way (an Anthropic upstream is sent the body without them,
    `internal_to_anthropic_request.count_body`)."""
    return _generation(body, stream=False, beta=beta, counting=True)


def _generation(body: Mapping[str, Json], *, stream: bool | None, beta: Sequence[str],
                counting: bool) -> GenerationRequest:
    unread = list(check_fields(body, MESSAGE_FIELDS))
    max_tokens = given_max_tokens = opt_int(body, "max_tokens", 1)
    if max_tokens is None:
        if not counting:
            raise InvalidRequest("max_tokens: Field required", param="max_tokens")
        max_tokens = 1  # stands in: nothing that counts a prompt reads it
    messages = opt_array(body, "messages")
    if not messages and not _continues_a_thread(body):  # a paused turn is continued from none: the server has it
        raise InvalidRequest("messages: at least one message is required.", param="messages")
    turns = []
    # An empty system prompt is none, as on Anthropic's API (a model's template may have a default one to keep).
    # Blocks of other kinds (added to the API later): an Anthropic upstream judges them.
    system, others = text_parts(body.get("system"), "system", part_types=None)
    if others:
        unread.append(Unread(f"system[{others[0]}].type", "System blocks other than text are not supported by this "
                                                         "model."))
    if system:
        turns.append(Turn(Role.SYSTEM, system))
    turns += [_turn(message, f"messages[{i}]", unread) for i, message in enumerate(messages)]
    unread += (_empty_system_block(body.get("system")) or _empty_content(messages) or _tool_use_ids(messages)
               or _unpaired_tool_blocks(messages))
    last = turns[-1] if turns else None
    if len(messages) > 1 and last.role is Role.ASSISTANT and not (last.text or last.tool_calls):
        # An empty last assistant message ("", [], or thinking alone) is a prefill of nothing on Anthropic's API: the
        # answer is the one without it. Kept, the embedded model read it as an empty reply of its own and answered
        # after that, and an OpenAI-compatible upstream got an assistant message of null content, which OpenAI refuses.
        turns.pop()
        last = turns[-1]
    if last and last.role is Role.ASSISTANT and last.text and not last.tool_calls:  # a prefill: the answer continues it
        turns[-1] = dataclasses.replace(last, continued=True)
        if last.text != last.text.rstrip():  # as Anthropic's API refuses it (an upstream of the dialect judges it)
            unread.append(Unread(f"messages[{len(messages) - 1}].content", "messages: final assistant content "
                                 "cannot end with trailing whitespace", other_dialect=False))
    stops = opt_array(body, "stop_sequences") or []
    for i, stop in enumerate(stops):
        if not isinstance(stop, str) or not stop:
            raise InvalidRequest("stop_sequences: entries must be non-empty strings.", param=f"stop_sequences[{i}]")
        if not stop.strip():  # as Anthropic's API refuses it ("\n" to stop at a line's end); OpenAI's takes it
            unread.append(Unread(f"stop_sequences[{i}]", f"stop_sequences.{i}: each stop sequence must contain "
                                 "non-whitespace", other_dialect=False))
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=opt_number(body, "temperature", 0.0, 1.0),
        top_p=opt_number(body, "top_p", 0.0, 1.0),
        top_k=opt_int(body, "top_k", 0) or None,
        stop=tuple(stops),
    )
    _check_thinking(body, given_max_tokens, unread)
    metadata = opt_object(body, "metadata") or {}
    end_user = opt_string(metadata, "user_id", "metadata") or None
    unread += _metadata_unread(metadata, end_user)
    tools = _tools(body, unread)
    tool_choice = _tool_choice(body, unread)
    unread += _beside_thinking(body, params, tool_choice)
    output_format, effort = messages_output(body, unread)
    asked = bool(opt_bool(body, "stream"))
    stream = asked if stream is None else stream
    if counting:  # what has no effect on a count is refused by no model (an Anthropic upstream is never sent it)
        unread = [item for item in unread if re.split(r"[.\[]", item.param, maxsplit=1)[0] not in GENERATION_ONLY]
    return GenerationRequest(
        turns=tuple(turns), params=params, tools=tools, tool_choice=tool_choice, end_user=end_user,
        output_format=output_format, source=AnthropicMessagesSource(body, tuple(unread), tuple(beta)), stream=stream,
        reasoning=messages_reasoning(body, effort),
    )


def _metadata_unread(metadata: Mapping[str, Json], end_user: str | None) -> list[Unread]:
    """Anthropic's API refuses a `metadata.user_id` over 256 characters and members other than `user_id` (a
    session id put there, say); the embedded model ignored both, so code that worked here failed once the model was
    served by Anthropic. An OpenAI-compatible upstream receives the user id as `user`, an Anthropic one judges them."""
    if end_user is not None and len(end_user) > _LONGEST_USER_ID:
        return [Unread("metadata.user_id", f"metadata.user_id: String should have at most {_LONGEST_USER_ID} "
                                           "characters", other_dialect=False)]
    return [Unread(f"metadata.{name[:40]}", f"metadata.{name[:40]}: Extra inputs are not permitted",
                   other_dialect=False) for name in metadata if name != "user_id"][:1]


def _check_thinking(body: Mapping[str, Json], max_tokens: int | None, unread: list[Unread]) -> None:
    """`thinking` has no effect but on an Anthropic upstream, which judges it itself (a type added to the API later);
    any other model refuses, with Anthropic's words, what Anthropic's API refuses: an unknown type, an `enabled` one
    without a budget, or with one under 1024 tokens or not under `max_tokens` (when given: count_tokens may leave it
    out). Ignored, such a request would be answered here and fail once the model is served by Anthropic."""
    thinking = opt_object(body, "thinking")
    if thinking is None:
        return
    kind = opt_string(thinking, "type", "thinking")
    budget = opt_int(thinking, "budget_tokens", 1, path="thinking")
    display = opt_string(thinking, "display", "thinking")
    if kind is None:
        unread.append(Unread("thinking.type", "thinking.type: Field required"))
    elif kind not in _THINKING_TYPES:
        unread.append(Unread("thinking.type", f"thinking.type: {shown(kind)} is not one of the expected tags: "
                                              "'enabled', 'disabled', 'adaptive', 'between_tools'."))
    elif kind == "enabled" and budget is None:
        unread.append(Unread("thinking.budget_tokens", "thinking.enabled.budget_tokens: Field required"))
    elif kind == "enabled" and budget < LEAST_THINKING_BUDGET:
        unread.append(Unread("thinking.budget_tokens", "thinking.enabled.budget_tokens: Input should be greater "
                                                       f"than or equal to {LEAST_THINKING_BUDGET}, got {budget}."))
    elif kind == "enabled" and max_tokens is not None and budget >= max_tokens:
        unread.append(Unread("thinking.budget_tokens", "`max_tokens` must be greater than `thinking.budget_tokens` "
                                                       f"({max_tokens} is not greater than {budget})."))
    elif kind in THINKING_ON and display not in (None, "summarized", "omitted"):
        unread.append(Unread("thinking.display", f"thinking.{kind}.display: Input should be 'summarized' or "
                                                 "'omitted'."))


def _beside_thinking(body: Mapping[str, Json], params: SamplingParams, choice: ToolChoice | None) -> list[Unread]:
    """While thinking is on (`enabled` or `adaptive`), what Anthropic's API refuses beside it (thinking.py): the
    embedded model answered such a request, so code that worked there failed once the model was served by Anthropic;
    an Anthropic upstream judges it itself, and an OpenAI-compatible one stands in for Anthropic's API."""
    thinking = body.get("thinking")
    if not isinstance(thinking, dict) or thinking.get("type") not in THINKING_ON:
        return []
    return beside_thinking(params, choice, top_k=body.get("top_k") is not None)


def _blocks(message: Mapping[str, Json], kind: str) -> list[tuple[int, Mapping[str, Json]]]:
    content = message.get("content")
    blocks = content if isinstance(content, list) else []
    return [(j, block) for j, block in enumerate(blocks) if isinstance(block, dict) and block.get("type") == kind]


def _empty_system_block(system: Json) -> list[Unread]:
    """Anthropic's API refuses an empty text block in `system` too (an empty string is no system prompt, and is
    taken): an app that leaves a slot of its system prompt empty was answered here and refused once the model was
    served by Anthropic. An OpenAI-compatible upstream takes it, an Anthropic one judges it itself."""
    for j, block in enumerate(system if isinstance(system, list) else []):
        if isinstance(block, dict) and block.get("type") == "text" and block.get("text") == "":
            return [Unread(f"system[{j}].text", "system: text content blocks must be non-empty", other_dialect=False)]
    return []


def _empty_content(messages: list) -> list[Unread]:
    """Anthropic's API refuses a message without content (but the last one, an assistant's: no prefill) and an empty
    text block. The embedded model would answer them (a chat UI's empty turn, say), which then fails once the model is
    served by Anthropic; an OpenAI-compatible upstream takes them, an Anthropic one judges them itself."""
    for i, message in enumerate(messages):
        content = message.get("content")
        if content in ("", []) and not (i == len(messages) - 1 and message.get("role") == "assistant"):
            return [Unread(f"messages[{i}].content", f"messages.{i}: all messages must have non-empty content except "
                           "for the optional final assistant message", other_dialect=False)]
        for j, block in _blocks(message, "text"):
            if block.get("text") == "":
                return [Unread(f"messages[{i}].content[{j}].text", f"messages.{i}.content.{j}.text: text content "
                               "blocks must be non-empty", other_dialect=False)]
        # Nothing but whitespace (a voice turn heard as "\n", a tool loop's blank reply): refused too, but as the last
        # assistant message, a prefill, which the prefill rule refuses in its own words.
        if _only_whitespace(content) and not (i == len(messages) - 1 and message.get("role") == "assistant"):
            return [Unread(f"messages[{i}].content", "messages: text content blocks must contain non-whitespace text",
                           other_dialect=False)]
    return []


def _only_whitespace(content: Json) -> bool:
    """Whether a message's content is text of whitespace alone: a string, or text blocks only (Anthropic's API takes
    a whitespace block beside one with text)."""
    if isinstance(content, str):
        return content != "" and not content.strip()
    return isinstance(content, list) and bool(content) and all(
        isinstance(block, dict) and block.get("type") == "text" and isinstance(block.get("text"), str)
        and not block["text"].strip() for block in content)


def _unpaired_tool_blocks(messages: list) -> list[Unread]:
    """Anthropic's API refuses a `tool_use` block not answered by a `tool_result` in the next message, and a
    `tool_result` that answers no `tool_use` of the message before it. The embedded model would answer such a
    conversation, which then fails once the model is served by Anthropic; an Anthropic upstream judges it itself.
    The messages are read (_turn) already; the first fault is named, in Anthropic's words."""
    uses: list[str] = []  # the tool_use ids of the message before
    for i, message in enumerate(messages):
        results = _blocks(message, "tool_result")
        answered = {block.get("tool_use_id") for _, block in results}
        for j, block in results:
            if block.get("tool_use_id") not in uses:
                return [Unread(f"messages[{i}].content[{j}].tool_use_id", f"messages.{i}.content.{j}: unexpected "
                               f"`tool_use_id` found in `tool_result` blocks: {str(block.get('tool_use_id'))[:200]}. "
                               "Each `tool_result` block must have a corresponding `tool_use` block in the previous "
                               "message.", other_dialect=False)]
        if missing := [use for use in uses if use not in answered]:
            return [Unread(f"messages[{i}].content", f"messages.{i}: `tool_use` ids were found without "
                           f"`tool_result` blocks immediately after: {', '.join(missing)[:200]}. Each `tool_use` "
                           "block must have a corresponding `tool_result` block in the next message.",
                           other_dialect=False)]
        if uses and (first := _first_not_a_result(message, len(uses))) is not None:
            return [Unread(f"messages[{i}].content[{first}]", f"messages.{i}: Did not find {len(uses)} "
                           "`tool_result` block(s) at the beginning of this message. Messages following `tool_use` "
                           "blocks must begin with a matching number of `tool_result` blocks.", other_dialect=False)]
        uses = [block["id"] for _, block in _blocks(message, "tool_use") if isinstance(block.get("id"), str)]
    return []


def _tool_use_ids(messages: list) -> list[Unread]:
    """Anthropic's API refuses a `tool_use` id outside `[a-zA-Z0-9_-]` (as some models behind OpenAI-compatible
    servers write them, `functions.weather:0`) and one that an earlier `tool_use` of the request has: its results
    could not say which call they answer. The embedded model would answer both; an Anthropic upstream judges them."""
    seen: set[str] = set()
    for i, message in enumerate(messages):
        for j, block in _blocks(message, "tool_use"):
            call_id = block.get("id")
            if not isinstance(call_id, str):
                continue
            if not _TOOL_USE_ID.fullmatch(call_id):
                return [Unread(f"messages[{i}].content[{j}].id", f"messages.{i}.content.{j}.tool_use.id: String "
                               "should match pattern '^[a-zA-Z0-9_-]+$'", other_dialect=False)]
            if call_id in seen:
                return [Unread(f"messages[{i}].content[{j}].id", f"messages.{i}.content.{j}: `tool_use` ids must be "
                               "unique", other_dialect=False)]
            seen.add(call_id)
    return []


def _first_not_a_result(message: Mapping[str, Json], count: int) -> int | None:
    """The index of the first of a message's first `count` blocks that is no `tool_result` (text written before
    the results, say), or None when they all are."""
    content = message.get("content")
    blocks = content if isinstance(content, list) else []
    for j in range(min(count, len(blocks))):
        if not isinstance(blocks[j], dict) or blocks[j].get("type") != "tool_result":
            return j
    return None if len(blocks) >= count else len(blocks)


def _turn(message: Json, where: str, unread: list[Unread]) -> Turn:
    if not isinstance(message, dict):
        raise wrong_type(where, "an object", message)
    role_name = message.get("role")
    if not isinstance(role_name, str):
        raise InvalidRequest(f"{where}.role: must be 'user' or 'assistant', got {shown(role_name)}.",
                             param=f"{where}.role")
    role = _ROLES.get(role_name)
    if role is None:  # a role added to the API later (the beta's 'system' messages): an Anthropic upstream judges it
        unread.append(Unread(f"{where}.role", f"Messages of role {shown(role_name)} are not supported by this model; "
                                              "supported: user, assistant."))
        role = Role.USER  # stands in for the gateway's own estimates of the prompt
    content = message.get("content")
    if content is None and role_name in _ROLES:  # a system message may hold only its `output_config`
        raise InvalidRequest(f"{where}.content: Field required", param=f"{where}.content")
    if not isinstance(content, list):
        return Turn(role, text_parts(content, f"{where}.content")[0])
    parts = _Parts()
    for i, block in enumerate(content):
        _read_block(block, f"{where}.content[{i}]", role, parts, unread)
    return Turn(role, "\n".join(parts.texts), tool_calls=tuple(parts.calls), tool_results=tuple(parts.results),
                thoughts=tuple(parts.thoughts))


@dataclass(slots=True)
class _Parts:
    """What a message's content blocks hold, gathered block by block."""

    texts: list[str] = field(default_factory=list)
    calls: list[ToolCall] = field(default_factory=list)
    results: list[ToolResult] = field(default_factory=list)
    thoughts: list[Thought] = field(default_factory=list)


def _read_block(block: Json, where: str, role: Role, parts: _Parts, unread: list[Unread]) -> None:
    if not isinstance(block, dict):
        raise wrong_type(where, "a content block object", block)
    kind = block.get("type")
    if not isinstance(kind, str):
        raise wrong_type(f"{where}.type", "a string", kind)
    opt_object(block, "cache_control", where)  # not read, but still type-checked
    if kind == "text":
        text = block.get("text")
        if not isinstance(text, str):
            raise wrong_type(f"{where}.text", "a string", text)
        parts.texts.append(text)
    elif kind == "tool_use" and role is Role.ASSISTANT:
        call_id, name = opt_string(block, "id", where), opt_string(block, "name", where)
        if not call_id or not name:
            missing = f"{where}.name" if call_id else f"{where}.id"
            raise InvalidRequest(f"{where}: a tool_use block needs an `id` and a `name`.", param=missing)
        tool_input = opt_object(block, "input", where)
        if tool_input is None:  # Anthropic's API requires it ({} for a call without arguments): so does every model
            raise InvalidRequest(f"{_anthropic_path(where)}.tool_use.input: Field required", param=f"{where}.input")
        parts.calls.append(ToolCall(id=call_id, name=name, arguments=wire_json.dumps(tool_input).decode()))
    elif kind == "tool_result" and role is Role.USER:
        call_id = opt_string(block, "tool_use_id", where)
        if not call_id:
            raise InvalidRequest(f"{where}.tool_use_id: Field required", param=f"{where}.tool_use_id")
        # Blocks of any kind (images, documents, search results, tool search's `tool_reference`, kinds added later):
        # an Anthropic upstream judges them.
        text, others = text_parts(block.get("content"), f"{where}.content", part_types=None)
        if others:
            unread.append(Unread(f"{where}.content[{others[0]}].type",
                                 "Tool results with other than text blocks are not supported by this model."))
        is_error = bool(opt_bool(block, "is_error", where))
        parts.results.append(ToolResult(call_id=call_id, text=text, is_error=is_error))
    elif kind == "thinking" and role is Role.ASSISTANT:
        # Read as far as an OpenAI-compatible upstream needs it (Thought); an Anthropic upstream judges the block.
        text, signature = block.get("thinking"), block.get("signature")
        parts.thoughts.append(Thought(text if isinstance(text, str) else "",
                                      signature if isinstance(signature, str) else ""))
    elif kind == "redacted_thinking" and role is Role.ASSISTANT:
        data = block.get("data")
        parts.thoughts.append(Thought(redacted=data if isinstance(data, str) else ""))
    else:  # image, document, server tool blocks, ...: Anthropic's API judges them; no other model can take them
        unread.append(Unread(f"{where}.type", f"Content blocks of type {kind[:40]!r} are not supported by this "
                                              "model; supported: text, tool_use (assistant), tool_result (user), "
                                              "thinking (assistant)."))


def _anthropic_path(where: str) -> str:
    """`messages[1].content[0]` as Anthropic's errors write it: `messages.1.content.0`."""
    return where.replace("[", ".").replace("]", "")


def _tools(body: Mapping[str, Json], unread: list[Unread]) -> tuple[ToolSpec, ...]:
    specs, names = [], set()
    for i, tool in enumerate(opt_array(body, "tools") or []):
        where = f"tools[{i}]"
        if not isinstance(tool, dict):
            raise wrong_type(where, "an object", tool)
        kind = opt_string(tool, "type", where)
        if kind not in (None, "custom"):  # a server tool (web_search_20250305, ...) or a typo: Anthropic judges it
            unread.append(Unread(f"{where}.type", f"Tools of type {kind[:40]!r} (server tools, or types added to the "
                                                  "API later) are passed only to Anthropic upstreams; this model "
                                                  "takes custom tools (no type, or \"custom\")."))
            continue
        name = opt_string(tool, "name", where)
        if not name:
            raise InvalidRequest(f"{where}.name: Field required", param=f"{where}.name")
        strict = opt_bool(tool, "strict", where)
        # These three are not read, but still type-checked; an example is an input, an object.
        for j, example in enumerate(opt_array(tool, "input_examples", where) or []):
            if not isinstance(example, dict):
                raise wrong_type(f"{where}.input_examples[{j}]", "an object", example)
        opt_bool(tool, "defer_loading", where)
        opt_object(tool, "cache_control", where)
        schema = opt_object(tool, "input_schema", where)
        if schema is None:
            unread.append(Unread(f"{where}.input_schema", f"`{where}.input_schema`: Field required."))
            schema = {"type": "object"}
        unread += filter(None, (name_unread(name, f"{where}.name", ANTHROPIC_NAME_LIMIT),
                                duplicate_unread(name, f"{where}.name", names),
                                schema_type_unread(schema, f"{where}.input_schema", type_required=True)))
        description = opt_string(tool, "description", where) or ""
        specs.append(ToolSpec(name=name, description=description, parameters=schema, strict=strict))
    return tuple(specs)


def _continues_a_thread(body: Mapping[str, Json]) -> bool:
    thread = body.get("thread")
    return isinstance(thread, dict) and thread.get("type") == "continue"


def _tool_choice(body: Mapping[str, Json], unread: list[Unread]) -> ToolChoice | None:
    choice = opt_object(body, "tool_choice")
    if choice is None:
        return None
    kind = choice.get("type")
    if not isinstance(kind, str):
        raise InvalidRequest("tool_choice.type: must be one of auto, any, tool, none.", param="tool_choice.type")
    mode = _TOOL_CHOICES.get(kind)
    if mode is None:  # a kind added to the API later: for an Anthropic upstream only
        unread.append(Unread("tool_choice.type", f"`tool_choice` of type {shown(kind)} is not supported by this "
                                                 "model."))
        return None
    # A thread's `continue` turn leaves its `tools` out: the server holds them (only an Anthropic upstream holds
    # threads; any other model refuses `thread` itself).
    held = _continues_a_thread(body)
    if mode is ToolChoiceMode.REQUIRED and not body.get("tools") and not held:
        raise no_tools_to_call()
    name = opt_string(choice, "name", "tool_choice") or None
    names = {tool.get("name") for tool in body.get("tools") or () if isinstance(tool, dict)
             and isinstance(tool.get("name"), str)}
    if mode is ToolChoiceMode.TOOL and name not in names and not (held and name):  # a custom tool or a server tool
        raise InvalidRequest("tool_choice.name: must name one of `tools`.", param="tool_choice.name")
    parallel = not opt_bool(choice, "disable_parallel_tool_use", "tool_choice")
    return ToolChoice(mode, name=name if mode is ToolChoiceMode.TOOL else None, parallel=parallel)
