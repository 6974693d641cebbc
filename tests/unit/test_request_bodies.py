"""Raw request bodies: parsed once, validated with precise params, passed whole to a same-dialect upstream, and each
field translated, ignored or refused elsewhere by the documented rule (server/translate/field_rules.py)."""

from __future__ import annotations

import copy
import inspect
from pathlib import Path

import anthropic
import openai
import pytest

from server.domain import Dialect
from server.errors import InvalidRequest
from server.providers import Capabilities, unsupported
from server.services.messages import beta_values
from server.translate.anthropic_to_internal import message_request
from server.translate.field_rules import CHAT_FIELDS, MESSAGE_FIELDS, markdown_table
from server.translate.internal_to_anthropic_request import anthropic_body
from server.translate.internal_to_openai_request import openai_body
from server.translate.openai_to_internal import chat_request
from server.translate.values import parse_body, proto_to_json
from tests.helpers import chat_body, chat_request as chat_pb

EMBEDDED = Capabilities()
OPENAI = Capabilities(tool_calls=True, json_output=True, dialects=frozenset({Dialect.OPENAI}))
ANTHROPIC = Capabilities(tool_calls=True, dialects=frozenset({Dialect.ANTHROPIC}))
ROOT = Path(__file__).resolve().parents[2]


def chat(**fields):
    return chat_request(chat_body(**fields), default_max_tokens=16).generation


def message(**fields):
    body = {"model": "m", "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **fields}
    return message_request(body, beta=("context-management-2025-06-27",)).generation


def refusal(request, capabilities) -> str | None:
    error = unsupported(request, capabilities)
    return None if error is None else error.param


@pytest.mark.parametrize(
    ("data", "message"),
    [(b"", "empty"), (b"  \n", "empty"), (b'{"model": ', "Invalid JSON body"), (b"[1, 2]", "got an array"),
     (b'"text"', "got a string"), (b"\xff\xfe", "Invalid JSON body")],
)
def test_a_body_that_is_not_a_json_object_is_a_400(data, message):
    with pytest.raises(InvalidRequest) as caught:
        parse_body(data)
    assert message in caught.value.message and caught.value.param is None


def test_fields_at_every_level_reach_a_same_dialect_upstream_unchanged():
    body = chat_body(
        top_k=20, min_p=0.05, repetition_penalty=1.1, chat_template_kwargs={"enable_thinking": False},
        prompt_cache_retention="24h", stream=True, stream_options={"include_usage": False, "x_extra": 1},
        messages=[{"role": "user", "content": "hi"},
                  {"role": "assistant", "content": "ok", "reasoning_content": "because"},
                  {"role": "user", "content": [{"type": "text", "text": "and", "cache_control": {"type": "x"}}]}],
        tools=[{"type": "function", "function": {"name": "f", "strict": True, "parameters": {"type": "object"}},
                "x_tool_extra": [1]}],
    )
    original = copy.deepcopy(body)
    request = chat_request(body, default_max_tokens=16).generation
    assert refusal(request, OPENAI) is None
    sent = openai_body(request, model="upstream-name")
    owned = {"model": "upstream-name", "max_tokens": 8, "stream": True,
             "stream_options": {"include_usage": True, "x_extra": 1}}
    assert sent == {**original, **owned}
    assert body == original  # the caller's body is never edited


def test_unknown_and_refused_fields_are_refused_by_the_embedded_model_and_the_other_dialect():
    request = chat(chat_template_kwargs={"enable_thinking": False})
    assert refusal(request, EMBEDDED) == refusal(request, ANTHROPIC) == "chat_template_kwargs"
    assert refusal(chat(x_vendor_knob=1), EMBEDDED) == "x_vendor_knob"
    assert refusal(chat(x_vendor_knob=1), ANTHROPIC) == "x_vendor_knob"
    # Extensions llama.cpp honours are acted on by the embedded model; Anthropic has no min_p.
    request = chat(top_k=5, min_p=0.1, repetition_penalty=1.2, frequency_penalty=0.5)
    assert refusal(request, EMBEDDED) is None
    assert request.params.top_k == 5 and request.params.min_p == 0.1 and request.params.repetition_penalty == 1.2
    assert refusal(request, ANTHROPIC) == "min_p"
    # A neutral value asks for nothing and is never refused; an ignored field is never refused.
    assert refusal(chat(frequency_penalty=0, presence_penalty=0.0, logit_bias={}, user="u", store=True), ANTHROPIC) is None
    assert refusal(chat(seed=3, top_k=4), ANTHROPIC) is None
    # The deprecated function_call naming a function asks for a call, as a named tool_choice does.
    named = chat(functions=[{"name": "f", "parameters": {}}], function_call={"name": "f"})
    assert refusal(named, EMBEDDED) == "function_call"
    assert refusal(chat(functions=[{"name": "f", "parameters": {}}], function_call="auto"), EMBEDDED) is None


def test_a_model_with_deployments_of_both_dialects_takes_either_whole():
    both = Capabilities(tool_calls=True, dialects=frozenset({Dialect.OPENAI, Dialect.ANTHROPIC}))
    assert refusal(chat(x_vendor_knob=1), both) is None
    assert refusal(message(tools=[{"type": "web_search_20250305", "name": "w"}]), both) is None


def test_parts_the_internal_values_cannot_hold_pass_only_to_their_own_dialect():
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
    request = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "what is it?"}, image]}])
    assert refusal(request, EMBEDDED) == refusal(request, ANTHROPIC) == "messages[0].content[1].type"
    assert refusal(request, OPENAI) is None
    assert request.turns[0].text == "what is it?"


