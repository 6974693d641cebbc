"""Traces through the whole stack: an official SDK caller's `traceparent` crosses Envoy, Portico's spans join it and
reach a real OTLP/HTTP receiver, the upstream receives the trace, and the access log names it; with the collector
down, callers see nothing different."""

from __future__ import annotations

import os
import secrets
import socket
import time

import anthropic
import grpc
import httpx
import openai
import orjson
import pytest

from portico.v1 import model_pb2, model_service_pb2_grpc
from tests.e2e.conftest import running_gateway
from tests.otlp_receiver import OtlpReceiver
from tests.upstream_double import UpstreamDouble
from tests.upstream_support import UPSTREAM_KEY, UPSTREAM_KEY_ENV

HI = [{"role": "user", "content": "Hi"}]


def traced_config(directory, collector: str, upstream: str):
    path = directory / "traced.yaml"
    path.write_text(f"""\
tracing: {{otlp_endpoint: '{collector}', export_delay_seconds: 0.05, export_timeout_seconds: 1}}
models:
  - {{id: family-a-5.5, endpoint: /v1/chat/completions, provider: {{kind: llamacpp}}}}
  - id: up-chat
    endpoint: /v1/chat/completions
    provider: {{kind: openai, base_url: '{upstream}', api_key_env: {UPSTREAM_KEY_ENV}, model: main-model}}
  - id: up-messages
    endpoint: /v1/messages
    provider: {{kind: anthropic, base_url: '{upstream.removesuffix("/v1")}', api_key_env: {UPSTREAM_KEY_ENV},
               model: claude-up}}
""")
    return path


@pytest.fixture(scope="module")
def upstream_key():
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    yield
    os.environ.pop(UPSTREAM_KEY_ENV, None)


def caller(trace_id: str, span_id: str, gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.secret, max_retries=0,
                         default_headers={"traceparent": f"00-{trace_id}-{span_id}-01"})


def access_lines(gateway, trace_id: str, count: int) -> list[dict]:
    """The access-log lines carrying `trace_id`, once there are `count` of them."""
    deadline = time.monotonic() + 5
    while True:
        lines = [orjson.loads(line) for line in gateway.log_path.read_text().splitlines() if line.startswith('{"ts":')]
        found = [line for line in lines if line["trace_id"] == trace_id]
        if len(found) >= count or time.monotonic() > deadline:
            assert len(found) == count, (trace_id, found)
            return found
        time.sleep(0.05)


def test_a_rest_callers_trace_runs_through_envoy_portico_and_the_upstream(tmp_path, upstream_key):
    receiver, double = OtlpReceiver().start(), UpstreamDouble().start()
    try:
        with running_gateway(tmp_path / "data", config=traced_config(tmp_path, receiver.url, double.url)) as gateway:
            trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
            client = caller(trace_id, span_id, gateway)
            answer = client.chat.completions.create(model="up-chat", messages=HI, max_tokens=5)
            assert answer.choices[0].message.content == "echo Hi"
            stream = client.chat.completions.create(model="family-a-5.5", messages=HI, max_tokens=2, stream=True)
            assert len([chunk for chunk in stream]) >= 2

            with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:  # gRPC through the same port
                models = model_service_pb2_grpc.ModelServiceStub(channel)
                models.ListModels(model_pb2.ListModelsRequest(), timeout=30, metadata=(
                    ("authorization", f"Bearer {gateway.secret}"), ("traceparent", f"00-{trace_id}-{span_id}-01")))

            spans = receiver.wait_for_trace(trace_id, server_spans=3)
            requests = [s for s in spans if s.kind == "server"]
            assert all(s.parent_id == span_id for s in requests)  # all joined to the caller's span
            assert {s.name for s in requests} == {"chat up-chat", "chat family-a-5.5",
                                                  "portico.v1.ModelService/ListModels"}
            (attempt,) = [s for s in spans if s.kind == "client"]
            assert double.seen[-1].headers["traceparent"] == f"00-{trace_id}-{attempt.span_id}-01"
            assert any(s.name.startswith("generate SmolLM2") for s in spans)
            lines = access_lines(gateway, trace_id, 3)
            assert {line["model"] for line in lines} == {"up-chat", "family-a-5.5", None}
            exported = b"".join(receiver.bodies)
            assert gateway.secret.encode() not in exported and UPSTREAM_KEY.encode() not in exported
    finally:
        receiver.stop()
        double.stop()


def test_a_collector_that_is_down_changes_nothing_for_rest_callers(tmp_path, upstream_key):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        nowhere = f"http://127.0.0.1:{probe.getsockname()[1]}"
    double = UpstreamDouble().start()
    try:
        with running_gateway(tmp_path / "data", config=traced_config(tmp_path, nowhere, double.url)) as gateway:
            trace_id = secrets.token_hex(16)
            client = caller(trace_id, secrets.token_hex(8), gateway)
            for _ in range(5):
                answer = client.chat.completions.create(model="up-chat", messages=HI, max_tokens=5)
                assert answer.choices[0].message.content == "echo Hi"
            assert [line["status"] for line in access_lines(gateway, trace_id, 5)] == [200] * 5
    finally:
        double.stop()


