"""Every row of docs/api.md's two request-field tables, one by one, through the official SDKs, real Envoy and
`portico serve` against a recording upstream: the upstream of the caller's dialect receives the field unchanged (but
for what the gateway owns), the other dialect's upstream receives it translated (acted on) or not at all (ignored),
or the caller gets a 400 naming it (refused), and the embedded model answers or refuses it by its column.

The rows come from server/translate/field_rules.py, which tests/unit/test_request_bodies.py keeps equal to the
tables in docs/api.md; every row must have a sample value here, so a row added later is tried too."""

from __future__ import annotations

import inspect
from collections.abc import Callable

import anthropic
import openai
import pytest

from server.translate.field_rules import CHAT_FIELDS, MESSAGE_FIELDS, Rule
from tests.e2e.conftest import upstream_gateway
from tests.e2e.test_passthrough_sdks import SEARCH_TOOL, models_yaml
from tests.upstream_support import UPSTREAM_KEY_ENV

FUNCTION = {"name": "weather", "description": "Weather.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}
CUSTOM = {"name": "weather", "description": "Weather.",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}

# A value for each chat field that asks for something (never a neutral one), and what an Anthropic upstream must
# receive for it when the table says "acted on" (None: checked by the row's own test below).
CHAT_SAMPLES: dict[str, object] = {
    "max_completion_tokens": 6, "max_tokens": 6, "temperature": 1.5, "top_p": 0.9, "stop": ["END", "STOP"],
    "stream": True, "stream_options": {"include_usage": True}, "n": 1,
    "tools": [{"type": "function", "function": FUNCTION}], "tool_choice": "auto", "parallel_tool_calls": False,
    "response_format": {"type": "text"}, "seed": 7, "top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1,
    "frequency_penalty": 0.5, "presence_penalty": 0.5, "logit_bias": {"50256": -100}, "logprobs": True,
    "top_logprobs": 2, "user": "u-1", "safety_identifier": "s-1", "prompt_cache_key": "k",
    "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "explicit", "ttl": "30m"},
    "service_tier": "auto", "store": True, "metadata": {"a": "b"}, "modalities": ["text"], "reasoning_effort": "low",
    "verbosity": "low", "prediction": {"type": "content", "content": "Oslo"},
    "audio": {"voice": "alloy", "format": "wav"}, "web_search_options": {"search_context_size": "low"},
    "moderation": {"model": "omni-moderation-latest"}, "functions": [FUNCTION],
    "function_call": {"name": "weather"}, "chat_template_kwargs": {"enable_thinking": False},
}
CHAT_TO_ANTHROPIC: dict[str, Callable[[dict], bool]] = {
    "max_completion_tokens": lambda body: body["max_tokens"] == 6,
    "max_tokens": lambda body: body["max_tokens"] == 6,
    "temperature": lambda body: body["temperature"] == 1.0,  # capped
    "top_p": lambda body: body["top_p"] == 0.9,
    "stop": lambda body: body["stop_sequences"] == ["END", "STOP"],
    "stream": lambda body: body["stream"] is True,
    "stream_options": lambda body: body["stream"] is True,
    "n": lambda body: "n" not in body,
    "tools": lambda body: body["tools"] == [CUSTOM],
    "tool_choice": lambda body: body["tool_choice"] == {"type": "auto"},
    "parallel_tool_calls": lambda body: body["tool_choice"] == {"type": "auto", "disable_parallel_tool_use": True},
    "response_format": lambda body: "response_format" not in body,
    "top_k": lambda body: body["top_k"] == 20,
    "user": lambda body: body["metadata"] == {"user_id": "u-1"},
    "safety_identifier": lambda body: body["metadata"] == {"user_id": "s-1"},
    "reasoning_effort": lambda body: body["thinking"] == {"type": "enabled", "budget_tokens": 1024},
}
# What a chat field needs beside it to mean something.
CHAT_WITH = {"stream_options": {"stream": True}, "tool_choice": {"tools": CHAT_SAMPLES["tools"]},
             "parallel_tool_calls": {"tools": CHAT_SAMPLES["tools"]}, "top_logprobs": {"logprobs": True},
             "audio": {"modalities": ["text", "audio"]}, "function_call": {"functions": [FUNCTION]},
             "reasoning_effort": {"max_tokens": 2048}}

MESSAGE_SAMPLES: dict[str, object] = {
    "max_tokens": 6, "system": "Be brief.", "stop_sequences": ["END"], "temperature": 0.5, "top_p": 0.9,
    "top_k": 20, "stream": True, "tools": [CUSTOM], "tool_choice": {"type": "any"},
    "metadata": {"user_id": "u-1"}, "thinking": {"type": "enabled", "budget_tokens": 1024}, "service_tier": "auto",
    "inference_geo": "us", "speed": "fast", "user_profile_id": "p-1", "workspace_id": "w-1",
    "cache_control": {"type": "ephemeral"}, "diagnostics": {"request_trace": True},
    "output_config": {"effort": "low"}, "container": "container_1",
    "mcp_servers": [{"type": "url", "url": "https://mcp.example", "name": "x"}],
    "context_management": {"edits": [{"type": "clear_tool_uses_20250919"}]}, "thread": {"type": "create"},
}
MESSAGES_TO_OPENAI: dict[str, Callable[[dict], bool]] = {
    "max_tokens": lambda body: body["max_tokens"] == 6,
    "system": lambda body: body["messages"][0] == {"role": "system", "content": "Be brief."},
    "stop_sequences": lambda body: body["stop"] == ["END"],
    "temperature": lambda body: body["temperature"] == 0.5,
    "top_p": lambda body: body["top_p"] == 0.9,
    "stream": lambda body: body["stream"] is True and body["stream_options"] == {"include_usage": True},
    "tools": lambda body: body["tools"] == [{"type": "function", "function": FUNCTION}],
    "tool_choice": lambda body: body["tool_choice"] == "required",
    "metadata": lambda body: body["user"] == "u-1",
    "thinking": lambda body: body["reasoning_effort"] == "low",
    "output_config": lambda body: body["reasoning_effort"] == "low" and "response_format" not in body,
}
SDK_HEADERS = {"user_profile_id": "anthropic-user-profile-id", "workspace_id": "anthropic-workspace-id"}
MESSAGE_WITH = {"tool_choice": {"tools": [CUSTOM]}, "thinking": {"max_tokens": 2048}}
BETA_FIELDS = {"mcp_servers", "context_management", "thread"}  # the SDK's beta client only

HI = [{"role": "user", "content": "Oslo"}]
OPENAI_PARAMS = set(inspect.signature(openai.resources.chat.Completions.create).parameters)
ANTHROPIC_PARAMS = set(inspect.signature(anthropic.resources.beta.Messages.create).parameters)


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    images = (f"  - {{id: images-gpt, endpoint: /v1/images/generations, provider: {{kind: openai, base_url: "
              f"'{double.url}', api_key_env: {UPSTREAM_KEY_ENV}, model: image-up, retry: {{attempts: 1}}}}}}\n"
              "  - {id: images-dev, endpoint: /v1/images/generations, provider: {kind: dev-image}}\n")
    with upstream_gateway(tmp_path_factory.mktemp("table-gateway"), models_yaml(double.url) + images) as gateway:
        yield gateway


@pytest.fixture(autouse=True)
def fresh(double):
    double.reset()


def as_sdk_call(fields: dict, params: set[str]) -> dict:
    """The SDK's own parameter where it has one, else `extra_body`, as a user writes it."""
    call = {k: v for k, v in fields.items() if k in params}
    if extra := {k: v for k, v in fields.items() if k not in params}:
        call["extra_body"] = extra
    return call


def chat(oai: openai.OpenAI, model: str, fields: dict):
    call = as_sdk_call({"max_tokens": 3, **fields}, OPENAI_PARAMS)
    if call.get("stream"):
        with oai.chat.completions.create(model=model, messages=HI, **call) as chunks:
            return list(chunks)
    return oai.chat.completions.create(model=model, messages=HI, **call)


def message(claude: anthropic.Anthropic, model: str, fields: dict):
    call = as_sdk_call({"max_tokens": 3, **fields}, ANTHROPIC_PARAMS)
    betas = {"betas": ["mcp-client-2025-04-04"]} if set(fields) & BETA_FIELDS else {}
    if call.pop("stream", False):
        with claude.beta.messages.stream(model=model, messages=HI, **betas, **call) as stream:
            return stream.get_final_message()
    return claude.beta.messages.create(model=model, messages=HI, **betas, **call)


def test_every_row_has_a_sample():
    assert set(CHAT_SAMPLES) == set(CHAT_FIELDS) - {"model", "messages"}
    assert set(MESSAGE_SAMPLES) == set(MESSAGE_FIELDS) - {"model", "messages"}
    acted = {name for name, rule in CHAT_FIELDS.items() if rule.other is Rule.ACT} - {"model", "messages"}
    assert set(CHAT_TO_ANTHROPIC) == acted
    acted = {name for name, rule in MESSAGE_FIELDS.items() if rule.other is Rule.ACT} - {"model", "messages"}
    assert set(MESSAGES_TO_OPENAI) == acted


def first_refused(table: dict, fields: dict, *, embedded: bool) -> str:
    """The field a refusal names: the table's first that the model refuses (a field beside it may be refused too)."""
    return next(name for name, rule in table.items()
                if name in fields and rule.refused_by(fields[name], embedded=embedded))


def without_owned(body: dict, owned: set[str]) -> dict:
    return {k: v for k, v in body.items() if k not in owned}


@pytest.mark.parametrize("name", list(CHAT_SAMPLES))
def test_a_chat_field_by_its_row(oai, double, name):
    rule = CHAT_FIELDS[name]
    fields = {**CHAT_WITH.get(name, {}), name: CHAT_SAMPLES[name]}
    owned = {"model", "max_tokens", "max_completion_tokens", "stream", "stream_options"}

    chat(oai, "chat-gpt", fields)  # the caller's dialect: the body whole
    (seen,) = double.seen
    assert without_owned(seen.body, owned) == without_owned({"messages": HI, **fields}, owned)
    double.reset()

    for model, column in (("chat-claude", rule.other), ("chat-embedded", rule.embedded)):
        if column is Rule.REFUSE:
            with pytest.raises(openai.BadRequestError) as caught:
                chat(oai, model, fields)
            param = first_refused(CHAT_FIELDS, fields, embedded=model == "chat-embedded")
            assert (caught.value.body["param"], caught.value.body["code"]) == (param, "invalid_request")
            assert not double.seen
            continue
        answer = chat(oai, model, fields)
        if name == "stream_options":  # acted on: the usage chunk the caller asked for ends the stream
            assert answer[-1].choices == [] and answer[-1].usage.completion_tokens >= 1
        if model == "chat-claude":
            (seen,) = double.seen
            if column is Rule.ACT and name in CHAT_TO_ANTHROPIC:
                assert CHAT_TO_ANTHROPIC[name](seen.body), seen.body
            elif column is Rule.IGNORE:
                assert name not in seen.body and set(seen.body) <= {"model", "messages", "max_tokens", "stream",
                                                                    "tools", "tool_choice"}, seen.body


@pytest.mark.parametrize("name", list(MESSAGE_SAMPLES))
def test_a_messages_field_by_its_row(claude, double, name):
    rule = MESSAGE_FIELDS[name]
    fields = {**MESSAGE_WITH.get(name, {}), name: MESSAGE_SAMPLES[name]}

    message(claude, "messages-claude", fields)  # the caller's dialect: the body whole
    (seen,) = double.seen
    if name in SDK_HEADERS:  # the SDK sends these as headers, which stay with the gateway (api.md's note)
        assert SDK_HEADERS[name] not in seen.headers and set(seen.body) == {"model", "stream", "max_tokens", "messages"}
    else:
        owned = {"model", "stream"}
        assert without_owned(seen.body, owned) == without_owned({"max_tokens": 3, "messages": HI, **fields}, owned)
    if set(fields) & BETA_FIELDS:
        assert seen.headers["anthropic-beta"] == "mcp-client-2025-04-04"
    double.reset()

    for model, column in (("messages-gpt", rule.other), ("messages-embedded", rule.embedded)):
        if model == "messages-embedded" and name == "tool_choice":  # the note: `auto`/`none` only
            with pytest.raises(anthropic.BadRequestError) as caught:
                message(claude, model, fields)
            assert caught.value.body["error"]["param"] == "tool_choice"
            message(claude, model, {**fields, name: {"type": "auto"}})
            continue
        if column is Rule.REFUSE:
            with pytest.raises(anthropic.BadRequestError) as caught:
                message(claude, model, fields)
            error = caught.value.body["error"]
            param = first_refused(MESSAGE_FIELDS, fields, embedded=model == "messages-embedded")
            assert (error["param"], error["code"], error["type"]) == (param, "invalid_request", "invalid_request_error")
            assert not double.seen
            continue
        message(claude, model, fields)
        if model == "messages-gpt":
            (seen,) = double.seen
            if column is Rule.ACT:
                assert MESSAGES_TO_OPENAI[name](seen.body), seen.body
            else:
                assert set(seen.body) <= {"model", "messages", "max_tokens", "stream", "tools"}, seen.body
            double.reset()  # the embedded model's refusal reaches no upstream


@pytest.mark.parametrize("name", [n for n, rule in CHAT_FIELDS.items() if rule.neutral])
def test_a_neutral_value_of_a_refused_chat_field_is_no_refusal(oai, double, name):
    for value in CHAT_FIELDS[name].neutral:
        for model in ("chat-claude", "chat-embedded"):
            chat(oai, model, {name: value})
    assert all(name not in seen.body for seen in double.seen)


@pytest.mark.parametrize("name", [n for n, rule in MESSAGE_FIELDS.items() if rule.neutral])
def test_a_neutral_value_of_a_refused_messages_field_is_no_refusal(claude, double, name):
    for value in MESSAGE_FIELDS[name].neutral:
        for model in ("messages-gpt", "messages-embedded"):
            message(claude, model, {name: value})
    assert all(name not in seen.body for seen in double.seen)


PNG = {"type": "base64", "media_type": "image/png", "data": "iVBORw0KGgo="}
OPENAI_PARTS = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo=", "detail": "low"}},
                {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
                {"type": "file", "file": {"file_id": "file-1"}}]
ANTHROPIC_BLOCKS = [{"type": "image", "source": PNG},
                    {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "Oslo"},
                     "title": "Notes", "citations": {"enabled": True}},
                    {"type": "search_result", "source": "https://example.com", "title": "Oslo",
                     "content": [{"type": "text", "text": "4 C"}]}]
