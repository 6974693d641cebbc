"""Reasoning across dialects (docs/api.md, Request bodies): chat's `reasoning_effort` becomes Anthropic's `thinking`
and back, and an upstream's thinking reaches the caller in its own dialect's member or block."""

from __future__ import annotations

import pytest

from server.domain import Reasoning
from server.providers import Capabilities, unsupported
from server.providers.anthropic_http import AnthropicProvider
from server.translate.internal_to_anthropic_request import anthropic_body
from server.translate.internal_to_openai_request import openai_body
from server.translate.openai_to_internal import chat_request
from tests.helpers import chat_body


def chat(**fields):
    return chat_request(chat_body(**fields), default_max_tokens=1000).generation


def refusal(generation, capabilities=AnthropicProvider.capabilities):
    return unsupported(generation, capabilities)


@pytest.mark.parametrize(("effort", "budget"), [
    ("minimal", 1024), ("low", 1024), ("medium", 2048), ("high", 4096), ("xhigh", 8192), ("max", 16384)])
def test_reasoning_effort_is_a_thinking_budget_for_an_anthropic_upstream(effort, budget):
    generation = chat(reasoning_effort=effort, max_completion_tokens=20000)
    body = anthropic_body(generation, model="claude-up")
    assert body["thinking"] == {"type": "enabled", "budget_tokens": budget}
    assert body["max_tokens"] == 20000
    assert generation.reasoning == Reasoning(effort=effort, budget_tokens=budget)


def test_no_reasoning_effort_and_none_ask_for_no_thinking():
    for generation in (chat(), chat(reasoning_effort="none"), chat(reasoning_effort=None)):
        assert "thinking" not in anthropic_body(generation, model="claude-up")
        assert generation.reasoning is None


def test_without_a_token_limit_the_default_is_room_for_the_answer_after_the_budget():
    """Anthropic refuses a budget not under max_tokens: default_max_tokens (1000 here) is the answer's, on top."""
    generation = chat_request({"model": "m", "messages": [{"role": "user", "content": "Hi"}],
                               "reasoning_effort": "high"}, default_max_tokens=1000).generation
    assert anthropic_body(generation, model="claude-up")["max_tokens"] == 5096
    assert generation.most_output_tokens == 5096  # what the limits reserve
    assert generation.params.max_tokens == 1000  # what an OpenAI-compatible upstream is sent, as before
    assert openai_body(generation, model="gpt-up")["max_tokens"] == 1000
    plain = chat_request({"model": "m", "messages": [{"role": "user", "content": "Hi"}]},
                         default_max_tokens=1000).generation
    assert plain.most_output_tokens == 1000


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_completion_tokens": 4096}, "max_completion_tokens"),
    ({"max_tokens": 100}, "max_tokens"),
    ({"temperature": 0.5}, "temperature"),
    ({"top_p": 0.9}, "top_p"),
    ({"top_k": 40}, "top_k"),
    ({"tool_choice": "required", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
])
def test_what_anthropic_refuses_beside_thinking_is_a_400_naming_the_chat_field(fields, param):
    fields = {"max_tokens": 9000, "reasoning_effort": "high", **fields}
    generation = chat(**fields)
    error = refusal(generation)
    assert error is not None and error.param == param
    # The embedded model ignores reasoning_effort (it has no reasoning): the same request is no refusal there.
    assert unsupported(generation, Capabilities(tool_calls=True)) is None


def test_a_temperature_of_one_a_high_top_p_and_an_auto_tool_choice_go_with_thinking():
    generation = chat(max_tokens=9000, reasoning_effort="low", temperature=1, top_p=0.95, top_k=0,
                      tool_choice="auto", tools=[{"type": "function", "function": {"name": "f"}}])
    assert refusal(generation) is None
    assert anthropic_body(generation, model="claude-up")["thinking"]["budget_tokens"] == 1024


def test_reasoning_content_in_chat_history_is_left_out_for_anthropic():
    """Anthropic takes a thinking block back only with its signature, which a chat history does not have."""
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello.", "reasoning_content": "They greet me."},
                {"role": "user", "content": "Bye"}]
    body = anthropic_body(chat(messages=messages, reasoning_effort="low", max_tokens=5000), model="claude-up")
    assert body["messages"][1] == {"role": "assistant", "content": "Hello."}
