"""A typed stream whose caller closes on its last message had the whole answer: a 200, as a REST stream closed on
`[DONE]` is (tests/e2e/test_stream_outcomes.py). grpc cancels its write of that message, or what runs after it,
and drops the servicer's generator there; the interceptor took that for a caller who left (499 `cancelled` in the
access log, the metrics and the usage ledger)."""

from __future__ import annotations

import uuid

import grpc
import pytest

from bench.handler import CallDetails, InProcessContext
from server.services.chat import ChatServicer
from server.services.interceptor import ErrorInterceptor
from server.services.messages import MessageServicer
from tests.helpers import chat_request, message_request


async def _statuses(running, method: str, behavior, request, secret: str, keep: int | None) -> tuple[int, list]:
    """Runs the stream through the error interceptor as grpc does, taking `keep` messages (None: all) before grpc
    drops it; the status its ledger row says, and the messages."""

    async def continuation(details):
        return grpc.unary_stream_rpc_method_handler(behavior)

    handler = await ErrorInterceptor(running.core.telemetry).intercept_service(continuation, CallDetails(method))
    request_id = f"typed-end-{uuid.uuid4().hex[:8]}"
    stream = handler.unary_stream(request, InProcessContext(secret, request_id))
    taken = []
    async for message in stream:
        taken.append(message)
        if keep is not None and len(taken) == keep:
            break
    await stream.aclose()  # grpc drops the generator where it stands
    await running.core.ledger.flush()
    [row] = [r for r in running.core.usage.rows() if r.request_id == request_id]
    return row.status, taken


@pytest.mark.parametrize("kind", ["chat", "messages"])
async def test_a_typed_stream_closed_on_its_last_message_is_a_200(running, secret, kind):
    pipeline = running.core.pipeline
    if kind == "chat":
        method = "/portico.v1.ChatService/StreamChatCompletion"
        behavior = ChatServicer(pipeline, default_max_tokens=64).StreamChatCompletion
        request = chat_request(max_tokens=4, stream=True, stream_options={"include_usage": True}, temperature=0)
    else:
        method = "/portico.v1.MessageService/StreamMessage"
        behavior = MessageServicer(pipeline).StreamMessage
        request = message_request(max_tokens=4, stream=True, temperature=0)
    # temperature 0: the same answer, in the same number of messages, each time
    status, whole = await _statuses(running, method, behavior, request, secret, None)
    assert status == 200 and len(whole) > 2
    status, taken = await _statuses(running, method, behavior, request, secret, len(whole))
    assert status == 200 and len(taken) == len(whole), "the caller had every message"
    status, _ = await _statuses(running, method, behavior, request, secret, 2)
    assert status == 499, "a caller who leaves before the end is still one who left"
