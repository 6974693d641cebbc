"""The access log: one JSON object per line and per request, written straight to its file descriptor.

A line holds ids, labels, counts and times only: never a prompt, a completion, a header value or a secret. The
record it is built from has no field that could hold one, so nothing here needs scrubbing.

Not a `logging` handler: the logging machinery (records, caller lookup, formatters, locks) cost more than the rest
of a request's bookkeeping together. Each line is one `write` on a descriptor opened with O_APPEND, so the workers
of `--workers N` can share one file without interleaving lines, and a line is on disk when the request ends.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
import time
from datetime import datetime, timezone

import orjson

from server.observability.record import Outcome, RequestRecord

_logger = logging.getLogger(__name__)


class AccessLog:
    """Where the lines go: "stderr", "stdout", a file path (appended to, created if missing), or "off"."""

    def __init__(self, target: str) -> None:
        self.target = target
        self._own = target not in ("stderr", "stdout", "off")
        if target == "off":
            self._fd: int | None = None
        elif target in ("stderr", "stdout"):
            self._fd = (sys.stderr if target == "stderr" else sys.stdout).fileno()
        else:
            self._fd = os.open(target, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o640)
        self._lost = 0  # lines not written since the last one that was: the operator is told when it starts and ends
        self._torn = False  # a full disk took part of a line: the next one starts on a line of its own

    def write(self, record: RequestRecord, outcome: Outcome, finished: float) -> None:
        if self._fd is not None:
            data = line(record, outcome, finished) + b"\n"
            if self._torn:
                data = b"\n" + data
            try:
                self._torn = os.write(self._fd, data) < len(data)
                if self._torn:
                    raise OSError(errno.ENOSPC, "the line was cut short")
            except OSError as exc:  # a full disk or a closed stderr must not fail the request that was just answered
                if not self._lost:
                    _logger.error("access log: cannot write to %s (%s); its lines are lost until it can",
                                  self.target, exc.strerror or exc)
                self._lost += 1
                return
            if self._lost:
                _logger.warning("access log: writing to %s again; %d line(s) lost", self.target, self._lost)
                self._lost = 0

    def close(self) -> None:
        if self._own and self._fd is not None:
            os.close(self._fd)
            self._fd = None


def line(record: RequestRecord, outcome: Outcome, finished: float) -> bytes:
    return orjson.dumps({
        "ts": datetime.fromtimestamp(time.time(), timezone.utc).isoformat(timespec="milliseconds"),
        "request_id": record.request_id,
        "trace_id": record.trace_id,
        "rpc": record.rpc,
        "endpoint": record.endpoint,
        "key_id": record.key_id or None,
        "key_env": record.key_env or None,
        "target_key_id": record.target_key_id or None,
        "model": record.model or None,
        "status": outcome.status,
        "code": outcome.code or None,
        "limit": outcome.limit or None,
        "input_tokens": record.input_tokens,
        "output_tokens": record.output_tokens,
        "images": record.images,  # an image request's: it uses no tokens
        "duration_ms": _ms(finished - record.started),
        "upstream_ms": _ms(record.upstream_seconds),
        "first_token_ms": _ms(record.first_token_seconds),
        "upstream_attempts": record.upstream_attempts,
        "cache": record.cache or None,
    })


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else round(seconds * 1000, 1)
