"""Structured output across dialects through the whole stack (real Envoy, `portico serve`), asked for and read by
the official SDKs: chat's `response_format` to a model behind Anthropic, Messages' `output_config` to one behind an
OpenAI-compatible server, and the answer parsed by the caller's SDK (docs/api.md, Request bodies, Upstream
providers)."""

from __future__ import annotations

import anthropic
import openai
import pydantic
import pytest
from openai.lib._parsing._completions import type_to_response_format_param

from tests.e2e.conftest import upstream_gateway
from tests.upstream_double import Cue
from tests.upstream_echo import sse
from tests.upstream_support import double_providers

HELLO = [{"role": "user", "content": "Weather in Oslo?"}]


class City(pydantic.BaseModel):
    city: str
    celsius: int


SENT_SCHEMA = type_to_response_format_param(City)["json_schema"]["schema"]  # as the openai SDK's parse() sends it
ANSWER = '{"city": "Oslo", "celsius": -3}'


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    gpt, claude = double_providers(double.url)
    models = (f"  - {{id: chat-claude, endpoint: /v1/chat/completions, provider: {claude}}}\n"
              f"  - {{id: chat-gpt, endpoint: /v1/chat/completions, provider: {gpt}}}\n"
              f"  - {{id: messages-gpt, endpoint: /v1/messages, provider: {gpt}}}\n"
              f"  - {{id: messages-claude, endpoint: /v1/messages, provider: {claude}}}\n")
    with upstream_gateway(tmp_path_factory.mktemp("structured-gateway"), models) as gateway:
        yield gateway


@pytest.fixture(autouse=True)
def fresh(double):
    double.reset()


def anthropic_message(text: str) -> dict:
    return {"id": "msg_up", "type": "message", "role": "assistant", "model": "claude-up",
            "content": [{"type": "text", "text": text}], "stop_reason": "end_turn", "stop_sequence": None,
            "usage": {"input_tokens": 5, "output_tokens": 12}}


def anthropic_frames(pieces: list[str]) -> list[bytes]:
    """An Anthropic stream of one text block written in `pieces`."""
    start = {**anthropic_message(""), "content": [], "stop_reason": None, "usage": {"input_tokens": 5,
                                                                                  "output_tokens": 1}}
    events = [{"type": "message_start", "message": start},
              {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
              *({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}}
                for piece in pieces),
              {"type": "content_block_stop", "index": 0},
              {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
               "usage": {"output_tokens": 12}},
              {"type": "message_stop"}]
    return [sse(event, event["type"]) for event in events]


def test_a_chat_json_schema_reaches_anthropic_as_output_config_and_comes_back_parsed(oai, double):
    double.cue(Cue(body=anthropic_message(ANSWER)))
    completion = oai.chat.completions.parse(model="chat-claude", messages=HELLO, response_format=City)
    sent = double.seen[-1].body
    assert sent["output_config"] == {"format": {"type": "json_schema", "schema": SENT_SCHEMA}}  # not rewritten
    assert "response_format" not in sent
    assert completion.choices[0].message.parsed == City(city="Oslo", celsius=-3)
    assert completion.choices[0].message.content == ANSWER


def test_a_streamed_chat_json_schema_comes_back_parsed(oai, double):
    double.cue(Cue(frames=anthropic_frames(['{"city": "Os', 'lo", "cel', 'sius": -3}'])))
    with oai.chat.completions.stream(model="chat-claude", messages=HELLO, response_format=City) as stream:
        final = stream.get_final_completion()
    assert double.seen[-1].body["output_config"]["format"]["schema"] == SENT_SCHEMA
    assert double.seen[-1].body["stream"] is True
    assert final.choices[0].message.parsed == City(city="Oslo", celsius=-3)


def test_json_object_is_refused_behind_anthropic_and_passed_through_otherwise(oai, double):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-claude", messages=HELLO, response_format={"type": "json_object"})
    assert caught.value.param == "response_format.type" and "json_schema" in caught.value.message
    assert not double.seen
    oai.chat.completions.create(model="chat-gpt", messages=HELLO, response_format={"type": "json_object"})
    assert double.seen[-1].body["response_format"] == {"type": "json_object"}


def test_a_json_schema_without_a_schema_is_refused_behind_anthropic(oai, double):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-claude", messages=HELLO,
                                    response_format={"type": "json_schema", "json_schema": {"name": "City"}})
    assert caught.value.param == "response_format.json_schema.schema" and not double.seen


def test_anthropics_400_about_the_schema_names_the_response_format(oai, double):
    """Anthropic refuses some JSON Schema features (numeric bounds among them); the gateway does not rewrite the
    schema, so the caller is told which of its fields the refusal is about."""
    message = "output_config.format.schema: For 'integer' type, property 'minimum' is not supported"
    double.cue(Cue(status=400, body={"type": "error", "error": {"type": "invalid_request_error", "message": message}}))
    bounded = {"type": "object", "properties": {"celsius": {"type": "integer", "minimum": -90}},
               "required": ["celsius"], "additionalProperties": False}
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="chat-claude", messages=HELLO, response_format={
            "type": "json_schema", "json_schema": {"name": "Bounded", "schema": bounded, "strict": True}})
    assert double.seen[-1].body["output_config"]["format"]["schema"] == bounded
    assert caught.value.body["param"] == "response_format.json_schema.schema"


# Messages -> an OpenAI-compatible upstream.
def openai_completion(content: str) -> dict:
    return {"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "gpt-up",
            "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": content}}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}}


