"""The SDK side of traces: spans exported over OTLP/HTTP (protobuf) by the official OpenTelemetry SDK and exporter
(opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http) rather than code of our own: their sampling, batching,
retries and wire format are what every collector is tested against. Imported only when `tracing.otlp_endpoint` is
set: the exporter and its HTTP client add ~4 MB and ~80 ms of imports to every server process.

Nothing is made global (no `trace.set_tracer_provider`): each server owns its provider, and parents are passed
explicitly (server/observability/tracing.py), so the SDK's own context never has to follow grpc.aio's tasks.

Export never slows or fails a request: ending a span appends it to a bounded queue, a background thread sends
batches, and a span that finds the queue full is dropped and counted (`portico_trace_spans_dropped_total`), as is
every span of a batch the collector did not take.
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from http import HTTPStatus
from urllib.parse import urlsplit

import requests
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http._common import _load_session_from_envvar
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.environment_variables import (
    _OTEL_PYTHON_EXPORTER_OTLP_HTTP_TRACES_CREDENTIAL_PROVIDER as _CREDENTIAL_PROVIDER,
)
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, set_span_in_context

from server.config_tracing import TracingSettings
from server.observability.metrics import SPANS_EXPORT_FAILED, SPANS_QUEUE_FULL
from server.observability.tracing import METADATA, PROPAGATOR, Metadata, Scope

_logger = logging.getLogger(__name__)

SHUTDOWN_SECONDS = 2.0  # at shutdown, how long queued spans may take to leave; the drain must not wait on a collector


class Tracing:
    def __init__(self, settings: TracingSettings, on_dropped: Callable[[str, int], None]) -> None:
        """`on_dropped(reason, spans)`: spans lost, because the queue was full or the collector refused them."""
        assert settings.otlp_endpoint is not None
        self.settings = settings
        resource = _resource(settings.service_name)
        # Parent-based: a caller's sampling decision wins; the ratio applies to traces that start here.
        sampler = ParentBased(TraceIdRatioBased(settings.sample_ratio))
        self._provider = TracerProvider(sampler=sampler, resource=resource, shutdown_on_exit=False)
        exporter = _CountingExporter(
            _exporter(settings.otlp_endpoint, settings.export_timeout_seconds), on_dropped,
            collector=_address(settings.otlp_endpoint), timeout_seconds=settings.export_timeout_seconds,
        )
        self._processor = _BoundedProcessor(
            BatchSpanProcessor(
                exporter, max_queue_size=settings.max_queue_size,
                schedule_delay_millis=settings.export_delay_seconds * 1000,
                max_export_batch_size=settings.max_export_batch_size,
            ),
            settings.max_queue_size, on_dropped, exporter,
        )
        self._provider.add_span_processor(self._processor)
        self._tracer = self._provider.get_tracer("portico")

    def server_span(self, name: str, metadata: Metadata) -> Span:
        """The request's span, a child of the caller's `traceparent` (REST callers' header, which Envoy passes on
        as metadata, or gRPC metadata) when it sent a valid one."""
        parent = PROPAGATOR.extract(metadata, getter=METADATA)
        return self._tracer.start_span(name, context=parent, kind=SpanKind.SERVER)

    def child(self, parent: Span, name: str, kind: SpanKind, attributes: Mapping[str, str | int | bool]) -> Scope:
        return Scope(self._tracer.start_span(name, context=set_span_in_context(parent), kind=kind,
                                             attributes=attributes))

    def flush(self, timeout_seconds: float = 5.0) -> bool:
        return self._provider.force_flush(int(timeout_seconds * 1000))

    def close(self) -> None:
        """Sends what is queued, waiting at most SHUTDOWN_SECONDS."""
        self._processor.shutdown_within(SHUTDOWN_SECONDS)


DEFAULT_SERVICE_NAME = "portico"


def _resource(service_name: str | None) -> Resource:
    """The spans' resource: OTEL_RESOURCE_ATTRIBUTES' attributes, and as service.name the configured one, else the
    standard variables' (OTEL_SERVICE_NAME, which the SDK reads first, then OTEL_RESOURCE_ATTRIBUTES': set per
    deployment by operators and Kubernetes' OpenTelemetry Operator), else Portico's."""
    resource = Resource.create({} if service_name is None else {"service.name": service_name})
    if str(resource.attributes.get("service.name", "")).startswith("unknown_service"):  # the SDK's stand-in
        resource = resource.merge(Resource({"service.name": DEFAULT_SERVICE_NAME}))
    return resource


_HEADERS_LOGGER = "opentelemetry.util.re"  # where the SDK warns of an OTEL_EXPORTER_OTLP_HEADERS entry it ignores
_HEADERS_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "OTEL_EXPORTER_OTLP_HEADERS")  # the first one set is read


def _exporter(endpoint: str, timeout_seconds: float) -> OTLPSpanExporter:
    """The OTLP exporter, which reads the collector's headers from the environment. An entry it cannot read
    (`authorization: Bearer ...`, a quoted value) it ignores with a warning quoting the entry, credential and all:
    those lines are held back, and one warning names the variable and how many entries were ignored."""
    ignored = _Ignored()
    logger = logging.getLogger(_HEADERS_LOGGER)
    logger.addFilter(ignored)
    try:
        exporter = OTLPSpanExporter(endpoint=endpoint, timeout=timeout_seconds, session=_session())
    finally:
        logger.removeFilter(ignored)
    if ignored.count:
        variable = next((name for name in _HEADERS_VARIABLES if os.environ.get(name)), _HEADERS_VARIABLES[1])
        entries = "1 entry is" if ignored.count == 1 else f"{ignored.count} entries are"
        _logger.warning("%s: %s not name=value (a value's quotes, commas, semicolons and backslashes URL-encoded) "
                        "and not sent to the collector", variable, entries)
    return exporter


def _session() -> requests.Session:
    """The exporter's HTTP session (requests, the exporter's own client): the one a credential provider named in
    OTEL_PYTHON_EXPORTER_OTLP_HTTP_[TRACES_]CREDENTIAL_PROVIDER makes, as the exporter would load it, else a plain
    one. The exporter follows no redirect and takes any 3xx for success, so a collector behind one (an ingress moved
    to https) lost every span unsaid: a 3xx now fails the export, and the outage warning says where it points."""
    session = _load_session_from_envvar(_CREDENTIAL_PROVIDER) or requests.Session()
    session.hooks["response"].append(_refuse_redirect)
    session.merge_environment_settings = functools.partial(_own_ca_first, session, session.merge_environment_settings)
    return session


def _own_ca_first(session: requests.Session, merge: Callable[..., dict], url: str, proxies: Mapping, stream: bool,
                  verify: object, cert: object) -> dict:
    """The exporter sets the session's `verify` to OTEL_EXPORTER_OTLP_[TRACES_]CERTIFICATE, but requests lets
    REQUESTS_CA_BUNDLE or CURL_CA_BUNDLE (set in many images to the system's bundle) win over a session's own, and
    a collector behind a private CA lost every batch to CERTIFICATE_VERIFY_FAILED. The named file wins."""
    settings = merge(url, proxies, stream, verify, cert)
    if verify is None and session.verify is not True:
        settings["verify"] = session.verify
    return settings


class CollectorRedirect(Exception):
    """A collector's 3xx: its answer to a batch it did not take."""

    def __init__(self, response: requests.Response) -> None:
        parts = urlsplit(response.headers.get("location", ""))
        # Scheme, host and port only: a URL may carry a password, and its path is not what the operator looks for.
        target = f" to {parts.scheme}://{_address(parts.geturl())}" if parts.scheme and parts.hostname else ""
        super().__init__(f"{_status(response.status_code)}{target}")


def _refuse_redirect(response: requests.Response, *args: object, **kwargs: object) -> None:
    if 300 <= response.status_code < 400:
        raise CollectorRedirect(response)


class _Ignored(logging.Filter):
    """Counts and holds back the lines it sees."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        self.count += 1
        return False


def _address(url: str) -> str:
    """host:port of the collector, for log lines (never a password a URL might carry)."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


class _CountingExporter(SpanExporter):
    """The OTLP exporter, counting the spans of batches the collector did not take, and (for _BoundedProcessor)
    how many spans have left the queue.

    The exporter logs every failed batch (an error a few seconds apart for as long as a collector is down); those
    lines are held back and an outage is logged once when it begins, with why (the collector's status, or why it
    could not be reached: from the lines held back), and once when it ends."""

    def __init__(self, inner: OTLPSpanExporter, on_dropped: Callable[[str, int], None], collector: str,
                 timeout_seconds: float) -> None:
        self._inner = inner
        self._timeout_seconds = timeout_seconds
        self._on_dropped = on_dropped
        self._collector = collector
        self._failing = False
        self.taken: Callable[[int], None] = lambda count: None
        self._quiet = _Quiet()
        logging.getLogger(_EXPORTER_LOGGER).addFilter(self._quiet)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.taken(len(spans))
        self._quiet.reason = ""
        began = time.monotonic()
        try:
            result = self._inner.export(spans)
        except Exception:  # noqa: BLE001 - the export thread must go on whatever the exporter does
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self._on_dropped(SPANS_EXPORT_FAILED, len(spans))
            if not self._failing:
                why = self._quiet.reason
                if not why and time.monotonic() - began >= self._timeout_seconds * 0.9:  # its last try timed out
                    why = f"no answer within {self._timeout_seconds:g} s"
                why = f" ({why})" if why else ""
                _logger.warning("exporting traces to %s fails%s; spans are dropped "
                                "(portico_trace_spans_dropped_total) until it takes them again", self._collector, why)
        elif self._failing:
            _logger.warning("exporting traces to %s works again", self._collector)
        self._failing = result is not SpanExportResult.SUCCESS
        return result

    def shutdown(self) -> None:
        self._inner.shutdown()
        logging.getLogger(_EXPORTER_LOGGER).removeFilter(self._quiet)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)


