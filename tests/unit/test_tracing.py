"""The `tracing:` settings, reading a caller's traceparent, sampling, and what an untraced request costs (nothing)."""

from __future__ import annotations

import contextvars
import logging

import pytest
from opentelemetry.trace import TraceState, get_current_span

from server.config import ConfigError, load_config
from server.config_tracing import TracingSettings, parse_tracing
from server.observability import Outcome, Telemetry
from server.observability.tracing import METADATA, NO_SCOPE, PROPAGATOR, caller_trace_id
from server.observability.tracing_export import Tracing

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
NOWHERE = "http://127.0.0.1:9"  # nothing is exported in these tests: nothing is sampled, or nothing is ended


def test_tracing_is_off_by_default():
    assert load_config().tracing == TracingSettings() and not TracingSettings().enabled


@pytest.mark.parametrize(("given", "used"), [
    ("http://127.0.0.1:4318", "http://127.0.0.1:4318/v1/traces"),
    ("https://otel.example.com/", "https://otel.example.com/v1/traces"),
    ("http://collector:4318/custom/traces", "http://collector:4318/custom/traces"),
    # The path goes before a query, not after it (`?tenant=a/v1/traces` sent every batch to `/`).
    ("http://collector:4318?tenant=a", "http://collector:4318/v1/traces?tenant=a"),
    ("http://collector:4318/?tenant=a", "http://collector:4318/v1/traces?tenant=a"),
])
def test_an_endpoint_without_a_path_gets_the_otlp_traces_path(given, used):
    assert parse_tracing({"otlp_endpoint": given}, "tracing").otlp_endpoint == used


@pytest.mark.parametrize(("raw", "named"), [
    ({"otlp_endpoint": "grpc://127.0.0.1:4317"}, "otlp_endpoint"),
    ({"otlp_endpoint": 4318}, "otlp_endpoint"),
    ({"sample_ratio": 1.5}, "sample_ratio"),
    ({"sample_ratio": "half"}, "tracing"),
    ({"max_queue_size": 0}, "max_queue_size"),
    ({"max_queue_size": 10, "max_export_batch_size": 20}, "max_export_batch_size"),
    ({"export_timeout_seconds": 0}, "export_timeout_seconds"),
    ({"endpoint": "http://127.0.0.1:4318"}, r"unknown setting\(s\) endpoint"),
    ({"service_name": ["gw"]}, r"service_name: a non-empty string, not \['gw'\]"),
    ({"service_name": {"name": "gw"}}, r"service_name: a non-empty string"),
])
def test_mistakes_stop_start_up_naming_the_setting(raw, named):
    with pytest.raises(ConfigError, match=named):
        parse_tracing(raw, "tracing")


@pytest.mark.parametrize(("header", "trace_id"), [
    (f"00-{TRACE}-00f067aa0ba902b7-01", TRACE),
    (f"00-{TRACE}-00f067aa0ba902b7-00", TRACE),  # not sampled: still the caller's trace
    (f"00-{'0' * 32}-00f067aa0ba902b7-01", None),  # the invalid all-zero id
    (f"00-{TRACE.upper()}-00f067aa0ba902b7-01", None),  # W3C ids are lowercase
    (f"00-{TRACE[:-1]}x-00f067aa0ba902b7-01", None),
    ("garbage", None),
    (b"\x00binary", None),
    # What the W3C spec (and so the tracing-on path, OpenTelemetry's propagator) refuses is no trace with it off.
    (f"ff-{TRACE}-00f067aa0ba902b7-01", None),  # version ff is invalid
    (f"00-{TRACE}-{'0' * 16}-01", None),  # the invalid all-zero parent id
    (f"00-{TRACE}-00f067aa0ba9zzzz-01", None),
    (f"00-{TRACE}-00f067aa0ba902b7-0x", None),
    (f"00-{TRACE}-00f067aa0ba902b7-01-extra", None),  # version 00 has nothing after the flags
    (f"00-+{TRACE[1:]}-00f067aa0ba902b7-01", None),  # int() would take a sign
    (f"01-{TRACE}-00f067aa0ba902b7-01-future", TRACE),  # a later version may add fields
])
def test_the_callers_trace_id_is_read_from_a_valid_traceparent_only(header, trace_id):
    assert caller_trace_id(header) == trace_id
    if isinstance(header, str):  # the same verdict as with tracing on, where the request span joins the trace
        tracing = Tracing(TracingSettings(otlp_endpoint=NOWHERE + "/v1/traces"), lambda *_: None)
        try:
            span = tracing.server_span("rpc", [("traceparent", header)])
            assert (f"{span.get_span_context().trace_id:032x}" == TRACE) == (trace_id is not None)
        finally:
            tracing.close()


