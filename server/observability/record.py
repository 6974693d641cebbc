"""What one request did, gathered while it runs and reported once when it ends (metrics and one access-log line).

Label values come only from bounded sets: the endpoint from a fixed table of RPCs, the model from the catalog
(never the caller's raw `model` text), key ids from the key store, status codes and error codes from the error table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from server.domain import Endpoint, SamplingParams
from server.domain_answers import UpstreamAnswer
from server.errors import PorticoError

CANCELLED_STATUS = 499  # the caller went away (or its gRPC deadline passed) before the answer ended

# Service -> the REST path it serves, the `endpoint` label. ProbeService and ConsoleService are absent on purpose:
# probes arrive every few seconds, and a console page load fetches a dozen files; they would drown the access log
# and request counts (operations.md: "probes and the console's files excepted").
_ENDPOINTS = {
    "ChatService": Endpoint.CHAT.value,
    "MessageService": Endpoint.MESSAGES.value,
    "ImageService": Endpoint.IMAGES.value,
    "ModelService": "/v1/models",
    "AnthropicModelService": "/v1/models",
    "KeyService": "/v1/admin/keys",
    "UsageService": "/v1/organization/usage/completions",
    "LimitService": "/v1/admin/keys",  # GET /v1/admin/keys/{id}/limits
    "ModelAdminService": "/v1/admin/models",
}


def endpoint_of(method: str) -> str | None:
    """"/portico.v1.ChatService/CreateChatCompletion" -> "/v1/chat/completions"; None for RPCs not observed."""
    service, _, rpc = method.removeprefix("/portico.v1.").partition("/")
    if rpc.startswith("CountMessageTokens"):  # free, no model request: apart from /v1/messages in metrics and logs
        return "/v1/messages/count_tokens"
    if rpc == "GetImageContent":
        return "/v1/images/content"
    if rpc.startswith("GetCosts"):
        return "/v1/organization/costs"
    if rpc.startswith("ListRequests"):
        return "/v1/organization/requests"
    return _ENDPOINTS.get(service)


@dataclass(slots=True)
class RequestRecord:
    request_id: str
    rpc: str  # "ChatService/CreateChatCompletionHttp"
    endpoint: str
    started: float = field(default_factory=time.monotonic)
    arrived: float = field(default_factory=time.time)  # wall clock, for the usage ledger
    key_id: str = ""
    key_env: str = ""
    target_key_id: str = ""  # the key an admin call acts on (created, read, updated, rotated, revoked), for audits
    model: str = ""  # set once the catalog resolved it, so unknown model names never become label values
    input_tokens: int = 0
    output_tokens: int = 0
    upstream_attempts: int = 0
    upstream_started: float | None = None
    upstream_seconds: float | None = None
    first_token_seconds: float | None = None  # from the start of the request
    in_band_error: str = ""  # the code of a failure reported inside an already started stream
    # A stream's last message went to grpc: a caller who leaves now (closing on `[DONE]`) had the whole answer.
    answered: bool = False
    # Its caller went away while its non-streamed answer was generated upstream, which ran on (server/cutoff.py): it
    # is answered no more, and ends as the caller's leaving or the exchange's failure made it.
    caller_left: bool = False
    cache: str = ""  # "hit" or "miss" for a model with a response cache (server/cache), else ""
    trace_id: str | None = None  # the W3C trace id: of the request's span, else of the caller's traceparent
    span: Any = None  # the request's OpenTelemetry span, when traces are on (server/observability/tracing.py)
    # For the span only (the metrics and the access log do not use them):
    params: SamplingParams | None = None  # the request's settings (gen_ai.request.*)
    finish_reason: str = ""
    response_id: str = ""  # the id the caller's answer carries (chatcmpl-..., msg_...)
    output_type: str = ""  # what the caller asked to get, where it asked: "json", "image" (gen_ai.output.type)
    answered_by: str = ""  # the model of the last upstream attempt: a fallback's, when one answered (span, ledger)
    provider: str = ""  # gen_ai.provider.name of the model of the last traced attempt or generation (the span only)
    model_answered: bool = False  # a model sent something (the span's gen_ai.response.model is then answered_by)
    deployment: str = ""  # the deployment of `answered_by` last tried, when the model has several
    spans_started: int = 0  # upstream attempts and generations traced so far, to number them
    # For the usage ledger (server/usage): a request that reached admission gets one row, whatever its end.
    admitted: bool = False
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0  # the part of input_tokens written to the upstream's prompt cache (the span only)
    images: int = 0
    cost_micros: int = 0  # settled cost in micro-dollars
    ledger_id: str = ""  # its row's id, given when it was handed to its model (the spool's mark has it too)
    # Its rate-limit reservation as a shared store booked it (Limiter.booked), for the spool's mark: the next process
    # settles it if this one dies first. None when there is nothing for another process to settle.
    booked: tuple | None = None

    def mark_answered(self) -> None:
        self.answered = True

    def upstream_call(self) -> None:
        self.upstream_attempts = max(self.upstream_attempts, 1)
        self.upstream_started = time.monotonic()

    def first_token(self) -> None:
        if self.first_token_seconds is None:
            self.first_token_seconds = time.monotonic() - self.started

    def upstream_done(self) -> None:
        if self.upstream_started is not None and self.upstream_seconds is None:
            self.upstream_seconds = time.monotonic() - self.upstream_started


@dataclass(frozen=True, slots=True)
class Outcome:
    """How a request ended, as the caller saw it."""

    status: int  # HTTP status (gRPC callers got the matching status code)
    code: str = ""  # the error table's code; "" for success
    limit: str = ""  # for a rate-limit refusal: which limit, e.g. "requests_per_minute"
    scope: str = ""  # ... and on what: "key" or "key_model"
    # The error object's code where it says more than the row's (context_length_exceeded, an upstream's own code): the
    # trace's error.type. Never a label (metrics, logs and the ledger keep `code`, a bounded set).
    caller_code: str = ""

    @classmethod
    def of_error(cls, error: PorticoError) -> Outcome:
        labels = error.metric_labels()
        return cls(error.kind.http_status, error.kind.code, labels.get("limit", ""), labels.get("scope", ""),
                   error.code if error.code != error.kind.code else "")

    @classmethod
    def cancelled(cls) -> Outcome:
        return cls(CANCELLED_STATUS, "cancelled")


class UpstreamRecorder(Protocol):
    """What provider code reports about upstream calls (server/providers: retries and fallbacks).

    Call these from inside the request (the RPC's task or a task it started): each call also counts one more
    upstream attempt in that request's access-log line. Pass model ids or upstream model names from the
    configuration and a reason from RETRY_REASONS, never text from a caller or an upstream's answer.
    """

    def retry(self, model: str, reason: str) -> None: ...

    def fallback(self, model: str, fallback: str, *, after_attempt: bool = True) -> None:
        """The request goes on to `fallback`; `after_attempt=False`: no attempt was made before it (every deployment
        of the models before it out of service), so it counts no attempt of its own."""
        ...

    def deployment(self, model: str, name: str) -> None:
        """The next upstream attempt goes to deployment `name` of `model` (the request's span names it)."""
        ...

    def deployment_attempt(self, model: str, deployment: str, failure: str | None) -> None:
        """An attempt on one deployment of `model` ended; `failure`: a reason from RETRY_REASONS when it failed in a
        way that speaks of the deployment (server/providers/router.py), else None."""
        ...

    def attempt(self, model: str, upstream_model: str, provider: str, operation: str, address: str,
                port: int | None) -> Scope:
        """A client span for one HTTP request to an upstream (`with` around the whole exchange, the answer read to
        its end); its headers() carry the span's traceparent to the upstream. A no-op unless the request is traced."""
        ...

    def generation(self, engine_model: str, operation: str = "chat") -> Scope:
        """A span for one generation in process (the embedded model, its queueing included; the development image
        provider, operation "generate_content"). A no-op unless traced."""
        ...


class Scope(Protocol):
    """A span open for a `with` block (server/observability/tracing.py Scope or NoScope)."""

    def set(self, key: str, value: str | int | float | bool) -> None: ...

    @property
    def recording(self) -> bool: ...

    def answered(self, answer: UpstreamAnswer) -> None: ...

    def headers(self) -> dict[str, str]: ...

    def __enter__(self) -> Scope: ...

    def __exit__(self, exc_type, exc, tb) -> None: ...


# Anything else is counted as "other", so the label set stays bounded whatever a provider passes. An upstream status
# is a reason when the model's `retry.on_status` names it: any of 100-599, bounded too (529: Anthropic's overload).
# "connect": no connection could be opened; "broken": one was, and the answer broke off (closed, reset or ended
# before its end, or not HTTP); "timeout": connecting timed out.
RETRY_REASONS = frozenset({"connect", "broken", "timeout", "other", *(str(status) for status in range(100, 600))})
