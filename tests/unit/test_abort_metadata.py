"""The interceptor's error answer keeps the headers a unary twin already set as trailing metadata (its x-ratelimit-*
go out at the end of the call, server/services/dialect.py): a caller whose admitted request fails later still sees
them, and the error's own headers win over them."""

from __future__ import annotations

import grpc
import pytest

from server.errors import RateLimited, UpstreamError
from server.services.interceptor import abort

SET_BEFORE = (("x-ratelimit-limit-requests", "5"), ("x-ratelimit-remaining-requests", "4"), ("retry-after", "9"))


class _Context:
    def __init__(self, trailing: tuple[tuple[str, str], ...]) -> None:
        self._trailing = trailing
        self.sent: dict[str, str] = {}

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing

    async def abort(self, code: grpc.StatusCode, details: str, trailing_metadata: tuple) -> None:
        self.sent = dict(trailing_metadata)
        assert len(self.sent) == len(trailing_metadata), "a header sent twice"
        raise grpc.aio.AbortError()


async def test_an_error_after_the_headers_were_set_keeps_them():
    context = _Context(SET_BEFORE)
    with pytest.raises(grpc.aio.AbortError):
        await abort(context, UpstreamError("The upstream failed."), anthropic=False)
    assert context.sent["x-ratelimit-remaining-requests"] == "4" and context.sent["portico-http-status"] == "502"


async def test_the_errors_own_headers_win():
    context = _Context(SET_BEFORE)
    with pytest.raises(grpc.aio.AbortError):
        await abort(context, RateLimited("Slow down.", retry_after=2), anthropic=False)
    assert context.sent["retry-after"] == "2" and context.sent["x-ratelimit-limit-requests"] == "5"


async def test_nothing_set_before_adds_nothing():
    context = _Context(())
    with pytest.raises(grpc.aio.AbortError):
        await abort(context, UpstreamError("The upstream failed."), anthropic=False)
    assert not any(name.startswith("x-ratelimit-") for name in context.sent)
