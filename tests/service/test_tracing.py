"""OpenTelemetry traces over real stubs, exported to a real OTLP/HTTP receiver: one server span per request joined to
the caller's traceparent, admission, each upstream attempt (retries, fallbacks) and embedded generation as children,
the gen_ai attributes, traceparent sent on to the upstream, the trace id in the access log, nothing secret or
user-written in any span, and a collector that is down or stuck changing nothing for callers."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from contextlib import asynccontextmanager

import grpc
import orjson
import pytest
from google.protobuf import json_format

from portico.v1 import chat_service_pb2_grpc, image_pb2, image_service_pb2_grpc
from server.app import start_server
from server.domain_keys import KeyLimits
from tests.helpers import bearer, chat_request, http_body
from tests.service.tracing_support import (  # noqa: F401 - receiver and running are fixtures
    CHAT, HELLO, access_line, ask, caller_context, one, receiver, running, spans_of, traced_config,
)
from tests.upstream_double import Cue
from tests.upstream_echo import echo_chat
from tests.upstream_support import UPSTREAM_KEY, UPSTREAM_KEY_ENV, upstream_models



async def test_a_request_joins_the_callers_trace_through_admission_and_its_upstream(chat, running, double,
                                                                                    receiver, key):
    key_id, secret = key
    trace_id, caller_span, traceparent = caller_context()
    await ask(chat, secret, traceparent, max_tokens=20)

    spans = await spans_of(receiver, trace_id)
    server = one(spans, kind="server")
    assert server.parent_id == caller_span and server.service == "portico"
    assert server.name == "chat up-main" and not server.error
    attributes = server.attributes
    assert attributes["gen_ai.operation.name"] == "chat"
    assert attributes["gen_ai.request.model"] == attributes["gen_ai.response.model"] == "up-main"
    assert attributes["gen_ai.request.max_tokens"] == 20
    assert (attributes["gen_ai.usage.input_tokens"], attributes["gen_ai.usage.output_tokens"]) == (2, 3)
    assert attributes["gen_ai.response.finish_reasons"] == ("stop",)  # as the caller was told
    assert attributes["portico.key_id"] == key_id and attributes["portico.endpoint"] == CHAT
    assert (attributes["rpc.service"], attributes["rpc.method"]) == ("portico.v1.ChatService", "CreateChatCompletion")
    assert attributes["http.response.status_code"] == 200 and "error.type" not in attributes

    admission = one(spans, name="admission")
    attempt = one(spans, kind="client")
    assert admission.parent_id == attempt.parent_id == server.span_id
    assert admission.end <= attempt.start and attempt.end <= server.end
    assert attempt.name == "chat main-model"
    assert attempt.attributes["gen_ai.request.model"] == "main-model"
    assert attempt.attributes["gen_ai.provider.name"] == "openai"
    assert attempt.attributes["server.address"] == "127.0.0.1"
    assert attempt.attributes["server.port"] == double.port
    assert attempt.attributes["http.response.status_code"] == 200
    assert (attempt.attributes["portico.attempt"], attempt.attributes["portico.fallback"]) == (1, False)

    # The upstream was told its parent is the attempt span, in the caller's trace.
    assert double.seen[-1].headers["traceparent"] == f"00-{trace_id}-{attempt.span_id}-01"
    assert access_line(running, trace_id)["request_id"]


async def test_a_stream_reports_its_usage_and_finish_reason(chat, running, receiver, key):
    _, secret = key
    trace_id, _, traceparent = caller_context()
    request = chat_request(model="up-main", messages=HELLO, stream=True)
    metadata = (*bearer(secret), traceparent)
    answer = [body async for body in chat.CreateChatCompletionHttp(http_body(request), metadata=metadata)]
    assert b"[DONE]" in answer[-1].data

    spans = await spans_of(receiver, trace_id)
    server = one(spans, kind="server")
    assert server.attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert server.attributes["gen_ai.usage.output_tokens"] == 3
    assert 0 < server.attributes["portico.time_to_first_token_ms"] <= (server.end - server.start) / 1e6
    attempt = one(spans, kind="client")
    assert attempt.parent_id == server.span_id and attempt.end <= server.end


async def test_each_retry_is_its_own_attempt_span(chat, running, double, receiver, key):
    _, secret = key
    double.cue(Cue(status=503, body={"error": {"message": "overloaded"}}))
    trace_id, _, traceparent = caller_context()
    await ask(chat, secret, traceparent)

    spans = await spans_of(receiver, trace_id)
    first, second = sorted((s for s in spans if s.kind == "client"), key=lambda s: s.start)
    assert first.error and first.attributes["http.response.status_code"] == 503
    assert first.attributes["error.type"] == "service_unavailable"
    assert first.attributes["portico.retry_reason"] == "503"
    assert not second.error and second.attributes["portico.attempt"] == 2
    assert one(spans, kind="server").attributes["portico.upstream_attempts"] == 2
    # Each attempt told the upstream its own span.
    assert [s.headers["traceparent"].split("-")[2] for s in double.seen] == [first.span_id, second.span_id]


async def test_a_fallback_is_traced_with_the_model_that_answered(chat, running, receiver, key):
    _, secret = key
    trace_id, _, traceparent = caller_context()
    await ask(chat, secret, traceparent, model="up-down")  # nothing listens there; falls back to up-backup

    spans = await spans_of(receiver, trace_id)
    attempts = sorted((s for s in spans if s.kind == "client"), key=lambda s: s.start)
    assert [s.attributes["portico.model"] for s in attempts] == ["up-down"] * 3 + ["up-backup"]
    assert all(s.error and s.attributes["portico.retry_reason"] == "connect" for s in attempts[:3])
    assert attempts[-1].attributes["portico.fallback"] and not attempts[-1].error
    assert attempts[-1].attributes["gen_ai.request.model"] == "backup-model"
    server = one(spans, kind="server")
    assert server.attributes["gen_ai.request.model"] == "up-down"
    assert server.attributes["gen_ai.response.model"] == "up-backup"


async def test_an_anthropic_upstream_is_traced_in_its_own_dialect(chat, running, double, receiver, key):
    _, secret = key
    trace_id, _, traceparent = caller_context()
    await ask(chat, secret, traceparent, model="chat-on-anthropic")

    attempt = one(await spans_of(receiver, trace_id), kind="client")
    assert attempt.name == "chat claude-up"
    assert attempt.attributes["gen_ai.provider.name"] == "anthropic"
    assert double.seen[-1].path == "/v1/messages"
    assert double.seen[-1].headers["traceparent"] == f"00-{trace_id}-{attempt.span_id}-01"


async def test_an_image_request_is_traced_as_content_generation(channel, running, double, receiver, key):
    _, secret = key
    trace_id, _, traceparent = caller_context()
    request = json_format.ParseDict({"model": "images-up", "prompt": "a lighthouse"}, image_pb2.CreateImageRequest())
    await image_service_pb2_grpc.ImageServiceStub(channel).CreateImage(request, metadata=(*bearer(secret), traceparent))

    spans = await spans_of(receiver, trace_id)
    server = one(spans, kind="server")
    assert server.name == "generate_content images-up"
    assert server.attributes["gen_ai.operation.name"] == "generate_content"
    assert server.attributes["gen_ai.output.type"] == "image"  # conditionally required by the conventions
    attempt = one(spans, kind="client")
    assert attempt.name == "generate_content image-up" and attempt.parent_id == server.span_id
    assert one(spans, name="admission").attributes["portico.tokens_reserved"] == 0
    assert double.seen[-1].headers["traceparent"] == f"00-{trace_id}-{attempt.span_id}-01"
    assert b"lighthouse" not in b"".join(receiver.bodies)


async def test_a_token_count_is_traced_as_counting_not_chat(messages, running, double, receiver, key):
    """/v1/messages/count_tokens generates nothing: its request span and its upstream attempt (Anthropic's own
    count) say `count_tokens`, where the attempt said `chat` and the request span had only its RPC's name."""
    _, secret = key
    trace_id, _, traceparent = caller_context()
    body = {"model": "messages-on-anthropic", "max_tokens": 8, "messages": HELLO}
    await messages.CountMessageTokensHttp(http_body(body), metadata=(*bearer(secret), traceparent))

    spans = await spans_of(receiver, trace_id)
    server = one(spans, kind="server")
    assert server.name == "count_tokens messages-on-anthropic"
    assert server.attributes["gen_ai.operation.name"] == "count_tokens"
    attempt = one(spans, kind="client")
    assert attempt.name == "count_tokens claude-up" and attempt.parent_id == server.span_id
    assert attempt.attributes["gen_ai.operation.name"] == "count_tokens"
    assert double.seen[-1].path == "/v1/messages/count_tokens"


