"""The usage ledger through the real gRPC server and a real upstream that fails on cue: one row per admitted
request whatever its end, with its cost, equal to the metrics and to what the limits settled."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import os
import time

import grpc
import orjson
import pytest

from portico.v1 import organization_usage_pb2 as pb
from portico.v1 import chat_service_pb2_grpc, usage_service_pb2_grpc
from server.app import start_server

from server.domain_keys import KeyLimits
from tests.helpers import bearer, chat_request, error_details, message_request
from tests.passthrough_objects import CACHED_ANSWER_CUES
from tests.upstream_double import Cue
from server.usage.ledger import LedgerRow
from server.usage.settings import UsageSettings
from server.usage.sqlite_ledger import SqliteLedger
from tests.upstream_support import (
    FAST_RETRY, UPSTREAM_KEY, UPSTREAM_KEY_ENV, load_upstream_config, upstream_server, window_tokens,
)

HELLO = [{"role": "user", "content": "Say hello."}]  # the double answers "echo Say hello." (3 tokens; prompt 2)


def priced_models(url: str) -> str:
    common = f"kind: openai, base_url: '{url}', api_key_env: {UPSTREAM_KEY_ENV}"
    anthropic = f"kind: anthropic, base_url: '{url.removesuffix('/v1')}', api_key_env: {UPSTREAM_KEY_ENV}"
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
  - id: up-claude
    endpoint: /v1/messages
    provider: {{{anthropic}, model: claude-up}}
    price: {{input: 3, output: 15, cached_input: 0.3, cache_write: 3.75, cache_write_1h: 6, web_search: 0.01}}
"""


@pytest.fixture(scope="module")
async def running(double, tmp_path_factory):
    async with upstream_server(tmp_path_factory.mktemp("ledger"), priced_models(double.url)) as server:
        yield server


def metric(running, name: str, **labels) -> float:
    return running.telemetry.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_prompt_cache_reads_and_writes_are_charged_at_their_own_prices(messages, running, double):
    """Anthropic bills tokens written to its prompt cache above input, and reads below: 10 plain, 100 written and
    2,000 read prompt tokens and 1 output token cost 10*3 + 100*3.75 + 2000*0.3 + 1*15 = 1,020 micro-dollars."""
    double.reset()
    key, secret = await running.store.create("cache-prices", all_models=True)
    double.cue(*CACHED_ANSWER_CUES)  # a JSON answer, then the same streamed
    await messages.CreateMessage(message_request(model="up-claude"), metadata=bearer(secret))
    [event async for event in messages.StreamMessage(message_request(model="up-claude"), metadata=bearer(secret))]
    await running.core.ledger.flush()
    rows = [r for r in running.core.usage.rows() if r.key_id == key.id]
    assert [(r.status, r.input_tokens, r.cached_input_tokens, r.output_tokens, r.cost_micros) for r in rows] == [
        (200, 2110, 2000, 1, 1020)] * 2


async def test_a_cached_prompt_cut_short_is_charged_at_its_cache_prices(messages, running, double):
    """A stream cut short (its caller gone, or the upstream breaking off) is settled with what came: Anthropic said
    in `message_start` that 2,000 prompt tokens were read from its cache and 100 written to it, so they cost their
    own prices, as in the whole answer, not 2,110 tokens at the input price (6,345 micro-dollars, six times the
    1,020 the upstream bills)."""
    double.reset()
    key, secret = await running.store.create("cache-prices-cut", all_models=True)
    frames = CACHED_ANSWER_CUES[1].frames
    double.cue(Cue(frames=frames, drop_after=3),  # message_start, the text block and "Hi"; then the connection drops
               Cue(frames=frames, frame_delay=0.5))  # its caller leaves after "Hi"
    cut = messages.StreamMessage(message_request(model="up-claude"), metadata=bearer(secret))
    with pytest.raises(grpc.aio.AioRpcError):  # UNAVAILABLE after the events that came (REST: an error event)
        [event async for event in cut]
    left = messages.StreamMessage(message_request(model="up-claude"), metadata=bearer(secret))
    while "Hi" not in str(await left.read()):
        pass
    left.cancel()
    deadline = time.monotonic() + 10
    while len([r for r in running.core.usage.rows() if r.key_id == key.id]) < 2 and time.monotonic() < deadline:
        await running.core.ledger.flush()
        await asyncio.sleep(0.05)
    rows = [r for r in running.core.usage.rows() if r.key_id == key.id]
    assert [(r.status, r.code, r.input_tokens, r.cached_input_tokens, r.output_tokens, r.cost_micros) for r in rows] == [
        (502, "upstream_error", 2110, 2000, 1, 1020), (499, "cancelled", 2110, 2000, 1, 1020)]
    assert metric(running, "portico_spend_microdollars_total", model="up-claude", key_id=key.id) == 2 * 1020


