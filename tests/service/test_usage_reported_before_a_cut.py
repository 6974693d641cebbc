"""A stream the upstream breaks off after it reported what the answer used (OpenAI's usage chunk before `[DONE]`,
Anthropic's `message_delta` before `message_stop`): the upstream counted the answer, and bills that count, so the
request is settled with it, in the limits, the usage ledger, the spend and the metrics (api.md, Rate limits: "its
tokens are what the model reported or sent"), not with the four-characters-a-token estimate of a stream that
reported nothing."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from server.domain_keys import KeyLimits
from tests.helpers import bearer, chat_request, message_request
from tests.upstream_double import Cue
from tests.upstream_echo import sse
from tests.upstream_support import FAST_RETRY, UPSTREAM_KEY_ENV, upstream_server, window_tokens

HELLO = [{"role": "user", "content": "Say hello."}]
TEXT = "x" * 40  # ten tokens at four characters a token; the upstream says the answer was 3
PROMPT, OUTPUT = 1000, 3  # what the upstream reported
PRICE = {"input": 3, "output": 7}  # micro-dollars a token
COST = PROMPT * PRICE["input"] + OUTPUT * PRICE["output"]


def models(url: str) -> str:
    openai = f"kind: openai, base_url: '{url}', api_key_env: {UPSTREAM_KEY_ENV}"
    anthropic = f"kind: anthropic, base_url: '{url.removesuffix('/v1')}', api_key_env: {UPSTREAM_KEY_ENV}"
    price = f"{{input: {PRICE['input']}, output: {PRICE['output']}}}"
    return f"""\
  - {{id: chat-up, endpoint: /v1/chat/completions, provider: {{{openai}, model: m, retry: {FAST_RETRY}}}, price: {price}}}
  - {{id: messages-up, endpoint: /v1/messages, provider: {{{anthropic}, model: m, retry: {FAST_RETRY}}}, price: {price}}}
"""


@pytest.fixture(scope="module")
async def running(double, tmp_path_factory):
    async with upstream_server(tmp_path_factory.mktemp("reported-cut"), models(double.url)) as server:
        yield server


def openai_frames() -> list[bytes]:
    base = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    return [sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": TEXT}}]}),
            sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
            sse({**base, "choices": [], "usage": {"prompt_tokens": PROMPT, "completion_tokens": OUTPUT,
                                                  "total_tokens": PROMPT + OUTPUT}}),
            sse("[DONE]")]


def anthropic_frames() -> list[bytes]:
    return [sse({"type": "message_start", "message": {
                "id": "msg", "type": "message", "role": "assistant", "model": "m", "content": [],
                "stop_reason": None, "usage": {"input_tokens": PROMPT, "output_tokens": 1}}}, "message_start"),
            sse({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                "content_block_start"),
            sse({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": TEXT}},
                "content_block_delta"),
            sse({"type": "content_block_stop", "index": 0}, "content_block_stop"),
            sse({"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
                 "usage": {"output_tokens": OUTPUT}}, "message_delta"),
            sse({"type": "message_stop"}, "message_stop")]


async def settled_row(running, key_id: str):
    deadline = time.monotonic() + 10
    while not (rows := [r for r in running.core.usage.rows() if r.key_id == key_id]) and time.monotonic() < deadline:
        await running.core.ledger.flush()
        await asyncio.sleep(0.05)
    await running.limiter.settled()
    (row,) = rows
    return row


def metric(running, name: str, **labels) -> float:
    return running.telemetry.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.mark.parametrize("how", ["dropped", "closed"])
@pytest.mark.parametrize("dialect", ["openai", "anthropic"])
async def test_a_stream_cut_after_its_usage_was_reported_is_settled_with_that_usage(chat, messages, running, double,
                                                                                    dialect, how):
    double.reset()
    key, secret = await running.store.create(f"reported-{dialect}-{how}", all_models=True,
                                             limits=KeyLimits(tokens_per_minute=10**6))
    frames = openai_frames() if dialect == "openai" else anthropic_frames()
    # Everything but the stream's last frame: the connection drops before it ([DONE] over a broken chunked body),
    # or closes cleanly without it (message_stop never sent; a clean close after OpenAI's usage is a whole answer).
    if how == "dropped":
        double.cue(Cue(frames=frames, drop_after=len(frames) - 1))
    else:
        double.cue(Cue(frames=frames[:-1]))
    if dialect == "openai":
        call = chat.StreamChatCompletion(chat_request(model="chat-up", messages=HELLO, stream=True, max_tokens=50),
                                         metadata=bearer(secret))
    else:
        call = messages.StreamMessage(message_request(model="messages-up", messages=HELLO, max_tokens=50),
                                      metadata=bearer(secret))
    try:
        [event async for event in call]
    except grpc.aio.AioRpcError as error:  # a stream broken off after its first events
        assert error.code() is grpc.StatusCode.UNAVAILABLE
    row = await settled_row(running, key.id)
    assert (row.input_tokens, row.output_tokens, row.cost_micros) == (PROMPT, OUTPUT, COST), row
    assert window_tokens(running, key.id) == PROMPT + OUTPUT
    model = "chat-up" if dialect == "openai" else "messages-up"
    assert metric(running, "portico_output_tokens_total", model=model, key_id=key.id) == OUTPUT
    assert metric(running, "portico_spend_microdollars_total", model=model, key_id=key.id) == COST
