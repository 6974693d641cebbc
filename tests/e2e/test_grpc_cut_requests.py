"""A native gRPC call whose request stream ends inside a message (or before one) is answered at once, as gRPC servers
answer it, by Envoy's Lua filter: grpc itself waits for the rest (docs/api.md, Errors)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import pytest
from portico.v1 import chat_service_pb2_grpc

from tests.helpers import bearer, chat_request


def _grpc_over_h2(conn: socket.socket, connection: h2.connection.H2Connection, stream: int, secret: str,
                  frames: list[bytes], headers: tuple[tuple[bytes, bytes], ...] = (),
                  path: bytes = b"/portico.v1.ChatService/CreateChatCompletion") -> dict[bytes, bytes]:
    """One native gRPC call to `path` whose request is `frames` (DATA, sent as flow control lets it go, the last
    ending the stream), with `headers` added, as raw HTTP/2: its answer's headers and trailers in one dict (a
    socket timeout fails the test). An answer before the request is all sent ends the sending."""
    connection.send_headers(stream, [
        (b":method", b"POST"), (b":path", path), (b":scheme", b"http"),
        (b":authority", b"x"), (b"content-type", b"application/grpc"), (b"te", b"trailers"),
        (b"authorization", b"Bearer " + secret.encode()), *headers], end_stream=not frames)
    conn.sendall(connection.data_to_send())
    answer: dict[bytes, bytes] = {}
    ended = False

    def receive() -> None:
        nonlocal ended
        chunk = conn.recv(65536)
        assert chunk, "the connection closed before the answer"
        for event in connection.receive_data(chunk):
            if isinstance(event, (h2.events.ResponseReceived, h2.events.TrailersReceived)):
                answer.update(dict(event.headers))
            elif isinstance(event, h2.events.DataReceived):
                connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamReset) and event.stream_id == stream:
                assert answer, f"stream reset: {event.error_code}"  # Envoy resets what it has not read, once answered
                ended = True
            elif isinstance(event, h2.events.StreamEnded) and event.stream_id == stream:
                ended = True
        conn.sendall(connection.data_to_send())

    for i, frame in enumerate(frames):
        at, pieces = 0, 0  # an empty frame is sent too, once
        while not ended and (at < len(frame) or not pieces):
            size = min(len(frame) - at, connection.local_flow_control_window(stream),
                       connection.max_outbound_frame_size)
            if not size and at < len(frame):
                receive()
                continue
            last = i == len(frames) - 1 and at + size == len(frame)
            connection.send_data(stream, frame[at:at + size], end_stream=last)
            conn.sendall(connection.data_to_send())
            at, pieces = at + size, pieces + 1
    while not ended:
        receive()
    return answer


def _framed(message: bytes) -> bytes:
    return b"\x00" + len(message).to_bytes(4, "big") + message


@pytest.mark.parametrize("cut", [
    b"\x00\x00\x00\x00\x64" + b"\x0a\x05hello",  # the prefix announces 100 bytes, 7 come
    b"\x00\x00\x00",  # the prefix itself cut
    _framed(b"\x0a\x05hello") + b"\x00\x00\x00\x00\x09\x0a",  # a whole message, then a cut one
    b"", None,  # no message at all: an empty DATA frame ends the stream, or the headers do
], ids=["body", "prefix", "second-message", "empty", "headers-only"])
def test_a_grpc_request_that_ends_inside_a_message_is_internal_at_once(gateway, cut):
    """grpc (the server's C core) waits for the rest of a message whose stream has ended, and never calls the
    method: the caller got nothing for 300 s (Envoy's silence limit), then a reset. gRPC servers answer such a call
    at once with INTERNAL (grpc-java: "Encountered end-of-stream mid-frame"); so does the gateway now, and the
    connection serves the next call."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5.0) as conn:
        connection.initiate_connection()
        conn.sendall(connection.data_to_send())
        started = time.monotonic()
        answer = _grpc_over_h2(conn, connection, 1, gateway.secret, [] if cut is None else [cut])
        assert time.monotonic() - started < 4
        assert (answer[b":status"], answer[b"content-type"], answer[b"grpc-status"]) == (
            b"200", b"application/grpc", str(grpc.StatusCode.INTERNAL.value[0]).encode())
        said = b"ended inside a gRPC message" if cut else b"ended before its gRPC message"
        assert said in answer[b"grpc-message"] and answer[b"x-request-id"] == answer[b"request-id"]
        request = chat_request(max_tokens=1).SerializeToString()
        # A valid call on the same connection, its message split over several DATA frames.
        answer = _grpc_over_h2(conn, connection, 3, gateway.secret, [_framed(request)[:3], _framed(request)[3:9],
                                                                     _framed(request)[9:]])
        assert answer[b":status"] == b"200" and answer[b"grpc-status"] == b"0", answer


@pytest.mark.parametrize("method", [b"Check", b"List"])
def test_a_cut_health_call_is_internal_at_once(gateway, method):
    """The health service's Check and List, unary like portico.v1's methods, waited for the rest of a cut message
    as they did (300 s)."""
    path = b"/grpc.health.v1.Health/" + method
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5.0) as conn:
        connection.initiate_connection()
        conn.sendall(connection.data_to_send())
        answer = _grpc_over_h2(conn, connection, 1, "", [b"\x00\x00\x00\x00\x09\x0a"], path=path)
        assert answer[b"grpc-status"] == str(grpc.StatusCode.INTERNAL.value[0]).encode(), answer
        assert b"ended inside a gRPC message" in answer[b"grpc-message"]
        answer = _grpc_over_h2(conn, connection, 3, "", [_framed(b"")], path=path)
        assert answer[b"grpc-status"] == b"0", answer



def test_a_cut_request_is_in_envoys_access_log_under_its_rpc(gateway):
    """operations.md: replies the server never sees are Envoy's lines, the request named. The line said "request":
    null and "status": 200 (the HTTP status of every gRPC answer): now the call and the status of its code's row."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5.0) as conn:
        connection.initiate_connection()
        conn.sendall(connection.data_to_send())
        answer = _grpc_over_h2(conn, connection, 1, gateway.secret, [b"\x00\x00\x00"])
    line = gateway.envoy_access_lines(answer[b"x-request-id"].decode())[0]
    assert (line["source"], line["request"], line["status"], line["code"]) == (
        "envoy", "POST /portico.v1.ChatService/CreateChatCompletion", 400, "invalid_request")


def test_a_request_over_envoys_buffer_is_in_its_access_log(gateway):
    """Envoy refuses a portico.v1 request over its 16 MiB buffer (the 413 row, test_grpc_envoy_replies): the server
    never sees it, and no log had a line for it. Now Envoy's, as for a REST body over 8 MiB."""
    request_id = "grpc-over-16-mib-" + str(time.time_ns())
    request = chat_request(messages=[{"role": "user", "content": "a" * (17 << 20)}])
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}",
                               options=[("grpc.max_send_message_length", 64 << 20)]) as channel:
        with pytest.raises(grpc.RpcError) as raised:
            chat_service_pb2_grpc.ChatServiceStub(channel).CreateChatCompletion(
                request, metadata=(*bearer(gateway.secret), ("x-request-id", request_id)), timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert ("portico-http-status", "413") in raised.value.trailing_metadata()  # as api.md's gRPC errors carry it
    line = gateway.envoy_access_lines(request_id)[0]
    assert (line["source"], line["request"], line["status"], line["code"]) == (
        "envoy", "POST /portico.v1.ChatService/CreateChatCompletion", 413, "request_too_large")
    assert request_id not in gateway.log_path.read_text()  # no line of the server's


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def test_a_request_of_many_small_messages_costs_envoy_little(gateway):
    """The framing is read in Envoy's worker thread, which serves every other caller on it too. A 16 MiB request
    of empty messages (3.3 million), sent with no key, took Envoy's worker 2 s of CPU: a few MB/s of such requests
    from anyone kept a core busy. A valid call of one message (the usual) is read in one step."""
    children = subprocess.run(["pgrep", "-P", str(gateway.process.pid)], capture_output=True, text=True).stdout
    (envoy,) = [int(pid) for pid in children.split() if Path(f"/proc/{pid}/exe").resolve().name.startswith("envoy")]
    body = b"\x00" * 5 * ((16 << 20) // 5 - 10)
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30.0) as conn:
        connection.initiate_connection()
        conn.sendall(connection.data_to_send())
        before = _cpu_seconds(envoy)
        answer = _grpc_over_h2(conn, connection, 1, gateway.secret, [body])
        spent = _cpu_seconds(envoy) - before
    assert answer[b"grpc-status"] == str(grpc.StatusCode.INVALID_ARGUMENT.value[0]).encode()  # grpc read the first
    assert spent < 0.6, f"{spent:.2f} s of Envoy's CPU"


@pytest.mark.parametrize("body", [b"\x00\x00\x00", _framed(b"\x0a" + b"x" * (17 << 20))], ids=["cut", "over-16-mib"])
def test_envoys_refusal_carries_a_request_id_when_the_callers_was_not_text(gateway, body):
    """An x-request-id that is not UTF-8 is removed (api.md): the call gets a new one. Envoy's refusals of such a
    portico.v1 call had none at all (the 413) or no request-id (the cut), and the 413's line no request_id."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30.0) as conn:
        connection.initiate_connection()
        conn.sendall(connection.data_to_send())
        answer = _grpc_over_h2(conn, connection, 1, gateway.secret, [body], ((b"x-request-id", b"caf\xe9"),))
    assert answer[b"grpc-status"] in (b"3", b"13")
    assert answer.get(b"x-request-id") and answer.get(b"request-id") == answer[b"x-request-id"], answer
    assert gateway.envoy_access_lines(answer[b"x-request-id"].decode())[0]["code"] in (
        "invalid_request", "request_too_large")
