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
