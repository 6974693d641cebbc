"""Tool definitions across dialects and on the embedded model, through the whole stack with the official SDKs
(docs/api.md, Request bodies and passthrough): a tool's `strict` reaches the other dialect as its own field, and a
definition OpenAI's and Anthropic's APIs refuse is refused wherever the gateway stands in for the caller's API (the
embedded model, an upstream of the other dialect) but passed whole to an upstream of the caller's dialect, which
judges it (vLLM and llama.cpp take any tool name)."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.e2e.conftest import upstream_gateway
from tests.e2e.test_passthrough_sdks import models_yaml

HI = [{"role": "user", "content": "Weather in Oslo?"}]
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
          "additionalProperties": False}


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    with upstream_gateway(tmp_path_factory.mktemp("tool-definitions-gateway"), models_yaml(double.url)) as gateway:
        yield gateway


@pytest.fixture(autouse=True)
def fresh(double):
    double.reset()


def function(name: str = "weather", **more) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": SCHEMA, **more}}


def custom(name: str = "weather", **more) -> dict:
    return {"name": name, "input_schema": SCHEMA, **more}


def test_a_tools_strict_reaches_the_other_dialect_as_its_own_field(oai, claude, double):
    """OpenAI's `function.strict` and Anthropic's custom tool `strict` are the same promise (inputs that follow the
    schema): a caller's `strict: true` was dropped on the way to the other dialect."""
    oai.chat.completions.create(model="chat-claude", messages=HI, max_tokens=4,
                                tools=[function(strict=True), function("time", strict=False), function("date")])
    tools = double.seen[-1].body["tools"]
    assert [tool.get("strict") for tool in tools] == [True, False, None]
    assert tools[0] == {"name": "weather", "input_schema": SCHEMA, "strict": True}
    claude.messages.create(model="messages-gpt", messages=HI, max_tokens=4,
                           tools=[custom(strict=True, input_examples=[{"city": "Oslo"}], defer_loading=False),
                                  custom("time")])
    tools = double.seen[-1].body["tools"]
    assert tools[0]["function"]["strict"] is True and "strict" not in tools[1]["function"]
    assert not {"input_examples", "defer_loading"} & set(tools[0]["function"])  # OpenAI has neither
    for model in ("chat-embedded", "messages-embedded"):  # the embedded model never calls tools: nothing to hold
        if model.startswith("chat"):
            assert oai.chat.completions.create(model=model, messages=HI, max_tokens=2,
                                               tools=[function(strict=True)]).choices
        else:
            assert claude.messages.create(model=model, messages=HI, max_tokens=2, tools=[custom(strict=True)]).content


LONG = "w" * 65  # OpenAI's limit is 64 characters
CHAT_REFUSED = [  # (tools, param): what OpenAI's API refuses, and Anthropic's too once translated
    ([function("get.weather")], "tools[0].function.name"),
    ([function("get weather")], "tools[0].function.name"),
    ([function(LONG)], "tools[0].function.name"),
    ([function(), function("time"), function()], "tools[2].function.name"),  # twice
    ([{"type": "function", "function": {"name": "weather", "parameters": {"type": "string"}}}],
     "tools[0].function.parameters.type"),
]


@pytest.mark.parametrize(("tools", "param"), CHAT_REFUSED)
def test_a_chat_tool_definition_the_apis_refuse_is_refused_where_the_gateway_stands_in(oai, double, tools, param):
    """A developer trying tools on `make serve`'s embedded model met the 400 only in production; an OpenAI-compatible
    upstream (vLLM and llama.cpp take any name) still receives them whole and judges."""
    for model in ("chat-embedded", "chat-claude"):
        with pytest.raises(openai.BadRequestError) as caught:
            oai.chat.completions.create(model=model, messages=HI, max_tokens=2, tools=tools)
        assert caught.value.body["param"] == param and caught.value.body["code"] == "invalid_request"
    assert not double.seen
    oai.chat.completions.create(model="chat-gpt", messages=HI, max_tokens=2, tools=tools)
    assert double.seen[0].body["tools"] == tools


def test_a_chat_functions_parameters_must_be_an_object_on_every_model(oai, double):
    bad = [{"type": "function", "function": {"name": "weather", "parameters": ["city"]}}]
    for model in ("chat-gpt", "chat-embedded", "chat-claude"):
        with pytest.raises(openai.BadRequestError) as caught:
            oai.chat.completions.create(model=model, messages=HI, max_tokens=2, tools=bad)
        assert caught.value.body["param"] == "tools[0].function.parameters"
    assert not double.seen


def test_a_chat_function_without_parameters_or_their_type_reaches_anthropic_with_an_object_schema(oai, double):
    """OpenAI takes a function without `parameters` (no arguments) or a schema without `type`; Anthropic requires
    `input_schema.type: object`."""
    properties = {"city": {"type": "string"}}
    tools = [{"type": "function", "function": {"name": "now"}},
             {"type": "function", "function": {"name": "weather", "parameters": {"properties": properties}}}]
    oai.chat.completions.create(model="chat-claude", messages=HI, max_tokens=2, tools=tools)
    assert [tool["input_schema"] for tool in double.seen[0].body["tools"]] == [
        {"type": "object"}, {"type": "object", "properties": properties}]
    assert oai.chat.completions.create(model="chat-embedded", messages=HI, max_tokens=2, tools=tools).choices


MESSAGES_REFUSED = [  # (tools, param): what Anthropic's API refuses
    ([custom("get.weather")], "tools[0].name"),
    ([custom("w" * 129)], "tools[0].name"),
    ([custom(), custom()], "tools[1].name"),
    ([{"name": "weather"}], "tools[0].input_schema"),
    ([{"name": "weather", "input_schema": {"type": "string"}}], "tools[0].input_schema.type"),
    ([{"name": "weather", "input_schema": {"properties": {}}}], "tools[0].input_schema.type"),
    ([{"name": "weather", "input_schema": {}}], "tools[0].input_schema.type"),
]


@pytest.mark.parametrize(("tools", "param"), MESSAGES_REFUSED)
def test_a_custom_tool_definition_anthropic_refuses_is_refused_where_the_gateway_stands_in(claude, double, tools,
                                                                                           param):
    for model in ("messages-embedded", "messages-gpt"):
        with pytest.raises(anthropic.BadRequestError) as caught:
            claude.messages.create(model=model, messages=HI, max_tokens=2, tools=tools)
        assert caught.value.body["error"]["param"] == param
    assert not double.seen
    claude.messages.create(model="messages-claude", messages=HI, max_tokens=2, tools=tools)
    assert double.seen[0].body["tools"] == tools


def test_a_custom_tools_name_anthropic_takes_is_taken_by_the_embedded_model(claude, double):
    """Anthropic takes names of up to 128 characters (OpenAI 64: an OpenAI-compatible upstream judges)."""
    tools = [custom("w" * 128)]
    assert claude.messages.create(model="messages-embedded", messages=HI, max_tokens=2, tools=tools).content
    claude.messages.create(model="messages-gpt", messages=HI, max_tokens=2, tools=tools)
    assert double.seen[0].body["tools"][0]["function"]["name"] == "w" * 128
