"""What a failed call raises: one typed error per row of the gateway's error table, read from the wire.

    PorticoClientError
     ├── APIError                    status, code, type, param, message, retry_after, grpc_code, should_retry,
     │                               request_id
     │    ├── BadRequestError         400, 408, 413, 426, 431   INVALID_ARGUMENT
     │    ├── AuthenticationError     401        UNAUTHENTICATED
     │    ├── PermissionDeniedError   403        PERMISSION_DENIED
     │    ├── NotFoundError           404        NOT_FOUND, UNIMPLEMENTED (a method the gateway does not have)
     │    ├── RateLimitError          429        RESOURCE_EXHAUSTED
     │    │    └── ClientRateLimitError          refused by this client's own per-user limiter, never sent
     │    ├── InternalServerError     500        INTERNAL (and any code without a row)
     │    ├── UpstreamError           502        UNAVAILABLE (an upstream model server failed, or refused the gateway)
     │    ├── ServiceUnavailableError 503        UNAVAILABLE
     │    ├── GatewayTimeoutError     504        DEADLINE_EXCEEDED
     │    └── APIConnectionError      -          no answer at all (refused, reset, timed out)
     │         └── APITimeoutError                not a GET, sent, and no answer in time: never retried
     ├── RetriesExhausted            every allowed attempt on every model failed; `.last` is the last APIError
     └── QueueFull                   the bounded queue of non-urgent work is full

gRPC errors are read from the google.rpc.Status details (portico.v1.ErrorResponse, google.rpc.RetryInfo); REST
errors from the JSON body and the `retry-after-ms` / `retry-after` headers.
"""

from __future__ import annotations

import email.utils
import json
import math
import time
from collections.abc import Callable, Mapping

import grpc
from google.rpc import error_details_pb2, status_pb2

from portico.v1 import error_pb2


class PorticoClientError(Exception):
    """Everything this package raises."""


class APIError(PorticoClientError):
    """A failed call. `status` is the HTTP status (gRPC codes are mapped through the gateway's table)."""

    default_status: int | None = 500
    default_code = "internal_error"
    default_type = "server_error"

    def __init__(self, message: str, *, status: int | None = None, code: str | None = None,
                 type: str | None = None, param: str | None = None, retry_after: float | None = None,
                 grpc_code: grpc.StatusCode | None = None, should_retry: bool | None = None,
                 request_id: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = self.default_status if status is None else status
        self.code = code or self.default_code
        self.type = type or self.default_type
        self.param = param
        self.retry_after = retry_after  # seconds the server asked us to wait, None without a hint
        self.grpc_code = grpc_code
        self.should_retry = should_retry  # the server's x-should-retry; None when it did not say
        self.request_id = request_id  # the answer's x-request-id, as the gateway logged it; None without an answer

    def __str__(self) -> str:
        # In tenths rounded up, as the gateway's own messages say it: never sooner than asked, never 57.1503s.
        tenths = math.ceil(self.retry_after * 10 - 1e-9) / 10 if self.retry_after is not None else None
        hint = f", retry after {tenths:.1f}s" if tenths is not None else ""
        status = f"{self.status} " if self.status is not None else ""
        return f"{status}{self.code}: {self.message}{hint}"


class BadRequestError(APIError):
    default_status, default_code, default_type = 400, "invalid_request", "invalid_request_error"


class AuthenticationError(APIError):
    default_status, default_code, default_type = 401, "invalid_api_key", "authentication_error"


class PermissionDeniedError(APIError):
    default_status, default_code, default_type = 403, "permission_denied", "permission_error"


class NotFoundError(APIError):
    default_status, default_code, default_type = 404, "not_found", "invalid_request_error"


class RateLimitError(APIError):
    default_status, default_code, default_type = 429, "rate_limit_exceeded", "rate_limit_error"


class ClientRateLimitError(RateLimitError):
    default_code = "client_rate_limited"


class InternalServerError(APIError):
    pass


class UpstreamError(APIError):
    default_status, default_code, default_type = 502, "upstream_error", "api_error"


class ServiceUnavailableError(APIError):
    default_status, default_code, default_type = 503, "service_unavailable", "service_unavailable_error"


class GatewayTimeoutError(APIError):
    default_status, default_code, default_type = 504, "upstream_timeout", "timeout_error"


class APIConnectionError(APIError):
    default_status, default_code, default_type = None, "connection_error", "connection_error"


class APITimeoutError(APIConnectionError):
    """The request was sent and no answer came within the client's timeout. The gateway may still be working on it,
    and its upstream billing for it, so a POST that timed out is not sent again (the gateway does the same)."""

    default_code = "timeout"


class RetriesExhausted(PorticoClientError):
    """Every allowed attempt failed; `failures` lists (model, error) in order, `last` is the final error."""

    def __init__(self, failures: list[tuple[str, APIError]]) -> None:
        self.failures = failures
        self.last = failures[-1][1]
        models = " -> ".join(dict.fromkeys(model for model, _ in failures if model))  # "": a call without a model
        on = f" on {models}" if models else ""
        super().__init__(f"gave up after {len(failures)} attempt(s){on}; last error: {self.last}")


class QueueFull(PorticoClientError):
    """The bounded queue already holds its maximum of waiting requests."""


_BY_STATUS: dict[int, type[APIError]] = {
    400: BadRequestError, 408: BadRequestError, 413: BadRequestError, 426: BadRequestError, 431: BadRequestError,
    401: AuthenticationError, 403: PermissionDeniedError, 404: NotFoundError, 429: RateLimitError,
    500: InternalServerError, 502: UpstreamError, 503: ServiceUnavailableError, 504: GatewayTimeoutError,
}
_GRPC_TO_HTTP: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429, grpc.StatusCode.INTERNAL: 500, grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNIMPLEMENTED: 404,  # a method this gateway does not have: over REST, its unknown route's 404
}


