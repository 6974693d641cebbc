"""A failed call's outcome is recorded before its error status goes out: a caller that reads /metrics, the access
log or its usage right after its call failed finds the call there (the status used to be sent first, so under load
such a read could miss it)."""

from __future__ import annotations

from types import SimpleNamespace

import grpc
import pytest

from server.errors import InternalError, UpstreamError
from server.observability.record import RequestRecord
from server.services.interceptor import ErrorInterceptor
from server.services.streaming import guard_stream

METHOD = "/portico.v1.ChatService/CreateChatCompletionHttp"


class _Telemetry:
    def __init__(self) -> None:
        self.finished: list[int] = []

    def begin(self, method, endpoint, metadata):
        return SimpleNamespace(cache=None, answered=False, caller_left=False)  # a RequestRecord's fields the interceptor reads

    def finish(self, record, outcome) -> None:
        self.finished.append(outcome.status)


class _Context:
    def __init__(self, telemetry: _Telemetry) -> None:
        self._telemetry = telemetry
        self.recorded_when_sent: list[int] | None = None

    def invocation_metadata(self):
        return ()

    def trailing_metadata(self):
        return ()

    async def abort(self, code, details, trailing_metadata):
        self.recorded_when_sent = list(self._telemetry.finished)
        raise grpc.aio.AbortError()


async def _fails(request, context):
    raise UpstreamError("The upstream failed.")


async def _fails_midway(request, context):
    yield "first event"
    raise UpstreamError("The upstream failed.")


async def test_a_failed_unary_call_is_recorded_once_before_its_status_is_sent():
    telemetry = _Telemetry()
    context = _Context(telemetry)
    unary = ErrorInterceptor(telemetry)._wrap_unary(_fails, METHOD, False)
    with pytest.raises(grpc.aio.AbortError):
        await unary(object(), context)
    assert context.recorded_when_sent == [502]
    assert telemetry.finished == [502]


async def test_a_stream_that_fails_midway_is_recorded_once_before_its_status_is_sent():
    telemetry = _Telemetry()
    context = _Context(telemetry)
    stream = ErrorInterceptor(telemetry)._wrap_stream(_fails_midway, METHOD, False)
    with pytest.raises(grpc.aio.AbortError):
        async for _ in stream(object(), context):
            pass
    assert context.recorded_when_sent == [502]
    assert telemetry.finished == [502]


async def _has_a_bug(request, context):
    raise InternalError("The provider ended without a result.")


async def _has_a_bug_midway(request, context):
    yield "first event"
    raise InternalError("The provider ended without a result.")


async def test_a_500_the_code_raised_itself_is_logged_with_its_traceback(caplog):
    """api.md, Errors: a 500 is "a bug; logged with its traceback", also one the code caught and raised as an
    InternalError (a provider that ended without a result; llama.cpp's own failure, its cause)."""
    for wrapped in (ErrorInterceptor(_Telemetry())._wrap_unary(_has_a_bug, METHOD, False),
                    ErrorInterceptor(_Telemetry())._wrap_stream(_has_a_bug_midway, METHOD, False)):
        caplog.clear()
        with caplog.at_level("ERROR"), pytest.raises(grpc.aio.AbortError):
            answer = wrapped(object(), _Context(_Telemetry()))
            if hasattr(answer, "__aiter__"):
                async for _ in answer:
                    pass
            else:
                await answer
        assert [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], InternalError)]


async def test_a_500_after_a_streams_first_byte_is_logged_with_its_traceback(caplog):
    async def frames():
        yield b"data: {}\n\n"
        raise InternalError("The provider ended without a result.")

    with caplog.at_level("ERROR"):
        record = RequestRecord("req", "ChatService/CreateChatCompletionHttp", "/v1/chat/completions")
        sent = [frame async for frame in guard_stream(frames(), lambda error: b"error", record)]
    assert sent == [b"data: {}\n\n", b"error"]
    assert [r for r in caplog.records if r.exc_info and isinstance(r.exc_info[1], InternalError)]
