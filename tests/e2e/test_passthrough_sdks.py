"""The passthrough table of docs/api.md through the whole stack: the official SDKs send fields at every level (their
own parameters, `extra_body`, server tools, beta fields with `anthropic-beta`) through real Envoy and `portico serve`
to a recording upstream of their own dialect, which must receive them unchanged but for what the gateway owns; the
embedded model and the other dialect act on, ignore or refuse each field as the table says."""

from __future__ import annotations

import anthropic
import grpc
import openai
import pytest
from google.protobuf import json_format

from portico.v1 import chat_pb2, chat_service_pb2_grpc, message_pb2, message_service_pb2_grpc
from tests.e2e.conftest import upstream_gateway
from tests.helpers import bearer, error_details
from tests.passthrough_objects import COMPLETION
from tests.upstream_double import Cue
from tests.upstream_support import double_providers

THINKING_KWARGS = {"enable_thinking": False}
STRICT_TOOL = {"type": "function", "function": {"name": "weather", "strict": True, "description": "Weather.",
                                                "parameters": {"type": "object", "additionalProperties": False,
                                                               "properties": {"city": {"type": "string"}},
                                                               "required": ["city"]}}}
CUSTOM_TOOL = {"name": "weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
               "strict": True, "input_examples": [{"city": "Oslo"}]}
SEARCH_TOOL = {"type": "web_search_20250305", "name": "web_search", "max_uses": 2}
CONTEXT_MANAGEMENT = {"edits": [{"type": "clear_tool_uses_20250919"}]}


def models_yaml(double_url: str) -> str:
    gpt, claude = double_providers(double_url)
    rows = [("chat-gpt", "/v1/chat/completions", gpt), ("chat-claude", "/v1/chat/completions", claude),
            ("chat-embedded", "/v1/chat/completions", "{kind: llamacpp}"),
            ("messages-claude", "/v1/messages", claude), ("messages-gpt", "/v1/messages", gpt),
            ("messages-embedded", "/v1/messages", "{kind: llamacpp}")]
    return "".join(f"  - {{id: {i}, endpoint: {e}, provider: {p}}}\n" for i, e, p in rows)


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    with upstream_gateway(tmp_path_factory.mktemp("passthrough-gateway"), models_yaml(double.url)) as gateway:
        yield gateway


@pytest.fixture(autouse=True)
def fresh(double):
    double.reset()


def chat_fields(**more) -> dict:
    """A chat request with fields at every level the protos never declared."""
    return dict(
        messages=[{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"},
                                               {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]},
                  {"role": "assistant", "content": "Checking.", "reasoning_content": "The user wants weather."},
                  {"role": "user", "content": "Go on."}],
        tools=[STRICT_TOOL], prompt_cache_retention="24h", max_tokens=7, temperature=0.3, seed=11,
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "chat_template_kwargs": THINKING_KWARGS,
                    "vendor": {"nested": [1, {"deep": True}], "big": 2**70, "low": -(2**63) - 1, "tiny": 1e-7}},
        **more,
    )


def sent_chat(fields: dict) -> dict:
    """What the SDK puts on the wire for `fields` (the body the upstream must see, but for what Portico owns)."""
    body = {k: v for k, v in fields.items() if k != "extra_body"}
    return {**body, **fields.get("extra_body", {})}


@pytest.mark.parametrize("stream", [False, True])
def test_an_openai_compatible_upstream_receives_the_chat_body_whole(oai, double, stream):
    fields = chat_fields()
    if stream:
        with oai.chat.completions.create(model="chat-gpt", stream=True, **fields) as chunks:
            assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    else:
        assert oai.chat.completions.create(model="chat-gpt", **fields).choices[0].message.content
    (seen,) = double.seen
    owned = {"model": "gpt-up", "max_tokens": 7, "stream": stream}
    if stream:
        owned["stream_options"] = {"include_usage": True}
    assert seen.path == "/v1/chat/completions" and seen.body == {**sent_chat(fields), **owned}


def test_an_upstream_answers_fields_are_passed_on_exactly(oai, double):
    """Integers beyond 64 bits too, which a double would round."""
    double.cue(Cue(body={**COMPLETION, "x_big": 2**70, "x_low": -(2**63) - 1}))
    completion = oai.chat.completions.create(model="chat-gpt", messages=[{"role": "user", "content": "Hi"}])
    assert completion.model_extra["x_big"] == 2**70 and completion.model_extra["x_low"] == -(2**63) - 1


