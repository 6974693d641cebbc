"""A valid model request whose caller leaves before admission has its usage-ledger row, as its access-log line and
metrics count it: the ledger, the access log and portico_requests_total agree request for request."""

from __future__ import annotations

import asyncio
import threading
import time

import grpc

from server.domain_keys import KeyLimits
from tests.helpers import bearer, chat_request

MODEL = "family-a-5.5"  # the embedded model: its prompt is counted (in a thread) before admission


async def test_a_caller_who_leaves_while_its_prompt_is_counted_has_a_499_row(chat, running, monkeypatch):
    key, secret = await running.store.create("gone-early", all_models=True, limits=KeyLimits(concurrent_requests=2))
    counter = running.core.pipeline._token_counters[MODEL]
    entered, release = threading.Event(), threading.Event()
    count = counter.count_tokens

    def slow_count(turns):  # as under load, when the count waits for a CPU
        entered.set()
        release.wait(10)
        return count(turns)

    monkeypatch.setattr(counter, "count_tokens", slow_count)
    cancelled = _cancelled(running)
    call = chat.CreateChatCompletion(chat_request(model=MODEL, max_tokens=4), metadata=bearer(secret))
    while not entered.is_set():
        await asyncio.sleep(0.005)
    call.cancel()
    deadline = time.monotonic() + 5
    while _cancelled(running) == cancelled and time.monotonic() < deadline:  # the server ended the RPC
        await asyncio.sleep(0.01)
    release.set()
    await running.core.ledger.flush()
    rows = [r for r in running.core.usage.rows() if r.key_id == key.id]
    assert [(r.model, r.upstream, r.status, r.code, r.input_tokens, r.output_tokens, r.upstream_attempts)
            for r in rows] == [(MODEL, "", 499, "cancelled", 0, 0, 0)]
    assert _cancelled(running) == cancelled + 1  # the metrics count it once, as the ledger does
    assert await running.limiter.store.in_flight(key.id) == 0  # nothing was admitted, nothing is held
    assert (await running.limiter.store.counts(key.id)).day_requests == 0
    assert call.cancelled() or call.code() is grpc.StatusCode.CANCELLED


def _cancelled(running) -> float:
    registry = running.telemetry.metrics.registry
    return sum(s.value for metric in registry.collect() if metric.name == "portico_requests"
               for s in metric.samples if s.name == "portico_requests_total" and s.labels.get("code") == "cancelled"
               and s.labels.get("model") == MODEL)