async def test_one_hour_cache_writes_of_a_stream_cut_short_cost_their_own_price(messages, running, double):
    """Anthropic's message_start splits the 100 written tokens by TTL (`cache_creation`): 70 written for an hour
    cost `cache_write_1h` (6), not `cache_write` (3.75), also when the stream breaks off after the first text:
    10*3 + 2000*0.3 + 30*3.75 + 70*6 + 1*15 = 1,178 micro-dollars, where 1,020 was charged."""
    double.reset()
    key, secret = await running.store.create("cache-1h-cut", all_models=True)
    frames = CACHED_ANSWER_CUES[1].frames
    start = orjson.loads(frames[0].split(b"data: ", 1)[1])
    start["message"]["usage"]["cache_creation"] = {"ephemeral_5m_input_tokens": 30, "ephemeral_1h_input_tokens": 70}
    double.cue(Cue(frames=[f"event: message_start\ndata: {orjson.dumps(start).decode()}\n\n".encode(), *frames[1:]],
                   drop_after=3))
    with pytest.raises(grpc.aio.AioRpcError):
        [event async for event in messages.StreamMessage(message_request(model="up-claude"), metadata=bearer(secret))]
    await running.core.ledger.flush()
    rows = [r for r in running.core.usage.rows() if r.key_id == key.id]
    assert [(r.status, r.input_tokens, r.cached_input_tokens, r.output_tokens, r.cost_micros) for r in rows] == [
        (502, 2110, 2000, 1, 1178)]


async def test_web_searches_are_charged_per_search(messages, running, double):
    """Anthropic bills its web search tool $10 per 1,000 searches: 3 searches add 30,000 micro-dollars to the
    row's cost, JSON and streamed (message_delta's count), where they cost nothing before."""
    double.reset()
    key, secret = await running.store.create("web-search", all_models=True)
    json_cue, stream_cue = CACHED_ANSWER_CUES
    searched = {**json_cue.body, "usage": {**json_cue.body["usage"], "server_tool_use": {"web_search_requests": 3}}}
    frames = [*stream_cue.frames]
    delta = orjson.loads(frames[-2].split(b"data: ", 1)[1])
    delta["usage"]["server_tool_use"] = {"web_search_requests": 3}
    frames[-2] = f"event: message_delta\ndata: {orjson.dumps(delta).decode()}\n\n".encode()
    double.cue(Cue(body=searched), Cue(frames=frames))
    await messages.CreateMessage(message_request(model="up-claude"), metadata=bearer(secret))
    [event async for event in messages.StreamMessage(message_request(model="up-claude"), metadata=bearer(secret))]
    await running.core.ledger.flush()
    rows = [r for r in running.core.usage.rows() if r.key_id == key.id]
    assert [(r.status, r.cost_micros) for r in rows] == [(200, 1020 + 3 * 10_000)] * 2


async def test_a_budget_removed_from_a_key_leaves_its_gauge_at_the_keys_next_request(chat, running, double):
    """portico_budget_remaining_microdollars of a budget the operator removed stayed at its last value for good (an
    alert on a spent budget kept firing for a key that had none any more): it goes once the key's next request ends
    without it, as the budget's own series changes with each request."""
    double.reset()
    key, secret = await running.store.create("gauge-gone", all_models=True,
                                             limits=KeyLimits(max_spend_day=10_000, max_spend_month=20_000))
    ask = lambda: chat.CreateChatCompletion(chat_request(model="up-main", messages=HELLO),  # noqa: E731
                                            metadata=bearer(secret))
    gauge = lambda budget: metric(running, "portico_budget_remaining_microdollars",  # noqa: E731
                                  key_id=key.id, budget=budget) or None
    await ask()  # 27 micro-dollars
    await running.limiter.settled()
    assert (gauge("day"), gauge("month")) == (10_000 - 27, 20_000 - 27)
    await running.store.update(key.id, limits={"max_spend_day": None})
    await asyncio.sleep(1.1)  # keys.cache_seconds: the change is seen
    await ask()
    await running.limiter.settled()
    assert (gauge("day"), gauge("month")) == (None, 20_000 - 54)


