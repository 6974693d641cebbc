"""The official anthropic SDK against the running gateway: create, the streaming helpers and typed errors."""

from __future__ import annotations

import anthropic
import pytest


@pytest.fixture(scope="module")
def client(gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.secret, max_retries=0)


def test_create(client):
    message = client.messages.create(model="family-b-sonnet-4-6", max_tokens=6, extra_body={"temperature": 0},
                                     system="Be brief.", messages=[{"role": "user", "content": "Say hello."}])
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 6 and message.usage.input_tokens > 0


def test_stream_helpers(client):
    # Greedy sampling: at temperature 1 the model sometimes ends its turn within 8 tokens.
    with client.messages.stream(model="family-b-opus-4-8", max_tokens=8, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "Count to five."}]) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert len(texts) >= 2
    assert final.content[0].text == "".join(texts)
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8 and final.usage.input_tokens > 0


def test_beta_query_parameter_is_accepted(client):
    message = client.beta.messages.create(model="family-b-haiku-4-5-20251001", max_tokens=2,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert message.content[0].text is not None


def test_typed_errors(client, gateway):
    bad = anthropic.Anthropic(base_url=gateway.base_url, api_key="pk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        bad.messages.create(model="family-b-opus-4-7", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert caught.value.body == {"type": "error", "error": {
        "message": "Incorrect API key provided.", "type": "authentication_error", "param": None,
        "code": "invalid_api_key"}}
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="family-a-5.5", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert "/v1/chat/completions" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="family-b-opus-4-7", max_tokens=5, extra_body={"temperature": 1.5},
                               messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["error"]["param"] == "temperature"
