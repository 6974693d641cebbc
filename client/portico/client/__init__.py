"""portico.client: Portico's client rules for internal Python callers, over the gRPC stubs or the REST API.

    from portico.client import ModelAliases, PorticoClient, RetryPolicy, UserRateLimiter

    client = PorticoClient.over_grpc("127.0.0.1:8080", api_key,
                                     aliases=ModelAliases.load("models.yaml"),
                                     retry=RetryPolicy(attempts=3, base=0.5, cap=30),
                                     limiter=UserRateLimiter.per_minute(20, burst=5))
    completion = client.chat_completion("chat", [{"role": "user", "content": "Hi"}], max_tokens=32, user="u-42")

Typed errors (_errors), the retry policy and fallback walk (_policy), aliases from configuration (_aliases), a
per-user token bucket (_limiter), bounded queues for non-urgent work (_queue), transports (_transports) and the
sync and asyncio clients (_client). See docs/client.md.
"""

from portico.client._aliases import ModelAliases, Route
from portico.client._client import AsyncPorticoClient, PorticoClient
from portico.client._errors import (
    APIConnectionError, APIError, APITimeoutError, AuthenticationError, BadRequestError, ClientRateLimitError,
    GatewayTimeoutError, InternalServerError, NotFoundError, PermissionDeniedError, PorticoClientError, QueueFull,
    RateLimitError, RetriesExhausted, ServiceUnavailableError, UpstreamError, error_from_grpc, error_from_http,
)
from portico.client._limiter import UserRateLimiter
from portico.client._policy import Plan, RetryPolicy
from portico.client._queue import AsyncRequestQueue, RequestQueue
from portico.client._transports import (
    CHANNEL_OPTIONS, CHAT_COMPLETION, COUNT_MESSAGE_TOKENS, LIST_MODELS, MESSAGE, AsyncGrpcTransport,
    AsyncHttpTransport, GrpcTransport, HttpTransport, Operation, Reply,
)

__all__ = [
    "APIConnectionError", "APIError", "APITimeoutError", "AsyncGrpcTransport", "AsyncHttpTransport", "AsyncPorticoClient",
    "AsyncRequestQueue", "AuthenticationError", "BadRequestError", "CHANNEL_OPTIONS", "CHAT_COMPLETION",
    "COUNT_MESSAGE_TOKENS", "ClientRateLimitError",
    "GatewayTimeoutError", "GrpcTransport", "HttpTransport", "InternalServerError", "LIST_MODELS", "MESSAGE",
    "ModelAliases", "NotFoundError", "Operation", "PermissionDeniedError", "Plan", "PorticoClient",
    "PorticoClientError", "QueueFull", "RateLimitError", "Reply", "RequestQueue", "RetriesExhausted", "RetryPolicy",
    "Route",
    "ServiceUnavailableError", "UpstreamError", "UserRateLimiter", "error_from_grpc", "error_from_http",
]