async def test_every_admitted_request_has_one_row_equal_to_metrics_and_limits(chat, running, double):
    double.reset()
    key, secret = await running.store.create("ledger", all_models=True, env="team-a",
                                       limits=KeyLimits(requests_per_minute=5))
    ask = lambda model="up-main", **f: chat.CreateChatCompletion(  # noqa: E731
        chat_request(model=model, messages=HELLO, **f), metadata=bearer(secret))
    double.cue(*[Cue(500, {"error": {"message": "boom"}})] * 3)  # fails: 502 after its retries (a request, no tokens)
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
    with pytest.raises(grpc.aio.AioRpcError) as refused:  # a 6th in the minute (the 502 counts): a row, no cost
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
    assert summary[3] == ("up-main", "up-backup", 200, "", 2, 3, 500)  # at the price of the model that answered
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
    counts = await running.limiter.store.counts(key.id)  # every request that reached a model, the 502 included
    assert len(counts.window) == counts.day_requests == sum(1 for r in rows if r.upstream_attempts) == 5


async def usage_json(channel, secret: str, rpc: str = "GetCompletionsUsageHttp", **fields) -> dict:
    stub = usage_service_pb2_grpc.UsageServiceStub(channel)
    request_type = {"GetCostsHttp": pb.GetCostsRequest, "ListRequestsHttp": pb.ListRequestsRequest}.get(
        rpc, pb.GetCompletionsUsageRequest)
    body = await getattr(stub, rpc)(request_type(**fields), metadata=bearer(secret))
    assert body.content_type == "application/json"
    return orjson.loads(body.data)


async def test_the_usage_api_sums_to_the_ledger_in_openais_shape(chat, channel, running, double):
    double.reset()
    admin, admin_secret = await running.store.create("usage-admin", all_models=True, admin=True)
    keys = [await running.store.create(f"u{i}", all_models=True, env=f"env-{i}") for i in range(2)]
    for (key, secret), asks in zip(keys, (2, 1)):
        for _ in range(asks):
            await chat.CreateChatCompletion(chat_request(model="up-main", messages=HELLO), metadata=bearer(secret))
    await running.core.ledger.flush()
    ours = {key.id for key, _ in keys}
    rows = [r for r in running.core.usage.rows() if r.key_id in ours]
    start = min(r.at_ms for r in rows) // 1000

    page = await usage_json(channel, admin_secret, start_time=start, bucket_width="1h",
                            group_by=["api_key_id", "model"], api_key_ids=sorted(ours))
    assert page["object"] == "page" and page["has_more"] is False and page["next_page"] is None
    bucket = page["data"][0]
    assert bucket["object"] == "bucket" and bucket["start_time"] == start - start % 3600
    assert bucket["end_time"] == bucket["start_time"] + 3600
    results = {r["api_key_id"]: r for r in bucket["results"]}
    assert set(results) == ours
    first = results[keys[0][0].id]
    latency = first.pop("latency_ms_p50"), first.pop("latency_ms_p95")  # Portico's own, estimated (latency.py)
    assert 0 < latency[0] <= latency[1]
    assert first == {
        "object": "organization.usage.completions.result", "input_tokens": 4, "output_tokens": 6,
        "input_cached_tokens": 0, "input_audio_tokens": 0, "output_audio_tokens": 0, "num_model_requests": 2,
        "project_id": None, "user_id": None, "api_key_id": keys[0][0].id, "model": "up-main", "batch": None,
        "num_requests": 2, "num_errors": 0,
    }
    costs = await usage_json(channel, admin_secret, "GetCostsHttp", start_time=start, group_by=["project_id"],
                             api_key_ids=sorted(ours))
    results = costs["data"][0]["results"]
    assert {r["project_id"]: r["amount"] for r in results} == {
        "env-0": {"value": 54e-6, "currency": "usd"}, "env-1": {"value": 27e-6, "currency": "usd"}}
    assert sum(r["amount_microdollars"] for r in results) == sum(r.cost_micros for r in rows)
    assert results[0]["object"] == "organization.costs.result" and results[0]["line_item"] is None

    # A key that is not an admin sees only its own usage, and may not ask for another's.
    mine = await usage_json(channel, keys[1][1], start_time=start)
    assert [(r["input_tokens"], r["num_model_requests"]) for r in mine["data"][0]["results"]] == [(2, 1)]
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await usage_json(channel, keys[1][1], start_time=start, api_key_ids=[keys[0][0].id])
    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED

    # The typed RPC answers the same data; ungrouped fields are unset.
    stub = usage_service_pb2_grpc.UsageServiceStub(channel)
    typed = await stub.GetCompletionsUsage(pb.GetCompletionsUsageRequest(start_time=start), metadata=bearer(keys[0][1]))
    result = typed.data[0].results[0]
    assert (result.input_tokens, result.output_tokens, result.num_model_requests) == (4, 6, 2)
    assert not result.HasField("model") and not result.HasField("api_key_id")


