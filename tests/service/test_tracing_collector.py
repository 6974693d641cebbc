"""The exporter against a collector that misbehaves, as an operator finds it: what the diagnostic log says when the
collector refuses spans or cannot be reached (a real OTLP/HTTP receiver answering as told, or a closed port)."""

from __future__ import annotations

import logging
import socket
import ssl
from concurrent.futures import ThreadPoolExecutor

import certifi
import grpc
import pytest

from server.config_tracing import TracingSettings
from server.observability.tracing_export import Tracing
from tests.otlp_receiver import OtlpReceiver
from tests.service.test_http_upstream_tls_proxy import certificates  # noqa: F401 (a fixture)


def _closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _export_one(endpoint: str) -> list[tuple[str, int]]:
    """Ends one sampled span and waits for its export; the drops counted."""
    dropped: list[tuple[str, int]] = []
    tracing = Tracing(TracingSettings(otlp_endpoint=endpoint, export_timeout_seconds=3),
                      lambda reason, count: dropped.append((reason, count)))
    tracing.server_span("portico.v1.ChatService/CreateChatCompletion", ()).end()
    tracing.flush()
    tracing.close()
    return dropped


@pytest.mark.parametrize(("collector", "said"), [
    (401, "HTTP 401 Unauthorized"),  # a wrong key in OTEL_EXPORTER_OTLP_HEADERS
    (404, "HTTP 404 Not Found"),  # an endpoint with the wrong path
    (503, "HTTP 503 Service Unavailable"),  # retried (the exporter's line says so) until the timeout
    # An http -> https ingress: the exporter follows no redirect and took a 3xx for success, every span lost unsaid.
    (308, "HTTP 308 Permanent Redirect to https://collector.example:4318"),
    (301, "HTTP 301 Moved Permanently to https://collector.example:4318"),
    ("closed", "Connection refused"),  # nothing listens there
    ("stuck", "no answer within 3 s"),  # it takes the connection and never answers
    ("grpc", "OTLP/gRPC"),  # the collector's OTLP/gRPC port (4317) given for its OTLP/HTTP one (4318)
])
def test_the_outage_warning_says_why_the_collector_did_not_take_the_spans(caplog, collector, said):
    """An operator told only that export "fails" cannot tell a wrong key from a wrong path or a collector that is
    down: the one warning of an outage names the collector's answer, or why there was none."""
    receiver = OtlpReceiver().start()
    stuck = socket.socket()
    grpc_server = grpc.server(ThreadPoolExecutor(1))
    try:
        if collector == "grpc":
            url = f"http://127.0.0.1:{grpc_server.add_insecure_port('127.0.0.1:0')}"
            grpc_server.start()
        elif collector == "stuck":
            stuck.bind(("127.0.0.1", 0))
            stuck.listen(8)
            url = f"http://127.0.0.1:{stuck.getsockname()[1]}"
        elif collector == "closed":
            url = f"http://127.0.0.1:{_closed_port()}"
        else:
            receiver.refusing, url = collector, receiver.url
        with caplog.at_level(logging.INFO):
            assert _export_one(url + "/v1/traces") == [("export_failed", 1)]
    finally:
        grpc_server.stop(0)
        stuck.close()
        receiver.stop()
    (warning,) = [r.getMessage() for r in caplog.records if "exporting traces to" in r.getMessage()]
    assert said in warning, warning


@pytest.mark.parametrize("bundle", ["REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE", None])
def test_a_collector_behind_a_private_ca_is_trusted_through_otel_exporter_otlp_certificate(
        monkeypatch, caplog, certificates, bundle):
    """operations.md: OTEL_EXPORTER_OTLP_CERTIFICATE names a private CA for the collector. requests, the exporter's
    client, let REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE (set in many container images and CI runners to the system's
    bundle) win over it: every batch failed with CERTIFICATE_VERIFY_FAILED, spans lost."""
    for name in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
        monkeypatch.delenv(name, raising=False)
    if bundle:
        monkeypatch.setenv(bundle, certifi.where())  # a bundle without the private CA
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_CERTIFICATE", str(certificates / "ca.pem"))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(certificates / "server.pem", certificates / "server.key")
    receiver = OtlpReceiver(tls=context).start()
    try:
        assert receiver.url.startswith("https://")
        assert _export_one(receiver.url + "/v1/traces") == []
        receiver.wait_for(lambda r: len(r.spans) == 1)
    finally:
        receiver.stop()
    assert not [r.getMessage() for r in caplog.records if "exporting traces to" in r.getMessage()]


@pytest.mark.parametrize("variable", ["OTEL_EXPORTER_OTLP_HEADERS", "OTEL_EXPORTER_OTLP_TRACES_HEADERS"])
def test_a_mistake_in_the_collectors_headers_keeps_their_secrets_out_of_the_log(monkeypatch, caplog, variable):
    """The headers' values are credentials (operations.md: kept out of every log); an entry written `name: value`
    or with quotes, as env files often have them, is not name=value, and the exporter quoted it whole in a warning.
    Now the warning names the variable and how many entries were ignored, never what they hold."""
    monkeypatch.setenv(variable, 'x-team=fine, authorization: Bearer s3cr3t-token, x-api-key="quoted-s3cr3t"')
    with caplog.at_level(logging.DEBUG):
        Tracing(TracingSettings(otlp_endpoint=f"http://127.0.0.1:{_closed_port()}"), lambda *_: None).close()
    lines = [record.getMessage() for record in caplog.records]
    assert not [line for line in lines if "s3cr3t" in line]
    (warning,) = [line for line in lines if variable in line]
    assert "2 entries" in warning, warning


@pytest.mark.parametrize(("configured", "environment", "service"), [
    (None, {}, "portico"),
    (None, {"OTEL_SERVICE_NAME": "portico-eu"}, "portico-eu"),  # as the OpenTelemetry Operator injects it
    (None, {"OTEL_RESOURCE_ATTRIBUTES": "service.name=gw-attrs,deployment.environment=prod"}, "gw-attrs"),
    ("gw-config", {"OTEL_SERVICE_NAME": "portico-eu"}, "gw-config"),  # the configuration file says it itself
])
def test_the_service_name_comes_from_the_environment_unless_configured(monkeypatch, configured, environment, service):
    """OTEL_SERVICE_NAME and service.name in OTEL_RESOURCE_ATTRIBUTES (the standard variables, which operators and
    Kubernetes' OpenTelemetry Operator set per deployment) were overridden by tracing.service_name's default, so
    every deployment's spans said `portico`."""
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    receiver = OtlpReceiver().start()
    try:
        settings = {"service_name": configured} if configured else {}
        tracing = Tracing(TracingSettings(otlp_endpoint=receiver.url + "/v1/traces", **settings), lambda *_: None)
        tracing.server_span("portico.v1.ChatService/CreateChatCompletion", ()).end()
        tracing.close()
        (span,) = receiver.spans
        assert span.service == service
    finally:
        receiver.stop()
