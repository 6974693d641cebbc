"""The response cache through the real gRPC server, against a real HTTP upstream: hits and misses for JSON and
streams on both dialects (the same framing replayed), per key unless shared, no-cache / no-store, errors never
cached, a hit counted as a request with no tokens, entries that expire or are too large."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import signal
import time
from pathlib import Path

import grpc
import orjson
import pytest

from portico.v1 import chat_service_pb2_grpc
from server.app import start_server
from server.config import load_config
from server.domain_keys import KeyLimits
from server.limits.redis_pipe import RedisPipe
from tests.helpers import bearer, chat_body, chat_request, http_body, message_body, sse_frames
from tests.upstream_double import Cue
from tests.upstream_support import UPSTREAM_KEY, UPSTREAM_KEY_ENV, upstream_server, window_tokens, write_config

HELLO = [{"role": "user", "content": "Say hello."}]


def models(url: str) -> str:
    openai = f"kind: openai, base_url: '{url}', api_key_env: {UPSTREAM_KEY_ENV}, model: m, retry: {{attempts: 1}}"
    anthropic = openai.replace("kind: openai", "kind: anthropic").replace(url, url.removesuffix("/v1"))
    return f"""\
  - {{id: cached-chat, endpoint: /v1/chat/completions, provider: {{{openai}}}, cache: {{ttl_seconds: 60}}}}
  - {{id: cached-messages, endpoint: /v1/messages, provider: {{{anthropic}}}, cache: {{}}}}
  - {{id: shared-chat, endpoint: /v1/chat/completions, provider: {{{openai}}}, cache: {{shared: true}}}}
  - {{id: brief-chat, endpoint: /v1/chat/completions, provider: {{{openai}}}, cache: {{ttl_seconds: 0.3}}}}
  - {{id: small-chat, endpoint: /v1/chat/completions, provider: {{{openai}}}, cache: {{max_entry_bytes: 100}}}}
  - {{id: plain-chat, endpoint: /v1/chat/completions, provider: {{{openai}}}}}
  - {{id: priced-chat, endpoint: /v1/chat/completions, provider: {{{openai}}}, cache: {{}}, price: {{input: 1000}}}}
  - {{id: cached-embedded, endpoint: /v1/chat/completions, provider: {{kind: llamacpp}}, cache: {{}}}}
  - {{id: cached-messages-on-openai, endpoint: /v1/messages, provider: {{{openai}}}, cache: {{}}}}
"""


@pytest.fixture(scope="module")
async def running(double, tmp_path_factory):
    async with upstream_server(tmp_path_factory.mktemp("cache"), models(double.url)) as server:
        yield server


@pytest.fixture
async def other_key(running):
    return (await running.store.create("other", all_models=True, limits=KeyLimits(tokens_per_minute=10**6)))[1]


async def chat_http(chat, secret, *, headers=(), **fields):
    """(x-portico-cache, the body bytes) of a chat completion through the REST RPC."""
    call = chat.CreateChatCompletionHttp(http_body(chat_body(messages=HELLO, **fields)),
                                         metadata=(*bearer(secret), *headers))
    metadata = dict(await call.initial_metadata())
    bodies = [body async for body in call]
    return metadata.get("x-portico-cache"), b"".join(b.data for b in bodies), bodies


async def message_http(messages, secret, **fields):
    call = messages.CreateMessageHttp(http_body(message_body(messages=HELLO, **fields)), metadata=bearer(secret))
    metadata = dict(await call.initial_metadata())
    bodies = [body async for body in call]
    return metadata.get("x-portico-cache"), b"".join(b.data for b in bodies), bodies


async def answers_across_restarts(tmp_path, redis_url: str, configs: list[tuple[str, str]], *, model: str,
                                  **chat) -> list[str]:
    """The x-portico-cache answer to one request for `model` from a server started afresh on each configuration in
    turn (its catalog, and settings added to the file), all on one data dir and one Redis cache."""
    answers = []
    for catalog, settings in configs:
        path = write_config(tmp_path, catalog, data_dir=tmp_path / "shared-data")
        path.write_text(path.read_text() + settings + f"limits: {{store: '{redis_url}'}}\n")
        server = await start_server(load_config(path), "127.0.0.1:0")
        try:
            secret = (await server.store.create("restarted", all_models=True))[1]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = chat_service_pb2_grpc.ChatServiceStub(channel)
                answers.append((await chat_http(stub, secret, model=model, **chat))[0])
        finally:
            await server.stop(0)
    return answers


def config_with(tmp_path, double, settings: str, **where) -> Path:
    """The file of this module's catalog on `double`, with `settings` added (a Redis limits.store, an access log),
    the upstream key set."""
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    path = write_config(tmp_path, models(double.url), **where)
    path.write_text(path.read_text() + settings)
    return path


def without_ids(data: bytes) -> bytes:
    """An answer with Portico's fresh id and created time blanked: a replay has new ones, like any answer."""
    text = re.sub(r'"id":"[^"]+"', '"id":"-"', data.decode())
    return re.sub(r'"created":\d+', '"created":0', text).encode()


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_json_and_streams_are_replayed_with_the_same_framing(chat, running, double, key, stream):
    key_id, secret = key
    first = await chat_http(chat, secret, model="cached-chat", stream=stream)
    tokens = window_tokens(running, key_id)
    second = await chat_http(chat, secret, model="cached-chat", stream=stream)
    assert (first[0], second[0]) == ("miss", "hit")
    assert len(double.seen) == 1  # the second never reached the upstream
    assert without_ids(second[1]) == without_ids(first[1])
    if stream:
        assert sse_frames(second[2])[-1] == b"data: [DONE]\n\n"
    assert window_tokens(running, key_id) == tokens  # a hit uses no tokens


