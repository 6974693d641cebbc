"""A request whose body never completes, or trickles in, is cut off (408) like one whose headers do: Envoy only cut
it after its silence limit (300 s, 635 s with upstream models), and one byte every few minutes held the connection
(and its buffer) for ever. The whole request must arrive within envoy.yaml's `request_timeout`; an answer, a
stream's included, has no such limit.

The real server and Envoy behind one port, with envoy.yaml's timeout shortened to keep the test fast."""

from __future__ import annotations

import asyncio
import base64
import json
import socket
import tempfile
import time
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import httpx
import pytest
from google.rpc import status_pb2
from portico.v1 import chat_service_pb2_grpc, error_pb2

from gateway.descriptors import DESCRIPTOR_SET
from gateway.envoy import (
    ADMIN_SOCKET,
    EnvoyProcess,
    free_ports,
    http_manager,
    load_template,
    render_config,
    repo_root,
)
from server.errors import REQUEST_TIMEOUT
from tests.helpers import bearer, chat_request
from tests.upstream_double import Cue
from tests.upstream_support import upstream_models, upstream_server

CUT_SECONDS = 2


def test_a_whole_request_must_arrive_within_300_seconds():
    assert http_manager(load_template())["request_timeout"] == "300s"


@pytest.fixture(scope="module")
async def front_door(double):
    """(port, secret) of Envoy, as envoy.yaml has it but for a 2 s request_timeout, in front of the real server."""
    # Outside pytest's tmp dir: the session's log scan expects a Portico log beside every Envoy log there.
    with tempfile.TemporaryDirectory(prefix="portico-slow-bodies-") as run_dir:
        async with upstream_server(Path(run_dir), upstream_models(double.url)) as server:
            _, secret = await server.store.create("slow", all_models=True)
            template = load_template()
            http_manager(template)["request_timeout"] = f"{CUT_SECONDS}s"
            port, admin_port = free_ports(2)
            config = render_config(template, listen_port=port, admin_port=admin_port,
                                   upstreams=[f"127.0.0.1:{server.port}"], admin_socket=Path(run_dir, ADMIN_SOCKET),
                                   descriptor_set=DESCRIPTOR_SET,
                                   lua_dir=repo_root() / "gateway" / "lua")
            async with EnvoyProcess(config, Path(run_dir)):
                yield port, secret


def _body(stream: bool) -> bytes:
    return json.dumps({"model": "up-solo", "messages": [{"role": "user", "content": "a b c d e"}],
                       "stream": stream}).encode()


