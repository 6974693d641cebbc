"""A call the gRPC server drops unanswered (CANCELLED from grpc-core itself: too many calls queued) reaches a REST
caller who is still there as 503 service_unavailable with retry-after, not as 499 "the caller went away"."""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import grpc
import httpx
import pytest

from gateway.descriptors import DESCRIPTOR_SET
from gateway.envoy import ADMIN_SOCKET, EnvoyProcess, free_ports, load_template, render_config, repo_root
from portico.v1 import chat_service_pb2_grpc, message_service_pb2_grpc
from tests.helpers import internal_headers


async def drop(request, context):
    await context.abort(grpc.StatusCode.CANCELLED, "CANCELLED")  # as grpc-core does, with no Portico metadata


async def drop_stream(request, context):
    await drop(request, context)
    yield  # a server-streaming method


class DroppingChat(chat_service_pb2_grpc.ChatServiceServicer):
    CreateChatCompletionHttp = staticmethod(drop_stream)
    CreateChatCompletionHttpUnary = staticmethod(drop)  # what Envoy sends a body that does not stream to


class DroppingMessages(message_service_pb2_grpc.MessageServiceServicer):
    CreateMessageHttp = staticmethod(drop_stream)
    CreateMessageHttpUnary = staticmethod(drop)


@pytest.fixture
async def front_door():
    # Outside pytest's tmp dir: the session's log scan expects a Portico log beside every Envoy log there.
    with tempfile.TemporaryDirectory(prefix="portico-dropped-") as run_dir:
        async with _front_door(Path(run_dir)) as url:
            yield url


@contextlib.asynccontextmanager
async def _front_door(run_dir: Path):
    server = grpc.aio.server()
    chat_service_pb2_grpc.add_ChatServiceServicer_to_server(DroppingChat(), server)
    message_service_pb2_grpc.add_MessageServiceServicer_to_server(DroppingMessages(), server)
    socket_path = run_dir / "grpc.sock"
    server.add_insecure_port(f"unix:{socket_path}")
    await server.start()
    port, admin_port = free_ports(2)
    config = render_config(load_template(), listen_port=port, admin_port=admin_port,
                           upstreams=[f"unix:{socket_path}"], admin_socket=Path(run_dir, ADMIN_SOCKET),
                           descriptor_set=DESCRIPTOR_SET,
                           lua_dir=repo_root() / "gateway" / "lua")
    try:
        async with EnvoyProcess(config, run_dir):
            yield f"http://127.0.0.1:{port}"
    finally:
        await server.stop(None)


@pytest.mark.parametrize("stream", [False, True])  # the unary twin, the streaming RPC
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/messages"])
async def test_a_call_the_server_dropped_is_503_with_retry_after(front_door, path, stream):
    async with httpx.AsyncClient(base_url=front_door) as http:
        reply = await http.post(path, json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                            "stream": stream})
    assert reply.status_code == 503
    assert reply.headers["retry-after"] == "1"
    assert reply.json()["error"]["code"] == "service_unavailable"
    assert not internal_headers(reply.headers)
