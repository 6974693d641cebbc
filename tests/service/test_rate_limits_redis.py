"""The server with the Redis limit store, over real stubs: exact under a burst, no slot left by an abandoned stream,
quotas and keys that survive a restart, a clear 503 (fail-closed) when Redis is unreachable, and a settlement that
Redis missed (paused mid-request) taken once it answers again."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import time
from collections.abc import AsyncIterator

import grpc
import redis.asyncio as redis_client
import pytest

from gateway.envoy import free_ports
from portico.v1 import chat_service_pb2_grpc, image_pb2, image_service_pb2_grpc
from portico.v1.probe_pb2 import GetReadinessRequest
from portico.v1.probe_service_pb2_grpc import ProbeServiceStub
from server.app import RunningServer, start_server
from server.config import Config, load_config
from server.domain_keys import KeyLimits
from tests.helpers import bearer, chat_request, error_details
from server.limits.redis import RedisLimitStore
from tests.redis_support import start_redis
from tests.service.test_http_upstream_tls_proxy import certificates  # noqa: F401 (a fixture)
from tests.upstream_double import Cue
from tests.upstream_support import UPSTREAM_KEY, UPSTREAM_KEY_ENV, load_upstream_config

IMAGE = image_pb2.CreateImageRequest(model="family-a-image-2", prompt="a buoy", size="256x256")


def redis_config(data_dir, store: str, *, images_only: bool = False) -> Config:
    config = load_config()
    models = tuple(m for m in config.models if m.provider.kind == "dev-image") if images_only else config.models
    limits = dataclasses.replace(config.limits, store=store, store_timeout_seconds=0.2)
    return dataclasses.replace(config, data_dir=data_dir, models=models, limits=limits)


@pytest.fixture(scope="module")
async def server(tmp_path_factory, redis_server) -> RunningServer:
    running = await start_server(redis_config(tmp_path_factory.mktemp("data"), redis_server.url), "127.0.0.1:0")
    yield running
    await running.stop(0)


@pytest.fixture(scope="module")
async def channel(server):
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        yield channel


async def test_200_concurrent_requests_admit_exactly_50(server, channel):
    secret = (await server.store.create("burst", all_models=True, limits=KeyLimits(requests_per_minute=50)))[1]
    images = image_service_pb2_grpc.ImageServiceStub(channel)
    calls = [images.CreateImage(IMAGE, metadata=bearer(secret)) for _ in range(200)]
    results = await asyncio.gather(*calls, return_exceptions=True)
    refused = [r for r in results if isinstance(r, grpc.aio.AioRpcError)]
    assert len(results) - len(refused) == 50
    assert {r.code() for r in refused} == {grpc.StatusCode.RESOURCE_EXHAUSTED}


async def test_abandoned_stream_frees_its_slot_and_settles(server, channel):
    key, secret = await server.store.create("stream", all_models=True,
                                      limits=KeyLimits(concurrent_requests=1, tokens_per_minute=400))
    chat = chat_service_pb2_grpc.ChatServiceStub(channel)
    story = [{"role": "user", "content": "Write a very long story."}]  # does not end within a few tokens
    call = chat.StreamChatCompletion(chat_request(max_tokens=300, messages=story), metadata=bearer(secret))
    for _ in range(4):
        await call.read()
    assert await server.limiter.store.in_flight(key.id) == 1
    call.cancel()
    deadline = time.monotonic() + 5.0
    while await server.limiter.store.in_flight(key.id):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    # Settled with what it used: another 300-token reservation fits in the 400 tokens per minute.
    await chat.CreateChatCompletion(chat_request(max_tokens=300, stop=["."]), metadata=bearer(secret))


async def test_quotas_and_keys_survive_a_restart(tmp_path, redis_server):
    config = redis_config(tmp_path, redis_server.url, images_only=True)
    first = await start_server(config, "127.0.0.1:0")
    secret = (await first.store.create("daily", all_models=True, limits=KeyLimits(daily_requests=2)))[1]
    async with grpc.aio.insecure_channel(f"127.0.0.1:{first.port}") as channel:
        for _ in range(2):
            await image_service_pb2_grpc.ImageServiceStub(channel).CreateImage(IMAGE, metadata=bearer(secret))
    await first.stop(0)
    second = await start_server(config, "127.0.0.1:0")
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{second.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await image_service_pb2_grpc.ImageServiceStub(channel).CreateImage(IMAGE, metadata=bearer(secret))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "daily requests" in error_details(caught.value).error.message
    finally:
        await second.stop(0)


async def on_a_redis_port_nothing_listens_on(tmp_path) -> tuple[RunningServer, int]:
    """A server of the image models whose limits.store is a port of 127.0.0.1 nothing listens on, and that port."""
    (port,) = free_ports(1)
    return await start_server(redis_config(tmp_path, f"redis://127.0.0.1:{port}/0", images_only=True),
                              "127.0.0.1:0"), port


async def test_unreachable_redis_is_a_quick_clear_503(tmp_path):
    running, port = await on_a_redis_port_nothing_listens_on(tmp_path)
    try:
        secret = (await running.store.create("any", all_models=True))[1]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            started = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await image_service_pb2_grpc.ImageServiceStub(channel).CreateImage(IMAGE, metadata=bearer(secret))
            assert time.monotonic() - started < 2.0  # a 0.2 s store timeout: never a hang
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        detail = error_details(caught.value)
        assert detail.http_status == 503 and "limit store is unreachable" in detail.error.message
        assert dict(caught.value.trailing_metadata())["retry-after"] == "1"
    finally:
        await running.stop(0)


async def test_each_redis_outage_and_its_end_have_their_lines_without_traffic(tmp_path, caplog):
    """operations.md: the limit store's outage line and its recovery line came only with a request's admission, so
    an outage with no traffic had no line, nor its end, and a second outage soon after had none of its own. The
    readiness check, which asks Redis every second, now tells the limiter what it met: one line per start and end."""
    caplog.set_level(logging.INFO, logger="server.limits.admission")
    redis = start_redis(tmp_path)
    running = await start_server(redis_config(tmp_path, redis.url, images_only=True), "127.0.0.1:0")

    def lines() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.name == "server.limits.admission"]

    async def logged(count: int) -> list[str]:
        deadline = time.monotonic() + 5.0  # the readiness check runs every second
        while len(lines()) < count:
            assert time.monotonic() < deadline, lines()
            await asyncio.sleep(0.1)
        await asyncio.sleep(1.5)  # and no more follow for the same outage
        return lines()

    try:
        assert lines() == []
        for outage in (1, 2):
            redis.stop()
            said = await logged(2 * outage - 1)
            assert len(said) == 2 * outage - 1 and said[-1].startswith("rate limits unavailable (the limit store "
                                                                      f"redis://127.0.0.1:{redis.port}/0 "), said
            assert "until it answers, requests are refused with 503" in said[-1], said
            redis.restart()
            said = await logged(2 * outage)
            assert len(said) == 2 * outage and said[-1] == "rate limits available again", said
    finally:
        await running.stop(0)
        redis.stop()


async def test_a_redis_down_at_start_has_one_outage_line_not_one_more_at_the_first_request(tmp_path, caplog):
    """The start-up line is the outage's line: neither the readiness check nor a refused request adds another."""
    caplog.set_level(logging.INFO, logger="server.limits.admission")
    running, port = await on_a_redis_port_nothing_listens_on(tmp_path)
    try:
        secret = (await running.store.create("any", all_models=True))[1]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError):
                await image_service_pb2_grpc.ImageServiceStub(channel).CreateImage(IMAGE, metadata=bearer(secret))
        await running.readiness.refresh()
    finally:
        await running.stop(0)
    said = [r.getMessage() for r in caplog.records if "the limit store" in r.getMessage()]
    assert len(said) == 1 and f"127.0.0.1:{port}" in said[0] and "until it answers" in said[0], said