@pytest.mark.parametrize("stream", [False, True])
async def test_messages_json_and_streams_are_replayed(messages, double, key, stream):
    first = await message_http(messages, key[1], model="cached-messages", stream=stream)
    second = await message_http(messages, key[1], model="cached-messages", stream=stream)
    assert (first[0], second[0]) == ("miss", "hit") and len(double.seen) == 1
    assert without_ids(second[1]) == without_ids(first[1])
    if stream:
        assert b"event: message_stop" in second[1]


async def test_a_tool_call_id_the_gateway_made_up_is_replayed_as_it_was_given(messages, double, key):
    """An OpenAI-compatible server's call without an id gets one of the gateway's, new for each answer: a hit replays
    the one its caller was given (the cache keeps the answer's events), another request gets another."""
    call = {"type": "function", "function": {"name": "weather", "arguments": "{}"}}
    whole = {"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "m",
             "usage": {"prompt_tokens": 5, "completion_tokens": 4},
             "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                 "role": "assistant", "content": None, "tool_calls": [call]}}]}
    double.cue(Cue(body=whole), Cue(body=whole))
    tools = [{"name": "weather", "input_schema": {"type": "object"}}]
    ids = []
    for text in ("Oslo?", "Oslo?", "Bergen?"):
        body = message_body(model="cached-messages-on-openai", tools=tools,
                            messages=[{"role": "user", "content": text}])
        call = messages.CreateMessageHttp(http_body(body), metadata=bearer(key[1]))
        cache = dict(await call.initial_metadata()).get("x-portico-cache")
        ids.append((cache, orjson.loads(b"".join([b.data async for b in call]))["content"][0]["id"]))
    assert [cache for cache, _ in ids] == ["miss", "hit", "miss"] and len(double.seen) == 2
    assert ids[0][1] == ids[1][1] != ids[2][1] and all(re.fullmatch(r"call_[A-Za-z0-9]{24}", i) for _, i in ids), ids


@pytest.mark.parametrize("thread", [{"type": "create"}, {"type": "continue", "id": "thread_1"}])
async def test_a_threaded_message_is_never_answered_from_the_cache(messages, double, key, thread):
    """A `thread` is a conversation the upstream holds: the same request is the next turn of a longer one each time
    (`continue`), or the start of a new thread (`create`). A second one was replayed from the cache: the upstream's
    message id of the first answer (which names its thread's turn) reached another caller, and the thread never
    heard of the turn. Such a request is no cache question: asked of the upstream each time, and never stored."""
    answers = [await message_http(messages, key[1], model="cached-messages", thread=thread) for _ in range(2)]
    assert [cache for cache, _, _ in answers] == [None, None]
    assert len(double.seen) == 2
    assert (await message_http(messages, key[1], model="cached-messages"))[0] == "miss"  # nor stored as another's


async def test_a_json_answer_does_not_answer_a_stream(chat, double, key):
    await chat_http(chat, key[1], model="cached-chat")
    assert (await chat_http(chat, key[1], model="cached-chat", stream=True))[0] == "miss"


async def test_labels_do_not_shape_the_key_but_sampling_does(chat, double, key):
    await chat_http(chat, key[1], model="cached-chat", user="a", metadata={"k": "1"})
    assert (await chat_http(chat, key[1], model="cached-chat", user="b"))[0] == "hit"
    assert (await chat_http(chat, key[1], model="cached-chat", temperature=0.5))[0] == "miss"
    assert (await chat_http(chat, key[1], model="cached-chat", tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]))[0] == "miss"


