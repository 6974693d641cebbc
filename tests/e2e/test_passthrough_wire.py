"""The same-dialect passthrough of docs/api.md (Request bodies and passthrough) down to the bytes: through real Envoy
and `portico serve`, an upstream of the caller's dialect receives the caller's members in the caller's order, numbers
as written (integers exactly, 1.0 still a float, others as the nearest double), a member named twice once; and the
rules of the section that test_passthrough_sdks and test_passthrough_table leave out."""

from __future__ import annotations

import json

import anthropic
import grpc
import httpx
import openai
import pytest
from google.protobuf import json_format

from portico.v1 import message_pb2, message_service_pb2_grpc
from tests.e2e.conftest import upstream_gateway
from tests.e2e.test_passthrough_sdks import models_yaml
from tests.helpers import bearer, error_details


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    with upstream_gateway(tmp_path_factory.mktemp("passthrough-wire"), models_yaml(double.url)) as gateway:
        yield gateway


@pytest.fixture(autouse=True)
def fresh(double):
    double.reset()


@pytest.fixture(scope="module")
def http(gateway):
    with httpx.Client(base_url=gateway.base_url, timeout=30, headers={
            "authorization": f"Bearer {gateway.secret}", "content-type": "application/json"}) as client:
        yield client


def exactly(raw: bytes) -> str:
    """A JSON text's members in their order, duplicates kept, each number with its type (1 is not 1.0)."""
    return repr(json.loads(raw, object_pairs_hook=list))


# Members in no alphabetical order; numbers spelt every way; escapes; a member named twice (the last value counts,
# in the first one's place, as Python's and orjson's parsers both read it).
CHAT = (b'{"zeta":1.0,"model":"chat-gpt","messages":[{"role":"user","content":"caf\\u00e9 \\ud83d\\ude00 a\\/b",'
        b'"zz":{"b":1,"a":-0.0}}],"temperature":1,"top_p":1.0,"alpha":1E2,"big":123456789012345678901234567890,'
        b'"dup":1,"max_tokens":5,"dup":{"y":2,"x":1},"tiny":1e-7,"STREAM"}')
# The resolved token limit replaces the caller's, after its members.
CHAT_SEEN = ('{"zeta":1.0,"model":"gpt-up","messages":[{"role":"user","content":"café 😀 a/b",'
             '"zz":{"b":1,"a":-0.0}}],"temperature":1,"top_p":1.0,"alpha":100.0,"big":123456789012345678901234567890,'
             '"dup":{"y":2,"x":1},"tiny":1e-7,"STREAM","max_tokens":5"OPTIONS"}')
MESSAGE = (b'{"model":"messages-claude","zeta":1.0,"max_tokens":5,"messages":[{"role":"user","content":[{"type":"text",'
           b'"text":"caf\\u00e9","zz":{"b":1,"a":2}}]}],"temperature":1,"top_k":20,"big":-9223372036854775809,'
           b'"dup":1,"dup":2.50,"STREAM"}')
MESSAGE_SEEN = ('{"model":"claude-up","zeta":1.0,"max_tokens":5,"messages":[{"role":"user","content":[{"type":"text",'
                '"text":"café","zz":{"b":1,"a":2}}]}],"temperature":1,"top_k":20,"big":-9223372036854775809,'
                '"dup":2.5,"STREAM"}')


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize(("path", "sent", "seen"), [("/v1/chat/completions", CHAT, CHAT_SEEN),
                                                    ("/v1/messages", MESSAGE, MESSAGE_SEEN)], ids=["chat", "messages"])
def test_an_upstream_of_the_callers_dialect_receives_its_members_in_order_and_numbers_as_written(
        http, double, path, sent, seen, stream):
    flag = '"stream":true' if stream else '"stream":false'
    answer = http.post(path, content=sent.replace(b'"STREAM"', flag.encode()))
    assert answer.status_code == 200, answer.text
    options = ',"stream_options":{"include_usage":true}' if stream else ""
    (received,) = double.seen
    assert exactly(received.raw) == exactly(seen.replace('"STREAM"', flag).replace('"OPTIONS"', options).encode())