async def _priced_on_redis(tmp_path, double):
    """A private Redis, and a server whose limits live in it (0.2 s timeouts) and whose model `priced` ($1,000 per
    million output tokens) is served by `double`."""
    redis = start_redis(tmp_path)
    models = f"""\
  - id: priced
    endpoint: /v1/chat/completions
    provider: {{kind: openai, base_url: '{double.url}', api_key_env: {UPSTREAM_KEY_ENV}, model: m}}
    price: {{input: 0, output: 1000}}
"""
    config = load_upstream_config(tmp_path, models)
    config = dataclasses.replace(config, limits=dataclasses.replace(config.limits, store=redis.url,
                                                                     store_timeout_seconds=0.2))
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    return redis, await start_server(config, "127.0.0.1:0")


@pytest.mark.parametrize("password", [None, "not-the-password-Qx7"], ids=["none", "wrong"])
async def test_a_redis_that_refuses_the_password_is_an_outage_whose_log_line_says_so(tmp_path, caplog, password):
    """A Redis with requirepass, and a limits.store URL without its password (none, or an old one): start-up was a
    traceback (NOAUTH) with none, and with a wrong one logged 'is unreachable', as for a Redis that is down, so the
    operator looked for a network fault. Now both are the documented outage (503, retry-after), and the log line
    says what Redis said, never the password in the URL; /readyz says `authentication_failed`."""
    (tmp_path / "redis").mkdir()
    redis = start_redis(tmp_path / "redis", password="the-real-one-Zr4")
    store = redis.url if password is None else redis.url.replace("//", f"//:{password}@", 1)
    try:
        running = await start_server(redis_config(tmp_path / "data", store, images_only=True), "127.0.0.1:0")
        try:
            secret = (await running.store.create("any", all_models=True))[1]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await image_service_pb2_grpc.ImageServiceStub(channel).CreateImage(IMAGE, metadata=bearer(secret))
            assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "limit store is unreachable" in error_details(caught.value).error.message
            assert dict(caught.value.trailing_metadata())["retry-after"] == "1"
            # /readyz said `limits unreachable`, as for a Redis that is down: it says what Redis answered.
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as unready:
                    await ProbeServiceStub(channel).GetReadiness(GetReadinessRequest())
            assert unready.value.details() == "Not ready: limits authentication_failed."
        finally:
            await running.stop(0)
        (line,) = [r.getMessage() for r in caplog.records if "the limit store" in r.getMessage()
                   and "until it answers" in r.getMessage()]
        said = "NOAUTH" if password is None else "password"
        assert said in line and f"127.0.0.1:{redis.port}" in line, line
        logged = "\n".join(r.getMessage() for r in caplog.records)
        assert "Traceback" not in caplog.text and (password is None or password not in logged + caplog.text)
    finally:
        redis.stop()