async def test_answers_are_per_key_unless_the_model_shares_them(chat, double, key, other_key):
    await chat_http(chat, key[1], model="cached-chat")
    assert (await chat_http(chat, other_key, model="cached-chat"))[0] == "miss"
    await chat_http(chat, key[1], model="shared-chat")
    assert (await chat_http(chat, other_key, model="shared-chat"))[0] == "hit"


async def test_no_cache_skips_the_lookup_and_no_store_the_storing(chat, double, key):
    await chat_http(chat, key[1], model="cached-chat", seed=1)
    assert (await chat_http(chat, key[1], model="cached-chat", seed=1, headers=[("cache-control", "no-cache")]))[
        0] == "miss"
    assert len(double.seen) == 2
    await chat_http(chat, key[1], model="cached-chat", seed=2, headers=[("cache-control", "no-store")])
    assert (await chat_http(chat, key[1], model="cached-chat", seed=2))[0] == "miss"


async def test_errors_are_never_cached(chat, double, key):
    double.cue(Cue(500, {"error": {"message": "boom"}}))
    with pytest.raises(grpc.aio.AioRpcError):
        await chat_http(chat, key[1], model="cached-chat", seed=3)
    status, body, _ = await chat_http(chat, key[1], model="cached-chat", seed=3)
    assert status == "miss" and b"echo Say hello." in body
    double.cue(Cue(frames=[b'data: {"choices":[{"index":0,"delta":{"content":"half"}}]}\n\n'], drop_after=1))
    call = chat.CreateChatCompletionHttp(http_body(chat_body(model="cached-chat", messages=HELLO, seed=4,
                                                             stream=True)), metadata=bearer(key[1]))
    assert b"error" in b"".join([b.data async for b in call])  # cut mid-stream: the error event
    assert (await chat_http(chat, key[1], model="cached-chat", seed=4, stream=True))[0] == "miss"


async def typed_odd_answers(chat, double, secret: str, seed: int) -> None:
    """Two typed calls answered with a value of the wrong type for the message: each a 502 from the upstream."""
    odd = {"id": "x", "object": "chat.completion", "created": 1, "model": "m", "system_fingerprint": {"a": 1},
           "choices": [{"index": 0, "message": {"role": "assistant", "content": "odd"}, "finish_reason": "stop"}],
           "usage": {"prompt_tokens": 1, "completion_tokens": 1}}
    double.reset()
    double.cue(Cue(body=odd), Cue(body=odd))
    for _ in range(2):
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await chat.CreateChatCompletion(chat_request(model="cached-chat", messages=HELLO, seed=seed),
                                            metadata=bearer(secret))
        assert "does not fit the typed" in failed.value.details()
    assert len(double.seen) == 2


async def test_an_answer_a_typed_caller_could_not_be_given_is_not_replayed(chat, double, key, tmp_path,
                                                                           redis_server):
    """A typed gRPC caller gets a 502 for an upstream value of the wrong type for the message (a REST caller gets it
    as it came), after the answer had been kept whole: each same request got that 502 again from the cache, the
    upstream never asked, for ttl_seconds. The answer is now dropped, and the next one asks the upstream. In the
    process and in Redis."""
    await typed_odd_answers(chat, double, key[1], seed=41)
    path = config_with(tmp_path, double, f"limits: {{store: '{redis_server.url}'}}\n")
    server = await start_server(load_config(path), "127.0.0.1:0")
    try:
        secret = (await server.store.create("typed", all_models=True))[1]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            await typed_odd_answers(chat_service_pb2_grpc.ChatServiceStub(channel), double, secret, seed=42)
    finally:
        await server.stop(0)
        os.environ.pop(UPSTREAM_KEY_ENV, None)