async def test_a_caller_that_goes_away_leaves_cancelled_spans(chat, running, double, receiver, key):
    _, secret = key
    double.cue(Cue(frame_delay=0.5))  # the answer's chunks come slowly
    trace_id, _, traceparent = caller_context()
    call = chat.CreateChatCompletionHttp(http_body(chat_request(model="up-main", messages=HELLO, stream=True)),
                                         metadata=(*bearer(secret), traceparent))
    await call.read()  # the first chunk: the stream is under way
    call.cancel()

    spans = await spans_of(receiver, trace_id)
    server = one(spans, kind="server")
    assert server.attributes["http.response.status_code"] == 499
    assert server.attributes["error.type"] == "cancelled" and not server.error  # the caller's choice, not a fault
    attempt = one(spans, kind="client")
    assert attempt.attributes["error.type"] == "cancelled" and attempt.end <= server.end
    # Both codes, as on the request span: a query on the table's code finds the attempt too.
    assert attempt.attributes["portico.error.code"] == server.attributes["portico.error.code"] == "cancelled"


async def test_each_attempt_names_its_deployment(chat, running, receiver, key):
    _, secret = key
    trace_id, _, traceparent = caller_context()
    await ask(chat, secret, traceparent, model="up-pair")

    attempts = sorted((s for s in await spans_of(receiver, trace_id) if s.kind == "client"), key=lambda s: s.start)
    *failed, answered = attempts
    assert answered.attributes["portico.deployment"] == "live" and not answered.error
    assert answered.attributes["server.port"] != 9 and not answered.attributes["portico.fallback"]
    for attempt in failed:  # the down deployment, tried first (but for 1 time in 1001)
        assert attempt.attributes["portico.deployment"] == "dead" and attempt.attributes["server.port"] == 9
        assert attempt.error and attempt.attributes["portico.retry_reason"] == "connect"


