"""A token bucket per user, checked before a request leaves this process."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from portico.client._errors import ClientRateLimitError


@dataclass
class UserRateLimiter:
    """Each user may make `rate` calls per second on average, with bursts of up to `burst`.

    `take(user)` books one call: it returns 0 when a token was free, or how long the caller must wait for the token
    it has just booked (callers queue up fairly: each booking pushes the next one further out). A wait longer than
    `max_wait` books nothing and raises ClientRateLimitError (a RateLimitError, code `client_rate_limited`, with
    `retry_after`). One call of the client takes one token, whatever retries and fallbacks it goes through.
    Thread-safe; the clock is injectable.
    """

    rate: float
    burst: float = 1.0
    max_wait: float = 0.0
    clock: Callable[[], float] = time.monotonic
    max_users: int = 10_000  # above this many buckets, the full (idle) ones are dropped: a full bucket is the default
    _buckets: dict[str, tuple[float, float]] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.rate <= 0 or self.burst < 1 or self.max_wait < 0:
            raise ValueError("need rate > 0, burst >= 1 and max_wait >= 0")

    @classmethod
    def per_minute(cls, requests: float, **options) -> UserRateLimiter:
        return cls(rate=requests / 60.0, **options)

    def take(self, user: str) -> float:
        with self._lock:
            now = self.clock()
            tokens = self._tokens(user, now)
            wait = 0.0 if tokens >= 1 else (1 - tokens) / self.rate
            if wait > self.max_wait:
                raise ClientRateLimitError(
                    f"Client-side rate limit for user {user!r}: {self.rate * 60:g} requests per minute "
                    f"(bursts of {self.burst:g}). Please retry after {wait:.3f} seconds.", retry_after=wait)
            self._buckets[user] = (tokens - 1, now)
            if len(self._buckets) > self.max_users:
                self._buckets = {u: b for u, b in self._buckets.items() if self._tokens(u, now) < self.burst}
            return wait

    def _tokens(self, user: str, now: float) -> float:
        tokens, at = self._buckets.get(user, (self.burst, now))
        return min(self.burst, tokens + (now - at) * self.rate)
