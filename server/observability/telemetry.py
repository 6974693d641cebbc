"""Telemetry: the one place a request is observed. The error interceptor opens a RequestRecord when an RPC starts
and closes it when it ends; in between, the authenticator and the pipeline note what they learn (key id, model,
tokens, upstream times) on the current record, and providers report retries and fallbacks (UpstreamRecorder).
Closing a record updates the metrics and writes the access-log line.

The current record lives in a ContextVar: grpc.aio runs every RPC in its own asyncio task, whose context is its
own copy, so a record set at the start of an RPC is seen by everything that RPC runs (tasks it starts included)
and by nothing else. The variable belongs to this object, not to the module, to keep module state out.
"""

from __future__ import annotations

import contextvars
import time
import uuid
from collections.abc import Sequence
from typing import Any

from server.domain import ApiKey
from server.observability.access_log import AccessLog
from server.observability.metrics import Metrics
from server.observability.record import RETRY_REASONS, Outcome, RequestRecord

_REQUEST_ID = "x-request-id"  # set by Envoy on every request it forwards


class Telemetry:
    def __init__(self, metrics: Metrics | None = None, access_log: AccessLog | None = None) -> None:
        self.metrics = metrics or Metrics.create()
        self.access_log = access_log or AccessLog("off")
        self._current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
            "portico_request", default=None
        )
        # Labelled children, looked up once per label set (prometheus_client's .labels() validates and locks on
        # every call). The label sets are bounded (server/observability/record.py), so these dicts are too.
        self._children: dict[tuple, Any] = {}

    def _child(self, family: Any, *labels: str) -> Any:
        key = (id(family), *labels)
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = family.labels(*labels)
        return child

    def begin(self, method: str, endpoint: str, metadata: Sequence[tuple[str, str | bytes]]) -> RequestRecord:
        record = RequestRecord(request_id=_request_id(metadata), rpc=method.removeprefix("/portico.v1."),
                               endpoint=endpoint)
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

    def finish(self, record: RequestRecord, outcome: Outcome) -> None:
        now = time.monotonic()
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
        if outcome.limit:
            child(m.rate_limit_rejections, outcome.limit, outcome.scope).inc()
        self.access_log.write(record, outcome, now)

    # UpstreamRecorder (server/observability/record.py)
    def retry(self, model: str, reason: str) -> None:
        self._child(self.metrics.upstream_retries, model, reason if reason in RETRY_REASONS else "other").inc()
        self.current().upstream_attempts += 1

    def fallback(self, model: str, fallback: str) -> None:
        self._child(self.metrics.upstream_fallbacks, model, fallback).inc()
        self.current().upstream_attempts += 1


def _request_id(metadata: Sequence[tuple[str, str | bytes]]) -> str:
    for name, value in metadata:
        if name == _REQUEST_ID and isinstance(value, str) and value:
            return value[:128]  # the caller may have chosen it: keep the log line bounded
    return uuid.uuid4().hex  # a direct gRPC caller, not through Envoy