async def test_the_embedded_model_has_a_generation_span(chat, running, receiver, key):
    _, secret = key
    trace_id, _, traceparent = caller_context()
    await ask(chat, secret, traceparent, model="embedded", max_tokens=3)

    spans = await spans_of(receiver, trace_id)
    server = one(spans, kind="server")
    generation = one(spans, name="generate SmolLM2-135M-Instruct.Q4_1")
    assert generation.parent_id == server.span_id and not generation.error
    assert generation.attributes["gen_ai.request.model"] == "SmolLM2-135M-Instruct.Q4_1"
    assert generation.attributes["portico.queued_ms"] >= 0
    assert generation.attributes["portico.fallback"] is False
    assert server.attributes["gen_ai.usage.output_tokens"] == 3
    assert server.attributes["gen_ai.response.finish_reasons"] == ("length",)


async def test_a_fallback_to_the_embedded_model_is_marked_as_one(chat, running, double, receiver, key):
    """As an upstream fallback's attempt is: a query for fallbacks finds the embedded model's generation too."""
    _, secret = key
    double.cue(Cue(500, {"error": {"message": "boom"}}))  # up-chain's one try; its first fallback is the embedded model
    trace_id, _, traceparent = caller_context()
    await ask(chat, secret, traceparent, model="up-chain", max_tokens=3)

    spans = await spans_of(receiver, trace_id)
    generation = one(spans, name="generate SmolLM2-135M-Instruct.Q4_1")
    assert generation.attributes["portico.model"] == "embedded" and generation.attributes["portico.attempt"] == 2
    assert generation.attributes["portico.fallback"] is True


