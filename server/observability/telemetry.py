"""Telemetry: the one place a request is observed. The error interceptor opens a RequestRecord when an RPC starts
and closes it when it ends; in between, the authenticator and the pipeline note what they learn (key id, model,
tokens, upstream times) on the current record, and providers report retries and fallbacks (UpstreamRecorder).
Closing a record updates the metrics and writes the access-log line.

The current record lives in a ContextVar: grpc.aio runs every RPC in its own asyncio task, whose context is its
own copy, so a record set at the start of an RPC is seen by everything that RPC runs (tasks it starts included)
and by nothing else. The variable belongs to this object, not to the module, to keep module state out.

With `tracing.otlp_endpoint` set, the record also carries the request's OpenTelemetry span, opened and ended with
it; the pipeline and providers open child spans under it through `span`, `attempt` and `generation`, which cost
one attribute check when the request is not traced.
"""

from __future__ import annotations

import contextvars
import os
import time
import uuid
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

from opentelemetry.trace import SpanKind, Status, StatusCode

from server.config_tracing import TracingSettings
from server.domain import SamplingParams
from server.domain_keys import ApiKey
from server.errors import redact_secrets
from server.observability.access_log import AccessLog
from server.observability.metrics import MULTIPROCESS_ENV, Metrics
from server.observability.record import RETRY_REASONS, Outcome, RequestRecord
from server.observability.tracing import NO_SCOPE, OPERATIONS, NoScope, Scope, caller_trace_id, trace_id_of

if TYPE_CHECKING:
    from server.observability.tracing_export import Tracing

DEPLOYMENT_STATES = ("healthy", "ejected", "trial")  # server/providers/health.py STATES
EMBEDDED_PROVIDER = "portico.embedded"  # gen_ai.provider.name: no well-known value names an in-process llama.cpp
_REQUEST_ID = "x-request-id"  # set by Envoy on every request it forwards
_TRACEPARENT = "traceparent"  # the caller's W3C trace context (REST: the HTTP header, passed on by Envoy)


class RequestSink(Protocol):
    """Where the record of a request that reached admission goes when it ends (the usage ledger)."""

    def opened(self, record: RequestRecord) -> None:
        """The request is handed to its model: it will be `add`ed when it ends (or by the next process to start,
        if this one dies first)."""
        ...

    def add(self, record: RequestRecord, outcome: Outcome, finished: float) -> None: ...


