"""Reasoning across dialects through the whole stack (real Envoy, `portico serve`), asked for and read by the official
SDKs: chat's `reasoning_effort` to a model behind Anthropic, Messages' `thinking` to one behind an OpenAI-compatible
server, and the upstream's thinking back in the caller's dialect (docs/api.md, Request bodies, Upstream providers)."""

from __future__ import annotations

import openai
import pytest

from tests.e2e.conftest import upstream_gateway
from tests.upstream_support import UPSTREAM_KEY_ENV

HELLO = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    gpt = (f"{{kind: openai, base_url: '{double.url}', api_key_env: {UPSTREAM_KEY_ENV}, model: gpt-up, "
           "retry: {attempts: 1}}")
    claude = (f"{{kind: anthropic, base_url: '{double.url.removesuffix('/v1')}', api_key_env: {UPSTREAM_KEY_ENV}, "
              "model: claude-up, retry: {attempts: 1}}")
    models = (f"  - {{id: chat-claude, endpoint: /v1/chat/completions, provider: {claude}}}\n"
              f"  - {{id: cached-chat-claude, endpoint: /v1/chat/completions, provider: {claude}, cache: {{}}}}\n"
              f"  - {{id: messages-gpt, endpoint: /v1/messages, provider: {gpt}}}\n"
              f"  - {{id: cached-messages-gpt, endpoint: /v1/messages, provider: {gpt}, cache: {{}}}}\n")
    with upstream_gateway(tmp_path_factory.mktemp("reasoning-gateway"), models) as gateway:
        yield gateway


@pytest.fixture(autouse=True)
def fresh(double):
    double.reset()


def test_a_chat_reasoning_effort_reaches_anthropic_as_a_thinking_budget(oai, double):
    oai.chat.completions.create(model="chat-claude", messages=HELLO, reasoning_effort="high")
    sent = double.seen[-1].body
    assert sent["thinking"] == {"type": "enabled", "budget_tokens": 4096}
    assert sent["max_tokens"] > 4096  # the default limit is the answer's: the budget comes on top
    oai.chat.completions.create(model="chat-claude", messages=HELLO, reasoning_effort="low",
                                max_completion_tokens=3000)
    assert double.seen[-1].body["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    assert double.seen[-1].body["max_tokens"] == 3000
    oai.chat.completions.create(model="chat-claude", messages=HELLO, reasoning_effort="none")
    assert "thinking" not in double.seen[-1].body


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_completion_tokens": 4096}, "max_completion_tokens"),
    ({"temperature": 0.3}, "temperature"),
    ({"top_p": 0.5}, "top_p"),
    ({"extra_body": {"top_k": 5}}, "top_k"),
    ({"tools": [{"type": "function", "function": {"name": "weather"}}], "tool_choice": "required"}, "tool_choice"),
])
def test_what_anthropic_refuses_beside_thinking_is_a_400_naming_the_chat_param(oai, double, fields, param):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-claude", messages=HELLO, reasoning_effort="high", **fields)
    assert caught.value.param == param and not double.seen
