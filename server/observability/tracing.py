"""OpenTelemetry traces: one server span per request, joined to the caller's W3C `traceparent`, with child spans for
admission, each upstream attempt (client kind) and embedded-model generation; exported over OTLP/HTTP (protobuf).

Built on the official SDK and exporter (opentelemetry-sdk, opentelemetry-exporter-otlp-proto-http) rather than code
of our own: their batching, retries and wire format are what every collector is tested against. Nothing is made
global (no `trace.set_tracer_provider`): each server owns its provider, and parents are passed explicitly, so the
SDK's own context never has to follow grpc.aio's tasks.

Export never slows or fails a request: ending a span appends it to a bounded queue, a background thread sends
batches, and a span that finds the queue full is dropped and counted (`portico_trace_spans_dropped_total`), as is
every span of a batch the collector did not take. Spans carry ids, labels, counts and codes only: never a prompt, a
completion, a header value, an error message (an upstream's may quote the prompt) or a secret.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from urllib.parse import urlsplit

from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import Span, SpanKind, Status, StatusCode, format_trace_id, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from server.config_tracing import TracingSettings
from server.errors import PorticoError
from server.limits.core import LimitExceeded

_logger = logging.getLogger(__name__)

Metadata = Sequence[tuple[str, str | bytes]]
SHUTDOWN_SECONDS = 2.0  # at shutdown, how long queued spans may take to leave; the drain must not wait on a collector

# What each endpoint does, in the gen_ai conventions' words (gen_ai.operation.name); absent: not a model call.
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/messages": "chat",
    "/v1/images/generations": "generate_content",
}


class Scope:
    """A child span from `with` to the end of the block; a failure leaving the block marks it failed."""

    __slots__ = ("span",)

    def __init__(self, span: Span) -> None:
        self.span = span

    def set(self, key: str, value: str | int | float | bool) -> None:
        self.span.set_attribute(key, value)

    def headers(self) -> dict[str, str]:
        """W3C trace-context headers naming this span as the parent: for the upstream this span calls."""
        carrier: dict[str, str] = {}
        _PROPAGATOR.inject(carrier, context=set_span_in_context(self.span))
        return carrier

    def __enter__(self) -> Scope:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # GeneratorExit: the consumer closed a generator it had read enough of (an answer after its Finished event),
        # not a failure; a caller that went away shows as CancelledError where the request was waiting.
        if exc is not None and exc_type is not GeneratorExit:
            failed(self.span, exc)
        self.span.end()


class NoScope:
    """What a caller gets when the request is not traced: every call does nothing."""

    __slots__ = ()

    def set(self, key: str, value: str | int | float | bool) -> None:
        pass

    def headers(self) -> dict[str, str]:
        return {}

    def __enter__(self) -> NoScope:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        pass


NO_SCOPE = NoScope()


def failed(span: Span, exc: BaseException) -> None:
    """The error's code from the error table, never its message (an upstream's message may quote the prompt)."""
    if isinstance(exc, PorticoError):
        code = exc.kind.code
        if exc.retry_reason:
            span.set_attribute("portico.retry_reason", exc.retry_reason)
        if isinstance(exc, LimitExceeded):
            span.set_attribute("portico.limit", exc.dimension.value)
    elif isinstance(exc, asyncio.CancelledError):
        code = "cancelled"
    else:
        code = "internal_error"
    span.set_attribute("error.type", code)
    span.set_status(Status(StatusCode.ERROR, code))


class Tracing:
    def __init__(self, settings: TracingSettings, on_dropped: Callable[[str, int], None]) -> None:
        """`on_dropped(reason, spans)`: spans lost, because the queue was full or the collector refused them."""
        assert settings.otlp_endpoint is not None
        self.settings = settings
        resource = Resource.create({"service.name": settings.service_name})
        # Parent-based: a caller's sampling decision wins; the ratio applies to traces that start here.
        sampler = ParentBased(TraceIdRatioBased(settings.sample_ratio))
        self._provider = TracerProvider(sampler=sampler, resource=resource, shutdown_on_exit=False)
        exporter = _CountingExporter(
            OTLPSpanExporter(endpoint=settings.otlp_endpoint, timeout=settings.export_timeout_seconds), on_dropped,
            collector=_address(settings.otlp_endpoint),
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
        parent = _PROPAGATOR.extract(metadata, getter=_METADATA)
        return self._tracer.start_span(name, context=parent, kind=SpanKind.SERVER)

    def child(self, parent: Span, name: str, kind: SpanKind, attributes: Mapping[str, str | int | bool]) -> Scope:
        return Scope(self._tracer.start_span(name, context=set_span_in_context(parent), kind=kind,
                                             attributes=attributes))

    def flush(self, timeout_seconds: float = 5.0) -> bool:
        return self._provider.force_flush(int(timeout_seconds * 1000))

    def close(self) -> None:
        """Sends what is queued, waiting at most SHUTDOWN_SECONDS."""
        self._processor.shutdown_within(SHUTDOWN_SECONDS)


def _address(url: str) -> str:
    """host:port of the collector, for log lines (never a password a URL might carry)."""
    parts = urlsplit(url)
    return f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"


def trace_id_of(span: Span) -> str:
    return format_trace_id(span.get_span_context().trace_id)


def caller_trace_id(traceparent: str | bytes) -> str | None:
    """The trace id of a valid W3C traceparent header ("00-<32 hex>-<16 hex>-<2 hex>"), else None."""
    if not isinstance(traceparent, str) or len(traceparent) < 55 or traceparent[2] != "-":
        return None
    trace_id = traceparent[3:35]
    try:
        valid = int(trace_id, 16) != 0 and traceparent[35] == "-" and trace_id.islower()
    except ValueError:
        return None
    return trace_id if valid else None


class _MetadataGetter(Getter[Metadata]):
    """Reads gRPC metadata, a sequence of (lowercase name, value) pairs, for the trace-context propagator."""

    def get(self, carrier: Metadata, key: str) -> list[str] | None:
        values = [value for name, value in carrier if name == key and isinstance(value, str)]
        return values or None

    def keys(self, carrier: Metadata) -> list[str]:
        return [name for name, _ in carrier]


_METADATA = _MetadataGetter()
_PROPAGATOR = TraceContextTextMapPropagator()  # stateless: W3C traceparent + tracestate


class _CountingExporter(SpanExporter):
    """The OTLP exporter, counting the spans of batches the collector did not take, and (for _BoundedProcessor)
    how many spans have left the queue.

    The exporter logs every failed batch (an error a few seconds apart for as long as a collector is down); those
    lines are held back and an outage is logged once when it begins and once when it ends."""

    def __init__(self, inner: OTLPSpanExporter, on_dropped: Callable[[str, int], None], collector: str) -> None:
        self._inner = inner
        self._on_dropped = on_dropped
        self._collector = collector
        self._failing = False
        self.taken: Callable[[int], None] = lambda count: None
        self._quiet = _Quiet()
        logging.getLogger(_EXPORTER_LOGGER).addFilter(self._quiet)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        self.taken(len(spans))
        try:
            result = self._inner.export(spans)
        except Exception:  # noqa: BLE001 - the export thread must go on whatever the exporter does
            result = SpanExportResult.FAILURE
        if result is not SpanExportResult.SUCCESS:
            self._on_dropped("export_failed", len(spans))
            if not self._failing:
                _logger.warning("exporting traces to %s fails; spans are dropped (portico_trace_spans_dropped_total) "
                                "until it takes them again", self._collector)
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
    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.CRITICAL


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
            self._on_dropped("queue_full", 1)
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
