"""OpenTelemetry traces: one server span per request, joined to the caller's W3C `traceparent`, with child spans for
admission, each upstream attempt (client kind) and embedded-model generation (the SDK side, exporting them over
OTLP/HTTP, is server/observability/tracing_export.py, loaded only when tracing is on).

This module needs only the OpenTelemetry API: the spans' scopes, their error marking, and W3C trace context read
from gRPC metadata and written into upstream requests. Spans carry ids, labels, counts and codes only: never a
prompt, a completion, a header value, an error message (an upstream's may quote the prompt) or a secret.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Sequence

from opentelemetry.propagators.textmap import Getter
from opentelemetry.trace import Span, Status, StatusCode, format_trace_id, get_current_span, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from server.domain import Endpoint
from server.domain_answers import UpstreamAnswer
from server.errors import PorticoError, redact_secrets

Metadata = Sequence[tuple[str, str | bytes]]

# What each endpoint does, in the gen_ai conventions' words (gen_ai.operation.name); absent: not a model call.
# Counting tokens has no name there (the conventions allow one of a system's own): it is no chat, generating nothing.
COUNT_TOKENS = "count_tokens"
OPERATIONS = {Endpoint.CHAT: "chat", Endpoint.MESSAGES: "chat", Endpoint.IMAGES: "generate_content",
              "/v1/messages/count_tokens": COUNT_TOKENS}


class Scope:
    """A child span from `with` to the end of the block; a failure leaving the block marks it failed."""

    __slots__ = ("span",)

    def __init__(self, span: Span) -> None:
        self.span = span

    def set(self, key: str, value: str | int | float | bool) -> None:
        self.span.set_attribute(key, value)

    @property
    def recording(self) -> bool:
        """Whether what is set is kept (a sampled trace): callers read an answer for `answered` only then."""
        return self.span.is_recording()

    def answered(self, answer: UpstreamAnswer) -> None:
        """What an upstream said of its answer, in the conventions' names: each value `answer` holds, replacing
        the one an earlier part of a stream gave."""
        span = self.span
        if answer.id:
            span.set_attribute("gen_ai.response.id", answer.id)
        if answer.model:
            span.set_attribute("gen_ai.response.model", answer.model)
        if answer.finish_reason:
            span.set_attribute("gen_ai.response.finish_reasons", (answer.finish_reason,))
        if answer.input_tokens is not None:
            span.set_attribute("gen_ai.usage.input_tokens", answer.input_tokens)
        if answer.output_tokens is not None:
            span.set_attribute("gen_ai.usage.output_tokens", answer.output_tokens)

    def headers(self) -> dict[str, str]:
        """W3C trace-context headers naming this span as the parent: for the upstream this span calls."""
        carrier: dict[str, str] = {}
        PROPAGATOR.inject(carrier, context=set_span_in_context(self.span))
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
    recording = False

    def set(self, key: str, value: str | int | float | bool) -> None:
        pass

    def answered(self, answer: UpstreamAnswer) -> None:
        pass

    def headers(self) -> dict[str, str]:
        return {}

    def __enter__(self) -> NoScope:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        pass


NO_SCOPE = NoScope()


def failed(span: Span, exc: BaseException) -> None:
    """The error's codes, never its message (an upstream's message may quote the prompt): error.type the one the
    caller is given (context_length_exceeded, an upstream's own), portico.error.code the error table's row."""
    if isinstance(exc, PorticoError):
        code, row = exc.code, exc.kind.code
        if exc.retry_reason:
            span.set_attribute("portico.retry_reason", exc.retry_reason)
        if limit := exc.metric_labels().get("limit"):
            span.set_attribute("portico.limit", limit)
    else:  # the rows the request span gets for these too
        code = row = "cancelled" if isinstance(exc, asyncio.CancelledError) else "internal_error"
    span.set_attribute("portico.error.code", row)
    span.set_attribute("error.type", code)
    span.set_status(Status(StatusCode.ERROR, code))


def trace_id_of(span: Span) -> str | None:
    """The span's trace id; None for the invalid span an SDK switched off (OTEL_SDK_DISABLED) starts."""
    context = span.get_span_context()
    return format_trace_id(context.trace_id) if context.is_valid else None


def caller_trace_id(traceparent: str | bytes) -> str | None:
    """The trace id of a W3C traceparent header that the tracing-on path would join (OpenTelemetry's propagator
    reads it by the spec: lowercase hex, no all-zero ids, version 00 exact and ff refused), else None."""
    if not isinstance(traceparent, str):
        return None
    context = get_current_span(PROPAGATOR.extract((("traceparent", traceparent),), getter=METADATA)).get_span_context()
    return format_trace_id(context.trace_id) if context.is_valid else None


class _MetadataGetter(Getter[Metadata]):
    """Reads gRPC metadata, a sequence of (lowercase name, value) pairs, for the trace-context propagator.

    What the propagator would refuse (W3C's limits) is absent here: it logs a WARNING for each, quoting a tracestate
    member, so one caller's malformed header was a line of its text in the diagnostic log for every request."""

    def get(self, carrier: Metadata, key: str) -> list[str] | None:
        values = [value for name, value in carrier if name == key and isinstance(value, str)]
        if key == "traceparent" and values and len(values[0]) > _TRACEPARENT_MAX:
            return None  # no parent, as the propagator decides: Portico starts the trace
        if key == "tracestate":  # the caller's own text, exported with every span and sent on to upstreams
            values = [_without_secrets(value) for value in values]
            if values and not _well_formed(values):
                return None  # dropped whole, as the propagator drops it
        return values or None

    def keys(self, carrier: Metadata) -> list[str]:
        return [name for name, _ in carrier]


def _without_secrets(tracestate: str) -> str:
    """`tracestate` without its entries that hold anything shaped like a Portico secret (a key pasted there)."""
    return ",".join(entry for entry in tracestate.split(",") if redact_secrets(entry) == entry)


# W3C trace context's limits, as OpenTelemetry's propagator applies them (opentelemetry.trace.span): a traceparent
# of at most 512 characters; a tracestate of at most 8192 (its headers joined by commas) and 32 members, each
# `key=value` (a key in lower case, perhaps `tenant@system`; a value of printable ASCII but `,` and `=`).
_TRACEPARENT_MAX, _TRACESTATE_MAX, _TRACESTATE_MEMBERS = 512, 8192, 32
_KEY = r"[a-z][_0-9a-z\-*/]{0,255}|[a-z0-9][_0-9a-z\-*/]{0,240}@[a-z][_0-9a-z\-*/]{0,13}"
_MEMBER = re.compile(rf"(?:{_KEY})=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{{0,255}}[\x21-\x2b\x2d-\x3c\x3e-\x7e]")


def _well_formed(tracestates: list[str]) -> bool:
    """Whether the propagator takes these tracestate headers without a word: within the limits, no member
    malformed, no key twice."""
    if sum(map(len, tracestates)) + len(tracestates) - 1 > _TRACESTATE_MAX:
        return False
    keys = set()
    for member in (m.strip(" \t") for value in tracestates for m in value.split(",")):
        if not member:
            continue
        if not _MEMBER.fullmatch(member):
            return False
        key = member.partition("=")[0]
        if key in keys:
            return False
        keys.add(key)
    return len(keys) <= _TRACESTATE_MEMBERS


METADATA = _MetadataGetter()
PROPAGATOR = TraceContextTextMapPropagator()  # stateless: W3C traceparent + tracestate