@pytest.mark.parametrize("grants", ["+ping", "+@read +@write", "+@read +@scripting"],
                         ids=["nothing", "no_scripts", "no_writes"])
async def test_a_redis_user_not_allowed_the_commands_is_reported_as_such_not_as_unreachable(tmp_path, caplog, grants):
    """A Redis that answers and takes the URL's password, but whose ACL user may not run what the limits need (NOPERM:
    SET, or the scripts, which @write does not grant): /readyz said `limits unreachable` (or `ok`, scripts refused),
    as for a Redis that is down, so the operator looked for a network fault. It now says `permission_denied`."""
    (tmp_path / "redis").mkdir()
    redis = start_redis(tmp_path / "redis")
    admin = await redis_client.from_url(redis.url)
    await admin.execute_command("ACL", "SETUSER", "portico", "on", ">its-password-Kp2", "~*", "&*", *grants.split())
    store = redis.url.replace("//", "//portico:its-password-Kp2@", 1)
    try:
        running = await start_server(redis_config(tmp_path / "data", store, images_only=True), "127.0.0.1:0")
        try:
            assert running.readiness.report.checks["limits"] == "permission_denied"
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as unready:
                    await ProbeServiceStub(channel).GetReadiness(GetReadinessRequest())
            assert unready.value.details() == "Not ready: limits permission_denied."
            secret = (await running.store.create("any", all_models=True))[1]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:  # the outage's 503, never a 500
                    await image_service_pb2_grpc.ImageServiceStub(channel).CreateImage(IMAGE, metadata=bearer(secret))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value.details()
        finally:
            await running.stop(0)
        (line,) = [r.getMessage() for r in caplog.records if "rate limits unavailable" in r.getMessage()]
        assert "NOPERM" in line and "its-password-Kp2" not in caplog.text, line
    finally:
        await admin.aclose()
        redis.stop()