SERVER_TURN = [{"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "Oslo"}},
               {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": [
                   {"type": "web_search_result", "url": "https://example.com", "title": "Oslo",
                    "encrypted_content": "Eq0", "page_age": None}]},
               {"type": "text", "text": "4 C."}]


@pytest.mark.parametrize("part", OPENAI_PARTS, ids=lambda part: part["type"])
def test_a_chat_content_part_the_gateway_cannot_hold_passes_whole_or_is_refused_by_path(oai, double, part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, part]}]
    oai.chat.completions.create(model="chat-gpt", messages=messages, max_tokens=3)
    assert double.seen[0].body["messages"] == messages
    for model in ("chat-claude", "chat-embedded"):
        with pytest.raises(openai.BadRequestError) as caught:
            oai.chat.completions.create(model=model, messages=messages, max_tokens=3)
        assert caught.value.body["param"] == "messages[0].content[1].type"
    assert len(double.seen) == 1


@pytest.mark.parametrize("block", ANTHROPIC_BLOCKS, ids=lambda block: block["type"])
def test_a_messages_block_the_gateway_cannot_hold_passes_whole_or_is_refused_by_path(claude, double, block):
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, block]}]
    claude.messages.create(model="messages-claude", messages=messages, max_tokens=3)
    assert double.seen[0].body["messages"] == messages
    for model in ("messages-gpt", "messages-embedded"):
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.create(model=model, messages=messages, max_tokens=3)
        assert caught.value.body["error"]["param"] == "messages[0].content[1].type"
    assert len(double.seen) == 1