def test_kinds_of_parts_tools_and_calls_the_gateway_does_not_know_pass_only_to_their_own_dialect():
    custom_call = {"id": "call_1", "type": "custom", "custom": {"name": "grammar", "input": "SELECT 1"}}
    cases = {
        "messages[0].content[1].type": [{"role": "user", "content": [
            {"type": "text", "text": "look"}, {"type": "video_url", "video_url": {"url": "http://v"}}]}],
        "messages[1].tool_calls[0].type": [{"role": "user", "content": "q"},
                                           {"role": "assistant", "content": None, "tool_calls": [custom_call]},
                                           {"role": "tool", "tool_call_id": "call_1", "content": "1"}],
    }
    for param, messages in cases.items():
        request = chat(messages=messages)
        assert refusal(request, OPENAI) is None
        assert refusal(request, EMBEDDED) == refusal(request, ANTHROPIC) == param
    request = chat(tools=[{"type": "mcp", "server_label": "x"}])
    assert refusal(request, OPENAI) is None and refusal(request, ANTHROPIC) == "tools[0].type"


def test_an_assistant_refusal_part_is_what_it_said_and_function_messages_stay_with_openai():
    request = chat(messages=[{"role": "user", "content": "q"},
                             {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}])
    assert request.turns[1].text == "I can't." and refusal(request, ANTHROPIC) is None
    request = chat(messages=[{"role": "user", "content": "q"}, {"role": "function", "name": "f", "content": "r"}])
    assert refusal(request, OPENAI) is None and refusal(request, EMBEDDED) is None
    assert refusal(request, ANTHROPIC) == "messages[1].role"


def test_server_tools_and_beta_fields_reach_an_anthropic_upstream():
    search = {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}
    custom = {"name": "f", "input_schema": {"type": "object"}, "strict": True, "input_examples": [{"a": 1}]}
    edits = {"edits": [{"type": "clear_tool_uses_20250919"}]}
    request = message(tools=[custom, search], tool_choice={"type": "tool", "name": "web_search"})
    assert refusal(request, ANTHROPIC) is None
    assert refusal(request, EMBEDDED) == refusal(request, OPENAI) == "tools[1].type"
    request = message(tools=[custom, search], context_management=edits)
    assert refusal(request, ANTHROPIC) is None and refusal(request, OPENAI) == "context_management"
    sent = anthropic_body(request, model="claude-x")
    assert sent["tools"] == [custom, search] and sent["context_management"] == edits
    assert anthropic_body(message(max_tokens=8.0), model="claude-x")["max_tokens"] == 8
    assert request.source.beta == ("context-management-2025-06-27",)
    assert [t.name for t in request.tools] == ["f"]


def test_blocks_only_anthropic_knows_are_refused_elsewhere():
    doc = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
    request = message(messages=[{"role": "user", "content": [doc, {"type": "text", "text": "summarise"}]}])
    assert refusal(request, OPENAI) == refusal(request, EMBEDDED) == "messages[0].content[0].type"
    assert refusal(request, ANTHROPIC) is None
    assert refusal(message(mcp_servers=[]), OPENAI) is None  # neutral
    assert refusal(message(mcp_servers=[{"type": "url", "url": "https://x", "name": "x"}]), OPENAI) == "mcp_servers"


