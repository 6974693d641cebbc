"""The usage ledger through the real gRPC server and a real upstream that fails on cue: one row per admitted
request whatever its end, with its cost, equal to the metrics and to what the limits settled."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from server.domain import KeyLimits
from tests.helpers import bearer, chat_request
from tests.upstream_double import Cue
from tests.upstream_support import FAST_RETRY, UPSTREAM_KEY_ENV, upstream_server, window_tokens

HELLO = [{"role": "user", "content": "Say hello."}]  # the double answers "echo Say hello." (3 tokens; prompt 2)


def priced_models(url: str) -> str:
    common = f"kind: openai, base_url: '{url}', api_key_env: {UPSTREAM_KEY_ENV}"
    return f"""\
  - id: up-main
    endpoint: /v1/chat/completions
    provider: {{{common}, model: main-model, retry: {FAST_RETRY}}}
    fallbacks: [up-backup]
    price: {{input: 3, output: 7}}
  - id: up-backup
    endpoint: /v1/chat/completions
    provider: {{{common}, model: backup-model, retry: {{attempts: 1}}}}
    price: {{input: 100, output: 100}}
  - id: up-solo
    endpoint: /v1/chat/completions
    provider: {{{common}, model: solo-model, retry: {FAST_RETRY}}}
    price: {{input: 0.5, output: 1.5}}
"""


@pytest.fixture(scope="module")
async def running(double, tmp_path_factory):
    async with upstream_server(tmp_path_factory.mktemp("ledger"), priced_models(double.url)) as server:
        yield server


def metric(running, name: str, **labels) -> float:
    return running.telemetry.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_every_admitted_request_has_one_row_equal_to_metrics_and_limits(chat, running, double):
    double.reset()
    key, secret = running.store.create("ledger", all_models=True, env="team-a",
                                       limits=KeyLimits(requests_per_minute=4))
    ask = lambda model="up-main", **f: chat.CreateChatCompletion(  # noqa: E731
        chat_request(model=model, messages=HELLO, **f), metadata=bearer(secret))
    double.cue(*[Cue(500, {"error": {"message": "boom"}})] * 3)  # fails: 502 after its retries (refunded)
    with pytest.raises(grpc.aio.AioRpcError):
        await ask("up-solo")
    await ask()  # JSON: 2 prompt + 3 output tokens = 2*3 + 3*7 = 27 micro-dollars
    streamed = chat.StreamChatCompletion(chat_request(model="up-main", messages=HELLO, stream=True),
                                         metadata=bearer(secret))
    [chunk async for chunk in streamed]
    double.cue(Cue(frame_delay=0.3))  # abandoned by its caller mid-answer
    abandoned = chat.StreamChatCompletion(chat_request(model="up-solo", messages=HELLO, stream=True),
                                          metadata=bearer(secret))
    await abandoned.read()
    await abandoned.read()
    abandoned.cancel()
    double.cue(*[Cue(500, {"error": {"message": "boom"}})] * 3)  # falls back to up-backup
    await ask()
    with pytest.raises(grpc.aio.AioRpcError):
        await ask("no-such-model")  # never reached admission: no row
    while await running.limiter.store.in_flight(key.id):
        await asyncio.sleep(0.02)
    with pytest.raises(grpc.aio.AioRpcError) as refused:  # a 5th in the minute (the 502 was refunded): a row, no cost
        await ask()
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    await asyncio.sleep(0.05)
    await running.core.ledger.flush()

    rows = [r for r in running.core.usage.rows() if r.key_id == key.id]
    summary = [(r.model, r.upstream, r.status, r.code, r.input_tokens, r.output_tokens, r.cost_micros) for r in rows]
    assert summary.pop(0) == ("up-solo", "up-solo", 502, "upstream_error", 0, 0, 0)
    assert summary[:2] == [("up-main", "up-main", 200, "", 2, 3, 27)] * 2
    model, upstream, status, code, input_tokens, output_tokens, cost = summary[2]
    assert (model, upstream, status, code) == ("up-solo", "up-solo", 499, "cancelled")
    assert 0 < output_tokens < 3 and cost == -(-(input_tokens * 500_000 + output_tokens * 1_500_000) // 10**6)
    assert summary[3] == ("up-main", "up-backup", 200, "", 2, 3, 27)  # charged at the asked model's price
    assert summary[4] == ("up-main", "", 429, "rate_limit_exceeded", 0, 0, 0)
    assert len(rows) == 6
    assert all(r.env == "team-a" and r.request_id and r.latency_ms > 0 for r in rows)
    assert rows[1].first_token_ms is not None and rows[5].upstream_attempts == 0

    # The ledger, Portico's own metrics and the limit store agree, request for request.
    for model in ("up-main", "up-solo"):
        mine = [r for r in rows if r.model == model]
        assert metric(running, "portico_spend_microdollars_total", model=model, key_id=key.id) == sum(
            r.cost_micros for r in mine)
        assert metric(running, "portico_input_tokens_total", model=model, key_id=key.id) == sum(
            r.input_tokens for r in mine)
        assert metric(running, "portico_output_tokens_total", model=model, key_id=key.id) == sum(
            r.output_tokens for r in mine)
    assert window_tokens(running, key.id) == sum(r.input_tokens + r.output_tokens for r in rows)