def _make(status: int, message: str, **fields) -> APIError:
    return _BY_STATUS.get(status, InternalServerError)(message, status=status, **fields)  # no row: as INTERNAL


def error_from_grpc(error: grpc.RpcError, *, read_only: bool = False) -> APIError:
    """Read a failed RPC: the ErrorResponse and RetryInfo in its status details, else its code alone. `read_only`:
    the RPC changes nothing (its REST binding is a GET), so its answer not coming in time may be asked for again."""
    code = error.code()
    status = _GRPC_TO_HTTP.get(code, 500)
    message, fields, retry_after = error.details() or code.name, {}, None
    trailing = dict(error.trailing_metadata() or ())
    if raw := trailing.get("grpc-status-details-bin"):
        for detail in status_pb2.Status.FromString(raw).details:
            response, retry = error_pb2.ErrorResponse(), error_details_pb2.RetryInfo()
            if detail.Unpack(response):
                api = response.error
                status = response.http_status or status
                message = api.message or message
                fields = {"code": api.code, "type": api.type, "param": api.param if api.HasField("param") else None}
                retry_after = response.retry_after_seconds or retry_after
            elif detail.Unpack(retry):
                retry_after = retry.retry_delay.ToNanoseconds() / 1e9
    if retry_after is None and (ms := trailing.get("retry-after-ms")):
        retry_after = float(ms) / 1000
    if code == grpc.StatusCode.DEADLINE_EXCEEDED and not fields:
        # The client's own deadline passed (the gateway's 504s carry their ErrorResponse): the request may still be
        # running, as for a REST read timeout, and is tried again only if it changes nothing.
        text = f"No answer within the client's timeout ({message})."
        return APIConnectionError(text, grpc_code=code) if read_only else APITimeoutError(text, grpc_code=code)
    said = should_retry(trailing)
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED and not fields:
        # Not the gateway's 429, which always carries its error object: grpc's own message size limit (an answer over
        # the channel's receive limit, a request over the server's), which the same call would meet again.
        said = False
    return _make(status, message, retry_after=retry_after, grpc_code=code, should_retry=said,
                 request_id=trailing.get("x-request-id"), **fields)


def error_from_http(status: int, body: bytes, headers: Mapping[str, str],
                    now: Callable[[], float] = time.time) -> APIError:
    """Read a failed REST answer: {"error": {...}} (either dialect) and the retry-after-ms / retry-after headers."""
    try:
        error = json.loads(body)["error"]
        fields = {"code": error.get("code"), "type": error.get("type"), "param": error.get("param")}
        message = str(error.get("message") or f"HTTP {status}")
    except (ValueError, KeyError, TypeError, AttributeError):
        fields, message = {}, body.decode(errors="replace")[:500] or f"HTTP {status}"
    return _make(status, message, retry_after=retry_after_from_headers(headers, now),
                 should_retry=should_retry(headers), request_id=headers.get("x-request-id"), **fields)


def should_retry(headers: Mapping[str, str]) -> bool | None:
    """The server's x-should-retry, which the official SDKs obey too: "false" on a request that can never pass."""
    return {"true": True, "false": False}.get(headers.get("x-should-retry", ""))


def retry_after_from_headers(headers: Mapping[str, str], now: Callable[[], float] = time.time) -> float | None:
    """retry-after-ms wins (it is exact); retry-after is seconds or an HTTP date."""
    if (ms := headers.get("retry-after-ms")) is not None:
        try:
            return max(0.0, float(ms) / 1000)
        except ValueError:
            pass
    if (value := headers.get("retry-after")) is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        try:
            return max(0.0, email.utils.parsedate_to_datetime(value).timestamp() - now())
        except (TypeError, ValueError):
            return None