def test_a_lone_surrogate_escape_is_a_400_before_any_upstream(http, double):
    """No UTF-8 text holds half a surrogate pair (the SDKs cannot even encode one): refused, as api.md says, rather
    than passed on for the upstream to choke on."""
    answer = http.post("/v1/chat/completions", content=b'{"model":"chat-gpt","messages":[{"role":"user",'
                                                       b'"content":"half \\ud83d"}],"max_tokens":3}')
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["code"] == "invalid_request" and "surrogate" in error["message"]
    assert not double.seen


def test_a_function_message_is_a_tool_result_for_the_embedded_model_and_refused_by_an_anthropic_upstream(oai, double):
    """The deprecated function calling's history: passed whole to its own dialect, read by the embedded model, refused
    where Anthropic has no such turn, naming its first part there (the assistant's call; the result's role alone)."""
    messages = [{"role": "user", "content": "Weather in Oslo?"},
                {"role": "assistant", "content": None, "function_call": {"name": "weather", "arguments": "{}"}},
                {"role": "function", "name": "weather", "content": "4 C"}]
    oai.chat.completions.create(model="chat-gpt", messages=messages, max_tokens=3)
    assert double.seen[0].body["messages"] == messages
    assert oai.chat.completions.create(model="chat-embedded", messages=messages, max_tokens=2).choices
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-claude", messages=messages, max_tokens=3)
    assert (caught.value.body["param"], caught.value.body["code"]) == ("messages[1].function_call", "invalid_request")
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-claude", messages=[messages[0], messages[2]], max_tokens=3)
    assert caught.value.body["param"] == "messages[1].role"
    assert len(double.seen) == 1


def test_a_messages_field_in_neither_table_passes_to_anthropic_and_is_refused_elsewhere_naming_it(claude, double):
    hi = [{"role": "user", "content": "hi"}]
    claude.messages.create(model="messages-claude", messages=hi, max_tokens=3, extra_body={"x_later": {"a": [1]}})
    assert double.seen[0].body["x_later"] == {"a": [1]}
    for model in ("messages-gpt", "messages-embedded"):
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.create(model=model, messages=hi, max_tokens=3, extra_body={"x_later": {"a": [1]}})
        error = caught.value.body["error"]
        assert (error["param"], error["type"], error["code"]) == ("x_later", "invalid_request_error", "invalid_request")
    assert len(double.seen) == 1


def test_the_sdks_account_headers_stay_but_the_same_names_as_body_members_pass(claude, double):
    """api.md: `user_profile_id` and `workspace_id` pick among the accounts of the gateway's key when the SDK sends
    them as headers; written into the body, they pass like any other member."""
    claude.messages.create(model="messages-claude", messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                           user_profile_id="p-header", workspace_id="w-header",
                           extra_body={"user_profile_id": "p-body", "workspace_id": "w-body"})
    (seen,) = double.seen
    assert (seen.body["user_profile_id"], seen.body["workspace_id"]) == ("p-body", "w-body")
    assert not {"anthropic-user-profile-id", "anthropic-workspace-id"} & set(seen.headers)


