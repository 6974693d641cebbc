"""Structured output across dialects (docs/api.md, Request bodies): chat's `response_format` json_schema becomes
Anthropic's `output_config.format` and back, Messages' `output_config.effort` a `reasoning_effort`, and an upstream's
error about them names the caller's field."""

from __future__ import annotations

import pytest

from server.domain import OutputFormat, Reasoning
from server.providers import Capabilities, unsupported
from server.providers.anthropic_http import AnthropicProvider
from server.providers.openai_http import OpenAIProvider
from server.translate.anthropic_to_internal import message_request
from server.translate.internal_to_anthropic_request import anthropic_body
from server.translate.internal_to_anthropic_request import caller_param as anthropic_caller_param
from server.translate.internal_to_openai_request import caller_param as openai_caller_param
from server.translate.internal_to_openai_request import openai_body
from server.translate.openai_to_internal import chat_request
from server.translate.structured import FORMAT_NAME
from tests.helpers import chat_body, message_body

CITY = {"type": "object", "properties": {"city": {"type": "string"}, "celsius": {"type": "integer"}},
        "required": ["city", "celsius"], "additionalProperties": False}


def chat(**fields):
    return chat_request(chat_body(**fields), default_max_tokens=1000).generation


def json_schema(**members):
    return {"type": "json_schema", "json_schema": {"name": "City", "schema": CITY, **members}}


@pytest.mark.parametrize("members", [{}, {"strict": True}, {"strict": False, "description": "A city's weather."}])
def test_a_json_schema_is_anthropics_output_config_format(members):
    generation = chat(response_format=json_schema(**members))
    assert generation.output_format == OutputFormat(schema=CITY)
    body = anthropic_body(generation, model="claude-up")
    assert body["output_config"] == {"format": {"type": "json_schema", "schema": CITY}}
    assert "response_format" not in body
    assert unsupported(generation, AnthropicProvider.capabilities) is None


def test_no_response_format_and_text_ask_for_no_format():
    for generation in (chat(), chat(response_format={"type": "text"}), chat(response_format=None)):
        assert generation.output_format is None
        assert "output_config" not in anthropic_body(generation, model="claude-up")


def test_json_object_has_no_anthropic_equivalent_and_is_refused_there():
    generation = chat(response_format={"type": "json_object"})
    assert generation.output_format == OutputFormat(schema=None)
    error = unsupported(generation, AnthropicProvider.capabilities)
    assert error is not None and error.param == "response_format.type" and "json_schema" in error.message
    assert unsupported(generation, OpenAIProvider.capabilities) is None  # passed through


@pytest.mark.parametrize(("response_format", "param"), [
    ({"type": "json_schema"}, "response_format.json_schema"),
    ({"type": "json_schema", "json_schema": {"name": "City"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"name": "City", "schema": "{}"}}, "response_format.json_schema.schema"),
    ({"type": "json_schema", "json_schema": []}, "response_format.json_schema"),
])
def test_a_json_schema_anthropic_cannot_be_sent_is_a_400_naming_it_there_only(response_format, param):
    generation = chat(response_format=response_format)
    error = unsupported(generation, AnthropicProvider.capabilities)
    assert error is not None and error.param == param
    assert unsupported(generation, OpenAIProvider.capabilities) is None  # the upstream of the dialect judges it


@pytest.mark.parametrize("response_format", [json_schema(), {"type": "json_object"}])
def test_the_embedded_model_still_refuses_json_output(response_format):
    error = unsupported(chat(response_format=response_format), Capabilities(tool_calls=True))
    assert error is not None and error.param == "response_format.type"


def test_an_openai_upstream_gets_the_response_format_as_it_came():
    body = openai_body(chat(response_format=json_schema(strict=True)), model="gpt-up")
    assert body["response_format"] == json_schema(strict=True) and "output_config" not in body


@pytest.mark.parametrize(("message", "param"), [
    ("output_config.format.schema: For 'integer' type, property 'minimum' is not supported",
     "response_format.json_schema.schema"),
    ("output_config.format.schema.properties.celsius: unsupported",
     "response_format.json_schema.schema.properties.celsius"),
    ("output_config.format: Input should be a valid dictionary", "response_format"),
    ("output_config: Extra inputs are not permitted", "response_format"),
])
def test_an_anthropic_error_about_the_format_names_the_response_format(message, param):
    generation = chat(response_format=json_schema())
    assert anthropic_caller_param(generation, message) == param


# Messages -> an OpenAI-compatible upstream: `output_config`'s format and effort.
def message(**fields):
    return message_request(message_body(**fields)).generation


FORMAT = {"type": "json_schema", "schema": CITY}
SENT_FORMAT = {"type": "json_schema", "json_schema": {"name": FORMAT_NAME, "schema": CITY, "strict": True}}


