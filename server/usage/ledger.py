"""The usage ledger's row: one per request that reached admission, whatever its end (answered, refused by a limit
or a budget, failed upstream, a stream cut or abandoned by its caller), built from the request's telemetry record
when it ends, so the ledger, the metrics and the access log describe each request with the same numbers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, fields
from operator import attrgetter

from server.limits.core import ReservationIds
from server.observability.record import Outcome, RequestRecord


@dataclass(frozen=True, slots=True)
class LedgerRow:
    id: str  # unique across processes and hosts, so a batch written twice (a retry after a lost reply) is kept once
    at_ms: int  # unix milliseconds of the request's arrival
    request_id: str  # Envoy's x-request-id, which the caller got back
    key_id: str
    env: str  # the key's env: OpenAI's project_id
    endpoint: str
    model: str  # the model the caller asked for (catalog id)
    upstream: str  # the model that answered it (a fallback's id when one took over)
    status: int  # the HTTP status the caller got (gRPC callers: the matching code); 499: the caller went away
    code: str  # the error table's code, "" on success (a stream that failed after its 200 keeps its error's code)
    input_tokens: int
    output_tokens: int
    cached_input_tokens: int
    images: int
    cost_micros: int
    upstream_attempts: int  # 0: no model was asked (refused at admission)
    latency_ms: float
    first_token_ms: float | None
    deployment: str = ""  # which deployment of `upstream` answered, by name (schema v2)


class RowsRefused(Exception):
    """The store answered, but refuses a row's values (a number beyond its column's range, a broken constraint):
    written again, the same rows fail the same way, so they must not hold up the rows behind them."""


COLUMNS = tuple(f.name for f in fields(LedgerRow))
STORE_NAME = "usage ledger"  # in the 503 of a read the database did not answer (StoreUnavailable)
# A row's values in COLUMNS order, for the inserts: dataclasses.astuple deep-copies every field and was half of a
# row's cost in the writer thread (12 of 25 us).
values_of = attrgetter(*COLUMNS)


def mark_of(record: RequestRecord) -> tuple:
    """What a request handed to its model is known by, for `died` (the spool's mark: a tuple, not a row, because
    every model request writes one and a row costs ~2 us to build). What its rate-limit reservation booked goes
    beside it (LedgerSpool.mark), not in it: versions up to f39270b read a mark as exactly these eight values."""
    return (record.ledger_id, int(record.arrived * 1000), record.request_id, record.key_id, record.key_env,
            record.endpoint, record.model, record.deployment)


def died(mark: Sequence) -> LedgerRow:
    """The row of a request whose process died while it ran (`mark_of`): the caller got Envoy's 503 (or a stream cut
    off), the model had been asked, and what it used died with the process."""
    row_id, at_ms, request_id, key_id, env, endpoint, model, deployment = mark[:8]  # a later version's may have more
    return LedgerRow(id=row_id, at_ms=at_ms, request_id=request_id, key_id=key_id, env=env, endpoint=endpoint,
                     model=model, upstream=model, status=503, code="service_unavailable", input_tokens=0,
                     output_tokens=0, cached_input_tokens=0, images=0, cost_micros=0, upstream_attempts=1,
                     latency_ms=0.0, first_token_ms=None, deployment=deployment)


def row_of(record: RequestRecord, outcome: Outcome, finished: float, ids: ReservationIds) -> LedgerRow:
    """`finished`: time.monotonic() when the request ended; `ids` makes the row's id."""
    return LedgerRow(
        id=record.ledger_id or ids.new(),
        at_ms=int(record.arrived * 1000),
        request_id=record.request_id,
        key_id=record.key_id,
        env=record.key_env,
        endpoint=record.endpoint,
        model=record.model,
        upstream=(record.answered_by or record.model) if record.upstream_attempts else "",
        status=outcome.status,
        code=outcome.code,
        input_tokens=record.input_tokens,
        output_tokens=record.output_tokens,
        cached_input_tokens=record.cached_input_tokens,
        images=record.images,
        cost_micros=record.cost_micros,
        upstream_attempts=record.upstream_attempts,
        latency_ms=round((finished - record.started) * 1000, 3),
        first_token_ms=None if record.first_token_seconds is None else round(record.first_token_seconds * 1000, 3),
        deployment=record.deployment if record.upstream_attempts else "",
    )