_EXPORTER_LOGGER = OTLPSpanExporter.__module__  # the logger the exporter and its HTTP client write to


class _Quiet(logging.Filter):
    """Holds back the exporter's lines, keeping why its latest export failed (`reason`)."""

    def __init__(self) -> None:
        super().__init__()
        self.reason = ""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.CRITICAL:
            return True
        args = record.args if isinstance(record.args, tuple) else ()
        self.reason = next(filter(None, map(_reason, args)), self.reason)
        return False


_PHRASES = {status.phrase: status for status in HTTPStatus}


def _reason(value: object) -> str:
    """Why an export failed, from an argument of an exporter's log line: the collector's status (its code, or the
    reason phrase the exporter's retry lines give), or the error that left no answer, as the OS names it when one
    did ("Connection refused", "Name or service not known"), else by the innermost error's class. Never the errors'
    whole text, which names the URL."""
    if isinstance(value, int) and not isinstance(value, bool) and 100 <= value <= 599:
        return _status(value)
    if isinstance(value, str) and value in _PHRASES:
        return _status(_PHRASES[value].value)
    if not isinstance(value, BaseException):
        return ""
    if isinstance(value, CollectorRedirect):
        return str(value)
    # requests' ConnectionError > urllib3's MaxRetryError (.reason) or ProtocolError (args) > the OS's or
    # http.client's error
    error, seen = value, 0
    while seen < 8:
        if isinstance(error, OSError) and error.strerror:
            return str(error.strerror)[:120]
        inner = [getattr(error, "reason", None), *error.args, error.__cause__, error.__context__]
        found = next((each for each in inner if isinstance(each, BaseException)), None)
        if found is None:
            break
        error, seen = found, seen + 1
    return _WHY.get(type(error).__name__, type(error).__name__)