def openai_frames(pieces: list[str]) -> list[bytes]:
    base = {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "gpt-up"}
    deltas = [{"role": "assistant", "content": ""}, *({"content": piece} for piece in pieces)]
    frames = [sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}) for delta in deltas]
    frames.append(sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}))
    frames.append(sse({**base, "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 12,
                                                        "total_tokens": 17}}))
    return [*frames, b"data: [DONE]\n\n"]


def test_a_messages_output_format_reaches_openai_as_a_strict_json_schema_and_comes_back_parsed(claude, double):
    double.cue(Cue(body=openai_completion(ANSWER)))
    message = claude.messages.parse(model="messages-gpt", max_tokens=500, messages=HELLO, output_format=City)
    sent = double.seen[-1].body
    schema = sent["response_format"]["json_schema"]["schema"]
    assert sent["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": schema, "strict": True}}
    assert set(schema["properties"]) == {"city", "celsius"} and "output_config" not in sent
    assert message.parsed_output == City(city="Oslo", celsius=-3)


def test_a_streamed_messages_output_format_comes_back_parsed(claude, double):
    double.cue(Cue(frames=openai_frames(['{"city": "Os', 'lo", "cel', 'sius": -3}'])))
    with claude.messages.stream(model="messages-gpt", max_tokens=500, messages=HELLO, output_format=City) as stream:
        final = stream.get_final_message()
    assert double.seen[-1].body["response_format"]["json_schema"]["strict"] is True
    assert final.parsed_output == City(city="Oslo", celsius=-3)


def test_a_messages_effort_reaches_openai_as_a_reasoning_effort(claude, double):
    for effort, sent in (("low", "low"), ("high", "high"), ("max", "high")):
        claude.messages.create(model="messages-gpt", max_tokens=500, messages=HELLO, output_config={"effort": effort})
        assert double.seen[-1].body["reasoning_effort"] == sent and "response_format" not in double.seen[-1].body
    claude.messages.create(model="messages-gpt", max_tokens=8000, messages=HELLO, output_config={"effort": "low"},
                           thinking={"type": "enabled", "budget_tokens": 6000})
    assert double.seen[-1].body["reasoning_effort"] == "low"  # the effort wins over the budget's (high)
    reasoned = openai_completion("Cold.")
    reasoned["choices"][0]["message"]["reasoning_content"] = "Oslo in winter is cold."
    double.cue(Cue(body=reasoned))
    answer = claude.messages.create(model="messages-gpt", max_tokens=500, messages=HELLO,
                                    output_config={"effort": "high"})
    assert [block.type for block in answer.content] == ["text"]  # an effort alone asks for no thinking block


def test_a_messages_output_config_is_passed_to_anthropic_as_it_came(claude, double):
    output_config = {"format": {"type": "json_schema", "schema": SENT_SCHEMA}, "effort": "xhigh"}
    claude.messages.create(model="messages-claude", max_tokens=500, messages=HELLO, output_config=output_config)
    assert double.seen[-1].body["output_config"] == output_config and "response_format" not in double.seen[-1].body


@pytest.mark.parametrize(("output_config", "param"), [
    ({"format": {"type": "json_schema"}}, "output_config.format.schema"),
    ({"effort": "extreme"}, "output_config.effort"),
])
def test_an_output_config_an_openai_upstream_cannot_take_is_a_400_naming_it(claude, double, output_config, param):
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="messages-gpt", max_tokens=500, messages=HELLO, output_config=output_config)
    assert caught.value.body["error"]["param"] == param and not double.seen


@pytest.mark.parametrize(("upstream_param", "param"), [
    ("response_format", "output_config.format"), ("reasoning_effort", "output_config.effort")])
def test_an_openai_400_about_the_format_or_effort_names_the_output_config(claude, double, upstream_param, param):
    double.cue(Cue(status=400, body={"error": {"message": "Invalid schema for response_format 'output'.",
                                               "type": "invalid_request_error", "param": upstream_param,
                                               "code": None}}))
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="messages-gpt", max_tokens=500, messages=HELLO, output_config={
            "format": {"type": "json_schema", "schema": SENT_SCHEMA}, "effort": "low"})
    assert caught.value.body["error"]["param"] == param


def test_reasoning_that_comes_between_the_json_leaves_the_streamed_text_whole(claude, double):
    """A server that reasons again in the middle of its answer: the text stays one block (the SDK parses each text
    block of a structured output alone), and that reasoning is a thinking block after it."""
    base = {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "gpt-up"}
    deltas = [{"role": "assistant", "content": ""}, {"reasoning_content": "Oslo is cold."}, {"content": '{"city": "Os'},
              {"reasoning": "Below zero."}, {"content": 'lo", "celsius": -3}'}]
    frames = [sse({**base, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]}) for delta in deltas]
    frames += [sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}), b"data: [DONE]\n\n"]
    double.cue(Cue(frames=frames))
    with claude.messages.stream(model="messages-gpt", max_tokens=2000, messages=HELLO, output_format=City,
                                thinking={"type": "enabled", "budget_tokens": 1024}) as stream:
        final = stream.get_final_message()
    assert [(block.type, getattr(block, "thinking", None)) for block in final.content] == [
        ("thinking", "Oslo is cold."), ("text", None), ("thinking", "Below zero.")]
    assert final.parsed_output == City(city="Oslo", celsius=-3)