async def test_usage_pages_and_bad_parameters(channel, running):
    key, secret = await running.store.create("pages", all_models=True)
    now = int(time.time())
    first = await usage_json(channel, secret, start_time=now - 3 * 60, bucket_width="1m", limit=2)
    assert len(first["data"]) == 2 and first["has_more"] is True
    assert [b["results"] for b in first["data"]] == [[], []]  # empty buckets are listed too
    second = await usage_json(channel, secret, start_time=now - 3 * 60, bucket_width="1m", limit=2,
                              page=first["next_page"])
    assert second["data"][0]["start_time"] == first["data"][1]["end_time"]
    assert second["has_more"] is False and second["next_page"] is None
    for fields, param in (({}, "start_time"), ({"start_time": now, "bucket_width": "2d"}, "bucket_width"),
                          ({"start_time": now, "group_by": ["colour"]}, "group_by"),
                          ({"start_time": now, "limit": 32}, "limit"), ({"start_time": now, "page": "x"}, "page"),
                          ({"start_time": now, "end_time": now - 5}, "end_time")):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await usage_json(channel, secret, **fields)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_details(caught.value).error.param == param


@pytest.mark.parametrize("rpc", ["GetCompletionsUsageHttp", "GetCostsHttp"])
async def test_a_page_holds_whole_buckets_up_to_a_bounded_number_of_results(channel, running, monkeypatch, rpc):
    """A page held every result of its `limit` buckets: a quarter's costs by key and model of 2,200 active keys grew
    the server by 800 MB and ended after 10 s in a 429 rate_limit_exceeded ("Sent message larger than max"). A page
    now ends before the bucket that would take it past the bound, and next_page goes on from there; a bucket
    alone past it is answered whole."""
    monkeypatch.setattr("server.services.usage.MAX_PAGE_RESULTS", 5)
    admin, secret = await running.store.create(f"pages-admin-{rpc}", all_models=True, admin=True)
    day = 1_600_041_600  # a UTC midnight in 2020: no other test's rows
    per_day = (4, 4, 7)
    running.core.usage.write([
        LedgerRow(id=f"pg-{rpc}-{d}-{k}", at_ms=(day + d * 86_400) * 1000, request_id="r", key_id=f"key_{k}", env="",
                  endpoint="/v1/chat/completions", model="m", upstream="m", status=200, code="", input_tokens=1,
                  output_tokens=1, cached_input_tokens=0, images=0, cost_micros=1, upstream_attempts=1,
                  latency_ms=1.0, first_token_ms=None)
        for d, keys in enumerate(per_day) for k in range(keys)])
    pages, page = [], ""
    while True:
        answer = await usage_json(channel, secret, rpc, start_time=day, end_time=day + 3 * 86_400, limit=3,
                                  group_by=["api_key_id"], page=page)
        pages.append([len(bucket["results"]) for bucket in answer["data"]])
        if not answer["has_more"]:
            break
        page = answer["next_page"]
    assert pages == [[4], [4], [7]]


