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
     │    └── UpstreamMisconfigured 502 (x-should-retry: false: the upstream refuses the gateway's configuration)
     ├── ServiceUnavailable    503  service_unavailable    service_unavailable_error
     └── UpstreamTimeout       504  upstream_timeout       timeout_error

In Anthropic-shaped bodies (/v1/messages) `type` is Anthropic's for the status instead (ANTHROPIC_TYPES below): 404
not_found_error, 413 request_too_large, 500 api_error, 503 overloaded_error.

`TABLE` below is every row a caller can receive: these, plus the replies only Envoy makes (408 slow request
headers, 426 HTTP/1.0, 431 oversized headers or URL) and 499 for a caller who went away (logs and metrics only).
It is the one source: gateway/envoy.py renders the Lua shaper's table from it, docs/api.md lists it, and the
Python client's error classes are tested against it.

An error is one row, but its `code` may say more than the row's where applications branch on it (an upstream's own
code on its 4xx, `context_length_exceeded`): the status, gRPC code and type stay the row's, and logs, the ledger and
metrics keep the row's code (a bounded set of labels).

gRPC callers get the status code of the row with the error object in the status details; REST callers get the
HTTP status and the JSON body, shaped by Envoy's Lua filter from the trailing metadata set here.

`retry_reason` marks a failure of an upstream model server that another attempt (or a fallback model) may not meet,
and says why ("429", "503", "connect", "broken", "timeout", ... for metrics: server/observability/record.py): set by
the upstream providers, read by server/providers/retry.py, never shown to callers. `fallback_may_serve` marks a
refusal that no retry of the model would escape but another model may not meet (a prompt over its context window):
retry.py sends it down the model's fallbacks at once.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import grpc

from server.domain_answers import Usage

# An answer whose retry-after is longer than this also says `x-should-retry: false` (PorticoError.trailing_metadata):
# a per-minute limit's wait is at most this long, a daily quota's or a budget's hours.
LONGEST_CLIENT_WAIT_SECONDS = 60.0
# A Portico secret (server/keys/store.py: pk-[env-]token_urlsafe), as gateway/lua/text.lua's `redacted` finds it.
_SECRET_SHAPED = re.compile(r"pk-[A-Za-z0-9_-]+")
# A whole secret, not a word that merely starts with `pk-` (`pk-data`): `pk-` and 40 or more of its characters.
_WHOLE_SECRET = re.compile(r"pk-[A-Za-z0-9_-]{40,}")
# A message or param may quote the caller (a member's name, a value) at any length; both travel in the gRPC
# trailers, where tens of KB make Envoy drop the stream (a 502 or 503 for a 400). Cut short, with an ellipsis.
LONGEST_MESSAGE, LONGEST_PARAM = 2000, 200
# OpenAI's code for a prompt over the model's context window: Portico's own refusal says it too (ContextLengthExceeded).
CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def redact_secrets(text: str) -> str:
    """`text` with anything shaped like a Portico secret replaced by `pk-[redacted]`."""
    return _SECRET_SHAPED.sub("pk-[redacted]", text) if "pk-" in text else text


def holds_secret(text: str) -> bool:
    """Whether `text` holds what is surely a whole Portico secret (a name, a path), not just something shaped so."""
    return _WHOLE_SECRET.search(text) is not None


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


# Anthropic's error `type` for each status its API answers (its errors page; another 4xx is invalid_request_error and
# another 5xx api_error there). Portico's 503 is what Anthropic calls overloaded (529): an upstream's 529 becomes it.
ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
    413: "request_too_large", 429: "rate_limit_error", 500: "api_error", 504: "timeout_error",
    529: "overloaded_error",
}