async def test_entries_expire_and_large_answers_are_not_kept(chat, double, key):
    await chat_http(chat, key[1], model="brief-chat")
    assert (await chat_http(chat, key[1], model="brief-chat"))[0] == "hit"
    await asyncio.sleep(0.35)
    assert (await chat_http(chat, key[1], model="brief-chat"))[0] == "miss"
    await chat_http(chat, key[1], model="small-chat")
    assert (await chat_http(chat, key[1], model="small-chat"))[0] == "miss"


async def test_identical_requests_at_once_each_ask_the_upstream_and_one_answer_is_kept(chat, double, key):
    """No coalescing (configuration.md, Response cache): requests that arrive while the first is still answered are
    misses, each answered by the upstream; the next after them is a hit."""
    double.reset()
    double.default_cue = Cue(delay=0.3)
    try:
        answers = await asyncio.gather(*[chat_http(chat, key[1], model="cached-chat", seed=31) for _ in range(5)])
    finally:
        double.default_cue = Cue()
    assert [answer[0] for answer in answers] == ["miss"] * 5 and len(double.seen) == 5
    assert (await chat_http(chat, key[1], model="cached-chat", seed=31))[0] == "hit" and len(double.seen) == 5


async def test_models_without_a_cache_say_nothing(chat, double, key):
    assert (await chat_http(chat, key[1], model="plain-chat"))[0] is None
    await chat_http(chat, key[1], model="plain-chat")
    assert len(double.seen) == 2


async def test_a_hit_costs_nothing_so_no_budget_refuses_it(chat, running, double):
    """Also once a request that cost more than it reserved (an upstream counting a prompt Portico does not read)
    took the key over its budget: that key's next new request is refused, its repeated one answered."""
    _, secret = await running.store.create("budgeted", all_models=True, limits=KeyLimits(max_spend_day=100_000))
    assert (await chat_http(chat, secret, model="priced-chat", seed=21))[0] == "miss"  # 2 prompt tokens: $0.002
    dear = {"id": "x", "object": "chat.completion", "created": 1, "model": "m", "choices": [{"index": 0, "message": {
        "role": "assistant", "content": "dear"}, "finish_reason": "stop"}], "usage": {"prompt_tokens": 1000,
                                                                                   "completion_tokens": 1}}
    double.cue(Cue(body=dear))
    await chat_http(chat, secret, model="priced-chat", seed=22)  # $1: the budget is $0.10
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await chat_http(chat, secret, model="priced-chat", seed=23)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "Budget reached" in refused.value.details()
    status, body, _ = await chat_http(chat, secret, model="priced-chat", seed=21)
    assert status == "hit" and b"echo Say hello." in body


async def test_a_prompt_over_the_context_window_has_no_cache_header(chat, running, key):
    """A 400 for the request itself, like one for a bad parameter: no answer to it could come from the cache, and
    neither the header, the access log nor the metric says it was asked (configuration.md, Response cache)."""
    too_long = [{"role": "user", "content": "word " * 6000}]  # ~6,000 tokens: the embedded model's window is 2,048
    registry = running.telemetry.metrics.registry
    call = chat.CreateChatCompletionHttp(http_body(chat_body(model="cached-embedded", messages=too_long)),
                                         metadata=bearer(key[1]))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        [body async for body in call]
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "maximum context length" in refused.value.details()
    assert "x-portico-cache" not in dict(refused.value.trailing_metadata() or ())
    assert registry.get_sample_value("portico_cache_lookups_total", {"model": "cached-embedded", "result": "miss"}) \
        is None


@pytest.mark.usefixtures("no_collector_pauses")
async def test_a_hit_counts_as_a_request_and_is_fast(chat, running, key):
    await chat_http(chat, key[1], model="cached-chat", seed=9)
    registry = running.telemetry.metrics.registry
    hits = registry.get_sample_value("portico_cache_lookups_total", {"model": "cached-chat", "result": "hit"}) or 0
    started = time.perf_counter()
    for _ in range(20):
        await chat_http(chat, key[1], model="cached-chat", seed=9)
    assert (time.perf_counter() - started) / 20 < 0.05  # gRPC round trips included; bench measures the gateway
    assert registry.get_sample_value("portico_cache_lookups_total",
                                     {"model": "cached-chat", "result": "hit"}) == hits + 20


