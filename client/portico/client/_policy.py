"""When to try again, how long to wait, and which model to try next: pure decisions, no I/O."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from portico.client._errors import (
    APIConnectionError, APIError, APITimeoutError, ClientRateLimitError, RetriesExhausted,
)


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential backoff with full jitter, honouring the server's retry hint.

    A model is tried up to `attempts` times. Before retry n (1, 2, ...) the client waits a uniformly random time in
    [0, min(cap, base * 2**(n-1))) (full jitter; with `jitter=False`, that ceiling itself), but never less than the
    server's hint (`retry-after`, RetryInfo). A hint longer
    than `cap` is not waited for: the model is given up at once (next fallback, or RetriesExhausted).
    Only `retry_statuses` (HTTP statuses; gRPC codes map onto them) and connection errors are retried; 400, 401,
    403 and 404 never are, and neither is a POST (any call but a GET) whose answer timed out (APITimeoutError): it
    may still be running, and a second one could be billed twice. Nor is an answer with `x-should-retry: false`: a
    429 for a request too large for the key's limits (raised at once), or one with a retry hint of more than a
    minute, a daily quota or a budget, or a 500/502/503 (an upstream refusing the gateway's key or account): the
    model is given up, as for a hint over `cap`. The default statuses are the gateway's own upstream retry statuses.
    """

    attempts: int = 3
    base: float = 0.5
    cap: float = 30.0
    jitter: bool = True  # full jitter spreads callers that failed together; False only for a fixed schedule
    retry_statuses: frozenset[int] = frozenset({429, 500, 502, 503})
    retry_connection_errors: bool = True

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise ValueError("attempts must be at least 1 (the first try counts)")
        if self.base <= 0 or self.cap < self.base:
            raise ValueError("need 0 < base <= cap")
        if {400, 401, 403, 404} & self.retry_statuses:
            raise ValueError("400, 401, 403 and 404 are never retried: the same request would fail the same way")

    def retryable(self, error: APIError) -> bool:
        if isinstance(error, ClientRateLimitError):
            return False  # this client's own limiter: nothing was sent
        if isinstance(error, APITimeoutError):
            return False  # sent, and perhaps still running
        if isinstance(error, APIConnectionError):
            return self.retry_connection_errors
        if error.should_retry is False:
            return False  # the server says this request can never pass (x-should-retry: false)
        return error.status in self.retry_statuses

    def ceiling(self, retry: int) -> float:
        """The upper bound of the jittered wait before retry number `retry` (1-based)."""
        return min(self.cap, self.base * 2.0 ** min(retry - 1, 64))

    def delay(self, retry: int, error: APIError, draw: float) -> float | None:
        """The wait before retry `retry` given a uniform `draw` in [0, 1); None when the server's hint exceeds cap."""
        hint = error.retry_after or 0.0
        if hint > self.cap:
            return None
        return max(hint, (draw if self.jitter else 1.0) * self.ceiling(retry))


@dataclass
class Plan:
    """One call's walk over its models (primary, then fallbacks), fed each failure in turn.

    `model` is the model to try now. `failed(error)` records a failure of it and returns how long to wait before
    the next try (and `model` may have moved on to the next fallback), or raises: a non-retryable error of the
    primary as it is, and an APITimeoutError of any model as it is, else RetriesExhausted carrying every failure
    once no model is left. A fallback that fails with another non-retryable error (say, a model not granted to the
    key) is skipped rather than fatal.
    """

    models: tuple[str, ...]
    policy: RetryPolicy
    random: Callable[[], float]
    failures: list[tuple[str, APIError]] = field(default_factory=list)
    index: int = 0
    tries: int = 0

    def __post_init__(self) -> None:
        if not self.models:
            raise ValueError("a plan needs at least one model")

    @property
    def model(self) -> str:
        return self.models[self.index]

    def failed(self, error: APIError) -> float:
        self.failures.append((self.model, error))
        self.tries += 1
        if isinstance(error, APITimeoutError):
            # Sent, and perhaps still running (and billed) at the gateway, on whichever model of the chain: sending
            # the request on to the next fallback could make it twice.
            raise error
        if self.policy.retryable(error):
            if self.tries < self.policy.attempts:
                wait = self.policy.delay(self.tries, error, self.random())
                if wait is not None:
                    return wait
        elif self.index == 0 and not self._another_model_may_serve(error):
            raise error  # the request itself is wrong (or the key): another try would fail the same way
        # Else the model is given up: retryable errors that used its attempts, refusals with a hint too long for the
        # SDKs to sleep on (x-should-retry: false with a retry-after: a daily quota, a budget), and failures of the
        # model's own side marked not to retry (its upstream refuses the gateway's key or account).
        if self.index + 1 < len(self.models):
            self.index, self.tries = self.index + 1, 0
            return 0.0
        raise RetriesExhausted(self.failures) from error

    def _another_model_may_serve(self, error: APIError) -> bool:
        """A failure marked x-should-retry: false that is about this model, not the request: refused until later
        (a retry hint), or a 500/502/503, the model's side failing in a way a retry would not mend (a 502 whose
        upstream refuses the gateway's key or account). A model without fallbacks raises the latter as it is."""
        if error.should_retry is not False:
            return False
        return bool(error.retry_after) or (error.status in _MODEL_SIDE and len(self.models) > self.index + 1)


_MODEL_SIDE = frozenset({500, 502, 503})  # statuses of a model's failure rather than the request's or the key's