@dataclass(frozen=True, slots=True)
class ErrorKind:
    grpc_code: grpc.StatusCode
    http_status: int
    code: str
    type: str
    message: str  # what the caller reads when nobody knows more (e.g. Envoy's own replies)

    @property
    def anthropic_type(self) -> str:
        """The `type` in an Anthropic-shaped body (/v1/messages): the anthropic SDK's users read Anthropic's."""
        status = 529 if self.http_status == 503 else self.http_status
        return ANTHROPIC_TYPES.get(status) or ("invalid_request_error" if status < 500 else "api_error")

    def type_for(self, *, anthropic: bool) -> str:
        """The `type` a caller reads: Anthropic's for the Anthropic-shaped services, else the table's."""
        return self.anthropic_type if anthropic else self.type


class PorticoError(Exception):
    kind = ErrorKind(
        grpc.StatusCode.INTERNAL, 500, "internal_error", "server_error", "The server had an error while processing your request."
    )

    def __init__(
        self, message: str, *, param: str | None = None, retry_after: float = 0.0, retry_reason: str | None = None,
        details: dict | None = None, code: str | None = None,
    ) -> None:
        # A message may quote what the caller sent (a key id, a model), where a secret is sometimes pasted by
        # mistake: no message carries one, to the caller (the console shows messages on screen) or to a log. Nor
        # does a param, which names a member of the caller's (a pasted key as a member's name).
        message = _cut(redact_secrets(message), LONGEST_MESSAGE)
        super().__init__(message)
        self.message = message
        self.param = None if param is None else _cut(redact_secrets(param), LONGEST_PARAM)
        self.retry_after = retry_after
        self.retry_reason = retry_reason
        self.details = details  # Anthropic's `error.details`, which its SDK reads (e.g. its `error_code`)
        # The error object's `code`: the row's, or a more specific one that applications branch on (an upstream's
        # own, `context_length_exceeded`). Logs, the ledger and metrics keep the row's: a bounded set of labels.
        self.code = code or self.kind.code
        # False where the upstream said `x-should-retry: false`: its deployment is not tried again for the request
        # (server/providers/retry.py), and the caller is told so.
        self.should_retry: bool | None = None
        # An image upstream's answer that failed after it named its images (a link that cannot be fetched, bytes that
        # are no image): the images it drew and billed, which the request still costs (server/pipeline.py).
        self.images_drawn = 0
        # An upstream that answered (2xx) and so did, and billed, the work, but whose answer could not be read (cut
        # off, not JSON): no try of it is made again, nor asked for by the caller (server/providers/http_upstream.py).
        self.answer_unread = False
        # What a stream's upstream reported the answer used before it broke off (OpenAI's usage chunk before
        # `[DONE]`, Anthropic's message_delta before message_stop): counted and billed by the upstream, so the request
        # is settled with it rather than with an estimate of what was sent (server/metering.py).
        self.usage_reported: Usage | None = None
        # False for a failure that says nothing of the deployment that met it (server/providers/router.py): no health
        # verdict, as a caller's own mistake gives none.
        self.judges_deployment = True

    def message_for(self, *, anthropic: bool) -> str:
        """The message in the caller's dialect: the same in both, unless the two APIs word this failure apart."""
        return self.message

    @property
    def retryable(self) -> bool:
        return self.retry_reason is not None

    @property
    def fallback_may_serve(self) -> bool:
        """A refusal of the model, not of the request: a prompt over its context window, which no retry or other
        deployment of it would take (they share its window), but a fallback with a longer one may."""
        return self.code == CONTEXT_LENGTH_EXCEEDED

    def trailing_metadata(self, *, anthropic: bool = False) -> tuple[tuple[str, str], ...]:
        """Headers the answer carries besides the error body (Envoy's Lua filter keeps them as HTTP headers): the
        retry hint, in both forms the SDKs read (they prefer retry-after-ms). A wait of more than a minute (a daily
        quota, a budget, an upstream's long retry-after) also says `x-should-retry: false`: the anthropic SDK would
        sleep for the whole retry-after, hours until UTC midnight, with its caller hanging on it. The retry-after
        still says when; the caller decides whether to wait. `anthropic`: the caller speaks the Messages API (a
        limit's refusal then also names it as Anthropic does)."""
        final = (("x-should-retry", "false"),)
        if self.retry_after <= 0:
            return final if self.should_retry is False else ()
        hint = (("retry-after", str(math.ceil(self.retry_after))),
                ("retry-after-ms", str(math.ceil(self.retry_after * 1000))))
        if self.retry_after > LONGEST_CLIENT_WAIT_SECONDS or self.should_retry is False:
            return (*hint, *final)
        return hint

    def metric_labels(self) -> dict[str, str]:
        """Bounded label values saying more about this failure than its code (a rate limit: which limit, where)."""
        return {}


