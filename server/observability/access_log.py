"""The access log: one JSON object per line and per request, on the `portico.access` logger.

A line holds ids, labels, counts and times only: never a prompt, a completion, a header value or a secret. The
record it is built from has no field that could hold one, so nothing here needs scrubbing.
"""

from __future__ import annotations

import logging
import sys
import time
from datetime import datetime, timezone

import orjson

from server.observability.record import Outcome, RequestRecord

ACCESS_LOGGER = "portico.access"


def configure(target: str) -> None:
    """Send access lines to "stderr", "stdout", a file path (appended to), or nowhere ("off"). Bare JSON lines, not
    the text format of the other logs, so they stay machine-readable even when they share stderr."""
    logger = logging.getLogger(ACCESS_LOGGER)
    logger.propagate = False
    logger.setLevel(logging.INFO)  # access lines are not diagnostics: --log-level does not silence them
    for handler in list(logger.handlers):
        logger.removeHandler(handler)
        handler.close()
    if target == "off":
        logger.disabled = True
        return
    if target in ("stderr", "stdout"):
        handler: logging.Handler = logging.StreamHandler(sys.stderr if target == "stderr" else sys.stdout)
    else:
        handler = logging.FileHandler(target, encoding="utf-8")  # appends; one write per line, so workers can share
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)


def line(record: RequestRecord, outcome: Outcome, finished: float) -> str:
    return orjson.dumps({
        "ts": datetime.fromtimestamp(time.time(), timezone.utc).isoformat(timespec="milliseconds"),
        "request_id": record.request_id,
        "rpc": record.rpc,
        "endpoint": record.endpoint,
        "key_id": record.key_id or None,
        "key_env": record.key_env or None,
        "model": record.model or None,
        "status": outcome.status,
        "code": outcome.code or None,
        "limit": outcome.limit or None,
        "input_tokens": record.input_tokens,
        "output_tokens": record.output_tokens,
        "duration_ms": _ms(finished - record.started),
        "upstream_ms": _ms(record.upstream_seconds),
        "first_token_ms": _ms(record.first_token_seconds),
        "upstream_attempts": record.upstream_attempts,
    }).decode()


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)