def test_an_anthropic_upstream_receives_server_tools_beta_fields_and_the_beta_header(claude, double):
    fields = dict(max_tokens=9, tools=[CUSTOM_TOOL, SEARCH_TOOL], context_management=CONTEXT_MANAGEMENT,
                  messages=[{"role": "user", "content": [{"type": "text", "text": "Oslo", "cache_control":
                                                          {"type": "ephemeral", "ttl": "1h"}}]}],
                  thinking={"type": "enabled", "budget_tokens": 1024}, extra_body={"future_field": {"a": [1]}})
    message = claude.beta.messages.create(model="messages-claude", betas=["context-management-2025-06-27"], **fields)
    assert message.model == "messages-claude"
    (seen,) = double.seen
    assert seen.path == "/v1/messages" and seen.headers["anthropic-beta"] == "context-management-2025-06-27"
    expected = {**{k: v for k, v in fields.items() if k != "extra_body"}, "future_field": {"a": [1]}}
    assert seen.body == {**expected, "model": "claude-up", "stream": False}


def test_a_typed_grpc_caller_sends_custom_and_server_tools_settings_as_a_rest_caller_does(gateway, claude, double):
    """api.md: the typed requests hold every field of the passthrough tables, a custom tool's `strict` and
    `input_examples` and server tools' settings included."""
    location = {"type": "approximate", "city": "Oslo", "country": "NO"}
    tools = [{**CUSTOM_TOOL, "defer_loading": True},
             {**SEARCH_TOOL, "allowed_domains": ["met.no"], "user_location": location},
             {"type": "web_fetch_20250910", "name": "web_fetch", "blocked_domains": ["x.example"],
              "citations": {"enabled": True}, "max_content_tokens": 5000},
             {"type": "computer_20250124", "name": "computer", "display_width_px": 1024, "display_height_px": 768,
              "display_number": 1},
             {"type": "text_editor_20250728", "name": "str_replace_based_edit_tool", "max_characters": 10000}]
    fields = {"model": "messages-claude", "max_tokens": 4, "tools": tools,
              "messages": [{"role": "user", "content": "Oslo"}]}
    claude.messages.create(**fields)
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        create = message_service_pb2_grpc.MessageServiceStub(channel).CreateMessage
        create(json_format.ParseDict(fields, message_pb2.CreateMessageRequest()), metadata=bearer(gateway.secret))
    rest, typed = double.seen
    assert rest.body["tools"] == tools
    assert typed.body["tools"] == tools


def test_an_anthropic_stream_passes_the_body_and_several_betas(claude, double):
    with claude.beta.messages.stream(model="messages-claude", max_tokens=5, tools=[SEARCH_TOOL],
                                     betas=["a-2025-01-01", "b-2025-02-02"],
                                     messages=[{"role": "user", "content": "Oslo"}]) as stream:
        assert stream.get_final_message().content
    (seen,) = double.seen
    assert seen.headers["anthropic-beta"] == "a-2025-01-01,b-2025-02-02"
    assert seen.body["tools"] == [SEARCH_TOOL] and seen.body["stream"] is True


def test_a_tool_results_blocks_of_kinds_added_later_reach_an_anthropic_upstream_only(claude, double):
    """Tool search answers with `tool_reference` blocks inside a `tool_result`."""
    messages = [{"role": "user", "content": "Find a weather tool."},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "search",
                                                   "input": {"query": "weather"}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                    {"type": "tool_reference", "tool_name": "weather"}]}]}]
    tools = [{**CUSTOM_TOOL, "name": "search"}]
    claude.messages.create(model="messages-claude", max_tokens=4, tools=tools, messages=messages)
    (seen,) = double.seen
    assert seen.body["messages"] == messages
    for model in ("messages-gpt", "messages-embedded"):
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.messages.create(model=model, max_tokens=4, tools=tools, messages=messages)
        assert refused.value.body["error"]["param"] == "messages[2].content[0].content[0].type"
    assert len(double.seen) == 1