async def test_a_rediss_store_whose_certificate_is_not_trusted_says_so_in_the_log(tmp_path, certificates, caplog):
    """rediss:// to a Redis whose certificate a private CA signed: its ssl_ca_certs option (or SSL_CERT_FILE) makes
    it trusted; without either, the start-up line said only 'did not answer: ConnectionError', as for a Redis that
    is down. It now says what the TLS handshake found."""
    (tmp_path / "redis").mkdir()
    redis = start_redis(tmp_path / "redis", tls=certificates)
    try:
        trusted = RedisLimitStore(f"{redis.tls_url}?ssl_ca_certs={certificates / 'ca.pem'}")
        assert await trusted.ping()
        await trusted.close()
        running = await start_server(redis_config(tmp_path / "data", redis.tls_url, images_only=True), "127.0.0.1:0")
        await running.stop(0)
        (line,) = [r.getMessage() for r in caplog.records if "until it answers" in r.getMessage()]
        assert "certificate verify failed" in line and f"127.0.0.1:{redis.tls[0]}" in line, line
    finally:
        redis.stop()


async def _answered_while_redis_pauses(running, redis, double, secret: str, *, upstream_delay: float,
                                       pause: float):
    """A chat answer of the priced model whose request was admitted before Redis was paused (SIGSTOP) and ended
    while it was; Redis answers again `pause` seconds after the answer."""
    double.reset()
    double.cue(Cue(delay=upstream_delay))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        call = chat_service_pb2_grpc.ChatServiceStub(channel).CreateChatCompletion(
            chat_request(model="priced", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8),
            metadata=bearer(secret))
        while not double.seen:  # admitted, and waiting on the upstream
            await asyncio.sleep(0.01)
        redis.process.send_signal(signal.SIGSTOP)
        try:
            answer = await call
            await asyncio.sleep(pause)
        finally:
            redis.process.send_signal(signal.SIGCONT)
    return answer


async def test_a_settlement_redis_missed_is_taken_once_it_answers_again(tmp_path, double):
    """Redis stops answering while a request is in flight: the answer is not held up, and once Redis is back the
    key's limits hold what the request used and cost (as the ledger does), not its reservation's estimates."""
    redis, running = await _priced_on_redis(tmp_path, double)
    try:
        key, secret = await running.store.create("outage", all_models=True, limits=KeyLimits(daily_tokens=10_000))
        # The settlement's first try times out while Redis is paused, and a retry too.
        answer = await _answered_while_redis_pauses(running, redis, double, secret, upstream_delay=1.0, pause=1.5)
        used = answer.usage.prompt_tokens + answer.usage.completion_tokens
        assert answer.usage.completion_tokens == 3  # "echo Say hello.", estimated at 8
        deadline = time.monotonic() + 10
        while (counts := await running.limiter.store.counts(key.id)).day_tokens != used:
            assert time.monotonic() < deadline, f"still the reservation's estimates: {counts}"
            await asyncio.sleep(0.1)
        assert (counts.day_requests, counts.day_spend, counts.month_spend, counts.in_flight) == (1, 3000, 3000, 0)
    finally:
        await running.stop(0)
        os.environ.pop(UPSTREAM_KEY_ENV, None)
        redis.stop()


async def test_settlements_that_waited_for_redis_are_taken_as_soon_as_it_answers_again(tmp_path, double):
    """A request that ended while Redis was paused kept its reservation's estimates (its slot, max_tokens) until its
    settlement's next retry, up to 10 s after Redis answered again and /readyz said ready: a key allowed one request
    at a time got 429 though none ran. The readiness check sees Redis answer within a second; the settlement follows.
    """
    redis, running = await _priced_on_redis(tmp_path, double)
    try:
        key, secret = await running.store.create("waited", all_models=True, limits=KeyLimits(
            daily_tokens=10_000, concurrent_requests=1))
        # Its settlement's tries (0.2 s timeouts, pauses doubling from 0.25 s) fail meanwhile: without a wake-up the
        # next comes about 3 s after Redis is back.
        answer = await _answered_while_redis_pauses(running, redis, double, secret, upstream_delay=0.5, pause=5.5)
        used = answer.usage.prompt_tokens + answer.usage.completion_tokens
        deadline = time.monotonic() + 2.0  # a readiness check (every second) sees it answer, and what waited is sent
        while ((counts := await running.limiter.store.counts(key.id)).day_tokens, counts.in_flight) != (used, 0):
            assert time.monotonic() < deadline, f"still the reservation's estimates: {counts}"
            await asyncio.sleep(0.1)
    finally:
        await running.stop(0)
        os.environ.pop(UPSTREAM_KEY_ENV, None)
        redis.stop()


