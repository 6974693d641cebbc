"""Budgets through two servers ("hosts") sharing one Redis limit store and one key store: a budget of $0.01 admits
exactly as many requests as the model's prices allow, whichever server they reach and however they interleave; the
refusal is a 429 naming the budget and its reset, with retry-after."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import re

import grpc
import pytest

from portico.v1 import chat_service_pb2_grpc, key_pb2, key_service_pb2_grpc, limit_pb2, limit_service_pb2_grpc
from server.app import start_server
from server.db import StoreSettings
from server.domain_keys import KeyLimits
from tests.helpers import bearer, chat_request, error_details, schema_and_functions
from tests.postgres_support import PASSWORD_ENV
from tests.upstream_echo import echo_chat
from tests.upstream_support import UPSTREAM_KEY, UPSTREAM_KEY_ENV, load_upstream_config

HELLO = [{"role": "user", "content": "Say hello."}]  # the double answers "echo Say hello.": 3 output tokens


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
async def hosts(request, double, redis_server, tmp_path_factory):
    """Two servers, one Redis, one key store and ledger (a shared keys.db, or one PostgreSQL database); model
    `priced` costs $1,000 per million output tokens (1,000 micro-dollars a token) and nothing per input token;
    `priced-prompt` $100 per million prompt tokens and nothing per output token."""
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    models = f"""\
  - id: priced
    endpoint: /v1/chat/completions
    provider: {{kind: openai, base_url: '{double.url}', api_key_env: {UPSTREAM_KEY_ENV}, model: m}}
    price: {{input: 0, output: 1000}}
  - id: priced-prompt
    endpoint: /v1/chat/completions
    provider: {{kind: openai, base_url: '{double.url}', api_key_env: {UPSTREAM_KEY_ENV}, model: m}}
    price: {{input: 100, output: 0}}