def _send_slowly(port: int, secret: str, body: bytes, *, trickle: bool) -> tuple[float, bytes]:
    """Headers at once, then the body a byte every 0.2 s (trickle) or half of it and nothing more: how long until
    the connection ended, and what came back."""
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: portico\r\nAuthorization: Bearer {secret}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    started, answer, sent = time.monotonic(), b"", 0
    with socket.create_connection(("127.0.0.1", port), timeout=0.2) as conn:
        conn.sendall(head if trickle else head + body[:len(body) // 2])
        while time.monotonic() - started < 10:
            try:
                chunk = conn.recv(4096)
            except TimeoutError:
                if trickle and sent < len(body) - 1:  # never the last byte
                    conn.sendall(body[sent:sent + 1])
                    sent += 1
                continue
            except ConnectionResetError:  # Envoy resets what it has not read, once its answer is out
                break
            if not chunk:
                break
            answer += chunk
    return time.monotonic() - started, answer


@pytest.mark.parametrize("trickle", [False, True])
async def test_a_body_that_never_completes_is_408(front_door, trickle):
    port, secret = front_door
    elapsed, answer = _send_slowly(port, secret, _body(stream=False), trickle=trickle)
    assert CUT_SECONDS <= elapsed < CUT_SECONDS + 3
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408")
    error = json.loads(body)["error"]
    assert error["code"] == "request_timeout" and error["type"] == "invalid_request_error"
    assert error["message"] == "The request did not arrive in time."


async def test_answers_longer_than_the_cut_are_whole(front_door, double):
    """The timeout ends when the request has arrived: streams may run as long as they like, REST and gRPC."""
    port, secret = front_door
    double.cue(Cue(frame_delay=0.5), Cue(frame_delay=0.5))  # 7 frames: 3 s
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=30) as http:
        answer = await http.post("/v1/chat/completions", content=_body(stream=True),
                                 headers={"authorization": f"Bearer {secret}", "content-type": "application/json"})
    assert answer.status_code == 200 and answer.text.rstrip().endswith("data: [DONE]")
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        chunks = [chunk async for chunk in chat_service_pb2_grpc.ChatServiceStub(channel).StreamChatCompletion(
            chat_request(model="up-solo", messages=[{"role": "user", "content": "a b c d e"}]),
            metadata=bearer(secret))]
    assert chunks[-1].choices[0].finish_reason == "stop"


async def test_a_bidirectional_stream_open_longer_than_the_cut_goes_on(front_door):
    """grpcurl's reflection stream keeps its request side open between questions: once answered, it is not cut."""
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    port, _ = front_door
    questions: asyncio.Queue = asyncio.Queue()

    async def asked():
        while (question := await questions.get()) is not None:
            yield question

    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(asked())
        for _ in range(2):
            await questions.put(reflection_pb2.ServerReflectionRequest(list_services=""))
            answer = await call.read()
            assert "portico.v1.ChatService" in {s.name for s in answer.list_services_response.service}
            await asyncio.sleep(CUT_SECONDS + 1)
        await questions.put(None)


def _grpc_call_never_ended(port: int, secret: str, path: str) -> tuple[float, dict[bytes, bytes]]:
    """A native gRPC call whose request stops inside its message and never ends: how long until its answer ended,
    and that answer's headers and trailers."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    message = chat_request(max_tokens=1).SerializeToString()
    answer: dict[bytes, bytes] = {}
    with socket.create_connection(("127.0.0.1", port), timeout=CUT_SECONDS + 3) as conn:
        started = time.monotonic()
        connection.initiate_connection()
        connection.send_headers(1, [
            (b":method", b"POST"), (b":path", path.encode()), (b":scheme", b"http"), (b":authority", b"x"),
            (b"content-type", b"application/grpc"), (b"te", b"trailers"),
            (b"authorization", f"Bearer {secret}".encode())])
        connection.send_data(1, b"\x00" + len(message).to_bytes(4, "big") + message[:4])
        conn.sendall(connection.data_to_send())
        while True:
            chunk = conn.recv(65536)
            assert chunk, "the connection closed before the answer"
            for event in connection.receive_data(chunk):
                if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                    answer.update(dict(event.headers))
                elif isinstance(event, h2.events.StreamReset):
                    raise AssertionError(f"stream reset: {event.error_code}")
                elif isinstance(event, h2.events.StreamEnded):
                    return time.monotonic() - started, answer
            conn.sendall(connection.data_to_send())


@pytest.mark.parametrize("path", ["/portico.v1.ChatService/CreateChatCompletion", "/grpc.health.v1.Health/Check"])
async def test_a_grpc_request_that_never_completes_gets_the_408_row(front_door, path):
    """Envoy holds a portico.v1 call's request until it has all arrived (its gRPC framing is read then): one that
    never does is cut at the request timeout, as a REST body is. Its gRPC caller got UNKNOWN "request timeout",
    Envoy's words without the error object; now the 408 row, as api.md's table has it."""
    port, secret = front_door
    elapsed, answer = await asyncio.to_thread(_grpc_call_never_ended, port, secret, path)
    assert CUT_SECONDS <= elapsed < CUT_SECONDS + 3
    kind = REQUEST_TIMEOUT
    assert (answer[b"grpc-status"], answer[b"grpc-message"].decode()) == (
        str(grpc.StatusCode.DEADLINE_EXCEEDED.value[0]).encode(), kind.message)
    raw = answer[b"grpc-status-details-bin"]
    detail = error_pb2.ErrorResponse()
    assert status_pb2.Status.FromString(base64.b64decode(raw + b"=" * (-len(raw) % 4))).details[0].Unpack(detail)
    assert (detail.http_status, detail.error.code, detail.error.type) == (408, "request_timeout", kind.type)
    assert answer[b"x-request-id"]