def test_a_tool_choice_of_a_kind_the_gateway_does_not_know_passes_to_its_own_dialect_only(oai, claude, double):
    """As a content part, a tool or a response format of a kind added to the API later does: OpenAI's `allowed_tools`
    and `custom` choices, and whatever either API adds next, reach an upstream of their own dialect whole and are
    refused elsewhere naming `tool_choice.type` (a 400 even in front of OpenAI or Anthropic themselves before)."""
    hi = [{"role": "user", "content": "hi"}]
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    allowed = {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": [
        {"type": "function", "function": {"name": "weather"}}]}}
    later = {"type": "x_later", "x_later": {"mode": "auto"}}
    for choice in (allowed, later):
        oai.chat.completions.create(model="chat-gpt", messages=hi, tools=tools, tool_choice=choice, max_tokens=3)
        assert double.seen[-1].body["tool_choice"] == choice
        for model in ("chat-claude", "chat-embedded"):
            with pytest.raises(openai.BadRequestError) as caught:
                oai.chat.completions.create(model=model, messages=hi, tools=tools, tool_choice=choice, max_tokens=3)
            assert caught.value.body["param"] == "tool_choice.type"
    custom = [{"name": "weather", "input_schema": {"type": "object"}}]
    later = {"type": "x_later", "tools": ["weather"]}
    claude.messages.create(model="messages-claude", messages=hi, tools=custom, tool_choice=later, max_tokens=3)
    assert double.seen[-1].body["tool_choice"] == later
    for model in ("messages-gpt", "messages-embedded"):
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.create(model=model, messages=hi, tools=custom, tool_choice=later, max_tokens=3)
        assert caught.value.body["error"]["param"] == "tool_choice.type"
    assert len(double.seen) == 3
    with pytest.raises(anthropic.BadRequestError) as caught:  # a kind is still a string
        claude.messages.create(model="messages-claude", messages=hi, tools=custom, tool_choice={"type": 7},
                               max_tokens=3)
    assert caught.value.body["error"]["param"] == "tool_choice.type" and len(double.seen) == 3


def test_system_blocks_of_a_kind_the_gateway_does_not_know_pass_to_anthropic_only(oai, claude, double):
    """As in a message's content: a kind added to the API later reaches an Anthropic upstream whole (it was a 400
    there too) and is refused elsewhere by its path; so is a chat system message's part of such a kind."""
    hi = [{"role": "user", "content": "hi"}]
    system = [{"type": "text", "text": "Be brief."}, {"type": "x_later", "x_later": {"a": 1}}]
    claude.messages.create(model="messages-claude", system=system, messages=hi, max_tokens=3)
    assert double.seen[-1].body["system"] == system
    for model in ("messages-gpt", "messages-embedded"):
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.create(model=model, system=system, messages=hi, max_tokens=3)
        assert caught.value.body["error"]["param"] == "system[1].type"
    messages = [{"role": "system", "content": system}, *hi]
    oai.chat.completions.create(model="chat-gpt", messages=messages, max_tokens=3)
    assert double.seen[-1].body["messages"] == messages
    for model in ("chat-claude", "chat-embedded"):
        with pytest.raises(openai.BadRequestError) as caught:
            oai.chat.completions.create(model=model, messages=messages, max_tokens=3)
        assert caught.value.body["param"] == "messages[0].content[1].type"
    assert len(double.seen) == 2


def test_a_role_the_gateway_does_not_know_passes_to_an_openai_compatible_upstream_only(oai, double):
    """vLLM takes messages of any role its model's chat template knows (Llama's `ipython` for a tool's output): a
    chat body's role is the upstream's to judge, as OpenAI's own 400 would be; a model that cannot hold the turn
    refuses it by its path (it was a 400 in front of every model)."""
    messages = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "ipython", "content": "4 C"}]
    oai.chat.completions.create(model="chat-gpt", messages=messages, max_tokens=3)
    assert double.seen[0].body["messages"] == messages
    for model in ("chat-claude", "chat-embedded"):
        with pytest.raises(openai.BadRequestError) as caught:
            oai.chat.completions.create(model=model, messages=messages, max_tokens=3)
        assert (caught.value.body["param"], caught.value.body["code"]) == ("messages[1].role", "invalid_request")
        # The roles it names are those this model takes: an Anthropic upstream refuses 'function' too.
        takes = "user, assistant, tool, function." if model == "chat-embedded" else "user, assistant, tool."
        assert caught.value.body["message"].endswith(takes), caught.value.body["message"]
    with pytest.raises(openai.BadRequestError) as caught:  # a role is still a string
        oai.chat.completions.create(model="chat-gpt", messages=[{"role": 5, "content": "hi"}], max_tokens=3)
    assert caught.value.body["param"] == "messages[0].role" and len(double.seen) == 1