def test_a_server_tools_blocks_sent_back_pass_whole_or_are_refused_by_path(claude, double):
    """What the anthropic SDK hands back after a web search, sent again as history."""
    messages = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": SERVER_TURN},
                {"role": "user", "content": "Thanks."}]
    claude.messages.create(model="messages-claude", messages=messages, max_tokens=3, tools=[SEARCH_TOOL])
    assert double.seen[0].body["messages"] == messages
    for model in ("messages-gpt", "messages-embedded"):
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.create(model=model, messages=messages, max_tokens=3)
        assert caught.value.body["error"]["param"] == "messages[1].content[0].type"
    assert len(double.seen) == 1


def test_members_the_gateway_does_not_read_are_ignored_by_the_other_dialect_and_the_embedded_model(oai, claude,
                                                                                                  double):
    """api.md: `reasoning_content`, `cache_control`, `input_examples`, `name` on a user message reach an upstream of
    their own dialect (test_passthrough_sdks) and are ignored elsewhere: answered, never sent on; a tool's `strict`
    is translated (test_tool_definitions)."""
    chat_messages = [{"role": "user", "content": "Oslo?", "name": "bob"},
                     {"role": "assistant", "content": "Checking.", "reasoning_content": "The user wants weather."},
                     {"role": "user", "content": [{"type": "text", "text": "Go on."}]}]
    strict = [{"type": "function", "function": {**FUNCTION, "strict": True}}]
    for model in ("chat-claude", "chat-embedded"):
        oai.chat.completions.create(model=model, messages=chat_messages, tools=strict, max_tokens=3)
    (seen,) = double.seen
    assert seen.body["messages"] == [{"role": "user", "content": "Oslo?"},
                                     {"role": "assistant", "content": "Checking."},
                                     {"role": "user", "content": "Go on."}]
    assert seen.body["tools"] == [{**CUSTOM, "strict": True}]
    double.reset()
    ephemeral = {"type": "ephemeral"}
    messages = [{"role": "user", "content": [{"type": "text", "text": "Oslo?", "cache_control": ephemeral}]}]
    tools = [{**CUSTOM, "strict": True, "input_examples": [{"city": "Oslo"}], "cache_control": ephemeral}]
    system = [{"type": "text", "text": "Be brief.", "cache_control": ephemeral}]
    for model in ("messages-gpt", "messages-embedded"):
        claude.messages.create(model=model, messages=messages, tools=tools, system=system, max_tokens=3)
    (seen,) = double.seen
    assert seen.body["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Oslo?"}]
    assert seen.body["tools"] == [{"type": "function", "function": {**FUNCTION, "strict": True}}]


