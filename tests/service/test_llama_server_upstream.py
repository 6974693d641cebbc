"""The openai provider against a real OpenAI-compatible server: `python -m llama_cpp.server` serving the embedded
model file, behind the real gRPC server."""

from __future__ import annotations

import asyncio

import orjson
import pytest

from server.app import start_server
from server.domain_keys import KeyLimits
from tests.helpers import bearer, chat_request, message_request, sse_frames, http_body
from tests.llama_server import MODEL_ALIAS
from tests.upstream_support import load_upstream_config, window_tokens

MODELS = """\
  - id: family-a-5.5
    endpoint: /v1/chat/completions
    provider: {{kind: openai, base_url: '{url}', model: {alias}}}
  - id: family-b-sonnet-4-6
    endpoint: /v1/messages
    provider: {{kind: openai, base_url: '{url}', model: {alias}}}
"""
LONG = [{"role": "user", "content": "Write a very long story about the sea."}]


@pytest.fixture(scope="module")
async def running(llama_server, tmp_path_factory):
    models = MODELS.format(url=llama_server.url, alias=MODEL_ALIAS)
    server = await start_server(load_upstream_config(tmp_path_factory.mktemp("llama-up"), models), "127.0.0.1:0")
    yield server
    await server.stop(0)


@pytest.fixture
async def key(running):
    key, secret = await running.store.create("llama-upstream", all_models=True, limits=KeyLimits(tokens_per_minute=10**6))
    return key.id, secret


async def test_completion_with_its_token_limit_and_settled_usage(chat, running, key):
    key_id, secret = key
    response = await chat.CreateChatCompletion(chat_request(max_tokens=6, temperature=0), metadata=bearer(secret))
    choice = response.choices[0]
    assert choice.message.content and choice.finish_reason == "length"
    # Not streamed, so the server's one JSON answer, which carries its own usage: the prompt counted with its chat
    # template, not estimated from its 10 characters.
    assert response.usage.completion_tokens == 6 and response.usage.prompt_tokens > 10
    assert window_tokens(running, key_id) == response.usage.total_tokens


async def test_streamed_over_the_http_rpc(chat, key):
    request = chat_request(max_tokens=5, temperature=0, stream=True, stream_options={"include_usage": True})
    frames = sse_frames([b async for b in chat.CreateChatCompletionHttp(http_body(request), metadata=bearer(key[1]))])
    assert frames[-1] == b"data: [DONE]\n\n"
    chunks = [orjson.loads(f.removeprefix(b"data: ")) for f in frames[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text and chunks[-2]["choices"][0]["finish_reason"] == "length"
    # llama-cpp-python's server ignores stream_options, so a stream's usage is counted: one token per delta.
    assert chunks[-1]["usage"]["completion_tokens"] == 5


async def test_stop_strings_reach_the_upstream(chat, key):
    free = await chat.CreateChatCompletion(chat_request(max_tokens=12, temperature=0), metadata=bearer(key[1]))
    word = free.choices[0].message.content.split()[1]
    stopped = await chat.CreateChatCompletion(chat_request(max_tokens=12, temperature=0, stop=[word]),
                                              metadata=bearer(key[1]))
    assert word not in stopped.choices[0].message.content
    assert stopped.choices[0].finish_reason == "stop"


async def test_a_caller_that_goes_away_frees_the_upstream(chat, running, key):
    """llama.cpp's server stops generating when its client disconnects: the next request is not kept waiting
    behind the 1500 tokens the abandoned one asked for (one sequence at a time, ~100 tokens/s)."""
    key_id, secret = key
    call = chat.StreamChatCompletion(chat_request(max_tokens=1500, messages=LONG, stream=True),
                                     metadata=bearer(secret))
    for _ in range(4):
        await call.read()
    call.cancel()
    loop = asyncio.get_running_loop()
    started = loop.time()
    response = await chat.CreateChatCompletion(chat_request(max_tokens=2), metadata=bearer(secret))
    assert response.usage.completion_tokens == 2
    assert loop.time() - started < 8
    assert await running.limiter.store.in_flight(key_id) == 0


async def test_messages_translated_for_the_openai_upstream(messages, key):
    request = message_request(max_tokens=5, temperature=0, system="Answer in English.")
    response = await messages.CreateMessage(request, metadata=bearer(key[1]))
    assert response.content[0].type == "text" and response.content[0].text
    assert (response.stop_reason, response.usage.output_tokens) == ("max_tokens", 5)
    assert response.usage.input_tokens > 10  # the server's count, with the chat template
    stream = messages.StreamMessage(message_request(max_tokens=4, temperature=0, stream=True), metadata=bearer(key[1]))
    events = [event async for event in stream]
    assert [e.type for e in events][:3] == ["message_start", "content_block_start", "ping"]
    assert events[-2].delta.stop_reason == "max_tokens" and events[-2].usage.output_tokens == 4