class Telemetry:
    def __init__(self, metrics: Metrics | None = None, access_log: AccessLog | None = None,
                 tracing: TracingSettings | None = None, ledger: RequestSink | None = None) -> None:
        self.metrics = metrics or Metrics.create()
        self.access_log = access_log or AccessLog("off")
        self.ledger = ledger
        self.tracing: Tracing | None = None
        if tracing is not None and tracing.enabled:
            # Imported here: the SDK and exporter cost every server process ~4 MB when tracing is off.
            from server.observability.tracing_export import Tracing

            self.tracing = Tracing(tracing, self._spans_dropped)
        self._current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
            "portico_request", default=None
        )
        # Labelled children, looked up once per label set (prometheus_client's .labels() validates and locks on
        # every call). The label sets are bounded (server/observability/record.py), so these dicts are too.
        self._children: dict[tuple, Any] = {}
        # key id -> the budgets ("day", "month") it has a portico_budget_remaining_microdollars series of, so that a
        # budget removed from the key loses its series (budgets_in_force). prometheus_client cannot remove a series
        # of the workers' shared files (--workers N): there it stays until the gateway stops.
        self._budget_gauges: dict[str, set[str]] = {}
        self._budget_gauges_removable = MULTIPROCESS_ENV not in os.environ

    def _child(self, family: Any, *labels: str) -> Any:
        key = (id(family), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(*labels)
        return child

    def begin(self, method: str, endpoint: str, metadata: Sequence[tuple[str, str | bytes]]) -> RequestRecord:
        request_id, trace_id = _ids(metadata)
        record = RequestRecord(request_id=request_id, rpc=method.removeprefix("/portico.v1."), endpoint=endpoint,
                               trace_id=trace_id)
        if self.tracing is not None:
            record.span = self.tracing.server_span(method.removeprefix("/"), metadata)
            record.trace_id = trace_id_of(record.span) or trace_id  # the SDK switched off: the caller's, if any
        self._current.set(record)  # no reset needed: the RPC's task, and so this context, ends with the RPC
        self._child(self.metrics.in_flight, endpoint).inc()
        return record

    def current(self) -> RequestRecord:
        """The record of the RPC running now; outside an observed RPC (direct calls in tests), a throwaway one."""
        return self._current.get() or RequestRecord(request_id="", rpc="", endpoint="")

    def identified(self, key: ApiKey) -> None:
        """The authenticator found the caller's key."""
        record = self.current()
        record.key_id, record.key_env = key.id, key.env

    def acts_on(self, key_id: str) -> None:
        """An admin call acts on this key: its line says which, so that who changed a key can be found."""
        self.current().target_key_id = key_id

    def handed_over(self, record: RequestRecord) -> None:
        """The request goes to its model now (the usage ledger marks it, in case this process dies before it ends).
        Only an observed RPC's: a throwaway record (`current` outside one) never ends, so its mark would outlive it."""
        if self.ledger is not None and self._current.get() is record:
            self.ledger.opened(record)

    def finish(self, record: RequestRecord, outcome: Outcome) -> None:
        now, wall_ns = time.monotonic(), time.time_ns()
        m, endpoint, model = self.metrics, record.endpoint, record.model
        record.upstream_done()
        if record.in_band_error and not outcome.code:  # a stream that failed after its 200 went out
            outcome = Outcome(outcome.status, record.in_band_error)
        child = self._child
        child(m.in_flight, endpoint).dec()
        child(m.requests, endpoint, model, str(outcome.status), outcome.code).inc()
        child(m.request_seconds, endpoint, model).observe(now - record.started)
        if record.upstream_seconds is not None:
            child(m.upstream_seconds, model).observe(record.upstream_seconds)
        if record.first_token_seconds is not None:
            child(m.first_token_seconds, endpoint, model).observe(record.first_token_seconds)
        if record.input_tokens or record.output_tokens:
            child(m.input_tokens, model, record.key_id).inc(record.input_tokens)
            child(m.output_tokens, model, record.key_id).inc(record.output_tokens)
        if record.cost_micros:
            child(m.spend, model, record.key_id).inc(record.cost_micros)
        if record.cache:
            child(m.cache_lookups, model, record.cache).inc()
        if outcome.limit:
            child(m.rate_limit_rejections, outcome.limit, outcome.scope).inc()
        self.access_log.write(record, outcome, now)
        if record.admitted and self.ledger is not None:
            self.ledger.add(record, outcome, now)
        if record.span is not None:
            _end_span(record, outcome, wall_ns)

    def span(self, record: RequestRecord, name: str, **attributes: str | int | bool) -> Scope | NoScope:
        """A child span of the request's (internal kind), e.g. admission; a no-op when it is not traced."""
        if record.span is None or self.tracing is None:
            return NO_SCOPE
        return self.tracing.child(record.span, name, SpanKind.INTERNAL, attributes)

    def attempt(self, model: str, upstream_model: str, provider: str, operation: str, address: str,
                port: int | None) -> Scope | NoScope:
        record = self._current.get()
        if record is None:
            return NO_SCOPE
        record.answered_by = model  # traced or not: the usage ledger reads it too
        if record.span is None or self.tracing is None:
            return NO_SCOPE
        record.spans_started += 1
        record.provider = provider
        attributes = {
            "gen_ai.operation.name": operation, "gen_ai.provider.name": provider,
            "gen_ai.request.model": upstream_model, "server.address": address, "portico.model": model,
            "portico.attempt": record.spans_started, "portico.fallback": bool(record.model) and model != record.model,
        }
        if port is not None:
            attributes["server.port"] = port
        if record.deployment:
            attributes["portico.deployment"] = record.deployment
        return self.tracing.child(record.span, f"{operation} {upstream_model}", SpanKind.CLIENT, attributes)

    def generation(self, engine_model: str, operation: str = "chat") -> Scope | NoScope:
        record = self._current.get()
        if record is None or record.span is None or self.tracing is None:
            return NO_SCOPE
        record.spans_started += 1
        record.provider = EMBEDDED_PROVIDER
        # The embedded model serves many model ids: this is the one asked for, or the fallback being tried.
        model = record.answered_by or record.model
        attributes = {"gen_ai.operation.name": operation, "gen_ai.provider.name": EMBEDDED_PROVIDER,
                      "gen_ai.request.model": engine_model, "portico.model": model,
                      "portico.attempt": record.spans_started, "portico.fallback": model != record.model}
        return self.tracing.child(record.span, f"generate {engine_model}", SpanKind.INTERNAL, attributes)

    def close(self) -> None:
        if self.tracing is not None:
            self.tracing.close()
        self.access_log.close()

    def _spans_dropped(self, reason: str, count: int) -> None:
        self._child(self.metrics.trace_spans_dropped, reason).inc(count)

    def budget_left(self, key_id: str, budget: str, microdollars: int) -> None:
        """What is left of a key's budget ("day" or "month") after its latest request."""
        self._child(self.metrics.budget_left, key_id, budget).set(microdollars)
        if self._budget_gauges_removable:
            self._budget_gauges.setdefault(key_id, set()).add(budget)

    def shows_budgets(self, key_id: str) -> bool:
        return key_id in self._budget_gauges

    def budgets_in_force(self, key_id: str, budgets: set[str]) -> None:
        """A request of the key ends under these budgets only: the series of any other it had go (the operator
        removed that budget), rather than show for good what was left of a budget the key no longer has."""
        shown = self._budget_gauges.get(key_id, set())
        for budget in shown - budgets:
            shown.discard(budget)
            self._children.pop((id(self.metrics.budget_left), key_id, budget), None)
            self.metrics.budget_left.remove(key_id, budget)
        if not shown:
            self._budget_gauges.pop(key_id, None)

    # UpstreamRecorder (server/observability/record.py)
    def retry(self, model: str, reason: str) -> None:
        self._child(self.metrics.upstream_retries, model, reason if reason in RETRY_REASONS else "other").inc()
        self.current().upstream_attempts += 1

    def deployment(self, model: str, name: str) -> None:
        record = self.current()
        record.answered_by, record.deployment = model, name

    def fallback(self, model: str, fallback: str, *, after_attempt: bool = True) -> None:
        self._child(self.metrics.upstream_fallbacks, model, fallback).inc()
        record = self.current()
        if after_attempt:  # the first attempt is counted by upstream_call: one sent straight here is that one
            record.upstream_attempts += 1
        record.answered_by = fallback
        if record.span is not None:
            record.provider = ""  # the failed model's; a fallback counted by Portico itself has none

    def deployment_attempt(self, model: str, deployment: str, failure: str | None) -> None:
        self._child(self.metrics.deployment_requests, model, deployment).inc()
        if failure is not None:
            reason = failure if failure in RETRY_REASONS else "other"
            self._child(self.metrics.deployment_failures, model, deployment, reason).inc()

    def deployment_states(self, states: Sequence[tuple[str, str, str]]) -> None:
        """(model, deployment, state) of every watched deployment, as the health board says now."""
        for model, deployment, state in states:
            for each in DEPLOYMENT_STATES:
                self._child(self.metrics.deployment_state, model, deployment, each).set(int(each == state))


def _ids(metadata: Sequence[tuple[str, str | bytes]]) -> tuple[str, str | None]:
    """The request id (Envoy's x-request-id, else a new one) and the trace id of the caller's traceparent."""
    request_id, trace_id = "", None
    for name, value in metadata:
        if name == _REQUEST_ID and isinstance(value, str) and value:
            # The caller may have chosen it: keep the log line bounded, and a key pasted there out of it (for REST
            # callers Envoy's Lua filter did the same already, so they got back this id).
            request_id = redact_secrets(value)[:128]
        elif name == _TRACEPARENT:
            trace_id = caller_trace_id(value)
    return request_id or uuid.uuid4().hex, trace_id  # no x-request-id: a direct gRPC caller, not through Envoy


# The conventions' gen_ai.request.* settings a caller may set, with their types there (a caller's `"temperature": 1`
# is still a double: backends index an attribute by its type); not stop sequences, which are the caller's text.
_SETTINGS = (("max_tokens", int), ("temperature", float), ("top_p", float), ("top_k", float), ("seed", int),
             ("frequency_penalty", float), ("presence_penalty", float))


def _request_settings(params: SamplingParams, attributes: dict) -> None:
    for name, kind in _SETTINGS:
        if (value := getattr(params, name)) is not None:  # None: the caller did not set it
            attributes["gen_ai.request." + name] = kind(value)


def _end_span(record: RequestRecord, outcome: Outcome, end_ns: int) -> None:
    """The request's span gets what the request turned out to be, in the gen_ai conventions' names where they
    have one, and ends when the access log and the ledger say it did (not after writing them). Only ids, labels,
    counts and codes: nothing a caller or a model wrote."""
    span = record.span
    operation = OPERATIONS.get(record.endpoint)
    service, _, method = record.rpc.partition("/")
    attributes: dict[str, str | int | float | Sequence[str]] = {
        "portico.endpoint": record.endpoint, "portico.request_id": record.request_id, "rpc.system": "grpc",
        "rpc.service": "portico.v1." + service, "rpc.method": method, "http.response.status_code": outcome.status,
    }
    if operation is not None:
        attributes["gen_ai.operation.name"] = operation
    if record.key_id:
        attributes["portico.key_id"] = record.key_id
    if record.model:
        attributes["gen_ai.request.model"] = record.model
        if operation is not None:
            span.update_name(f"{operation} {record.model}")
    if record.model_answered:  # not for a refusal, a request every upstream failed, a cache hit
        attributes["gen_ai.response.model"] = record.answered_by or record.model
    # Required by the conventions on an inference span: who answered, as its attempt or generation span says (a 200
    # without a model's answer: a count an upstream made; none for a cache hit or a count made here, no attempt).
    if record.provider and (record.model_answered or outcome.status == 200):
        attributes["gen_ai.provider.name"] = record.provider
    if record.params is not None:
        _request_settings(record.params, attributes)
    if record.output_type:
        attributes["gen_ai.output.type"] = record.output_type
    if record.cache:
        attributes["portico.cache"] = record.cache
    if record.input_tokens or record.output_tokens:
        attributes["gen_ai.usage.input_tokens"] = record.input_tokens
        attributes["gen_ai.usage.output_tokens"] = record.output_tokens
    if record.cached_input_tokens:
        attributes["gen_ai.usage.cache_read.input_tokens"] = record.cached_input_tokens
    if record.cache_write_tokens:
        attributes["gen_ai.usage.cache_creation.input_tokens"] = record.cache_write_tokens
    if record.response_id and outcome.status == 200:  # the caller got an answer with this id
        attributes["gen_ai.response.id"] = record.response_id
    if record.finish_reason:
        attributes["gen_ai.response.finish_reasons"] = (record.finish_reason,)
    if record.upstream_attempts:
        attributes["portico.upstream_attempts"] = record.upstream_attempts
    if record.first_token_seconds is not None:
        attributes["portico.time_to_first_token_ms"] = round(record.first_token_seconds * 1000, 1)
    if outcome.code:
        attributes["error.type"] = outcome.caller_code or outcome.code  # the conventions: the provider's code
        attributes["portico.error.code"] = outcome.code
    if outcome.limit:
        attributes["portico.limit"] = outcome.limit
    span.set_attributes(attributes)
    if outcome.status >= 500 or (outcome.code and outcome.status < 400):  # and a stream that failed after its 200
        span.set_status(Status(StatusCode.ERROR, outcome.code))
    span.end(end_time=end_ns)