"""
    config = load_upstream_config(tmp_path_factory.mktemp("budgets"), models)
    config = dataclasses.replace(config, limits=dataclasses.replace(config.limits, store=redis_server.url))
    if request.param == "postgresql":
        database = request.getfixturevalue("postgres_server").new_database()
        config = dataclasses.replace(config, key_store=StoreSettings(url=database, password_env=PASSWORD_ENV))
    servers = [await start_server(config, "127.0.0.1:0") for _ in range(2)]
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{s.port}") for s in servers]
    yield servers, [chat_service_pb2_grpc.ChatServiceStub(c) for c in channels]
    for channel in channels:
        await channel.close()
    for server in servers:
        await server.stop(0)
    os.environ.pop(UPSTREAM_KEY_ENV, None)


async def test_a_budget_of_a_cent_admits_exactly_what_its_prices_allow_across_two_hosts(hosts, double):
    double.reset()
    servers, stubs = hosts
    key, secret = await servers[0].store.create("budgeted", all_models=True, limits=KeyLimits(max_spend_day=10_000))
    # max_tokens 3: each request may cost 3,000 micro-dollars and really does, so $0.01 pays for exactly 3.
    calls = [stubs[i % 2].CreateChatCompletion(chat_request(model="priced", messages=HELLO, max_tokens=3),
                                                metadata=bearer(secret)) for i in range(8)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    answered = [r for r in results if not isinstance(r, Exception)]
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(answered) == 3 and len(refused) == 5
    assert all(r.usage.completion_tokens == 3 for r in answered)
    error = refused[0]
    detail = error_details(error)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (detail.http_status, detail.error.code, detail.error.type) == (429, "rate_limit_exceeded",
                                                                          "rate_limit_error")
    assert not detail.error.HasField("param")
    for error in refused:  # while the three ran, what they held might have come back: a retry soon may pass
        message = error_details(error).error.message
        assert message.startswith(f"Budget reached for the spend per UTC day budget of key {key.id}: "
                                  "limit $0.01, spent $0.009")
        # Some of the three may have ended by then: what is still held is $0.003 for each that runs.
        held = re.search(r"\(\$0\.00[369] of it held by requests in flight until they end\)", message)
        if held:
            assert dict(error.trailing_metadata())["retry-after"] == "1"
        else:
            assert "resets at" in message
    for server in servers:  # an answer can reach its caller before its settlement reaches Redis
        await server.limiter.settled()
    with pytest.raises(grpc.aio.AioRpcError) as caught:  # they have ended, each paying its worst case: midnight
        await stubs[0].CreateChatCompletion(chat_request(model="priced", messages=HELLO, max_tokens=3),
                                            metadata=bearer(secret))
    message = error_details(caught.value).error.message
    assert "resets at" in message and " 00:00 UTC" in message and "in flight" not in message
    assert 1 < int(dict(caught.value.trailing_metadata())["retry-after"]) <= 86_400

    # What is left of the budget, as a gauge: the host that admitted the last of the three saw $0.001 left.
    left = [s.telemetry.metrics.registry.get_sample_value("portico_budget_remaining_microdollars",
                                                           {"key_id": key.id, "budget": "day"}) for s in servers]
    assert min(v for v in left if v is not None) == 1_000

    # Each host's ledger holds its own requests; together they are the three costs the budget paid.
    for server in servers:
        await server.core.ledger.flush()
    rows = [r for r in servers[0].core.usage.rows() if r.key_id == key.id]
    assert sorted(r.cost_micros for r in rows) == [0] * 6 + [3_000] * 3
    assert sorted(r.code for r in rows if r.cost_micros == 0) == ["rate_limit_exceeded"] * 6


async def test_budgets_through_the_admin_api_are_in_dollars(hosts):
    servers, _ = hosts
    _, admin = await servers[0].store.create("budget-admin", all_models=True, admin=True)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{servers[0].port}") as channel:
        keys = key_service_pb2_grpc.KeyServiceStub(channel)
        created = await keys.CreateKey(key_pb2.CreateKeyRequest(
            name="b", all_models=True, limits=key_pb2.KeyLimits(max_spend_day=5, max_spend_month=100.25)),
            metadata=bearer(admin))
        assert (created.key.limits.max_spend_day, created.key.limits.max_spend_month) == (5.0, 100.25)
        stored = (await servers[0].store.get(created.key.id)).limits
        assert (stored.max_spend_day, stored.max_spend_month) == (5_000_000, 100_250_000)
        updated = await keys.UpdateKey(key_pb2.UpdateKeyRequest(
            id=created.key.id, limits=key_pb2.KeyLimits(max_spend_day=0)), metadata=bearer(admin))
        assert not updated.key.limits.HasField("max_spend_day")  # 0 removes it
        assert updated.key.limits.max_spend_month == 100.25
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await keys.UpdateKey(key_pb2.UpdateKeyRequest(
                id=created.key.id, limits=key_pb2.KeyLimits(max_spend_day=0.0000001)), metadata=bearer(admin))
        assert error_details(caught.value).error.param == "limits.max_spend_day"


async def test_where_a_budget_stands_is_in_dollars(hosts, double):
    double.reset()
    servers, stubs = hosts
    key, secret = await servers[0].store.create("standing", all_models=True,
                                          limits=KeyLimits(max_spend_month=5_000_000_000))  # $5,000
    _, admin = await servers[0].store.create("standing-admin", all_models=True, admin=True)
    await stubs[1].CreateChatCompletion(chat_request(model="priced", messages=HELLO, max_tokens=3),
                                        metadata=bearer(secret))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{servers[0].port}") as channel:
        status = await limit_service_pb2_grpc.LimitServiceStub(channel).GetKeyLimitStatus(
            limit_pb2.GetKeyLimitStatusRequest(id=key.id), metadata=bearer(admin))
    [month] = [s for s in status.limits if s.limit == "max_spend_month"]
    assert (month.value, month.used, month.remaining) == (5000.0, 0.003, 4999.997)
    assert month.reset_seconds > 0


async def test_a_budget_holds_when_the_upstream_counts_more_prompt_tokens_than_four_characters_make(hosts, double):
    """CJK text is about a token a character, not four characters a token: a budget reserves a prompt's worst case
    (its UTF-8 bytes and the chat template's markers), so the upstream's real count never takes it over."""
    double.reset()
    servers, stubs = hosts
    key, secret = await servers[0].store.create("cjk", all_models=True, limits=KeyLimits(max_spend_day=10_000))
    prompt = [{"role": "user", "content": "東京大阪京都"}]  # 6 characters, 18 bytes

    def a_token_a_character(body: dict) -> dict:
        answer = echo_chat({**body, "stream": False})
        answer["usage"]["prompt_tokens"] = sum(len(m["content"]) for m in body["messages"])
        return answer

    double.defaults["/v1/chat/completions"] = a_token_a_character
    try:
        answered = 0
        for i in range(25):  # each really costs 600 micro-dollars; four characters a token would reserve 200
            try:
                await stubs[i % 2].CreateChatCompletion(chat_request(model="priced-prompt", messages=prompt,
                                                                     max_tokens=1), metadata=bearer(secret))
                answered += 1
            except grpc.aio.AioRpcError as error:
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        double.defaults["/v1/chat/completions"] = echo_chat
    for server in servers:
        await server.core.ledger.flush()
    spent = sum(r.cost_micros for r in servers[0].core.usage.rows() if r.key_id == key.id)
    assert spent == 600 * answered and spent <= 10_000
    assert answered >= 11  # refused only once the worst case (34 tokens: 3,400 micro-dollars) no longer fits


async def test_a_budget_holds_when_a_json_schema_or_legacy_functions_pass_through_to_the_upstream(hosts, double):
    """An OpenAI upstream reads `response_format`'s JSON schema and the deprecated `functions` as prompt tokens,
    though the gateway passes them through unread: the worst case a budget reserves counts their bytes too, so one
    plain-text request with a big schema cannot spend many times a budget that had all of it left."""
    double.reset()
    servers, stubs = hosts
    key, secret = await servers[0].store.create("schema", all_models=True, limits=KeyLimits(max_spend_day=10_000))
    schema, functions = schema_and_functions(60, 3)

    def prompt_as_openai_counts_it(body: dict) -> dict:  # about four bytes a token, the schema and functions included
        answer = echo_chat({**body, "stream": False})
        read = {name: body[name] for name in ("messages", "response_format", "functions") if name in body}
        answer["usage"]["prompt_tokens"] = len(json.dumps(read)) // 4
        return answer

    double.defaults["/v1/chat/completions"] = prompt_as_openai_counts_it
    try:
        for extra in ({"response_format": schema}, {"functions": functions}):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await stubs[0].CreateChatCompletion(chat_request(model="priced-prompt", messages=HELLO, max_tokens=1,
                                                                 **extra), metadata=bearer(secret))
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert error_details(caught.value).error.message.startswith("Request too large")
    finally:
        double.defaults["/v1/chat/completions"] = echo_chat
    for server in servers:
        await server.core.ledger.flush()
    assert sum(r.cost_micros for r in servers[0].core.usage.rows() if r.key_id == key.id) <= 10_000