def test_each_sdk_callers_span_says_what_it_was_told(tmp_path, upstream_key):
    """An operator reading a span sees the finish reason and answer id the caller's SDK returned, in its dialect."""
    receiver, double = OtlpReceiver().start(), UpstreamDouble().start()
    try:
        with running_gateway(tmp_path / "data", config=traced_config(tmp_path, receiver.url, double.url)) as gateway:
            chat_trace, messages_trace = secrets.token_hex(16), secrets.token_hex(16)
            answer = caller(chat_trace, secrets.token_hex(8), gateway).chat.completions.create(
                model="up-chat", messages=HI, max_tokens=1, temperature=1)
            message = anthropic.Anthropic(
                base_url=gateway.base_url, api_key=gateway.secret, max_retries=0,
                default_headers={"traceparent": f"00-{messages_trace}-{secrets.token_hex(8)}-01"},
            ).messages.create(model="up-messages", messages=HI, max_tokens=20)

            (chat,) = [s for s in receiver.wait_for_trace(chat_trace) if s.kind == "server"]
            reasons = chat.attributes["gen_ai.response.finish_reasons"]
            assert reasons == (answer.choices[0].finish_reason,) == ("length",)
            assert chat.attributes["gen_ai.response.id"] == answer.id
            assert chat.attributes["gen_ai.request.temperature"] == 1.0
            (messages,) = [s for s in receiver.wait_for_trace(messages_trace) if s.kind == "server"]
            assert messages.attributes["gen_ai.response.finish_reasons"] == (message.stop_reason,) == ("end_turn",)
            assert messages.attributes["gen_ai.response.id"] == message.id
            (attempt,) = [s for s in receiver.trace(messages_trace) if s.kind == "client"]
            assert double.seen[-1].headers["traceparent"] == f"00-{messages_trace}-{attempt.span_id}-01"
    finally:
        receiver.stop()
        double.stop()


def test_a_secret_in_the_callers_tracestate_reaches_neither_the_collector_nor_the_upstream(tmp_path, upstream_key):
    """`tracestate` is the caller's own text, which the trace context exports with every span and sends on to the
    upstream: a key pasted there (a vendor's entry holding it) was in both. Its other entries still travel."""
    receiver, double = OtlpReceiver().start(), UpstreamDouble().start()
    try:
        with running_gateway(tmp_path / "data", config=traced_config(tmp_path, receiver.url, double.url)) as gateway:
            trace_id = secrets.token_hex(16)
            client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.secret, max_retries=0,
                                   default_headers={"traceparent": f"00-{trace_id}-{secrets.token_hex(8)}-01",
                                                    "tracestate": f"vendor=kept,auth={gateway.secret},other=too"})
            answer = client.chat.completions.create(model="up-chat", messages=HI, max_tokens=5)
            assert answer.choices[0].message.content == "echo Hi"
            receiver.wait_for_trace(trace_id)
            assert double.seen[-1].headers["tracestate"] == "vendor=kept,other=too"
            tail = gateway.secret.split("-")[-1].encode()
            assert tail not in b"".join(receiver.bodies)
            assert all(tail.decode() not in value for seen in double.seen for value in seen.headers.values())
    finally:
        receiver.stop()
        double.stop()



@pytest.mark.parametrize(("traceparent", "logged"), [
    ("00-{trace}-00f067aa0ba902b7-01", "{trace}"),
    ("01-{trace}-00f067aa0ba902b7-00-a-later-version", "{trace}"),  # a later version, read as version 00
    ("00-{trace}-00f067aa0ba902b7-01-more", None),  # version 00 is exactly 55 characters
    ("00-00000000000000000000000000000000-00f067aa0ba902b7-01", None),  # the invalid, all-zero trace id
    ("00-{TRACE}-00f067aa0ba902b7-01", None),  # upper case hex
    ("ff-{trace}-00f067aa0ba902b7-01", None),  # the forbidden version
    (None, None),
])
def test_a_reply_envoy_makes_is_logged_with_the_callers_trace_id(gateway, traceparent, logged):
    """operations.md: every access-log line carries `trace_id`, to go from a log line to its trace. The lines of the
    replies the server never saw (an unknown URL, an oversize body, a worker that died) had no trace_id at all, so
    a caller's trace of a 404 or a 503 led to no line; now the caller's, by the rules the server reads it with."""
    trace = secrets.token_hex(16)
    request_id = f"envoy-traced-{secrets.token_hex(6)}"
    headers = {"x-request-id": request_id}
    if traceparent:
        headers["traceparent"] = traceparent.format(trace=trace, TRACE=trace.upper())
    with httpx.Client(base_url=gateway.base_url, timeout=30) as http:
        assert http.get("/v1/nothing-here", headers=headers).status_code == 404
    line = gateway.envoy_access_lines(request_id)[0]
    assert line["trace_id"] == (logged.format(trace=trace) if logged else None), line
