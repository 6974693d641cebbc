"""The answers as the SDKs and raw-JSON readers meet them, through real Envoy and `portico serve`, from upstreams
whose answers the tests script: what Portico puts in (ids, model, usage an upstream left out) is well-formed, so the
SDKs' stream helpers and the fields their types always carry work on every model."""

from __future__ import annotations

import anthropic
import httpx
import openai
import pydantic
import pytest

from tests.e2e.conftest import upstream_gateway
from tests.e2e.test_passthrough_sdks import models_yaml
from tests.upstream_double import Cue
from tests.upstream_echo import sse
from tests.upstream_support import UPSTREAM_KEY_ENV

HELLO = [{"role": "user", "content": "Hello there, how are you today?"}]


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    odd = "".join(f"  - {{id: '{i}', endpoint: /v1/chat/completions, provider: {{kind: openai, "
                  f"base_url: '{double.url}', api_key_env: {UPSTREAM_KEY_ENV}, model: gpt-up}}}}\n"
                  for i in ("org/model", "qwen:unary"))
    with upstream_gateway(tmp_path_factory.mktemp("answer-wire-gateway"),
                          models_yaml(double.url) + odd) as gateway:
        yield gateway


@pytest.fixture(autouse=True)
def fresh(double):
    double.reset()


def events(gateway, body: dict) -> list[tuple[str, dict]]:
    """A streamed message's events, read off the wire."""
    headers = {"x-api-key": gateway.secret, "anthropic-version": "2023-06-01"}
    answer = httpx.post(f"{gateway.base_url}/v1/messages", json={**body, "stream": True}, headers=headers, timeout=30)
    assert answer.status_code == 200, answer.text
    out = []
    for frame in answer.text.strip().split("\n\n"):
        name, data = frame.split("\n")
        out.append((name.removeprefix("event: "), httpx.Response(200, content=data.removeprefix("data: ")).json()))
    return out


def test_an_anthropic_compatible_server_without_usage_still_gives_the_sdk_its_usage(claude, double):
    """Anthropic always sends usage (message_start's, message_delta's, a message's), and the SDK reads it: an
    Anthropic-compatible server that sends none gets the counts Portico settled put in, as a chat caller gets."""
    answer = {"id": "msg_up", "type": "message", "role": "assistant", "model": "claude-up", "stop_sequence": None,
              "content": [{"type": "text", "text": "Fine, thanks for asking"}], "stop_reason": "end_turn"}
    frames = [{"type": "message_start", "message": {**answer, "content": [], "stop_reason": None}},
              {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
              {"type": "content_block_delta", "index": 0,
               "delta": {"type": "text_delta", "text": "Fine, thanks for asking"}},
              {"type": "content_block_stop", "index": 0},
              {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None}},
              {"type": "message_stop"}]
    double.cue(Cue(body=answer), Cue(frames=[sse(e, e["type"]) for e in frames]))
    message = claude.messages.create(model="messages-claude", max_tokens=50, messages=HELLO)
    assert message.usage.input_tokens > 0 and message.usage.output_tokens > 0
    with claude.messages.stream(model="messages-claude", max_tokens=50, messages=HELLO) as stream:
        final = stream.get_final_message()
    assert final.content[0].text == "Fine, thanks for asking" and final.stop_reason == "end_turn"
    assert (final.usage.input_tokens, final.usage.output_tokens) == (message.usage.input_tokens,
                                                                     message.usage.output_tokens)


def test_a_message_streamed_from_an_openai_compatible_upstream_starts_with_a_prompt_count(gateway, double):
    """Anthropic's message_start carries the prompt's input_tokens, which stream readers take from there; an
    OpenAI-compatible upstream reports its count only at the end, so message_start has the prompt's estimate (not 0)
    and message_delta the upstream's count."""
    seen = events(gateway, {"model": "messages-gpt", "max_tokens": 5, "messages": HELLO})
    assert seen[0][0] == "message_start" and seen[0][1]["message"]["usage"]["input_tokens"] > 0
    assert seen[-2][0] == "message_delta" and seen[-2][1]["usage"]["input_tokens"] == 6  # the echo's: its words


def test_a_model_id_with_a_slash_is_found_as_the_sdks_write_it(gateway, oai, claude):
    assert oai.models.retrieve("org/model").endpoint == "/v1/chat/completions"  # the SDKs send org%2Fmodel
    assert claude.models.retrieve("org/model").id == "org/model"
    answer = httpx.get(f"{gateway.base_url}/v1/models/org/model", headers={"authorization": f"Bearer {gateway.secret}"})
    assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"


def test_a_model_id_ending_as_the_unary_twins_verb_is_found(gateway, oai, claude):
    # `:unary` is the custom verb of the unary twins' bindings (POST /v1/chat/completions:unary), which the
    # transcoder read off the end of GET /v1/models/qwen:unary: the SDKs send the colon as it is.
    assert oai.models.retrieve("qwen:unary").id == "qwen:unary"
    assert claude.models.retrieve("qwen:unary").id == "qwen:unary"
    headers = {"authorization": f"Bearer {gateway.secret}"}
    assert httpx.head(f"{gateway.base_url}/v1/models/qwen:unary", headers=headers).status_code == 200


class City(pydantic.BaseModel):
    echo: str


async def test_the_async_sdks_helpers_assemble_tool_calls_the_gateway_translated(gateway):
    """Applications use the async clients and their helpers: the call a chat caller gets from an Anthropic upstream,
    and a Messages caller from an OpenAI-compatible one, is rebuilt by the gateway, and the helpers assemble it
    (streamed arguments parsed into the caller's pydantic model; input parsed per input_json_delta)."""
    oai = openai.AsyncOpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.secret, max_retries=0)
    claude = anthropic.AsyncAnthropic(base_url=gateway.base_url, api_key=gateway.secret, max_retries=0)
    asked = {"model": "chat-claude", "messages": [{"role": "user", "content": "Oslo"}], "max_tokens": 20,
             "tools": [openai.pydantic_function_tool(City, name="weather")], "tool_choice": "required"}
    parsed = (await oai.chat.completions.parse(**asked)).choices[0].message.tool_calls[0].function.parsed_arguments
    async with oai.chat.completions.stream(**asked) as stream:
        done = [event.parsed_arguments async for event in stream
                if event.type == "tool_calls.function.arguments.done"]
        final = await stream.get_final_completion()
    assert parsed == done[0] == final.choices[0].message.tool_calls[0].function.parsed_arguments == City(echo="Oslo")
    tools = [{"name": "weather", "input_schema": City.model_json_schema()}]
    async with claude.messages.stream(model="messages-gpt", max_tokens=20, tools=tools, tool_choice={"type": "any"},
                                      messages=[{"role": "user", "content": "Oslo"}]) as stream:
        inputs = [event.snapshot async for event in stream if event.type == "input_json"]
        message = await stream.get_final_message()
    assert inputs[-1] == message.content[0].input == {"echo": "Oslo"} and message.stop_reason == "tool_use"
    await oai.close()
    await claude.close()