class InvalidRequest(PorticoError):
    kind = ErrorKind(
        grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request", "invalid_request_error", "The request is invalid."
    )


class ContextLengthExceeded(InvalidRequest):
    """A prompt that leaves no room for an answer in the model's context window, as each API says it: frameworks
    catch OpenAI's code `context_length_exceeded` (and match its "maximum context length" wording, or Anthropic's
    "prompt is too long") to trim a conversation and try again."""

    def __init__(self, prompt_tokens: int, window: int) -> None:
        # "at least": a prompt too long by its size alone is not tokenized (LlamaCppProvider.count_tokens).
        super().__init__(f"This model's maximum context length is {window} tokens. However, your messages resulted in "
                         f"at least {prompt_tokens} tokens, which leaves no room for an answer. Please reduce the "
                         "length of the messages.", param="messages", code=CONTEXT_LENGTH_EXCEEDED)
        # Anthropic's words: the longest prompt that fits is one token short of the window.
        self._anthropic_message = f"prompt is too long: {prompt_tokens} tokens > {window - 1} maximum"

    def message_for(self, *, anthropic: bool) -> str:
        return self._anthropic_message if anthropic else self.message


class RequestTooLarge(InvalidRequest):
    kind = ErrorKind(
        grpc.StatusCode.INVALID_ARGUMENT, 413, "request_too_large", "invalid_request_error", "The request body is too large (limit 8 MiB)."
    )


class AuthenticationFailed(PorticoError):
    kind = ErrorKind(
        grpc.StatusCode.UNAUTHENTICATED, 401, "invalid_api_key", "authentication_error", "Invalid API key."
    )


class PermissionDenied(PorticoError):
    kind = ErrorKind(
        grpc.StatusCode.PERMISSION_DENIED, 403, "permission_denied", "permission_error", "Permission denied."
    )


class ModelNotFound(PorticoError):
    kind = ErrorKind(
        grpc.StatusCode.NOT_FOUND, 404, "model_not_found", "invalid_request_error", "The model does not exist or you do not have access to it."
    )

    def __init__(self, message: str) -> None:
        super().__init__(message, param="model")


class NotFound(PorticoError):
    kind = ErrorKind(
        grpc.StatusCode.NOT_FOUND, 404, "not_found", "invalid_request_error", "Not found."
    )


class RateLimited(PorticoError):
    kind = ErrorKind(
        grpc.StatusCode.RESOURCE_EXHAUSTED, 429, "rate_limit_exceeded", "rate_limit_error", "Rate limit exceeded."
    )

    def __init__(
        self, message: str, *, retry_after: float = 0.0, subject: str = "", retry_reason: str | None = None
    ) -> None:
        super().__init__(message, retry_after=retry_after, retry_reason=retry_reason)
        self.subject = subject  # which limit of what, for gRPC callers' google.rpc.QuotaFailure


class InternalError(PorticoError):
    pass


class UpstreamError(PorticoError):
    """An upstream model server failed (5xx, a broken stream, an answer that is not its API): not our bug."""

    kind = ErrorKind(
        grpc.StatusCode.UNAVAILABLE, 502, "upstream_error", "api_error", "The upstream model server failed."
    )


