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
import logging
import time
import uuid
from collections.abc import Sequence

from server.domain import ApiKey
from server.observability import access_log
from server.observability.metrics import Metrics
from server.observability.record import RETRY_REASONS, Outcome, RequestRecord

_REQUEST_ID = "x-request-id"  # set by Envoy on every request it forwards


class Telemetry:
    def __init__(self, metrics: Metrics | None = None, logger: logging.Logger | None = None) -> None:
        self.metrics = metrics or Metrics.create()
        self._log = logger or logging.getLogger(access_log.ACCESS_LOGGER)
        self._current: contextvars.ContextVar[RequestRecord | None] = contextvars.ContextVar(
            "portico_request", default=None
        )

    def begin(self, method: str, endpoint: str, metadata: Sequence[tuple[str, str | bytes]]) -> RequestRecord:
        record = RequestRecord(request_id=_request_id(metadata), rpc=method.removeprefix("/portico.v1."),
                               endpoint=endpoint)
        self._current.set(record)  # no reset needed: the RPC's task, and so this context, ends with the RPC
        self.metrics.in_flight.labels(endpoint).inc()
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
        m.in_flight.labels(endpoint).dec()
        m.requests.labels(endpoint, model, str(outcome.status), outcome.code).inc()
        m.request_seconds.labels(endpoint, model).observe(now - record.started)
        if record.upstream_seconds is not None:
            m.upstream_seconds.labels(model).observe(record.upstream_seconds)
        if record.first_token_seconds is not None:
            m.first_token_seconds.labels(endpoint, model).observe(record.first_token_seconds)
        if record.input_tokens or record.output_tokens:
            m.input_tokens.labels(model, record.key_id).inc(record.input_tokens)
            m.output_tokens.labels(model, record.key_id).inc(record.output_tokens)
        if outcome.limit:
            m.rate_limit_rejections.labels(outcome.limit, outcome.scope).inc()
        self._log.info(access_log.line(record, outcome, now))

    # UpstreamRecorder (server/observability/record.py)
    def retry(self, model: str, reason: str) -> None:
        self.metrics.upstream_retries.labels(model, reason if reason in RETRY_REASONS else "other").inc()
        self.current().upstream_attempts += 1

    def fallback(self, model: str, fallback: str) -> None:
        self.metrics.upstream_fallbacks.labels(model, fallback).inc()
        self.current().upstream_attempts += 1


def _request_id(metadata: Sequence[tuple[str, str | bytes]]) -> str:
    for name, value in metadata:
        if name == _REQUEST_ID and isinstance(value, str) and value:
            return value[:128]  # the caller may have chosen it: keep the log line bounded
    return uuid.uuid4().hex  # a direct gRPC caller, not through Envoy