async def test_requests_refused_while_redis_was_paused_leave_nothing_counted(tmp_path):
    """Redis paused: requests are refused with 503 (fail-closed), but the reservation already sent runs once Redis
    resumes. It is released then: no ghost slot, request or quota is left for the key."""
    redis = start_redis(tmp_path)
    running = await start_server(redis_config(tmp_path, redis.url, images_only=True), "127.0.0.1:0")
    try:
        key, secret = await running.store.create("paused", all_models=True, limits=KeyLimits(
            requests_per_minute=10, concurrent_requests=1, daily_requests=10))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            images = image_service_pb2_grpc.ImageServiceStub(channel)
            await images.CreateImage(IMAGE, metadata=bearer(secret))  # counted: one request
            redis.process.send_signal(signal.SIGSTOP)
            try:
                for _ in range(3):
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await images.CreateImage(IMAGE, metadata=bearer(secret))
                    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
            finally:
                redis.process.send_signal(signal.SIGCONT)
            deadline = time.monotonic() + 15
            while (len((counts := await running.limiter.store.counts(key.id)).window), counts.in_flight,
                   counts.day_requests) != (1, 0, 1):
                assert time.monotonic() < deadline, f"the refused requests are still counted: {counts}"
                await asyncio.sleep(0.2)
            await images.CreateImage(IMAGE, metadata=bearer(secret))  # not refused by a ghost slot
    finally:
        await running.stop(0)
        redis.stop()


@contextlib.asynccontextmanager
async def _one_at_a_time_on_redis(tmp_path, double, *, upstream_delay: float, timeouts: str = "",
                                  **limits) -> AsyncIterator[tuple]:
    """A server whose model `slow` waits `upstream_delay` s upstream, limits in a private Redis (`limits`: settings
    of config.limits), and a key that may run one request at a time: yields (redis, server, key, secret, chat stub).
    """
    redis = start_redis(tmp_path)
    models = f"""\
  - id: slow
    endpoint: /v1/chat/completions
    provider: {{kind: openai, base_url: '{double.url}', api_key_env: {UPSTREAM_KEY_ENV}, model: m{timeouts}}}
"""
    config = load_upstream_config(tmp_path, models)
    config = dataclasses.replace(config, limits=dataclasses.replace(config.limits, store=redis.url, **limits))
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    running = await start_server(config, "127.0.0.1:0")
    try:
        key, secret = await running.store.create("one-at-a-time", all_models=True,
                                                 limits=KeyLimits(concurrent_requests=1))
        double.reset()
        double.cue(Cue(delay=upstream_delay))
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            yield redis, running, key, secret, chat_service_pb2_grpc.ChatServiceStub(channel)
    finally:
        await running.stop(0)
        os.environ.pop(UPSTREAM_KEY_ENV, None)
        redis.stop()


async def test_a_redis_restarted_empty_gets_the_slots_of_requests_still_running_back(tmp_path, double):
    """Redis restarted without its data (no persistence, a failover) while a request runs: the process holding the
    slot books it again at its next renewal, so a key's concurrency limit still holds; the slot is freed when the
    request ends, not a lease later."""
    async with _one_at_a_time_on_redis(tmp_path, double, upstream_delay=3.0, store_timeout_seconds=0.2,
                                       lease_seconds=1.5) as (redis, running, key, secret, chat):
        first = chat.CreateChatCompletion(chat_request(model="slow", max_tokens=4), metadata=bearer(secret))
        while not double.seen:  # admitted, and waiting on the upstream
            await asyncio.sleep(0.01)
        redis.restart()
        await asyncio.sleep(1.0)  # past a renewal (every lease / 3 = 0.5 s)
        assert await running.limiter.store.in_flight(key.id) == 1
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await chat.CreateChatCompletion(chat_request(model="slow", max_tokens=4), metadata=bearer(secret))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "concurrent requests" in error_details(caught.value).error.message
        await first
        deadline = time.monotonic() + 0.5  # settled as the request ends: well before its lease would run out
        while await running.limiter.store.in_flight(key.id):
            assert time.monotonic() < deadline, "the slot outlived its request"
            await asyncio.sleep(0.02)
        await chat.CreateChatCompletion(chat_request(model="slow", max_tokens=4), metadata=bearer(secret))