# What the innermost errors with no text of the OS's mean for an operator.
_WHY = {
    # An HTTP/2 frame where an HTTP/1.1 status line was expected: the port is the collector's OTLP/gRPC one.
    "BadStatusLine": "the answer is not HTTP/1.1: an OTLP/gRPC port, such as 4317? OTLP/HTTP's is 4318",
    "RemoteDisconnected": "the collector closed the connection without answering",
}


def _status(code: int) -> str:
    """"HTTP 308 Permanent Redirect", or "HTTP 599" for a code without a standard reason phrase."""
    return f"HTTP {code} {HTTPStatus(code).phrase}" if code in HTTPStatus._value2member_map_ else f"HTTP {code}"


class _BoundedProcessor(SpanProcessor):
    """The SDK's batch processor behind a gate that counts what it would drop: the SDK drops silently (a log line)
    when its queue is full, so spans in the queue are counted here, and one that would overflow it is dropped here,
    counted, instead."""

    def __init__(self, inner: BatchSpanProcessor, capacity: int, on_dropped: Callable[[str, int], None],
                 exporter: _CountingExporter) -> None:
        self._inner = inner
        self._capacity = capacity
        self._on_dropped = on_dropped
        self._queued = 0
        self._lock = threading.Lock()
        exporter.taken = self._taken

    def _taken(self, count: int) -> None:
        with self._lock:
            self._queued = max(0, self._queued - count)

    def on_start(self, span, parent_context: Context | None = None) -> None:
        pass

    def on_end(self, span: ReadableSpan) -> None:
        if not span.context.trace_flags.sampled:
            return
        with self._lock:
            full = self._queued >= self._capacity
            if not full:
                self._queued += 1
        if full:
            self._on_dropped(SPANS_QUEUE_FULL, 1)
            return
        self._inner.on_end(span)

    def shutdown(self) -> None:
        self.shutdown_within(SHUTDOWN_SECONDS)

    def shutdown_within(self, seconds: float) -> None:
        # The SDK's public shutdown waits up to 30 s for an export in progress (retrying an unreachable collector);
        # its batch processor takes the bound we need.
        batch = getattr(self._inner, "_batch_processor", None)
        if batch is None:
            self._inner.shutdown()
        else:
            batch.shutdown(timeout_millis=int(seconds * 1000))

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self._inner.force_flush(timeout_millis)