@pytest.mark.parametrize("rpc", ["GetCompletionsUsageHttp", "GetCostsHttp"])
async def test_a_bucket_past_the_most_a_page_can_carry_is_refused_naming_bucket_width(channel, running, monkeypatch,
                                                                                       rpc):
    """A bucket past a page's bound is answered whole, but one of 210,000 results (bucket_width=all by key and model,
    the console's table) took 71 MB, past gRPC's 64 MiB: a 429 rate_limit_exceeded "SERVER: Sent message larger
    than max". Now a 400 naming bucket_width, saying what to ask instead."""
    monkeypatch.setattr("server.services.usage.MAX_BUCKET_RESULTS", 5)
    admin, secret = await running.store.create(f"bucket-admin-{rpc}", all_models=True, admin=True)
    day = 1_600_300_800  # a UTC midnight in 2020: no other test's rows
    running.core.usage.write([
        LedgerRow(id=f"bk-{rpc}-{k}", at_ms=(day + 60) * 1000, request_id="r", key_id=f"key_{k}", env="",
                  endpoint="/v1/chat/completions", model="m", upstream="m", status=200, code="", input_tokens=1,
                  output_tokens=1, cached_input_tokens=0, images=0, cost_micros=1, upstream_attempts=1,
                  latency_ms=1.0, first_token_ms=None) for k in range(6)])
    fields = {"start_time": day, "end_time": day + 86_400, "group_by": ["api_key_id"]}
    for width in ("all", "1d"):
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await usage_json(channel, secret, rpc, bucket_width=width, **fields)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_details(caught.value).error.param == "bucket_width"
        assert caught.value.details().startswith("A bucket of this query holds more than 5 results"), caught.value
    assert len((await usage_json(channel, secret, rpc, **(fields | {"group_by": []})))["data"][0]["results"]) == 1


@pytest.mark.parametrize("rpc", ["GetCompletionsUsageHttp", "GetCostsHttp", "ListRequestsHttp"])
async def test_times_out_of_range_are_refused_naming_them(channel, running, rpc):
    """On SQLite such times were a 500 (an integer too big for it), on PostgreSQL a 200: now both stores refuse."""
    key, secret = await running.store.create(f"range-{rpc}", all_models=True)
    biggest, row = 2**63 - 1, base64.urlsafe_b64encode(f"{2**63}:x".encode()).decode()
    cases = [({"start_time": 0, "end_time": biggest}, "end_time"), ({"start_time": biggest - 1}, "start_time"),
             ({"start_time": -1, "end_time": 10}, "start_time"), ({"start_time": 10, "end_time": 10}, "end_time")]
    if rpc == "ListRequestsHttp":
        cases.append(({"page": "page_" + row}, "page"))
    for fields, param in cases:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await usage_json(channel, secret, rpc, **fields)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT, caught.value.details()
        assert error_details(caught.value).error.param == param
    assert (await usage_json(channel, secret, rpc, start_time=0, end_time=253_402_300_800))["data"] is not None


async def test_recent_requests_newest_first_in_pages(chat, channel, running, double):
    double.reset()
    key, secret = await running.store.create("recent", all_models=True, env="e")
    other, other_secret = await running.store.create("recent-other", all_models=True)
    for _ in range(3):
        await chat.CreateChatCompletion(chat_request(model="up-main", messages=HELLO), metadata=bearer(secret))
    double.cue(*[Cue(500, {"error": {"message": "boom"}})] * 3)
    with pytest.raises(grpc.aio.AioRpcError):
        await chat.CreateChatCompletion(chat_request(model="up-solo", messages=HELLO), metadata=bearer(secret))
    await chat.CreateChatCompletion(chat_request(model="up-main", messages=HELLO), metadata=bearer(other_secret))
    await running.core.ledger.flush()
    stored = [r for r in running.core.usage.rows() if r.key_id == key.id]

    first = await usage_json(channel, secret, "ListRequestsHttp", limit=3)
    assert first["object"] == "list" and first["has_more"] is True
    assert [r["id"] for r in first["data"]] == [r.id for r in reversed(stored)][:3]
    newest = first["data"][0]
    assert newest | {"latency_ms": 0, "created": 0, "id": "", "request_id": ""} == {
        "object": "organization.request", "id": "", "request_id": "", "created": 0, "api_key_id": key.id,
        "project_id": "e", "endpoint": "/v1/chat/completions", "model": "up-solo", "upstream": "up-solo",
        "status": 502, "code": "upstream_error", "input_tokens": 0, "output_tokens": 0, "input_cached_tokens": 0,
        "images": 0, "cost": {"value": 0.0, "currency": "usd"}, "cost_microdollars": 0, "latency_ms": 0,
        "first_token_ms": None, "deployment": "openai"}  # a plain provider: one deployment named by its kind
    rest = await usage_json(channel, secret, "ListRequestsHttp", limit=3, page=first["next_page"])
    assert [r["id"] for r in rest["data"]] == [stored[0].id] and rest["has_more"] is False
    errors = await usage_json(channel, secret, "ListRequestsHttp", errors_only=True)
    assert [r["status"] for r in errors["data"]] == [502]
    stub = usage_service_pb2_grpc.UsageServiceStub(channel)
    typed = await stub.ListRequests(pb.ListRequestsRequest(limit=1), metadata=bearer(other_secret))
    assert [(r.api_key_id, r.cost_microdollars) for r in typed.data] == [(other.id, 27)]


