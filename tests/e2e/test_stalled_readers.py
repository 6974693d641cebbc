"""Callers that stop reading a long streamed answer while others read theirs, through the real gateway: a stalled
reader holds back its own answer (back-pressure reaches its upstream), never anyone else's. Envoy reaches each server
process over one HTTP/2 connection per Envoy thread; with HTTP/2's default 256 MiB stream window the server kept
sending a stalled stream's answer into Envoy until Envoy stopped reading that whole connection, and every other
stream on it froze: other callers' answers, new requests included, until the stalled caller left."""

from __future__ import annotations

import json
import socket
import threading
import time

import h2.config
import h2.connection
import h2.events
import httpx
import pytest

from tests.e2e.conftest import upstream_gateway
from tests.upstream_double import Cue
from tests.upstream_echo import sse
from tests.upstream_support import UPSTREAM_KEY_ENV

CHAT = "/v1/chat/completions"
CHUNK = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m"}
# A long answer: 2,500 chunks of 16 KB (40 MB), more than Envoy buffers for a caller who does not read it.
LONG = [sse({**CHUNK, "choices": [{"index": 0, "delta": {"content": "abcd " * 3200}}]})] * 2500 + [
    sse({**CHUNK, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}), b"data: [DONE]\n\n"]
PATIENCE = 20  # seconds an answer that flows needs at most (it needs well under one)


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    provider = f"kind: openai, base_url: '{double.url}', api_key_env: {UPSTREAM_KEY_ENV}, model: m"
    models = f"  - {{id: long, endpoint: {CHAT}, provider: {{{provider}, retry: {{attempts: 1}}}}}}\n"
    with upstream_gateway(tmp_path_factory.mktemp("stalled-readers"), models) as gateway:
        yield gateway


@pytest.fixture(autouse=True)
def long_answers(double):
    double.reset()
    double.default_cue = Cue(frames=LONG)
    yield
    double.default_cue = Cue()


def _body() -> bytes:
    return json.dumps({"model": "long", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()


def test_a_stalled_stream_leaves_the_others_on_its_http2_connection_flowing(gateway):
    """One stream of four on one connection is never read (its window never reopened); the other three, and a
    request sent after them, are answered whole."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))

    def post(body: bytes) -> int:
        stream = connection.get_next_available_stream_id()
        connection.send_headers(stream, [(":method", "POST"), (":path", CHAT), (":scheme", "http"),
                                         (":authority", "x"), ("content-type", "application/json"),
                                         ("authorization", f"Bearer {gateway.secret}")])
        connection.send_data(stream, body, end_stream=True)
        return stream

    with socket.create_connection(("127.0.0.1", gateway.port), timeout=PATIENCE) as sock:
        connection.initiate_connection()
        stalled, *streams = [post(_body()) for _ in range(4)]
        sock.sendall(connection.data_to_send())
        bodies = {stream: b"" for stream in streams}
        ended: set[int] = set()
        late = None
        while late not in ended:
            try:
                data = sock.recv(1 << 20)
            except TimeoutError:
                raise AssertionError(f"answers froze behind the stalled one: {len(ended)} of 4 ended") from None
            assert data, "the connection was closed"
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.DataReceived):
                    if event.stream_id == stalled:  # the connection's window only: this stream's stays shut
                        connection.increment_flow_control_window(event.flow_controlled_length)
                    else:
                        bodies[event.stream_id] = bodies.get(event.stream_id, b"")[-100:] + event.data
                        connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                    ended.add(event.stream_id)
            if late is None and set(streams) <= ended:
                late = post(_body())
            sock.sendall(connection.data_to_send())
        assert stalled not in ended
        assert all(bodies[stream].endswith(b"data: [DONE]\n\n") for stream in (*streams, late))
        connection.reset_stream(stalled)
        sock.sendall(connection.data_to_send())


def test_callers_who_stop_reading_hold_up_no_one_else(gateway):
    """Four HTTP/1.1 callers stop reading (Envoy's threads take connections as they come, so some stalled stream
    shares each thread's connection to the server); six others, on their own connections, read theirs whole."""
    stalled = []
    try:
        for _ in range(4):
            sock = socket.create_connection(("127.0.0.1", gateway.port))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            body = _body()
            sock.sendall(f"POST {CHAT} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nAuthorization: "
                         f"Bearer {gateway.secret}\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
            stalled.append(sock)
            assert sock.recv(100).startswith(b"HTTP/1.1 200")
        time.sleep(1)  # their answers back up to their upstream
        tails: dict[int, bytes | str] = {}

        def read(i: int) -> None:
            try:
                with httpx.stream("POST", f"{gateway.base_url}{CHAT}", content=_body(), timeout=PATIENCE,
                                  headers={"authorization": f"Bearer {gateway.secret}",
                                           "content-type": "application/json"}) as answer:
                    tail = b""
                    for chunk in answer.iter_raw():
                        tail = (tail + chunk)[-100:]
                tails[i] = tail
            except httpx.TimeoutException as exc:
                tails[i] = repr(exc)

        readers = [threading.Thread(target=read, args=(i,)) for i in range(6)]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join()
        assert all(isinstance(tail, bytes) and tail.endswith(b"data: [DONE]\n\n") for tail in tails.values()), tails
    finally:
        for sock in stalled:
            sock.close()