def test_an_over_long_traceparent_is_no_trace_and_no_log_line(caplog):
    """Tracing off, the access log's trace id is read from every request's traceparent: one over the 512 characters
    OpenTelemetry's propagator reads was a WARNING line per request."""
    assert caller_trace_id(f"01-{TRACE}-00f067aa0ba902b7-01-" + "x" * 600) is None
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("tracestate", [
    "a=1,b=2", " a=1 , ,b=2\t", "tenant@vendor=x", "0tenant@v=x", "0a=1", "A=1", "a=1,a=2", "a= x", "a=x ",
    "a=b=c", "a=", "a=" + "x" * 256, "a=" + "x" * 257, ",".join(f"k{n}=v" for n in range(32)),
    ",".join(f"k{n}=v" for n in range(33)), "k=" + "v" * 250 + ",k2=" + "v" * 250,
])
def test_a_tracestate_is_read_as_opentelemetry_reads_it_without_its_warnings(tracestate, caplog):
    """The gRPC metadata getter drops what the propagator would drop, so that it has nothing to log."""
    carrier = [("traceparent", f"00-{TRACE}-00f067aa0ba902b7-01"), ("tracestate", tracestate)]
    read = get_current_span(PROPAGATOR.extract(carrier, getter=METADATA)).get_span_context().trace_state
    assert [r.getMessage() for r in caplog.records] == []
    assert dict(read) == dict(TraceState.from_header([tracestate]))  # OpenTelemetry's verdict, with its warning


def test_the_ratio_samples_traces_started_here_and_a_callers_decision_wins():
    tracing = Tracing(TracingSettings(otlp_endpoint=NOWHERE + "/v1/traces", sample_ratio=0.0), lambda *_: None)
    try:
        assert not tracing.server_span("rpc", ()).is_recording()
        joined = tracing.server_span("rpc", [("traceparent", f"00-{TRACE}-00f067aa0ba902b7-01")])
        assert joined.is_recording() and f"{joined.get_span_context().trace_id:032x}" == TRACE
        declined = tracing.server_span("rpc", [("traceparent", f"00-{TRACE}-00f067aa0ba902b7-00")])
        assert not declined.is_recording() and f"{declined.get_span_context().trace_id:032x}" == TRACE
    finally:
        tracing.close()


def test_without_tracing_a_request_has_no_span_but_logs_the_callers_trace_id():
    telemetry = Telemetry()
    record = telemetry.begin("/portico.v1.ChatService/CreateChatCompletion", "/v1/chat/completions",
                             [("traceparent", f"00-{TRACE}-00f067aa0ba902b7-01"), ("x-request-id", "r-1")])
    assert (record.span, record.trace_id, record.request_id) == (None, TRACE, "r-1")
    assert telemetry.span(record, "admission") is NO_SCOPE
    assert telemetry.attempt("m", "upstream-m", "openai", "chat", "127.0.0.1", 80) is NO_SCOPE
    assert telemetry.generation("SmolLM2") is NO_SCOPE
    telemetry.finish(record, Outcome(200))
    assert telemetry.begin("/portico.v1.ModelService/ListModels", "/v1/models", ()).trace_id is None


def test_the_model_that_answered_is_noted_traced_or_not():
    """The usage ledger reads it too: the last attempt's model, or the deployment runner's choice."""
    telemetry = Telemetry()
    record = telemetry.begin("/portico.v1.ChatService/CreateChatCompletion", "/v1/chat/completions", ())
    record.model = "asked"
    telemetry.attempt("fallback-model", "upstream-m", "openai", "chat", "127.0.0.1", 80)
    assert record.answered_by == "fallback-model"
    telemetry.deployment("asked", "eu-west")
    assert (record.answered_by, record.deployment) == ("asked", "eu-west")


def test_an_attempt_span_names_the_deployment_the_runner_chose():
    telemetry = Telemetry(tracing=TracingSettings(otlp_endpoint=NOWHERE + "/v1/traces"))

    def one_request():
        record = telemetry.begin("/portico.v1.ChatService/CreateChatCompletion", "/v1/chat/completions",
                                 [("traceparent", f"00-{TRACE}-00f067aa0ba902b7-01")])
        record.model = "asked"
        telemetry.deployment("asked", "eu-west")
        return telemetry.attempt("asked", "upstream-m", "openai", "chat", "10.0.0.7", 443).span.attributes

    try:
        attributes = contextvars.copy_context().run(one_request)  # never ended, so never exported
        assert attributes["portico.deployment"] == "eu-west" and attributes["server.address"] == "10.0.0.7"
        assert attributes["portico.attempt"] == 1 and attributes["portico.fallback"] is False
    finally:
        telemetry.close()


def test_with_the_sdk_switched_off_the_access_log_keeps_real_trace_ids(monkeypatch):
    """OTEL_SDK_DISABLED=true, the OpenTelemetry kill switch, makes the SDK's spans invalid ones: every access-log
    line without a caller's trace said trace_id "000...0", one trace for all. Now null, as with tracing off, and
    a caller's trace id is kept."""
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    telemetry = Telemetry(tracing=TracingSettings(otlp_endpoint=NOWHERE + "/v1/traces"))
    try:
        method, endpoint = "/portico.v1.ChatService/CreateChatCompletion", "/v1/chat/completions"
        assert contextvars.copy_context().run(telemetry.begin, method, endpoint, ()).trace_id is None
        caller = [("traceparent", f"00-{TRACE}-00f067aa0ba902b7-01")]
        assert contextvars.copy_context().run(telemetry.begin, method, endpoint, caller).trace_id == TRACE
    finally:
        telemetry.close()