def test_typed_requests_meet_the_same_rules():
    body = proto_to_json(chat_pb(seed=7, temperature=0.5, stop=["a"]))
    assert body["seed"] == 7 and isinstance(body["seed"], int)
    assert chat_request(body, default_max_tokens=16).generation.params.seed == 7
    with pytest.raises(InvalidRequest) as caught:
        chat_request(proto_to_json(chat_pb(temperature=3)), default_max_tokens=16)
    assert caught.value.param == "temperature"


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"messages": "hi"}, "messages"), ({"messages": [{"role": "user", "content": {"a": 1}}]}, "messages[0].content"),
     ({"max_tokens": "8"}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"), ({"stream": "yes"}, "stream"),
     ({"tools": [{"type": "function", "function": {"name": 3}}]}, "tools[0].function.name"),
     ({"messages": [{"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": {}}}]}]},
      "messages[0].tool_calls[0].function.arguments"),
     # A named choice's missing or null parts are named as a wrong-typed one is (they were all `tool_choice`).
     ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function"}},
      "tool_choice.function"),
     ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function",
                                                                                "function": {"name": None}}},
      "tool_choice.function.name"),
     ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"function": {"name": "f"}}},
      "tool_choice.type"),
     ({"repetition_penalty": 0}, "repetition_penalty"),  # it divides the logits: vLLM refuses it too
     ({"metadata": ["x"]}, "metadata"), ({"stream_options": {"include_usage": 1}, "stream": True},
                                         "stream_options.include_usage")],
)
def test_wrong_types_name_the_path(fields, param):
    with pytest.raises(InvalidRequest) as caught:
        chat(**fields)
    assert caught.value.param == param


def test_an_ignored_messages_field_is_still_type_checked():
    with pytest.raises(InvalidRequest) as caught:
        message(thinking={"type": "enabled", "budget_tokens": "x"})
    assert caught.value.param == "thinking.budget_tokens"


@pytest.mark.parametrize(
    ("read", "fields", "param"),
    [(chat, {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok",
                                                             "reasoning_content": 5}]},
      "messages[1].reasoning_content"),
     (chat, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": 5}]}]},
      "messages[0].content[0].cache_control"),
     (message, {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": "x"}]}]},
      "messages[0].content[0].cache_control"),
     (message, {"system": [{"type": "text", "text": "be brief", "cache_control": []}]}, "system[0].cache_control"),
     (message, {"tools": [{"name": "f", "input_schema": {"type": "object"}, "strict": "yes"}]}, "tools[0].strict"),
     (message, {"tools": [{"name": "f", "input_schema": {"type": "object"}, "input_examples": {}}]},
      "tools[0].input_examples"),
     # Each example is an input, an object (a gRPC caller's are Structs): a string was passed, or silently dropped.
     (message, {"tools": [{"name": "f", "input_schema": {"type": "object"}, "input_examples": [{"a": 1}, "x"]}]},
      "tools[0].input_examples[1]"),
     (message, {"tools": [{"name": "f", "input_schema": {"type": "object"}, "cache_control": 1}]},
      "tools[0].cache_control")],
)
def test_members_the_gateway_does_not_read_are_still_type_checked(read, fields, param):
    """docs/api.md: `reasoning_content`, `cache_control`, `strict`, `input_examples` are ignored, but type-checked."""
    with pytest.raises(InvalidRequest) as caught:
        read(**fields)
    assert caught.value.param == param