class UpstreamMisconfigured(UpstreamError):
    """An upstream that refuses the gateway's own configuration (its key, its model name, its base_url): no retry by
    the caller can mend that, so the answer says `x-should-retry: false` and the SDKs raise it at once instead of
    sending the same doomed request twice more (their default), slowly."""

    def trailing_metadata(self, *, anthropic: bool = False) -> tuple[tuple[str, str], ...]:
        return (("x-should-retry", "false"),)


class ServiceUnavailable(PorticoError):
    kind = ErrorKind(
        grpc.StatusCode.UNAVAILABLE, 503, "service_unavailable", "service_unavailable_error", "The service is temporarily unavailable."
    )


class OutOfResources(ServiceUnavailable):
    """The gateway cannot open a connection now (no file descriptor or kernel memory left): no deployment is to blame
    and another would fail the same way, so it is neither retried nor counted against a deployment's health."""


class UpstreamTimeout(PorticoError):
    kind = ErrorKind(
        grpc.StatusCode.DEADLINE_EXCEEDED, 504, "upstream_timeout", "timeout_error", "The upstream did not respond in time."
    )


# Replies only Envoy makes (no exception is ever raised for them), and the outcome of a caller who went away.
REQUEST_TIMEOUT = ErrorKind(grpc.StatusCode.DEADLINE_EXCEEDED, 408, "request_timeout", "invalid_request_error",
                            "The request did not arrive in time.")
HTTP_VERSION_NOT_SUPPORTED = ErrorKind(grpc.StatusCode.INVALID_ARGUMENT, 426, "http_version_not_supported",
                                       "invalid_request_error", "This HTTP version is not supported: use HTTP/1.1 or HTTP/2.")
HEADERS_TOO_LARGE = ErrorKind(grpc.StatusCode.INVALID_ARGUMENT, 431, "request_header_fields_too_large",
                              "invalid_request_error",
                              "The request's headers or URL are too large "
                              "(limit 60 KiB of headers, 1,000 header fields).")
CANCELLED = ErrorKind(grpc.StatusCode.CANCELLED, 499, "cancelled", "invalid_request_error",
                      "The caller went away before the answer was complete.")

# Every row, ordered by status; where a status has two rows the first is the one Envoy uses when it alone answers.
TABLE: tuple[ErrorKind, ...] = (
    InvalidRequest.kind, AuthenticationFailed.kind, PermissionDenied.kind, NotFound.kind, ModelNotFound.kind,
    REQUEST_TIMEOUT, RequestTooLarge.kind, HTTP_VERSION_NOT_SUPPORTED, RateLimited.kind, HEADERS_TOO_LARGE,
    CANCELLED, InternalError.kind, UpstreamError.kind, ServiceUnavailable.kind, UpstreamTimeout.kind,
)


def kind_by_status() -> dict[int, ErrorKind]:
    """One row per HTTP status (the first listed): what a reply with that status and no error object becomes."""
    kinds: dict[int, ErrorKind] = {}
    for kind in TABLE:
        kinds.setdefault(kind.http_status, kind)
    return kinds


def error_object(error: PorticoError, *, anthropic: bool = False) -> dict:
    """The `error` member of the body: {"message", "type", "param", "code"}, and "details" when there are any;
    `anthropic`: with Anthropic's `type` for the status."""
    body = {"message": error.message_for(anthropic=anthropic), "type": error.kind.type_for(anthropic=anthropic),
            "param": error.param, "code": error.code}
    return {**body, "details": error.details} if error.details else body


def error_body(error: PorticoError, *, anthropic: bool = False) -> bytes:
    """The whole JSON body REST callers see; the Anthropic SDK also wants a top-level "type": "error".

    ASCII-only, because it also travels as gRPC metadata (see gateway/lua/response.lua).
    """
    if anthropic:
        return _ascii_json({"type": "error", "error": error_object(error, anthropic=True)})
    return _ascii_json({"error": error_object(error)})


def _ascii_json(body: dict) -> bytes:
    return json.dumps(body, ensure_ascii=True, separators=(",", ":")).encode()