@pytest.mark.parametrize("model", ["chat-claude", "chat-embedded"])
def test_fields_the_other_models_cannot_honour_are_refused_naming_them(oai, double, model):
    for extra, param in (({"chat_template_kwargs": THINKING_KWARGS}, "chat_template_kwargs"),
                         ({"vendor": 1}, "vendor")):
        with pytest.raises(openai.BadRequestError) as caught:
            oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                        extra_body=extra)
        assert caught.value.body["param"] == param and caught.value.body["code"] == "invalid_request"
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=model, max_tokens=2, messages=[{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}]}])
    assert caught.value.body["param"] == "messages[0].content[0].type"
    assert not double.seen  # refused before any upstream was asked


def test_kinds_the_gateway_does_not_know_pass_whole_to_their_own_dialect_only(oai, double):
    """A custom tool's call sent back, a content part, a tool and a response format (vLLM's structural tags) of kinds
    added to the API later."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "Query?"},
                                             {"type": "video_url", "video_url": {"url": "http://v"}}]},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "custom", "custom": {"name": "sql", "input": "SELECT 1"}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": "1"}]
    tools = [{"type": "custom", "custom": {"name": "sql"}}, {"type": "future_tool", "future_tool": {}}]
    response_format = {"type": "structural_tag", "structures": [{"begin": "<f>", "schema": {}, "end": "</f>"}],
                       "triggers": ["<f>"]}
    oai.chat.completions.create(model="chat-gpt", messages=messages, tools=tools, max_tokens=3,
                                extra_body={"response_format": response_format})
    (seen,) = double.seen
    assert seen.body["messages"] == messages and seen.body["tools"] == tools
    assert seen.body["response_format"] == response_format
    hi = {"role": "user", "content": "Hi"}
    structural = {"messages": [hi], "extra_body": {"response_format": response_format}}
    for model, param, fields in (
            ("chat-claude", "messages[0].content[1].type", {"messages": messages}),
            ("chat-claude", "messages[1].tool_calls[0].type", {"messages": [hi, *messages[1:]]}),
            ("chat-claude", "tools[0].type", {"messages": [hi], "tools": tools[1:]}),
            ("chat-claude", "response_format.type", structural),
            ("chat-embedded", "response_format.type", structural)):
        with pytest.raises(openai.BadRequestError) as caught:
            oai.chat.completions.create(model=model, max_tokens=3, **fields)
        assert caught.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as caught:  # a kind is still a string
        oai.chat.completions.create(model="chat-gpt", messages=[hi], extra_body={"response_format": {"type": 7}})
    assert caught.value.body["param"] == "response_format.type" and len(double.seen) == 1


def test_assistant_turns_without_content_pass_whole_and_are_read_elsewhere(oai, double):
    """What the openai SDK hands back for the history: a refusal (content null) and a spoken answer referred to by
    its audio id (no content)."""
    hi, why = {"role": "user", "content": "Hi"}, {"role": "user", "content": "Why?"}
    refusal = {"role": "assistant", "content": None, "refusal": "I can't help with that."}
    spoken = {"role": "assistant", "audio": {"id": "audio_1"}}
    oai.chat.completions.create(model="chat-gpt", messages=[hi, refusal, why, spoken, why], max_tokens=3)
    assert double.seen[0].body["messages"] == [hi, refusal, why, spoken, why]
    oai.chat.completions.create(model="chat-claude", messages=[hi, refusal, why], max_tokens=3)
    assert double.seen[1].body["messages"][1] == {"role": "assistant", "content": "I can't help with that."}
    assert oai.chat.completions.create(model="chat-embedded", messages=[hi, refusal, why], max_tokens=2).choices
    for model in ("chat-claude", "chat-embedded"):
        with pytest.raises(openai.BadRequestError) as caught:
            oai.chat.completions.create(model=model, messages=[hi, spoken, why], max_tokens=3)
        assert caught.value.body["param"] == "messages[1].audio"
    with pytest.raises(openai.BadRequestError) as caught:  # still type-checked
        oai.chat.completions.create(model="chat-gpt", messages=[hi, {**refusal, "refusal": 5}, why])
    assert caught.value.body["param"] == "messages[1].refusal" and len(double.seen) == 2


def test_across_dialects_fields_are_translated_or_ignored_by_the_table(oai, claude, double):
    oai.chat.completions.create(model="chat-claude", messages=[{"role": "user", "content": "Oslo"}], max_tokens=4,
                                seed=3, user="u-1", frequency_penalty=0, extra_body={"top_k": 7})
    (seen,) = double.seen
    assert seen.path == "/v1/messages" and seen.body["top_k"] == 7
    assert not {"seed", "user", "frequency_penalty"} & set(seen.body)
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-claude", messages=[{"role": "user", "content": "Oslo"}],
                                    max_tokens=4, frequency_penalty=0.5)
    assert caught.value.body["param"] == "frequency_penalty"
    typo = {"type": "bogus", "name": "f", "input_schema": {"type": "object"}}
    for tool in (SEARCH_TOOL, typo):  # the message is true of a server tool and of a typo alike
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.messages.create(model="messages-gpt", max_tokens=4, tools=[tool],
                                   messages=[{"role": "user", "content": "Oslo"}])
        error = refused.value.body["error"]
        assert error["param"] == "tools[0].type" and f"Tools of type {tool['type']!r}" in error["message"]
        assert "custom tools" in error["message"] and "Server tools (" not in error["message"]


@pytest.mark.parametrize("model", ["chat-claude", "chat-embedded"])
def test_the_sdks_prompt_caching_hints_are_ignored_elsewhere(oai, double, model):
    """`prompt_cache_options` (an openai SDK parameter, beside `prompt_cache_key` and `prompt_cache_retention`) is a
    caching hint, so the table ignores it where it has no meaning rather than refusing the SDK's own request."""
    hints = {"prompt_cache_options": {"mode": "explicit", "ttl": "30m"}, "prompt_cache_key": "k",
             "prompt_cache_retention": "24h"}
    completion = oai.chat.completions.create(model=model, max_tokens=2, **hints, messages=[
        {"role": "user", "content": [{"type": "text", "text": "hi", "prompt_cache_breakpoint": {"mode": "explicit"}}]}])
    assert completion.usage.completion_tokens >= 1
    assert not set(hints) & {key for seen in double.seen for key in seen.body}  # never sent to Anthropic