async def test_no_response_model_when_no_model_answered(chat, running, double, receiver, key):
    """A request every upstream and fallback failed (502), and one refused before any upstream call (400), name
    the model asked for, but no model that answered."""
    _, secret = key
    double.cue(*[Cue(500, {"error": {"message": "boom"}})] * 4)  # up-main 3 times, then its fallback up-backup
    failed, _, traceparent = caller_context()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ask(chat, secret, traceparent)
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE  # 502 upstream_error
    refused, _, traceparent = caller_context()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ask(chat, secret, traceparent, temperature=5)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT

    for trace_id, status in ((failed, 502), (refused, 400)):
        server = one(await spans_of(receiver, trace_id), kind="server")
        assert server.attributes["http.response.status_code"] == status
        assert server.attributes["gen_ai.request.model"] == "up-main"
        assert "gen_ai.response.model" not in server.attributes and "gen_ai.provider.name" not in server.attributes


async def test_a_cache_hit_is_traced_like_a_request(chat, running, double, receiver, key):
    """Admission as a child, the request's attributes, and whether the cache answered."""
    _, secret = key
    traces = []
    for _ in range(2):
        trace_id, _, traceparent = caller_context()
        await ask(chat, secret, traceparent, model="up-cached", max_tokens=20, seed=7)
        traces.append(await spans_of(receiver, trace_id))
    for spans, cache in zip(traces, ("miss", "hit")):
        server = one(spans, kind="server")
        assert server.attributes["portico.cache"] == cache
        assert server.attributes["gen_ai.request.model"] == "up-cached"
        assert server.attributes["gen_ai.request.max_tokens"] == 20
        assert server.attributes["gen_ai.response.finish_reasons"] == ("stop",)  # a hit's caller is told it too
        assert one(spans, name="admission").parent_id == server.span_id
    hit = one(traces[1], kind="server")
    assert not [s for s in traces[1] if s.kind == "client"]  # no upstream was asked
    assert "gen_ai.response.model" not in hit.attributes  # the cache answered, not a model
    assert "gen_ai.provider.name" not in hit.attributes
    assert one(traces[0], kind="server").attributes["gen_ai.response.model"] == "up-cached"
    assert one(traces[0], kind="server").attributes["gen_ai.provider.name"] == "openai"


async def test_a_refusal_is_traced_with_its_code_and_limit(chat, running, receiver):
    _, secret = await running.store.create("traced-limited", all_models=True, limits=KeyLimits(requests_per_minute=1))
    await ask(chat, secret, caller_context()[2])
    trace_id, _, traceparent = caller_context()
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await ask(chat, secret, traceparent)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    spans = await spans_of(receiver, trace_id)
    admission = one(spans, name="admission")
    assert admission.error and admission.attributes["error.type"] == "rate_limit_exceeded"
    assert admission.attributes["portico.limit"] == "requests_per_minute"
    server = one(spans, kind="server")
    assert server.attributes["http.response.status_code"] == 429
    assert server.attributes["error.type"] == "rate_limit_exceeded"
    assert not [s for s in spans if s.kind == "client"]  # no upstream was asked


async def test_without_a_traceparent_portico_starts_the_trace(chat, running, receiver, key):
    _, secret = key
    before = len(receiver.spans)
    await chat.CreateChatCompletion(chat_request(model="up-solo", messages=HELLO), metadata=bearer(secret))
    await asyncio.to_thread(receiver.wait_for, lambda r: any(s.name == "chat up-solo" for s in r.spans[before:]))
    server = next(s for s in receiver.spans[before:] if s.name == "chat up-solo")
    assert server.parent_id == ""
    assert one(receiver.trace(server.trace_id), kind="client").parent_id == server.span_id