async def test_a_request_no_model_answered_has_null_upstream_and_deployment(chat, channel, running, double):
    """A request refused at admission reached no model: its row said `"upstream": ""` beside `"deployment": null`,
    two spellings of one fact in one row (a cache hit's row too), where OpenAI-shaped JSON says null."""
    double.reset()
    key, secret = await running.store.create("refused-row", all_models=True,
                                             limits=KeyLimits(requests_per_minute=1))
    await chat.CreateChatCompletion(chat_request(model="up-main", messages=HELLO), metadata=bearer(secret))
    with pytest.raises(grpc.aio.AioRpcError):
        await chat.CreateChatCompletion(chat_request(model="up-main", messages=HELLO), metadata=bearer(secret))
    await running.core.ledger.flush()
    refused, answered = (await usage_json(channel, secret, "ListRequestsHttp"))["data"]
    assert (refused["status"], refused["upstream"], refused["deployment"]) == (429, None, None)
    assert (answered["status"], answered["upstream"], answered["deployment"]) == (200, "up-main", "openai")


async def test_typed_costs_are_exact_integers_and_rest_keeps_its_shape(channel, running):
    key, secret = await running.store.create("big-spender", all_models=True)
    exact = 2**53 + 1  # micro-dollars; a double reads it back as 2**53
    row = LedgerRow(id=f"big-{key.id}", at_ms=int(time.time() * 1000), request_id="req-big", key_id=key.id, env="",
                    endpoint="/v1/chat/completions", model="up-main", upstream="up-main", status=200, code="",
                    input_tokens=1, output_tokens=1, cached_input_tokens=0, images=0, cost_micros=exact,
                    upstream_attempts=1, latency_ms=1.0, first_token_ms=None)
    running.core.usage.write([row])
    start = row.at_ms // 1000
    stub = usage_service_pb2_grpc.UsageServiceStub(channel)
    costs = await stub.GetCosts(pb.GetCostsRequest(start_time=start), metadata=bearer(secret))
    (result,) = costs.data[0].results
    assert result.amount_micros == exact and int(result.amount_microdollars) != exact
    (record,) = (await stub.ListRequests(pb.ListRequestsRequest(start_time=start), metadata=bearer(secret))).data
    assert record.cost_micros == exact
    # REST answers as documented: the exact integer as a JSON number, and no int64 (which would print as a string).
    (rest,) = (await usage_json(channel, secret, "GetCostsHttp", start_time=start))["data"][0]["results"]
    assert rest["amount_microdollars"] == exact and "amount_micros" not in rest
    (rest,) = (await usage_json(channel, secret, "ListRequestsHttp", start_time=start))["data"]
    assert rest["cost_microdollars"] == exact and "cost_micros" not in rest


async def test_rows_still_queued_are_written_when_the_server_stops(tmp_path, double):
    """The writer would wait an hour; stopping the server (the end of a drain) writes the row."""
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    config = load_upstream_config(tmp_path, priced_models(double.url))
    config = dataclasses.replace(config, usage=UsageSettings(flush_seconds=3600))
    server = await start_server(config, "127.0.0.1:0")
    try:
        key, secret = await server.store.create("drained", all_models=True)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            await chat_service_pb2_grpc.ChatServiceStub(channel).CreateChatCompletion(
                chat_request(model="up-main", messages=HELLO), metadata=bearer(secret))
        assert server.core.ledger.pending == 1
    finally:
        await server.stop(0)
        os.environ.pop(UPSTREAM_KEY_ENV, None)
    ledger = SqliteLedger(config.data_dir / "keys.db")
    assert [(r.key_id, r.cost_micros) for r in ledger.rows()] == [(key.id, 27)]
    ledger.close()
