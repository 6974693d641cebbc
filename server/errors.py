"""One error tree and one table: every failure a caller can see is a PorticoError.

    PorticoError
     ├── InvalidRequest        400  invalid_request        invalid_request_error
     │    └── RequestTooLarge  413  request_too_large      invalid_request_error
     ├── AuthenticationFailed  401  invalid_api_key        authentication_error
     ├── PermissionDenied      403  permission_denied      permission_error
     ├── ModelNotFound         404  model_not_found        invalid_request_error   (param "model")
     ├── NotFound              404  not_found              invalid_request_error
     ├── RateLimited           429  rate_limit_exceeded    rate_limit_error        (retry-after)
     ├── InternalError         500  internal_error         server_error
     ├── UpstreamError         502  upstream_error         api_error
     ├── ServiceUnavailable    503  service_unavailable    service_unavailable_error
     └── UpstreamTimeout       504  upstream_timeout       timeout_error

gRPC callers get the status code of the row with the error object in the status details; REST callers get the
HTTP status and the JSON body, shaped by Envoy's Lua filter from the trailing metadata set here.

`retry_reason` marks a failure of an upstream model server that another attempt (or a fallback model) may not meet,
and says why ("429", "503", "connect", "timeout", ... for metrics): set by the upstream providers, read by
server/providers/retry.py and fallback.py, never shown to callers.
"""

from __future__ import annotations

from dataclasses import dataclass

import json

import grpc


@dataclass(frozen=True, slots=True)
class ErrorKind:
    grpc_code: grpc.StatusCode
    http_status: int
    code: str
    type: str


class PorticoError(Exception):
    kind = ErrorKind(grpc.StatusCode.INTERNAL, 500, "internal_error", "server_error")

    def __init__(
        self, message: str, *, param: str | None = None, retry_after: float = 0.0, retry_reason: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after
        self.retry_reason = retry_reason

    @property
    def retryable(self) -> bool:
        return self.retry_reason is not None


class InvalidRequest(PorticoError):
    kind = ErrorKind(grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request", "invalid_request_error")


class RequestTooLarge(InvalidRequest):
    kind = ErrorKind(grpc.StatusCode.INVALID_ARGUMENT, 413, "request_too_large", "invalid_request_error")


class AuthenticationFailed(PorticoError):
    kind = ErrorKind(grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_api_key", "authentication_error")


class PermissionDenied(PorticoError):
    kind = ErrorKind(grpc.StatusCode.PERMISSION_DENIED, 403, "permission_denied", "permission_error")


class ModelNotFound(PorticoError):
    kind = ErrorKind(grpc.StatusCode.NOT_FOUND, 404, "model_not_found", "invalid_request_error")

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model")


class NotFound(PorticoError):
    kind = ErrorKind(grpc.StatusCode.NOT_FOUND, 404, "not_found", "invalid_request_error")


class RateLimited(PorticoError):
    kind = ErrorKind(grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_exceeded", "rate_limit_error")

    def __init__(
        self, message: str, *, retry_after: float = 0.0, subject: str = "", retry_reason: str | None = None
    ) -> None:
        super().__init__(message, retry_after=retry_after, retry_reason=retry_reason)
        self.subject = subject  # which limit of what, for gRPC callers' google.rpc.QuotaFailure


class InternalError(PorticoError):
    pass


class UpstreamError(PorticoError):
    """An upstream model server failed (5xx, a broken stream, an answer that is not its API): not our bug."""

    kind = ErrorKind(grpc.StatusCode.UNAVAILABLE, 502, "upstream_error", "api_error")


class ServiceUnavailable(PorticoError):
    kind = ErrorKind(grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", "service_unavailable_error")


class UpstreamTimeout(PorticoError):
    kind = ErrorKind(grpc.StatusCode.DEADLINE_EXCEEDED, 504, "upstream_timeout", "timeout_error")


def error_object(error: PorticoError) -> dict:
    """The `error` member of the body: {"message", "type", "param", "code"}."""
    return {"message": error.message, "type": error.kind.type, "param": error.param, "code": error.kind.code}


def error_body(error: PorticoError, *, anthropic: bool = False) -> bytes:
    """The whole JSON body REST callers see; the Anthropic SDK also wants a top-level "type": "error".

    ASCII-only, because it also travels as gRPC metadata (see gateway/error_shaper.lua).
    """
    body = {"type": "error", "error": error_object(error)} if anthropic else {"error": error_object(error)}
    return json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode()