async def test_a_hit_refused_by_a_limit_is_a_miss_everywhere(double, tmp_path):
    """The 429 did not come from the cache: its header, access-log line and metric all say `miss`."""
    path = config_with(tmp_path, double, f"access_log: {tmp_path / 'access.log'}\n")
    server = await start_server(load_config(path), "127.0.0.1:0")
    try:
        _, secret = await server.store.create("one-a-minute", all_models=True,
                                              limits=KeyLimits(requests_per_minute=1))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            chat = chat_service_pb2_grpc.ChatServiceStub(channel)
            assert (await chat_http(chat, secret, model="cached-chat", seed=11))[0] == "miss"
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await chat_http(chat, secret, model="cached-chat", seed=11)
        assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(refused.value.trailing_metadata() or ()).get("x-portico-cache") == "miss"
        lines = [orjson.loads(line) for line in (tmp_path / "access.log").read_text().splitlines()]
        assert [(line["status"], line["cache"]) for line in lines] == [(200, "miss"), (429, "miss")]
        registry = server.telemetry.metrics.registry
        assert [registry.get_sample_value("portico_cache_lookups_total", {"model": "cached-chat", "result": result})
                for result in ("hit", "miss")] == [None, 2]
    finally:
        await server.stop(0)
        os.environ.pop(UPSTREAM_KEY_ENV, None)


async def test_with_redis_two_servers_share_answers_and_an_outage_is_a_miss(double, tmp_path, redis_server):
    double.reset()
    path = config_with(tmp_path, double, f"limits: {{store: '{redis_server.url}'}}\n",
                       data_dir=tmp_path / "shared-data")
    first, second = [await start_server(load_config(path), "127.0.0.1:0") for _ in range(2)]
    try:
        secret = (await first.store.create("redis-cache", all_models=True))[1]  # one key store (the same data dir)
        results = []
        for server in (first, second, first):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = chat_service_pb2_grpc.ChatServiceStub(channel)
                results.append((await chat_http(stub, secret, model="shared-chat", seed=77, stream=True))[0])
        assert results == ["miss", "hit", "hit"] and len(double.seen) == 1
        await first.core.cache._store._pipe.close()
        first.core.cache._store._pipe = RedisPipe("redis://127.0.0.1:9/0", timeout=0.2)  # no Redis there
        async with grpc.aio.insecure_channel(f"127.0.0.1:{first.port}") as channel:
            status, body, _ = await chat_http(chat_service_pb2_grpc.ChatServiceStub(channel), secret,
                                              model="cached-chat", seed=78)
        assert status == "miss" and b"echo" in body
    finally:
        await first.stop(0)
        await second.stop(0)


async def test_an_answer_cached_before_the_model_s_upstream_changed_is_not_given_after(double, tmp_path, redis_server):
    # An operator moves the model to another upstream model (or base_url): hosts on the new configuration share the
    # Redis cache with those on the old one, and restarts keep it, but the old model's answers are not the new one's.
    double.reset()
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    configs = [(models(double.url).replace("model: m,", f"model: {upstream_model},"), "")
               for upstream_model in ("m", "m-next", "m")]
    answers = await answers_across_restarts(tmp_path, redis_server.url, configs, model="shared-chat", seed=79)
    assert answers == ["miss", "miss", "hit"]
    assert [seen.body["model"] for seen in double.seen] == ["m", "m-next"]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.usefixtures("no_collector_pauses")
async def test_a_redis_that_does_not_answer_costs_a_miss_one_timeout(double, tmp_path, redis_server, stream):
    """Redis stopped (SIGSTOP: connections taken, nothing answered), a key with no limits (nothing for Redis to
    count): each miss took two timeouts, the lookup's and then the storing's, which held the answer's end back, on
    every request of a cached model while Redis was out; then one, each lookup's, until lookups once Redis was
    found silent missed at once (but one a second, which tries it again)."""
    path = config_with(tmp_path, double, f"limits: {{store: '{redis_server.url}', store_timeout_seconds: 0.5}}\n")
    server = await start_server(load_config(path), "127.0.0.1:0")
    try:
        secret = (await server.store.create("unlimited", all_models=True))[1]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = chat_service_pb2_grpc.ChatServiceStub(channel)
            assert (await chat_http(stub, secret, model="cached-chat", seed=90, stream=stream))[0] == "miss"
            os.kill(redis_server.process.pid, signal.SIGSTOP)
            try:
                waits = []
                for seed in (91, 92, 93, 94):
                    began = time.monotonic()
                    status, body, _ = await chat_http(stub, secret, model="cached-chat", seed=seed, stream=stream)
                    assert status == "miss" and b"echo" in body
                    waits.append(time.monotonic() - began)
                assert waits[0] < 0.85  # the lookup's 0.5 s; 1.0 s before
                # Once a lookup timed out, those of the next second miss at once: 0.5 s each before.
                assert max(waits[1:]) < 0.3, waits
            finally:
                os.kill(redis_server.process.pid, signal.SIGCONT)
    finally:
        await server.stop(0)
        os.environ.pop(UPSTREAM_KEY_ENV, None)


