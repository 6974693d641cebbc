"""The operator's lines for retries and fallbacks, at most one a minute of each kind (operations.md, Logs).

During an outage every request retries and falls back the same way: a line each (two or three a request) buried the
log at a thousand lines a second, while the metrics already count each one. So a kind (the same line with the same
model, deployment, reason and next try) is logged when it first happens, counted while its minute lasts, and its next
line after that says how many were not logged. An outage that ends quietly needs no line of its own: the metrics
have every retry, and the count waits for the kind's next line."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

_logger = logging.getLogger("server.providers.router")  # where these lines were always logged

_WINDOW = 60.0
_MAX_KINDS = 4096  # a catalog's models x deployments x reasons is far fewer: only a bound on memory


@dataclass(slots=True)
class _Seen:
    logged_at: float
    unlogged: int = 0  # lines of this kind counted, not logged, since


class RetryLog:
    def __init__(self, clock: Callable[[], float] = time.monotonic, window: float = _WINDOW,
                 max_kinds: int = _MAX_KINDS) -> None:
        self._clock = clock
        self._window = window
        self._max_kinds = max_kinds
        self._kinds: dict[tuple[object, ...], _Seen] = {}  # (line, *args) -> when last logged, and since

    def warning(self, line: str, *args: object) -> None:
        """`line % args` as a WARNING, unless the same line was logged less than a minute ago: then only counted."""
        now = self._clock()
        kind = (line, *args)
        seen = self._kinds.get(kind)
        if seen is not None and now - seen.logged_at < self._window:
            seen.unlogged += 1
            return
        if seen is None and len(self._kinds) >= self._max_kinds:
            self._prune(now)
        if seen is not None and seen.unlogged:
            _logger.warning(line + " (and %d more like it, not logged, in the %d s since the last such line)",
                            *args, seen.unlogged, now - seen.logged_at)
        else:
            _logger.warning(line, *args)
        self._kinds.pop(kind, None)  # to the end: the dict is in the order lines were logged, oldest first
        self._kinds[kind] = _Seen(now)

    def _prune(self, now: float) -> None:
        """Forgets kinds whose minute is over with nothing left to count, and then, if every kind left is still
        needed, the oldest: a count of lines not logged is lost before memory grows without bound."""
        self._kinds = {kind: seen for kind, seen in self._kinds.items()
                       if seen.unlogged or now - seen.logged_at < self._window}
        while len(self._kinds) >= self._max_kinds:
            del self._kinds[next(iter(self._kinds))]