def test_an_images_upstream_receives_the_body_whole_but_response_format_and_dev_image_refuses_the_rest(oai, double):
    """api.md: an OpenAI-compatible images upstream receives the body whole (without `response_format`), other
    members included; the embedded image model refuses a member it does not read, naming it."""
    fields = dict(prompt="a lighthouse", n=2, size="1024x1024", quality="high", output_format="png",
                  background="opaque", moderation="low", user="u-1", extra_body={"vendor": {"seed": 2**70}})
    images = oai.images.generate(model="images-gpt", response_format="url", **fields)
    assert len(images.data) == 2 and images.data[0].url
    (seen,) = double.seen
    expected = {k: v for k, v in fields.items() if k != "extra_body"} | {"vendor": {"seed": 2**70}}
    assert seen.path == "/v1/images/generations" and seen.body == {**expected, "model": "image-up"}
    with pytest.raises(openai.BadRequestError) as caught:
        oai.images.generate(model="images-dev", **fields)
    assert caught.value.body["param"] == "vendor"
    fields.pop("extra_body")
    assert len(oai.images.generate(model="images-dev", **fields).data) == 2


def test_the_sdks_gpt_image_2_sizes_and_qualities_reach_the_upstream_and_dev_image_draws_them(oai, double):
    """The openai SDK documents gpt-image-2's sizes as any WIDTHxHEIGHT (edges multiples of 16, at most 3840x2160,
    between 1:3 and 3:1) and the qualities `xhigh` and `max`: an images upstream is sent them, dev-image draws them;
    a size outside that rule is refused before any upstream, naming `size`."""
    for quality in ("xhigh", "max"):
        oai.images.generate(model="images-gpt", prompt="a lighthouse", size="1536x864", quality=quality)
    assert [(seen.body["size"], seen.body["quality"]) for seen in double.seen] == [("1536x864", "xhigh"),
                                                                                   ("1536x864", "max")]
    drawn = oai.images.generate(model="images-dev", prompt="a lighthouse", size="3840x2160", quality="max")
    assert drawn.size == "3840x2160"
    double.reset()
    for size in ("1537x864", "3856x2160", "4800x1440", "16x64", "0x0", "1024x1024x1"):
        with pytest.raises(openai.BadRequestError) as caught:
            oai.images.generate(model="images-gpt", prompt="a lighthouse", size=size)
        assert caught.value.body["param"] == "size" and "multiples of 16" in caught.value.body["message"]
    assert double.seen == []