async def test_a_full_redis_is_logged_once_as_refusing_answers_not_as_silent(double, tmp_path, redis_server, caplog):
    """A Redis at its maxmemory under noeviction (Redis's default) answers lookups and refuses every SET (OOM): each
    miss logged that Redis did not answer and then that it answered again, two lines a request for as long as it was
    full, naming an outage where Redis answered. Now one warning says it refuses to store, and one that it stores."""
    path = config_with(tmp_path, double, f"limits: {{store: '{redis_server.url}'}}\n")
    server = await start_server(load_config(path), "127.0.0.1:0")
    redis = RedisPipe(redis_server.url, timeout=2)
    try:
        secret = (await server.store.create("unlimited", all_models=True))[1]  # no limits: only the cache writes
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = chat_service_pb2_grpc.ChatServiceStub(channel)
            await redis.execute("CONFIG", "SET", "maxmemory", "1")  # full: every write that needs memory is refused
            try:
                with caplog.at_level(logging.INFO, logger="server.cache.redis_store"):
                    for seed in (95, 96, 97, 95):
                        status, body, _ = await chat_http(stub, secret, model="cached-chat", seed=seed)
                        assert status == "miss" and b"echo" in body
                    await asyncio.sleep(0.1)  # the last SET, sent without waiting, refused
                    full = [record.getMessage() for record in caplog.records]
            finally:
                await redis.execute("CONFIG", "SET", "maxmemory", "0")
            with caplog.at_level(logging.INFO, logger="server.cache.redis_store"):
                answers = [(await chat_http(stub, secret, model="cached-chat", seed=98))[0] for _ in range(3)]
        assert answers == ["miss", "hit", "hit"]
        assert len(full) == 1 and "refuses to store answers" in full[0] and "OOM" in full[0], full
        assert [record.getMessage() for record in caplog.records][len(full):] == [
            "response cache: Redis stores answers again"]
    finally:
        await redis.close()
        await server.stop(0)
        os.environ.pop(UPSTREAM_KEY_ENV, None)


async def test_an_answer_cached_before_default_max_tokens_changed_is_not_given_after(double, tmp_path, redis_server):
    # The operator raises default_max_tokens because answers to requests without a token limit were cut off (finish
    # reason `length`): a restarted server, or another host sharing the Redis cache, must not give the cut answers.
    double.reset()
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    configs = [(models(double.url), f"default_max_tokens: {default}\n") for default in (16, 4096, 16)]
    answers = await answers_across_restarts(tmp_path, redis_server.url, configs, model="shared-chat", seed=80,
                                            max_tokens=None)
    assert answers == ["miss", "miss", "hit"]
    assert [seen.body["max_tokens"] for seen in double.seen] == [16, 4096]


async def test_an_embedded_answer_cached_before_its_context_size_changed_is_not_given_after(double, tmp_path,
                                                                                            redis_server):
    # The embedded model's answer ends where its window does (prompt and answer together): an operator who raises
    # embedded.context_size because answers stopped short must not be given the short ones by a restarted server or
    # another host sharing the Redis cache.
    double.reset()
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    shared = ("  - {id: shared-embedded, endpoint: /v1/chat/completions, provider: {kind: llamacpp},"
              " cache: {shared: true}}\n")
    configs = [(models(double.url) + shared, f"embedded: {{context_size: {size}}}\n") for size in (64, 2048, 64)]
    answers = await answers_across_restarts(tmp_path, redis_server.url, configs, model="shared-embedded", seed=81,
                                            max_tokens=4)
    assert answers == ["miss", "miss", "hit"]
