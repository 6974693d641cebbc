"""One interceptor turns every failure of a portico.v1 RPC into the error table's status, and observes every RPC.

A PorticoError becomes its row; anything else is logged and becomes one INTERNAL error, so no handler needs its
own try/except. The error travels three ways at once: the gRPC status code, the google.rpc.Status details for gRPC
callers, and `portico-*` trailing metadata from which Envoy's Lua filter builds the REST response.

Because this is where every RPC starts and ends, and where its outcome is known, it is also the one place that
opens and closes the RPC's telemetry record (metrics and the access-log line; server/observability).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Awaitable, Callable, Sequence

import grpc
from google.protobuf import any_pb2, duration_pb2
from google.rpc import error_details_pb2, status_pb2

from portico.v1 import error_pb2
from server.cache import HEADER as CACHE_HEADER
from server.db.database import StoreUnavailable
from server.errors import InternalError, PorticoError, RateLimited, error_body
from server.observability import Outcome, RequestRecord, Telemetry
from server.observability.record import endpoint_of
from server.services.undecodable import Undecodable, tolerant

_PORTICO_PREFIX = "/portico.v1."
# The services whose REST callers are the anthropic SDK: their errors take its shape.
_ANTHROPIC_PREFIXES = ("/portico.v1.MessageService/", "/portico.v1.AnthropicModelService/")


_logger = logging.getLogger(__name__)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, telemetry: Telemetry) -> None:
        self._telemetry = telemetry
        # method -> its wrapped handler, built on the method's first call rather than on every call. Only methods
        # the server registered get here, so the dict stays as small as the API.
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if (wrapped := self._wrapped.get(details.method)) is not None:
            return wrapped
        handler = await continuation(details)
        if handler is None:
            return handler
        wrapped = self._wrapped[details.method] = self._wrap(handler, details.method)
        return wrapped

    def _wrap(self, handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        if not method.startswith(_PORTICO_PREFIX):
            return handler
        anthropic = method.startswith(_ANTHROPIC_PREFIXES)
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, method, anthropic),
                request_deserializer=tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_stream(handler.unary_stream, method, anthropic),
                request_deserializer=tolerant(handler.request_deserializer),
                response_serializer=handler.response_serializer,
            )
        return handler

    def _wrap_unary(self, behavior, method: str, anthropic: bool):
        endpoint = endpoint_of(method)

        async def unary(request, context: grpc.aio.ServicerContext):
            observed = _Observation(self._telemetry, method, endpoint, context)
            try:
                if isinstance(request, Undecodable):
                    raise request.error
                return await behavior(request, context)
            except (asyncio.CancelledError, GeneratorExit):
                observed.outcome = Outcome.cancelled()
                raise
            except Exception as exc:  # noqa: BLE001 - every failure becomes a row of the table
                await observed.fail(context, self._as_portico_error(exc, method), anthropic=anthropic)
            finally:
                observed.close()

        return unary

    def _wrap_stream(self, behavior, method: str, anthropic: bool):
        endpoint = endpoint_of(method)

        async def stream(request, context: grpc.aio.ServicerContext):
            observed = _Observation(self._telemetry, method, endpoint, context)
            try:
                if isinstance(request, Undecodable):
                    raise request.error
                # Closed here: when grpc drops this generator (the caller went away), the servicer's generator is
                # closed right away too, so its cleanup (settling rate limits) does not wait for garbage collection.
                responses = behavior(request, context)
                try:
                    async for response in responses:
                        yield response
                finally:
                    await responses.aclose()  # aclosing's work, without its objects held by every open stream
            except (asyncio.CancelledError, GeneratorExit):
                observed.cancelled()
                raise
            except Exception as exc:  # noqa: BLE001
                await observed.fail(context, self._as_portico_error(exc, method), anthropic=anthropic)
            finally:
                observed.close()

        return stream

    def _as_portico_error(self, exc: Exception, method: str) -> PorticoError:
        if isinstance(exc, StoreUnavailable):  # its answer says only "unreachable": why is for the operator
            _logger.error("%s: the %s failed (%s)", method, exc.store, exc.detail)
        if isinstance(exc, PorticoError):
            if exc.kind.http_status == 500:  # a bug the code caught itself: logged with its traceback, as any 500
                _logger.error("internal error in %s: %s", method, exc.message, exc_info=exc)
            return exc
        if isinstance(exc, grpc.aio.AbortError):  # never raised by Portico's servicers: they raise PorticoErrors
            raise exc
        _logger.exception("unexpected error in %s", method)
        return InternalError("The server had an error while processing your request.")


class _Observation:
    """One RPC's telemetry record (None for RPCs that are not observed, e.g. probes); success unless told."""

    def __init__(self, telemetry: Telemetry, method: str, endpoint: str | None,
                 context: grpc.aio.ServicerContext) -> None:
        self._telemetry = telemetry
        self.outcome = Outcome(200)
        self._record: RequestRecord | None = None
        if endpoint is not None:
            metadata = context.invocation_metadata() or ()
            self._record = telemetry.begin(method, endpoint, metadata)

    def cancelled(self) -> None:
        """A stream cancelled: its caller went away, unless the whole answer had gone to grpc (a caller who closes on
        a stream's last event cancels grpc's write of it, or what runs after it)."""
        if self._record is None or not self._record.answered:
            self.outcome = Outcome.cancelled()

    async def fail(self, context: grpc.aio.ServicerContext, error: PorticoError, *, anthropic: bool) -> None:
        """Record the failure, then answer it: recorded first, so a caller that has its answer sees it counted. For
        a model with a response cache the answer also says the cache did not answer (configuration.md: every answer
        of a cached model carries x-portico-cache)."""
        self.outcome = Outcome.of_error(error)
        headers = ((CACHE_HEADER, "miss"),) if self._record is not None and self._record.cache else ()
        left = self._record is not None and self._record.caller_left
        self.close()
        if left:  # a call its caller ended takes no answer: recorded with the failure that ended its exchange
            raise asyncio.CancelledError
        await abort(context, error, anthropic=anthropic, headers=headers)

    def close(self) -> None:
        """Records the outcome once; later calls do nothing."""
        if self._record is not None:
            self._telemetry.finish(self._record, self.outcome)
            self._record = None