def test_an_output_config_format_is_a_strict_json_schema_response_format():
    generation = message(output_config={"format": FORMAT})
    assert generation.output_format == OutputFormat(schema=CITY)
    body = openai_body(generation, model="gpt-up")
    assert body["response_format"] == SENT_FORMAT and "output_config" not in body
    assert FORMAT_NAME == "output" and "reasoning_effort" not in body
    assert unsupported(generation, OpenAIProvider.capabilities) is None


@pytest.mark.parametrize(("effort", "sent"), [
    ("low", "low"), ("medium", "medium"), ("high", "high"), ("xhigh", "high"), ("max", "high")])
def test_an_output_config_effort_is_a_reasoning_effort_of_the_three_every_server_takes(effort, sent):
    generation = message(output_config={"effort": effort})
    body = openai_body(generation, model="gpt-up")
    assert body["reasoning_effort"] == sent and "response_format" not in body
    assert generation.reasoning == Reasoning(effort=sent, shown=False)  # no thinking asked for: no thinking block


@pytest.mark.parametrize(("thinking", "reasoning"), [
    ({"type": "enabled", "budget_tokens": 8000}, Reasoning(effort="low", budget_tokens=8000)),
    ({"type": "adaptive"}, Reasoning(effort="low")),
    ({"type": "disabled"}, Reasoning(effort="low", shown=False)),
])
def test_the_effort_wins_over_a_thinking_budget(thinking, reasoning):
    generation = message(max_tokens=9000, thinking=thinking, output_config={"effort": "low"})
    assert generation.reasoning == reasoning
    assert openai_body(generation, model="gpt-up")["reasoning_effort"] == "low"


def test_without_an_effort_the_thinking_budget_still_gives_one():
    generation = message(max_tokens=9000, thinking={"type": "enabled", "budget_tokens": 2048}, output_config={})
    assert openai_body(generation, model="gpt-up")["reasoning_effort"] == "medium"


@pytest.mark.parametrize(("output_config", "param"), [
    ({"format": {"type": "json_object"}}, "output_config.format.type"),
    ({"format": {"type": "json_schema"}}, "output_config.format.schema"),
    ({"format": {"type": "json_schema", "schema": []}}, "output_config.format.schema"),
    ({"format": "json"}, "output_config.format"),
    ({"effort": "extreme"}, "output_config.effort"),
    ({"effort": 3}, "output_config.effort"),
    ({"effort": ["low"]}, "output_config.effort"),
    ({"task_budget": {"type": "tokens", "total": 1000}}, "output_config.task_budget"),
])
def test_an_output_config_an_openai_upstream_cannot_be_sent_is_a_400_naming_it_there_only(output_config, param):
    generation = message(output_config=output_config)
    error = unsupported(generation, OpenAIProvider.capabilities)
    assert error is not None and error.param == param
    assert unsupported(generation, AnthropicProvider.capabilities) is None  # passed through: Anthropic judges it


def test_the_embedded_model_still_refuses_an_output_config():
    for output_config in ({"format": FORMAT}, {"effort": "low"}):
        error = unsupported(message(output_config=output_config), Capabilities(tool_calls=True))
        assert error is not None and error.param == "output_config"
    assert unsupported(message(output_config={}), Capabilities(tool_calls=True)) is None


def test_an_anthropic_upstream_gets_the_output_config_as_it_came():
    output_config = {"format": FORMAT, "effort": "max"}
    body = anthropic_body(message(output_config=output_config), model="claude-up")
    assert body["output_config"] == output_config and "response_format" not in body and "thinking" not in body


@pytest.mark.parametrize(("fields", "param", "caller"), [
    ({"output_config": {"format": FORMAT}}, "response_format", "output_config.format"),
    ({"output_config": {"format": FORMAT}}, "response_format.json_schema.schema", "output_config.format.schema"),
    ({"output_config": {"format": FORMAT}}, "response_format.json_schema.schema.properties",
     "output_config.format.schema.properties"),
    ({"output_config": {"effort": "high"}}, "reasoning_effort", "output_config.effort"),
    ({"max_tokens": 9000, "thinking": {"type": "enabled", "budget_tokens": 2048}}, "reasoning_effort", "thinking"),
    ({"max_tokens": 9000, "thinking": {"type": "enabled", "budget_tokens": 2048}, "output_config": {"effort": None}},
     "reasoning_effort", "thinking"),
])
def test_an_openai_upstreams_error_names_the_messages_field(fields, param, caller):
    assert openai_caller_param(message(**fields), param) == caller


def test_an_output_config_schema_counts_in_a_budgets_prompt():
    """An upstream reads the schema as prompt tokens (Anthropic's and, translated, OpenAI's)."""
    plain, structured = message(), message(output_config={"format": FORMAT})
    assert structured.most_prompt_tokens() - plain.most_prompt_tokens() > len(str(CITY)) // 2