async def test_a_redis_that_refuses_writes_is_an_outage_not_a_500_and_settlements_wait_for_it(tmp_path, double):
    """Redis answers but refuses writes (a replica after a failover says READONLY; LOADING, OOM, MISCONF and BUSY
    say the same in their words): requests get the outage policy's 503, never a 500, the host is not ready, and a
    request in flight meanwhile is settled with what it used once Redis takes writes again."""
    redis, running = await _priced_on_redis(tmp_path, double)
    admin = await redis_client.from_url(redis.url)
    try:
        key, secret = await running.store.create("read-only", all_models=True, limits=KeyLimits(daily_tokens=10_000))
        double.reset()
        double.cue(Cue(delay=1.0))
        hello = chat_request(model="priced", messages=[{"role": "user", "content": "Say hello."}], max_tokens=8)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            chat = chat_service_pb2_grpc.ChatServiceStub(channel)
            call = chat.CreateChatCompletion(hello, metadata=bearer(secret))
            while not double.seen:  # admitted, and waiting on the upstream
                await asyncio.sleep(0.01)
            await admin.replicaof("127.0.0.1", "9")  # a replica of nothing: it keeps its data, refuses writes
            try:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await chat.CreateChatCompletion(hello, metadata=bearer(secret))
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "limit store is unreachable" in error_details(caught.value).error.message
                assert not await running.limiter.store.ping()  # so /readyz says `"limits": "unreachable"`
                answer = await call
                await asyncio.sleep(0.5)  # its settlement was refused, and is retried
            finally:
                await admin.replicaof("NO", "ONE")
        used = answer.usage.prompt_tokens + answer.usage.completion_tokens
        deadline = time.monotonic() + 10
        while (counts := await running.limiter.store.counts(key.id)).day_tokens != used:
            assert time.monotonic() < deadline, f"still the reservation's estimates: {counts}"
            await asyncio.sleep(0.1)
        assert (counts.day_requests, counts.day_spend, counts.in_flight) == (1, 3000, 0)
        assert await running.limiter.store.ping()
    finally:
        await admin.aclose()
        await running.stop(0)
        os.environ.pop(UPSTREAM_KEY_ENV, None)
        redis.stop()


async def test_a_redis_restarted_empty_between_renewals_gets_the_slots_back_within_about_a_second(tmp_path, double):
    """operations.md: Redis came back without its data, its restart shorter than the pause between two renewals
    (a third of the default 30 s lease), so no renewal failed: the process sees the new connection (readiness pings
    every second) and books its slots again about a second after Redis answers, not at its next renewal 10 s on."""
    slow_reads = ", timeouts: {read: 20, answer: 20}"
    async with _one_at_a_time_on_redis(tmp_path, double, upstream_delay=6.0, timeouts=slow_reads) as setup:
        redis, running, key, secret, chat = setup
        first = chat.CreateChatCompletion(chat_request(model="slow", max_tokens=4), metadata=bearer(secret))
        while not double.seen:  # admitted, and waiting on the upstream
            await asyncio.sleep(0.01)
        redis.restart()
        deadline = time.monotonic() + 3.0  # a readiness ping (every second) reconnects, then the slot is booked
        while not await running.limiter.store.in_flight(key.id):
            assert time.monotonic() < deadline, "the running request's slot was not booked again"
            await asyncio.sleep(0.05)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await chat.CreateChatCompletion(chat_request(model="slow", max_tokens=4), metadata=bearer(secret))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        await first