@pytest.mark.parametrize("block", [{}, {"input": None}], ids=["missing", "null"])
def test_a_tool_use_without_its_input_is_refused_for_every_model(block):
    """Anthropic's API requires a tool_use block's `input` ({} for a call without arguments): the embedded model
    refused one without it, but an OpenAI-compatible upstream was sent arguments "{}" and answered. One rule now."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "f", **block}
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [use]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "ok"}]}]
    with pytest.raises(InvalidRequest) as caught:
        message(messages=messages, tools=[{"name": "f", "input_schema": {"type": "object"}}])
    assert caught.value.param == "messages[1].content[0].input"
    assert caught.value.message == "messages.1.content.0.tool_use.input: Field required"


def test_anthropic_beta_values_are_read_from_every_header():
    metadata = (("anthropic-beta", "a-1, b-2"), ("x-api-key", "k"), ("anthropic-beta", "c-3"))
    assert beta_values(metadata) == ("a-1", "b-2", "c-3")
    assert beta_values(None) == ()


def test_docs_show_the_field_tables():
    api = (ROOT / "docs" / "api.md").read_text()
    assert markdown_table(CHAT_FIELDS, "Anthropic") in api
    assert markdown_table(MESSAGE_FIELDS, "OpenAI-compatible") in api


@pytest.mark.parametrize("where", ["tools", "messages", "metadata"])
def test_bodies_nested_too_deeply_are_400_naming_the_field(where):
    """Deeper than the upstream body can be written (orjson stops at 254 levels): a 400, not a 500 on the way out."""
    deep = b"[" * 300 + b"]" * 300
    fields = {"tools": b'[{"function": {"parameters": %s}}]', "messages": b'[{"role": "user", "name": {"x": %s}}]',
              "metadata": b'{"x": %s}'}
    data = b'{"model": "m", "%s": %s}' % (where.encode(), fields[where] % deep)
    with pytest.raises(InvalidRequest) as caught:
        parse_body(data)
    assert caught.value.param.startswith(where) and "nested" in caught.value.message


def test_free_form_values_nested_32_levels_deep_are_400_and_31_pass():
    """Issue 14: JSON nested 32-99 levels inside free-form fields is a 400 naming the field, on REST as on the typed
    gRPC requests; escaped quotes and brackets inside strings do not count as nesting."""
    def body(levels: int, inner: bytes = b"") -> bytes:
        return b'{"model": "m", "metadata": {"x": %s}}' % (b"[" * levels + inner + b"]" * levels)

    assert parse_body(body(31))["model"] == "m"
    assert parse_body(body(31, b'"\\\"[[[[[\\\\", "{{{{"'))["model"] == "m"
    for levels in (32, 50, 99):
        with pytest.raises(InvalidRequest) as caught:
            parse_body(body(levels))
        assert caught.value.param.startswith("metadata.x") and "nested more than 32 levels" in caught.value.message
    part = b'{"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "hi", "extra": %s}]}]}'
    with pytest.raises(InvalidRequest) as caught:
        parse_body(part % (b"{\"a\": " * 32 + b"1" + b"}" * 32))
    assert caught.value.param == "messages[0].content"


def test_every_parameter_of_the_sdks_has_a_rule():
    """A parameter the official SDK offers is a field users send: the table must say what becomes of it (a field in
    neither table is refused as one the gateway does not know)."""
    transport = {"extra_headers", "extra_query", "extra_body", "timeout", "betas"}
    chat_create = openai.OpenAI(api_key="k").chat.completions.create
    assert set(inspect.signature(chat_create).parameters) - transport - set(CHAT_FIELDS) == set()
    messages_create = anthropic.Anthropic(api_key="k").messages.create
    assert set(inspect.signature(messages_create).parameters) - transport - set(MESSAGE_FIELDS) == set()


def test_the_typed_requests_hold_every_field_of_the_tables():
    """docs/api.md (gRPC callers): "The typed request messages hold every field of the tables". A field added to a
    table and not to its message would go unread from gRPC callers."""
    from portico.v1 import chat_pb2, message_pb2

    lacking = [name for table, message in ((CHAT_FIELDS, chat_pb2.CreateChatCompletionRequest),
                                           (MESSAGE_FIELDS, message_pb2.CreateMessageRequest))
               for name in table if name not in message.DESCRIPTOR.fields_by_name]
    assert "The typed request messages hold every field of the tables" in (ROOT / "docs" / "api.md").read_text()
    assert lacking == []


@pytest.mark.parametrize("data", [b'{"\\ud800": 1, "model": "m"}', b'{"model": "m", "x\\udc00y": {"a": 1}}'])
def test_a_member_name_at_the_top_holding_half_a_surrogate_pair_is_said_to(data):
    # A member name has no path to give as param; the message still says what is wrong, as for a value's string.
    with pytest.raises(InvalidRequest) as caught:
        parse_body(data)
    assert "a member's name holds half of a UTF-16 surrogate pair" in caught.value.message
    assert caught.value.param is None