async def abort(context: grpc.aio.ServicerContext, error: PorticoError, *, anthropic: bool,
                headers: Sequence[tuple[str, str]] = ()) -> None:
    kind = error.kind
    message = error.message_for(anthropic=anthropic)
    status = status_pb2.Status(code=kind.grpc_code.value[0], message=message,
                               details=_details(error, anthropic=anthropic))
    trailing = [
        ("grpc-status-details-bin", status.SerializeToString()),
        ("portico-http-status", str(kind.http_status)),
        ("portico-error", error_body(error, anthropic=anthropic).decode()),
    ]
    own = (*headers, *error.trailing_metadata(anthropic=anthropic))
    # Headers a unary twin already set as trailing metadata (server/services/dialect.py) stay, unless the error
    # says otherwise.
    said = {key for key, _ in own}
    trailing.extend(item for item in context.trailing_metadata() if item[0] not in said)
    trailing.extend(own)
    await context.abort(kind.grpc_code, message, tuple(trailing))


def _details(error: PorticoError, *, anthropic: bool) -> list[any_pb2.Any]:
    """ErrorResponse first (Portico's own callers look there), then the standard google.rpc details. Its `type` is
    the one the service's REST callers get (Anthropic's on MessageService), so the two transports agree."""
    kind = error.kind
    api_error = error_pb2.ApiError(message=error.message_for(anthropic=anthropic),
                                   type=kind.type_for(anthropic=anthropic), param=error.param, code=error.code)
    messages = [
        error_pb2.ErrorResponse(error=api_error, http_status=kind.http_status, retry_after_seconds=error.retry_after)
    ]
    if isinstance(error, RateLimited):
        if error.retry_after > 0:
            delay = duration_pb2.Duration()
            delay.FromNanoseconds(math.ceil(error.retry_after * 1e9))
            messages.append(error_details_pb2.RetryInfo(retry_delay=delay))
        violation = error_details_pb2.QuotaFailure.Violation(subject=error.subject, description=error.message)
        messages.append(error_details_pb2.QuotaFailure(violations=[violation]))
    details = []
    for message in messages:
        detail = any_pb2.Any()
        detail.Pack(message)
        details.append(detail)
    return details