def test_more_stop_strings_than_openais_four_reach_the_upstream_and_every_model_honours_them(oai, claude, double):
    """OpenAI's API takes at most 4; vLLM and llama.cpp's server take more, as the embedded model and Anthropic do
    (a Messages caller's `stop_sequences` had no such limit): the gateway no longer refuses a fifth."""
    stops = ["one", "two", "three", "four", "Oslo"]
    hi = [{"role": "user", "content": "Weather in Oslo today"}]
    answer = oai.chat.completions.create(model="chat-gpt", messages=hi, max_tokens=9, stop=stops)
    assert double.seen[0].body["stop"] == stops and answer.choices[0].message.content == "echo Weather in"
    answer = oai.chat.completions.create(model="chat-claude", messages=hi, max_tokens=9, stop=stops)
    assert double.seen[1].body["stop_sequences"] == stops and answer.choices[0].finish_reason == "stop"
    assert oai.chat.completions.create(model="chat-embedded", messages=hi, max_tokens=2, stop=stops).choices


def test_a_named_tool_choice_missing_its_parts_names_the_part_on_every_model(oai, double):
    """As a wrong-typed name is named (`tool_choice.function.name`), a missing or null one is, in front of every
    model, before any upstream: the SDK user learns which member of the choice to fix, not just `tool_choice`."""
    tools = [{"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}]
    hi = [{"role": "user", "content": "hi"}]
    cases = {"tool_choice.function": {"type": "function"},
             "tool_choice.function.name": {"type": "function", "function": {"name": None}},
             "tool_choice.type": {"function": {"name": "weather"}}}
    for model in ("chat-gpt", "chat-claude", "chat-embedded"):
        for param, choice in cases.items():
            with pytest.raises(openai.BadRequestError) as caught:
                oai.chat.completions.create(model=model, messages=hi, tools=tools, tool_choice=choice, max_tokens=3)
            assert (caught.value.body["param"], caught.value.body["code"]) == (param, "invalid_request")
    assert not double.seen


@pytest.mark.parametrize("block", [{}, {"input": None}], ids=["missing", "null"])
def test_a_tool_use_without_its_input_is_refused_on_every_model_rest_and_typed(claude, gateway, double, block):
    """docs/api.md: Anthropic's API requires a tool_use block's `input`. The embedded model refused one without it,
    while an OpenAI-compatible upstream was sent arguments "{}" and answered, and an Anthropic upstream refused it in
    its own words: now the same 400, naming the block's input, on every model, before any upstream."""
    use = {"type": "tool_use", "id": "toolu_1", "name": "weather", **block}
    messages = [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": [use]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"}]}]
    tools = [{"name": "weather", "input_schema": {"type": "object"}}]
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        create = message_service_pb2_grpc.MessageServiceStub(channel).CreateMessage
        for model in ("messages-gpt", "messages-claude", "messages-embedded"):
            with pytest.raises(anthropic.BadRequestError) as rest:
                claude.messages.create(model=model, messages=messages, tools=tools, max_tokens=3)
            error = rest.value.body["error"]
            assert error["param"] == "messages[1].content[0].input", (model, error)
            assert error["message"] == "messages.1.content.0.tool_use.input: Field required"
            typed = json_format.ParseDict({"model": model, "messages": messages, "tools": tools, "max_tokens": 3},
                                          message_pb2.CreateMessageRequest())
            with pytest.raises(grpc.RpcError) as caught:
                create(typed, metadata=bearer(gateway.secret))
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert error_details(caught.value).error.param == "messages[1].content[0].input", model
    assert not double.seen