async def test_a_caller_that_samples_nothing_gets_no_spans_but_its_trace_id_is_logged(chat, running, double,
                                                                                     receiver, key):
    _, secret = key
    trace_id, _, traceparent = caller_context(sampled=False)
    await ask(chat, secret, traceparent)
    assert double.seen[-1].headers["traceparent"].startswith(f"00-{trace_id}-")  # passed on, not sampled
    assert double.seen[-1].headers["traceparent"].endswith("-00")
    # A later, sampled request's spans arrive; the unsampled one's never do.
    later, _, sampled = caller_context()
    await ask(chat, secret, sampled)
    await spans_of(receiver, later)
    assert receiver.trace(trace_id) == []
    assert access_line(running, trace_id)["status"] == 200


@pytest.mark.parametrize("trace_context", [
    {"tracestate": "vendor=kept,Said By The Caller"},  # not W3C's key=value (nor are upper-case keys)
    {"tracestate": ",".join(f"said{n}=x" for n in range(33))},  # over the 32 entries W3C allows
    {"tracestate": "said=" + "x" * 9000},  # over the 8192 characters W3C allows
])
async def test_a_malformed_tracestate_is_dropped_without_a_log_line(chat, running, double, receiver, key, caplog,
                                                                    trace_context):
    """The W3C rules drop such a tracestate whole; OpenTelemetry also logged a WARNING quoting it for every request
    that sent it, so one caller's client filled the diagnostic log with its header's text."""
    _, secret = key
    trace_id, span_id, traceparent = caller_context()
    answer = await chat.CreateChatCompletion(chat_request(model="up-solo", messages=HELLO),
                                             metadata=(*bearer(secret), traceparent, *trace_context.items()))
    assert answer.choices[0].message.content == "echo Say hello."
    assert "tracestate" not in double.seen[-1].headers  # nothing of it sent on
    server = one(await spans_of(receiver, trace_id), kind="server")
    assert server.parent_id == span_id  # the traceparent still counts
    assert [r.getMessage()[:80] for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_an_over_long_traceparent_starts_a_trace_without_a_log_line(chat, running, double, receiver, key,
                                                                         caplog):
    """Over the 512 characters OpenTelemetry reads (a later version's fields), as W3C allows it to refuse: a new
    trace, with no WARNING for every request that sent it."""
    _, secret = key
    trace_id = os.urandom(16).hex()
    long = f"01-{trace_id}-{os.urandom(8).hex()}-01-" + "x" * 600
    answer = await chat.CreateChatCompletion(chat_request(model="up-solo", messages=HELLO),
                                             metadata=(*bearer(secret), ("traceparent", long)))
    assert answer.choices[0].message.content == "echo Say hello."
    assert trace_id not in double.seen[-1].headers["traceparent"]
    assert [r.getMessage()[:80] for r in caplog.records if r.levelno >= logging.WARNING] == []


async def test_no_span_holds_a_secret_a_prompt_or_an_answer(chat, running, receiver, key):
    _, secret = key
    trace_id, _, traceparent = caller_context()
    prompt = "My card number is 4111-1111-1111-1111, say it back."
    request = chat_request(model="up-main", messages=[{"role": "user", "content": prompt}])
    await chat.CreateChatCompletion(request, metadata=(*bearer(secret), traceparent))
    await spans_of(receiver, trace_id)
    exported = b"".join(receiver.bodies)
    for needle in (secret, UPSTREAM_KEY, "4111-1111", "Say hello", "echo ", "Bearer"):
        assert needle.encode() not in exported, needle


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@asynccontextmanager
async def collector_test_server(directory, double, collector: str, **settings):
    """A traced server exporting to `collector`, and a chat stub with a key; stopping it must not wait on the
    collector."""
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    tracing = orjson.dumps({"otlp_endpoint": collector, "export_delay_seconds": 0.05, **settings}).decode()
    server = await start_server(traced_config(directory, upstream_models(double.url), tracing), "127.0.0.1:0")
    try:
        _, secret = await server.store.create("collector-tests", all_models=True)
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            yield server, chat_service_pb2_grpc.ChatServiceStub(channel), secret
    finally:
        began = time.monotonic()
        await server.stop(0)
        assert time.monotonic() - began < 5  # shutting down does not wait on the collector
        os.environ.pop(UPSTREAM_KEY_ENV, None)


async def test_an_unreachable_collector_changes_nothing_for_callers(tmp_path, double, caplog):
    nowhere = f"http://127.0.0.1:{_free_port()}"
    async with collector_test_server(tmp_path, double, nowhere, export_timeout_seconds=1) as (server, chat, secret):
        began = time.monotonic()
        answers = await asyncio.gather(*(ask(chat, secret, caller_context()[2]) for _ in range(10)))
        assert all(a.choices[0].message.content == "echo Say hello." for a in answers)
        assert time.monotonic() - began < 3
        dropped = server.telemetry.metrics.registry.get_sample_value
        deadline = time.monotonic() + 10
        while not dropped("portico_trace_spans_dropped_total", {"reason": "export_failed"}):
            assert time.monotonic() < deadline, "failed exports were not counted"
            await asyncio.sleep(0.05)
    # One warning for the outage, not a line for every batch that failed.
    assert sum("exporting traces to" in r.getMessage() for r in caplog.records) == 1


async def test_a_stuck_collector_fills_the_bounded_queue_and_drops_are_counted(tmp_path, double):
    """A collector that accepts connections and never answers holds the export thread; the queue stays bounded."""
    with socket.socket() as stuck:
        stuck.bind(("127.0.0.1", 0))
        stuck.listen(64)
        collector = f"http://127.0.0.1:{stuck.getsockname()[1]}"
        async with collector_test_server(tmp_path, double, collector, export_timeout_seconds=30, max_queue_size=4,
                                         max_export_batch_size=1) as (server, chat, secret):
            for _ in range(5):  # 3 spans each (request, admission, attempt): far more than the queue holds
                answer = await ask(chat, secret, caller_context()[2])
                assert answer.choices[0].message.content == "echo Say hello."
            dropped = server.telemetry.metrics.registry.get_sample_value("portico_trace_spans_dropped_total",
                                                                         {"reason": "queue_full"})
            assert dropped is not None and dropped >= 15 - 4 - 1  # the queue and the batch being sent survive


def _cut(stream: bool, how: str) -> Cue:
    """An answer that breaks off after its connection was made: the connection closed mid-answer, or a stream whose
    body ended before its last chunk."""
    if how == "dropped":
        return Cue(drop_after=2 if stream else 1)
    frames = echo_chat({"model": "main-model", "messages": HELLO, "stream": True})
    return Cue(frames=frames[:2])


@pytest.mark.parametrize("stream, how", [(True, "dropped"), (False, "dropped"), (True, "ended")])
async def test_an_answer_that_broke_off_is_not_called_a_connect_failure(chat, running, double, receiver, key,
                                                                       stream, how):
    """The connection was made and the answer began: `connect` (no connection could be opened) would send an
    operator to the network. `broken` says the answer broke off, before anything reached the caller (retried) or
    after (the caller's stream fails)."""
    _, secret = key
    double.cue(_cut(stream, how))
    trace_id, _, traceparent = caller_context()
    body = {"model": "up-main", "max_tokens": 20, "messages": HELLO, "stream": stream}
    metadata = (*bearer(secret), traceparent)
    with contextlib.suppress(grpc.aio.AioRpcError):
        if stream:
            [part async for part in chat.CreateChatCompletionHttp(http_body(body), metadata=metadata)]
        else:
            await chat.CreateChatCompletionHttpUnary(http_body(body), metadata=metadata)

    attempts = sorted((s for s in await spans_of(receiver, trace_id) if s.kind == "client"), key=lambda s: s.start)
    assert attempts[0].error and attempts[0].attributes["portico.retry_reason"] == "broken"
    assert attempts[0].attributes["error.type"] == "upstream_error"
