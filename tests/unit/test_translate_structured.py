"""Structured output across dialects (docs/api.md, Request bodies): chat's `response_format` json_schema becomes
Anthropic's `output_config.format`, and an upstream's error about it names the caller's field."""

from __future__ import annotations

import pytest

from server.domain import OutputFormat
from server.providers import Capabilities, unsupported
from server.providers.anthropic_http import AnthropicProvider
from server.providers.openai_http import OpenAIProvider
from server.translate.internal_to_anthropic_request import anthropic_body
from server.translate.internal_to_anthropic_request import caller_param as anthropic_caller_param
from server.translate.internal_to_openai_request import openai_body
from server.translate.openai_to_internal import chat_request
from tests.helpers import chat_body

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

