"""A stopping server whose drain runs out: the model calls still running fail with 503 `service_unavailable` saying
the server is shutting down, which gRPC callers get as UNAVAILABLE with the error object (never CANCELLED, which
says the caller went away), and their reservations are settled. REST streams: tests/e2e/test_drain.py."""

from __future__ import annotations

import asyncio
import os

import grpc
import pytest

from portico.v1 import chat_service_pb2_grpc
from server.app import start_server
from server.domain_keys import KeyLimits
from tests.helpers import bearer, chat_request, error_details
from tests.upstream_double import Cue
from tests.upstream_support import UPSTREAM_KEY, UPSTREAM_KEY_ENV, load_upstream_config, upstream_models

WORDS = [{"role": "user", "content": " ".join(f"w{i}" for i in range(60))}]


@pytest.fixture
async def running(double, tmp_path, monkeypatch):
    """Not the shared server: this test stops it."""
    monkeypatch.setitem(os.environ, UPSTREAM_KEY_ENV, UPSTREAM_KEY)
    double.reset()
    return await start_server(load_upstream_config(tmp_path, upstream_models(double.url)), "127.0.0.1:0")


async def test_calls_the_drain_cannot_wait_for_fail_with_503_and_settle(running, double):
    key, secret = await running.store.create("cut", all_models=True, limits=KeyLimits(concurrent_requests=5))
    double.cue(Cue(frame_delay=0.1), Cue(delay=3))  # a stream of 60 words over 6 s; an answer in 3 s
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        chat = chat_service_pb2_grpc.ChatServiceStub(channel)
        stream = chat.StreamChatCompletion(chat_request(model="up-solo", messages=WORDS, max_tokens=100),
                                           metadata=bearer(secret))
        chunks = [await stream.read(), await stream.read()]  # under way
        unary = asyncio.ensure_future(chat.CreateChatCompletion(
            chat_request(model="up-solo", messages=WORDS, max_tokens=100), metadata=bearer(secret)))
        while len(double.seen) < 2:  # both calls wait on the upstream
            await asyncio.sleep(0.01)
        assert await running.limiter.store.in_flight(key.id) == 2
        stopped = asyncio.ensure_future(running.stop(grace=0.3))
        with pytest.raises(grpc.aio.AioRpcError) as streamed:
            while True:
                chunk = await stream.read()
                assert chunk is not grpc.aio.EOF, "the stream ended as if it were complete"
                chunks.append(chunk)
        with pytest.raises(grpc.aio.AioRpcError) as answered:
            await unary
        await asyncio.wait_for(stopped, 10)
    assert len(chunks) < 60
    for error in (streamed.value, answered.value):
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        detail = error_details(error)
        assert (detail.http_status, detail.error.code) == (503, "service_unavailable")
        assert "shutting down" in detail.error.message
    assert await running.limiter.store.in_flight(key.id) == 0  # both settled
