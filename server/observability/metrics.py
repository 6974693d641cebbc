"""Prometheus metrics and their admin listener (127.0.0.1 only).

One process (`portico serve`): the server's own registry is served. With `--workers N`, each worker writes its
values to files in a shared directory (prometheus_client's multiprocess mode, switched on by the
PROMETHEUS_MULTIPROC_DIR environment variable the parent gives the workers), and the parent serves the sum over all
workers, dead ones included, so counters never go backwards when a worker is restarted. The in-flight gauge only
counts live workers (`livesum`; the parent removes a dead worker's gauge file with `mark_dead`).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, multiprocess, start_http_server

from server.domain_keys import KEY_LIMIT_NAMES, LIMIT_SCOPES

MULTIPROCESS_ENV = "PROMETHEUS_MULTIPROC_DIR"
# Why finished spans were never exported (portico_trace_spans_dropped_total's `reason`).
SPANS_QUEUE_FULL, SPANS_EXPORT_FAILED = "queue_full", "export_failed"

# Whole requests include long streams; the first token comes much sooner.
_DURATION_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
_FIRST_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


@dataclass(frozen=True, slots=True)
class Metrics:
    registry: CollectorRegistry
    requests: Counter
    request_seconds: Histogram
    upstream_seconds: Histogram
    first_token_seconds: Histogram
    in_flight: Gauge
    input_tokens: Counter
    output_tokens: Counter
    rate_limit_rejections: Counter
    upstream_retries: Counter
    upstream_fallbacks: Counter
    trace_spans_dropped: Counter
    spend: Counter
    ledger_written: Counter
    ledger_dropped: Counter
    budget_left: Gauge
    deployment_requests: Counter
    cache_lookups: Counter
    deployment_failures: Counter
    deployment_state: Gauge

    @classmethod
    def create(cls) -> Metrics:
        """A fresh set in its own registry (several servers can live in one test process)."""
        r = CollectorRegistry()
        metrics = cls(
            registry=r,
            requests=Counter("portico_requests_total", "Requests answered, by endpoint, model, HTTP status and "
                             "error code (499: the caller went away)", ["endpoint", "model", "status", "code"],
                             registry=r),
            request_seconds=Histogram("portico_request_duration_seconds", "Whole request, streams to their end",
                                      ["endpoint", "model"], buckets=_DURATION_BUCKETS, registry=r),
            upstream_seconds=Histogram("portico_upstream_duration_seconds", "Time spent in the provider, retries "
                                       "included", ["model"], buckets=_DURATION_BUCKETS, registry=r),
            first_token_seconds=Histogram("portico_time_to_first_token_seconds", "From the request's arrival to "
                                          "the first part of the answer: text, a tool call, thinking or "
                                          "reasoning", ["endpoint", "model"],
                                          buckets=_FIRST_TOKEN_BUCKETS, registry=r),
            in_flight=Gauge("portico_requests_in_flight", "Requests being answered", ["endpoint"],
                            multiprocess_mode="livesum", registry=r),
            input_tokens=Counter("portico_input_tokens_total", "Prompt tokens", ["model", "key_id"], registry=r),
            output_tokens=Counter("portico_output_tokens_total", "Generated tokens", ["model", "key_id"],
                                  registry=r),
            rate_limit_rejections=Counter("portico_rate_limit_rejections_total", "Requests refused by one of "
                                          "Portico's limits (a rate, concurrency, a daily quota or a spend "
                                          "budget), by limit and scope (key, or key on one model)",
                                          ["limit", "scope"], registry=r),
            upstream_retries=Counter("portico_upstream_retries_total", "Upstream calls retried",
                                     ["model", "reason"], registry=r),
            upstream_fallbacks=Counter("portico_upstream_fallbacks_total", "Requests passed to a fallback model",
                                       ["model", "fallback"], registry=r),
            trace_spans_dropped=Counter("portico_trace_spans_dropped_total", "Finished spans never exported: the "
                                        "export queue was full, or the collector did not take them",
                                        ["reason"], registry=r),
            spend=Counter("portico_spend_microdollars_total", "Settled cost of requests in micro-dollars (model "
                          "prices in the configuration)", ["model", "key_id"], registry=r),
            ledger_written=Counter("portico_ledger_rows_written_total", "Usage ledger rows stored", registry=r),
            ledger_dropped=Counter("portico_ledger_rows_dropped_total", "Usage ledger rows lost: the buffer was "
                                   "full, the store refused their values, or neither it nor the spool took them "
                                   "before shutdown", registry=r),
            budget_left=Gauge("portico_budget_remaining_microdollars", "What is left of a key's budget (`budget`: "
                              "day or month) after its latest request, in micro-dollars", ["key_id", "budget"],
                              multiprocess_mode="mostrecent", registry=r),
            cache_lookups=Counter("portico_cache_lookups_total", "Requests for models with a response cache, by "
                                  "result (hit, miss)", ["model", "result"], registry=r),
            deployment_requests=Counter("portico_deployment_requests_total", "Upstream attempts per deployment of "
                                        "a model", ["model", "deployment"], registry=r),
            deployment_failures=Counter("portico_deployment_failures_total", "Attempts that failed in a way that "
                                        "speaks of the deployment (passive health counts them)",
                                        ["model", "deployment", "reason"], registry=r),
            # One-hot: 1 for the deployment's state now, 0 for the others; the board is shared by a host's workers,
            # so the most recent reading of any live one is right.
            deployment_state=Gauge("portico_deployment_state", "Passive health of each watched deployment",
                                   ["model", "deployment", "state"], multiprocess_mode="livemostrecent",
                                   registry=r),
        )
        # Series alerts watch start at 0: one born at its first increment has no earlier sample for increase() or
        # rate() to compare with, so a gateway's first refusals or lost spans would never show as an increase.
        for limit in KEY_LIMIT_NAMES:
            for scope in LIMIT_SCOPES:
                metrics.rate_limit_rejections.labels(limit, scope)
        for reason in (SPANS_QUEUE_FULL, SPANS_EXPORT_FAILED):
            metrics.trace_spans_dropped.labels(reason)
        return metrics


def aggregated_registry(directory: Path) -> CollectorRegistry:
    """What the parent of `--workers N` serves: every worker's values, summed."""
    registry = CollectorRegistry()
    multiprocess.MultiProcessCollector(registry, path=str(directory))
    return registry


def mark_dead(directory: Path, pid: int) -> None:
    multiprocess.mark_process_dead(pid, str(directory))


@dataclass(frozen=True, slots=True)
class MetricsServer:
    """`GET /metrics` on 127.0.0.1:port, answered by a daemon thread (scrapes never wait for the event loop)."""

    httpd: WSGIServer
    thread: threading.Thread

    @classmethod
    def start(cls, port: int, registry: CollectorRegistry) -> MetricsServer:
        httpd, thread = start_http_server(port, addr="127.0.0.1", registry=registry)
        return cls(httpd, thread)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)