def test_the_embedded_model_acts_on_sampling_extensions(oai):
    completion = oai.chat.completions.create(model="chat-embedded", messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=3, extra_body={"top_k": 1, "min_p": 0.1,
                                                                       "repetition_penalty": 1.3})
    assert completion.usage.completion_tokens >= 1


def test_a_top_k_of_minus_one_is_vllms_every_token(oai, double):
    for model in ("chat-gpt", "chat-claude", "chat-embedded"):
        assert oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                           extra_body={"top_k": -1}).choices
    gpt, claude = double.seen
    assert gpt.body["top_k"] == -1 and "top_k" not in claude.body  # unchanged; Anthropic's default is every token
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-gpt", messages=[{"role": "user", "content": "Hi"}],
                                    extra_body={"top_k": -2})
    assert caught.value.body["param"] == "top_k"


def test_wrong_types_are_400s_naming_the_path(gateway):
    import httpx

    with httpx.Client(base_url=gateway.base_url, headers={"authorization": f"Bearer {gateway.secret}"}) as http:
        answer = http.post("/v1/chat/completions", json={"model": "chat-embedded", "max_tokens": 2, "messages": [
            {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"id": "c", "function": {
                "name": "f", "arguments": {"not": "a string"}}}]}]})
        assert answer.status_code == 400
        assert answer.json()["error"]["param"] == "messages[1].tool_calls[0].function.arguments"
        for model, path, missing in (("chat-gpt", "messages[1].tool_calls[0].id", {"function": {"name": "f"}}),
                                     ("chat-claude", "messages[1].tool_calls[0].function", {"id": "c"})):
            answer = http.post("/v1/chat/completions", json={"model": model, "max_tokens": 2, "messages": [
                {"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [missing]}]})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == path  # the member missing
        for model, path, missing in (("messages-claude", "messages[1].content[0].id", {"name": "f"}),
                                     ("messages-gpt", "messages[1].content[0].name", {"id": "t"})):
            answer = http.post("/v1/messages", json={"model": model, "max_tokens": 2, "messages": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": [{"type": "tool_use", "input": {}, **missing}]}]})
            assert answer.status_code == 400 and answer.json()["error"]["param"] == path
        answer = http.post("/v1/messages", content=b'{"model": "messages-embedded", "max_tokens": ',
                           headers={"content-type": "application/json"})
        assert answer.status_code == 400 and answer.json()["type"] == "error"
        assert answer.json()["error"]["message"].startswith("Invalid JSON body")


def test_the_anthropic_sdks_tool_runner_runs_on_models_that_hold_no_threads(claude, double):
    """The anthropic SDK's tool runner asks for a server-held conversation (`thread`, a beta) unless told not to, and
    sends the whole conversation instead when the refusal says `thread_unsupported_request` (`error.details`): the
    embedded model and an OpenAI-compatible upstream hold no threads, so they must refuse it in that shape."""

    @anthropic.beta_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        return f"4 C in {city}"

    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    double.cue(Cue(body={**COMPLETION, "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
        "role": "assistant", "content": None, "tool_calls": [call]}}]}))
    replies = list(claude.beta.messages.tool_runner(model="messages-gpt", max_tokens=20, tools=[weather],
                                                    messages=[{"role": "user", "content": "Weather in Oslo?"}]))
    assert [reply.stop_reason for reply in replies] == ["tool_use", "end_turn"]
    assert replies[-1].content[0].text == "echo 4 C in Oslo"  # the last turn read the tool's result ...
    assert [m["role"] for m in double.seen[-1].body["messages"]] == ["user", "assistant", "tool"]  # ... in context
    with pytest.raises(anthropic.BadRequestError) as refused:  # a thread asked for in so many words: still refused
        claude.beta.messages.create(model="messages-embedded", max_tokens=2, thread={"type": "create"},
                                    messages=[{"role": "user", "content": "hi"}])
    assert refused.value.body["error"]["param"] == "thread"
    assert refused.value.body["error"]["details"] == {"error_code": "thread_unsupported_request"}
    (reply,) = claude.beta.messages.tool_runner(model="messages-embedded", max_tokens=2, tools=[weather],
                                                messages=[{"role": "user", "content": "hi"}])
    assert reply.usage.output_tokens >= 1
    (stream,) = claude.beta.messages.tool_runner(model="messages-embedded", max_tokens=2, tools=[weather],
                                                 messages=[{"role": "user", "content": "hi"}], stream=True)
    assert stream.get_final_message().usage.output_tokens >= 1


def test_the_typed_rpcs_refuse_what_the_sdks_body_is_refused_for_naming_the_same_field(gateway, oai, claude):
    """The SDKs write their fields in alphabetical order, a typed request reaches the server in the proto's field
    order: with two fields the model cannot honour, both must name the same one (the table's first)."""
    hi = [{"role": "user", "content": "hi"}]
    chats = [{"frequency_penalty": 0.5, "audio": {"voice": "alloy", "format": "wav"}},
             {"functions": [{"name": "weather"}], "function_call": {"name": "weather"}}]
    messages = [{"mcp_servers": [{"type": "url", "url": "https://mcp.example", "name": "x"}],
                 "context_management": CONTEXT_MANAGEMENT}]
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        chat = chat_service_pb2_grpc.ChatServiceStub(channel).CreateChatCompletion
        create = message_service_pb2_grpc.MessageServiceStub(channel).CreateMessage
        for model, fields in [("chat-claude", fields) for fields in chats] + [("chat-embedded", chats[1])]:
            with pytest.raises(openai.BadRequestError) as rest:
                oai.chat.completions.create(model=model, messages=hi, max_tokens=2, **fields)
            typed = json_format.ParseDict({"model": model, "messages": hi, "max_tokens": 2, **fields},
                                          chat_pb2.CreateChatCompletionRequest())
            with pytest.raises(grpc.RpcError) as caught:
                chat(typed, metadata=bearer(gateway.secret))
            assert error_details(caught.value).error.param == rest.value.body["param"]
        for model in ("messages-gpt", "messages-embedded"):
            with pytest.raises(anthropic.BadRequestError) as rest:
                claude.beta.messages.create(model=model, messages=hi, max_tokens=2, **messages[0])
            typed = json_format.ParseDict({"model": model, "messages": hi, "max_tokens": 2, **messages[0]},
                                          message_pb2.CreateMessageRequest())
            with pytest.raises(grpc.RpcError) as caught:
                create(typed, metadata=bearer(gateway.secret))
            assert error_details(caught.value).error.param == rest.value.body["error"]["param"]


def test_a_tool_call_demanded_without_tools_is_refused_on_every_model(oai, claude, double):
    """`required` (Anthropic: `any`) with no tools to call cannot be met: OpenAI's and Anthropic's APIs refuse it, and
    so must the gateway, rather than drop it on the way to the other dialect and answer with text."""
    hi = [{"role": "user", "content": "hi"}]
    for model in ("chat-gpt", "chat-claude", "chat-embedded"):
        with pytest.raises(openai.BadRequestError) as caught:
            oai.chat.completions.create(model=model, messages=hi, max_tokens=2, tool_choice="required")
        assert caught.value.body["param"] == "tool_choice"
    for model in ("messages-claude", "messages-gpt", "messages-embedded"):
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.messages.create(model=model, messages=hi, max_tokens=2, tool_choice={"type": "any"})
        assert refused.value.body["error"]["param"] == "tool_choice"
    assert not double.seen
    oai.chat.completions.create(model="chat-claude", messages=hi, max_tokens=2, tool_choice="auto")
    claude.messages.create(model="messages-gpt", messages=hi, max_tokens=2, tool_choice={"type": "none"})
    assert len(double.seen) == 2  # choices that ask for no call are fine without tools


def test_a_whitespace_stop_is_refused_by_name_only_where_anthropic_would_refuse_its_translation(oai, double):
    """Anthropic refuses stop sequences of whitespace only; a chat caller's `stop: ["\\n"]`, sent on as such, came back
    as the upstream's 400 about `stop_sequences`, a field the caller never sent."""
    hi = [{"role": "user", "content": "hi"}]
    for stop, param in ((["END", "\n"], "stop[1]"), (" \t", "stop")):
        with pytest.raises(openai.BadRequestError) as caught:
            oai.chat.completions.create(model="chat-claude", messages=hi, max_tokens=2, stop=stop)
        assert caught.value.body["param"] == param and "whitespace" in caught.value.body["message"]
    assert not double.seen
    for model in ("chat-gpt", "chat-embedded"):
        assert oai.chat.completions.create(model=model, messages=hi, max_tokens=2, stop=["\n"]).choices
    assert double.seen[0].body["stop"] == ["\n"]
    oai.chat.completions.create(model="chat-claude", messages=hi, max_tokens=2, stop=[" END "])
    assert double.seen[1].body["stop_sequences"] == [" END "]


def test_an_anthropic_upstreams_error_details_reach_the_sdk_so_its_tool_runner_recovers(claude, double):
    """The anthropic SDK's thread helpers and tool runner act on `error.details.error_code`: an Anthropic upstream that
    cannot thread a request says `thread_unsupported_request`, upon which the runner sends the whole conversation
    without `thread`; one that lost a thread answers 404 `thread_not_found`, a refusal of the request, not of the
    gateway's configured model."""

    @anthropic.beta_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        return f"4 C in {city}"

    unthreadable = {"error_code": "thread_unsupported_request", "unsupported": ["mcp_servers"]}
    double.cue(Cue(status=400, body={"type": "error", "error": {
        "type": "invalid_request_error", "message": "thread: not with mcp_servers", "details": unthreadable}}))
    (reply,) = claude.beta.messages.tool_runner(model="messages-claude", max_tokens=20, tools=[weather],
                                                messages=[{"role": "user", "content": "Weather in Oslo?"}])
    assert reply.content[0].text == "echo Weather in Oslo?"
    assert "thread" in double.seen[0].body and "thread" not in double.seen[1].body
    double.cue(Cue(status=404, body={"type": "error", "error": {
        "type": "not_found_error", "message": "thread: not found", "details": {"error_code": "thread_not_found"}}}))
    with pytest.raises(anthropic.types.ThreadNotFoundError) as lost:
        claude.beta.messages.create(model="messages-claude", max_tokens=2, thread={"type": "continue"},
                                    messages=[{"role": "user", "content": "hi"}])
    assert lost.value.body["error"]["message"] == "thread: not found"
    assert lost.value.response.headers.get("x-should-retry") is None


def test_a_thread_that_continues_takes_its_tools_from_the_thread_so_tool_choice_needs_none(claude, double):
    """On a `continue` turn the server holds the thread's `tools` (and `system`), so the anthropic SDK leaves them out
    and keeps `tool_choice`: its tool runner with `tool_choice` `any` sent its second turn as such, and the gateway
    refused it (400: demands a tool call without `tools`), which ended the runner on an Anthropic upstream."""

    @anthropic.beta_tool
    def weather(city: str) -> str:
        """The weather in a city."""
        return f"4 C in {city}"

    call = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}}
    double.cue(Cue(body={"id": "msg_up", "type": "message", "role": "assistant", "model": "claude-up",
                         "content": [call], "stop_reason": "tool_use", "stop_sequence": None,
                         "usage": {"input_tokens": 3, "output_tokens": 3}}))
    replies = list(claude.beta.messages.tool_runner(model="messages-claude", max_tokens=20, tools=[weather],
                                                    tool_choice={"type": "any"}, max_iterations=2,
                                                    messages=[{"role": "user", "content": "Weather in Oslo?"}]))
    assert [reply.stop_reason for reply in replies] == ["tool_use", "end_turn"]
    first, second = double.seen
    assert first.body["thread"] == {"type": "create"} and first.body["tools"]
    assert second.body["thread"] == {"type": "continue", "previous_message_id": "msg_up"} and "tools" not in second.body
    assert second.body["tool_choice"] == {"type": "any"}
    hi = [{"role": "user", "content": "hi"}]
    claude.beta.messages.create(model="messages-claude", max_tokens=2, messages=hi, tool_choice={
        "type": "tool", "name": "weather"}, thread={"type": "continue", "previous_message_id": "msg_up"})
    assert double.seen[-1].body["tool_choice"] == {"type": "tool", "name": "weather"}
    for model in ("messages-embedded", "messages-gpt"):  # they hold no threads, and say so
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.beta.messages.create(model=model, max_tokens=2, messages=hi, tool_choice={"type": "any"},
                                        thread={"type": "continue", "previous_message_id": "msg_up"})
        assert refused.value.body["error"]["details"] == {"error_code": "thread_unsupported_request"}
    with pytest.raises(anthropic.BadRequestError) as refused:  # a thread that starts holds only the tools it sends
        claude.beta.messages.create(model="messages-claude", max_tokens=2, messages=hi, tool_choice={"type": "any"},
                                    thread={"type": "create"})
    assert refused.value.body["error"]["param"] == "tool_choice"
    assert len(double.seen) == 3


@pytest.mark.parametrize("stream", [False, True])
def test_a_threaded_message_keeps_the_upstreams_id_which_the_next_turn_names(claude, double, stream):
    """A thread's next turn names the reply it continues (`previous_message_id`): with Portico's own id there, an
    Anthropic upstream that holds threads knew no such message (404 `thread_not_found`), and the SDK sent every turn
    twice, the second time with the whole history under a new thread."""
    hi = [{"role": "user", "content": "hi"}]
    for thread, upstream_id in (({"type": "create"}, True), (None, False)):
        fields = dict(model="messages-claude", max_tokens=5, messages=hi, **({"thread": thread} if thread else {}))
        if stream:
            with claude.beta.messages.stream(**fields) as events:
                reply = events.get_final_message()
        else:
            reply = claude.beta.messages.create(**fields)
        assert (reply.id == "msg_up") is upstream_id and reply.id.startswith("msg_")


def test_what_the_beta_messages_api_added_to_messages_reaches_an_anthropic_upstream_only(claude, double):
    """The SDK's thread helpers continue a paused turn (`pause_turn`) with no messages at all, and its tool runner
    adds or removes tools in a `system` message: an Anthropic upstream was never asked (400 `messages`, and
    `messages[1].role: must be 'user' or 'assistant'`), where the other models must refuse them by their path."""
    paused = {"model": "messages-claude", "max_tokens": 5, "messages": [],
              "thread": {"type": "continue", "previous_message_id": "msg_up"}}
    system = {"role": "system", "clear_at": "next_user_message",
              "content": [{"type": "tool_addition", "tool": {"name": "w", "input_schema": {"type": "object"}}}]}
    added = [{"role": "user", "content": "hi"}, system, {"role": "user", "content": "go on"}]
    double.cue(Cue(body={"id": "msg_up", "type": "message", "role": "assistant", "model": "claude-up",
                         "content": [{"type": "text", "text": "resumed"}], "stop_reason": "end_turn",
                         "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 1}}))
    assert claude.beta.messages.create(**paused).content[0].text == "resumed"
    assert claude.beta.messages.create(model="messages-claude", max_tokens=5, messages=added).content
    assert [seen.body["messages"] for seen in double.seen] == [[], added]
    for model in ("messages-embedded", "messages-gpt"):
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.beta.messages.create(**{**paused, "model": model})
        assert refused.value.body["error"]["param"] == "thread"
        with pytest.raises(anthropic.BadRequestError) as refused:
            claude.beta.messages.create(model=model, max_tokens=5, messages=added)
        assert refused.value.body["error"]["param"] == "messages[1].role"
    with pytest.raises(anthropic.BadRequestError) as refused:  # no thread holds the conversation: nothing to answer
        claude.beta.messages.create(**{**paused, "thread": {"type": "create"}})
    assert refused.value.body["error"]["param"] == "messages" and len(double.seen) == 2


@pytest.mark.parametrize("sent", ["max_completion_tokens", "max_tokens"])
def test_an_upstreams_refusal_of_the_token_limit_names_the_field_the_caller_sent(oai, double, sent):
    """The gateway puts the token limit in `max_tokens` in place of the caller's `max_completion_tokens` (the openai
    SDK's current parameter): the upstream's 400 names the field it received, which the caller never sent."""
    double.cue(Cue(status=400, body={"error": {"message": "max_tokens is too large: 500000.", "param": "max_tokens",
                                               "type": "invalid_request_error", "code": "invalid_value"}}))
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-gpt", messages=[{"role": "user", "content": "hi"}], **{sent: 500000})
    assert double.seen[0].body["max_tokens"] == 500000 and "max_completion_tokens" not in double.seen[0].body
    assert (caught.value.body["param"], caught.value.code) == (sent, "invalid_value")


def test_a_deprecated_function_call_in_the_history_is_never_silently_dropped(oai, double):
    """An assistant turn of the deprecated function calling (`function_call`, content null) passes whole to an
    OpenAI-compatible upstream; an Anthropic upstream, which refuses its result message (role `function`), refuses
    the call too, naming it, instead of leaving the turn out and answering as if the model had called nothing."""
    call = {"role": "assistant", "content": None, "function_call": {"name": "weather", "arguments": "{}"}}
    messages = [{"role": "user", "content": "Weather?"}, call, {"role": "user", "content": "Well?"}]
    oai.chat.completions.create(model="chat-gpt", messages=messages, max_tokens=2)
    assert double.seen[0].body["messages"] == messages
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-claude", messages=messages, max_tokens=2)
    assert caught.value.body["param"] == "messages[1].function_call" and len(double.seen) == 1
    for model in ("chat-gpt", "chat-claude", "chat-embedded"):  # still type-checked
        with pytest.raises(openai.BadRequestError) as caught:
            oai.chat.completions.create(model=model, messages=[messages[0], {**call, "function_call": 5}])
        assert caught.value.body["param"] == "messages[1].function_call"


def test_the_sdks_between_tools_thinking_is_thinking_off_where_anthropic_does_not_serve_it(claude, double):
    """The anthropic SDK's `thinking={"type": "between_tools"}` (thinking off; the model's progress notes between tool
    calls come back as thinking blocks) is a type Anthropic's API takes: an Anthropic upstream receives it, an
    OpenAI-compatible one is asked for no reasoning, as for `disabled`, and the embedded model ignores it."""
    hi = [{"role": "user", "content": "Oslo"}]
    for model in ("messages-claude", "messages-gpt", "messages-embedded"):
        message = claude.messages.create(model=model, max_tokens=5, messages=hi, thinking={"type": "between_tools"})
        assert [block.type for block in message.content] == ["text"]
    claude_seen, gpt_seen = double.seen
    assert claude_seen.body["thinking"] == {"type": "between_tools"}
    assert not {"reasoning_effort", "thinking"} & set(gpt_seen.body)
    with pytest.raises(anthropic.BadRequestError) as refused:  # a type no API has is still refused, naming it
        claude.messages.create(model="messages-gpt", max_tokens=5, messages=hi, thinking={"type": "sometimes"})
    assert refused.value.body["error"]["param"] == "thinking.type" and len(double.seen) == 2
