"""Callers who leave a stream after its first bytes are a 499 `cancelled` in the metrics, never a 500, and leave no
traceback, whether they leave while the server waits for tokens or while it is sending (its write blocked)."""

from __future__ import annotations

import asyncio
import logging

import orjson
import pytest
from google.api import httpbody_pb2

from tests.helpers import bearer
from tests.upstream_support import upstream_models, upstream_server

STREAMS = 40
LONG = " ".join(f"word{i}" for i in range(3000))  # the echo is ~400 KB of SSE: the caller's window fills up


@pytest.fixture(scope="module")
async def running(double, tmp_path_factory):
    async with upstream_server(tmp_path_factory.mktemp("abandon"), upstream_models(double.url)) as server:
        yield server


def _count(running, code: str) -> float:
    registry = running.telemetry.metrics.registry
    return sum(s.value for metric in registry.collect() if metric.name == "portico_requests"
               for s in metric.samples if s.name == "portico_requests_total" and s.labels.get("code") == code)


async def test_abandoned_streams_are_499_without_a_traceback(chat, running, key, caplog):
    body = orjson.dumps({"model": "up-main", "messages": [{"role": "user", "content": LONG}], "max_tokens": 4000,
                         "stream": True})
    before = _count(running, "internal_error"), _count(running, "cancelled"), _count(running, "")

    async def abandon(pause: float) -> None:
        call = chat.CreateChatCompletionHttp(httpbody_pb2.HttpBody(content_type="application/json", data=body),
                                             metadata=bearer(key[1]))
        await call.read()  # the first bytes; then stop reading: the server's writes block on flow control
        await asyncio.sleep(pause)
        call.cancel()

    with caplog.at_level(logging.WARNING):
        await asyncio.gather(*(abandon(0.01 * (i % 5)) for i in range(STREAMS)))
        for _ in range(300):  # let the server notice and finish each call
            if _count(running, "cancelled") - before[1] + _count(running, "") - before[2] >= STREAMS:
                break
            await asyncio.sleep(0.05)
    assert _count(running, "internal_error") == before[0]
    cancelled, finished = _count(running, "cancelled") - before[1], _count(running, "") - before[2]
    assert cancelled + finished == STREAMS and cancelled >= STREAMS / 4  # some may have ended before the cancel
    assert not [r for r in caplog.records if r.exc_info or "never retrieved" in r.getMessage()
                or "already running" in r.getMessage()]
