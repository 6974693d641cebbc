"""Envoy's own replies to native gRPC callers (the server down or restarting: nothing listens on its socket) carry
the error object in the status details, as every other Portico error does (api.md, Errors), and the table's words:
they were a bare UNAVAILABLE saying "upstream connect error or disconnect/reset before headers. retried and the
latest reset reason: remote connection failure", Envoy's words for its own plumbing."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import grpc
import httpx
import pytest

from gateway.descriptors import DESCRIPTOR_SET
from gateway.envoy import ADMIN_SOCKET, EnvoyProcess, free_ports, load_template, render_config, repo_root
from portico.v1 import (
    chat_service_pb2_grpc, message_service_pb2_grpc, model_pb2, model_service_pb2_grpc,
)
from server.errors import RequestTooLarge, ServiceUnavailable
from tests.helpers import chat_request, error_details, message_request


@pytest.fixture(scope="module")
async def server_down():
    # Outside pytest's tmp dir: the session's log scan expects a Portico log beside every Envoy log there.
    with tempfile.TemporaryDirectory(prefix="portico-down-") as run_dir:
        async with _envoy_alone(Path(run_dir)) as target:
            yield target


@contextlib.asynccontextmanager
async def _envoy_alone(run_dir: Path):
    port, admin_port = free_ports(2)
    config = render_config(load_template(), listen_port=port, admin_port=admin_port,
                           upstreams=[f"unix:{run_dir / 'grpc.sock'}"], admin_socket=run_dir / ADMIN_SOCKET,
                           descriptor_set=DESCRIPTOR_SET, lua_dir=repo_root() / "gateway" / "lua")
    async with EnvoyProcess(config, run_dir):
        yield f"127.0.0.1:{port}"


CALLS = {
    "chat": (lambda channel: chat_service_pb2_grpc.ChatServiceStub(channel).CreateChatCompletion(chat_request()),
             False),
    "chat stream": (lambda channel: chat_service_pb2_grpc.ChatServiceStub(channel).StreamChatCompletion(
        chat_request()), False),
    "models": (lambda channel: model_service_pb2_grpc.ModelServiceStub(channel).ListModels(
        model_pb2.ListModelsRequest()), False),
    "messages": (lambda channel: message_service_pb2_grpc.MessageServiceStub(channel).CreateMessage(
        message_request()), True),
}


@pytest.mark.parametrize("name", list(CALLS))
async def test_a_grpc_call_while_the_server_is_down_gets_the_503_row_in_its_details(server_down, name):
    call, anthropic = CALLS[name]
    async with grpc.aio.insecure_channel(server_down) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            answer = call(channel)
            if hasattr(answer, "__aiter__"):
                async for _ in answer:
                    pass
            else:
                await answer
    kind = ServiceUnavailable.kind
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert raised.value.details() == kind.message
    detail = error_details(raised.value)
    assert detail.http_status == 503
    assert (detail.error.code, detail.error.type, detail.error.message) == (
        kind.code, kind.type_for(anthropic=anthropic), kind.message)


async def test_a_rest_call_while_the_server_is_down_keeps_its_503_object(server_down):
    """The REST callers' replies are the Lua filter's, before these mappers: unchanged."""
    async with httpx.AsyncClient(base_url=f"http://{server_down}") as http:
        reply = await http.get("/v1/models", headers={"authorization": "Bearer pk-x"})
    assert reply.status_code == 503
    assert reply.json() == {"error": {"message": ServiceUnavailable.kind.message, "type": "service_unavailable_error",
                                      "param": None, "code": "service_unavailable"}}


async def test_a_request_message_over_16_mib_gets_the_413_row_from_envoy(server_down):
    """Envoy holds a portico.v1 call's request until it has all arrived (its gRPC framing is read at the end:
    test_envoy_replies), and refuses one over its buffer's 16 MiB before the server sees it: a gRPC caller got
    UNKNOWN "Payload Too Large", Envoy's words. Now the table's 413 row, as from the server between 8 and 16 MiB."""
    request = chat_request(messages=[{"role": "user", "content": "a" * (17 << 20)}])
    async with grpc.aio.insecure_channel(server_down, options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await chat_service_pb2_grpc.ChatServiceStub(channel).CreateChatCompletion(request, timeout=30)
    kind = RequestTooLarge.kind
    assert (raised.value.code(), raised.value.details()) == (grpc.StatusCode.INVALID_ARGUMENT, kind.message)
    detail = error_details(raised.value)
    assert (detail.http_status, detail.error.code, detail.error.type) == (413, "request_too_large", kind.type)
