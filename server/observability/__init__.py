"""Observability: Prometheus metrics, the JSON access log, and the per-request record both are built from.

    telemetry.Telemetry     opens and closes a request's record (the error interceptor), the current record
    record.RequestRecord    what one request did; Outcome: how it ended; UpstreamRecorder: for providers
    metrics.Metrics         the metric families; MetricsServer: GET /metrics on 127.0.0.1
    access_log.AccessLog    one JSON line per request, to stderr, stdout or a file
    tracing                 OpenTelemetry spans of a request (API side); tracing_export.Tracing: the SDK and OTLP
                            exporter, loaded only when `tracing.otlp_endpoint` is set
    grpc_logs               keeps metadata values out of grpc's own log lines
"""

from server.observability.metrics import Metrics, MetricsServer
from server.observability.record import Outcome, RequestRecord, UpstreamRecorder
from server.observability.telemetry import Telemetry

__all__ = ["Metrics", "MetricsServer", "Outcome", "RequestRecord", "Telemetry", "UpstreamRecorder"]
