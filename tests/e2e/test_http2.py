"""REST over HTTP/2 (h2c, prior knowledge), as a Go or Rust client may speak it: the same answers as over HTTP/1.1,
and gRPC's headers and trailers (grpc-status, grpc-message) never reach the caller, who would see HTTP/2 trailers
(HTTP/1.1 has none to leak). A raw h2 connection, since HTTP clients do not show trailers."""

from __future__ import annotations

import json
import socket
import sqlite3
import time
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events

from tests.helpers import internal_headers

CHAT = "/v1/chat/completions"


@dataclass
class Answer:
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    trailers: dict[str, str] = field(default_factory=dict)

    def internal(self) -> list[str]:
        return internal_headers((*self.headers, *self.trailers))


def h2_post(port: int, path: str, body: dict, secret: str) -> Answer:
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    answer = Answer()
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        connection.initiate_connection()
        stream = connection.get_next_available_stream_id()
        payload = json.dumps(body).encode()
        connection.send_headers(stream, [(":method", "POST"), (":path", path), (":scheme", "http"),
                                         (":authority", f"127.0.0.1:{port}"), ("content-type", "application/json"),
                                         ("authorization", f"Bearer {secret}"),
                                         ("content-length", str(len(payload)))])
        connection.send_data(stream, payload, end_stream=True)
        sock.sendall(connection.data_to_send())
        while True:
            data = sock.recv(65536)
            assert data, "the connection closed before the answer ended"
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    answer.headers = dict(event.headers)
                elif isinstance(event, h2.events.DataReceived):
                    answer.body += event.data
                    connection.acknowledge_received_data(event.flow_controlled_length, stream)
                elif isinstance(event, h2.events.TrailersReceived):
                    answer.trailers = dict(event.headers)
                elif isinstance(event, (h2.events.StreamEnded, h2.events.StreamReset)):
                    return answer
            sock.sendall(connection.data_to_send())


def test_a_json_answer_over_http2(gateway):
    answer = h2_post(gateway.port, CHAT, {"model": "family-a-5.5", "max_tokens": 4,
                                           "messages": [{"role": "user", "content": "Hi"}]}, gateway.secret)
    assert answer.headers[":status"] == "200"
    assert json.loads(answer.body)["object"] == "chat.completion"
    assert "x-ratelimit-remaining-requests" in answer.headers
    assert answer.internal() == []


def test_a_json_answer_over_http2_repeats_no_header_in_trailers(gateway):
    """The server sends a unary answer's x-ratelimit-* as trailing metadata; Envoy moved them up into the headers but
    left them in the trailers too, so an HTTP/2 caller got each one twice: in the headers and again in a trailing
    HEADERS frame (Go's `resp.Trailer`, say). HTTP/1.1 callers, whose trailers Envoy drops, never saw them."""
    for path, body in ((CHAT, {"model": "family-a-5.5", "max_tokens": 2,
                               "messages": [{"role": "user", "content": "Hi"}]}),
                       ("/v1/messages", {"model": "family-b-opus-4-8", "max_tokens": 2,
                                         "messages": [{"role": "user", "content": "Hi"}]})):
        answer = h2_post(gateway.port, path, body, gateway.secret)
        assert answer.headers[":status"] == "200", answer.body
        assert "x-ratelimit-remaining-requests" in answer.headers
        assert answer.trailers == {}, path


def test_a_stream_over_http2(gateway):
    answer = h2_post(gateway.port, CHAT, {"model": "family-a-5.5", "max_tokens": 4, "stream": True,
                                           "messages": [{"role": "user", "content": "Hi"}]}, gateway.secret)
    assert answer.headers[":status"] == "200" and answer.headers["content-type"] == "text/event-stream"
    assert answer.headers["cache-control"] == "no-cache"
    assert answer.body.rstrip().endswith(b"data: [DONE]")
    assert answer.internal() == []


def test_an_error_over_http2(gateway):
    answer = h2_post(gateway.port, CHAT, {"model": "no-such-model", "messages": [{"role": "user", "content": "Hi"}]},
                     gateway.secret)
    assert answer.headers[":status"] == "404"
    assert json.loads(answer.body)["error"]["code"] == "model_not_found"
    assert answer.internal() == []


def test_a_malformed_http2_request_resets_its_stream_not_the_connection(gateway):
    """An upper-case header name is malformed in HTTP/2. Envoy dropped the whole connection for it (a TCP reset),
    and with it every other request on that connection; now only that stream is reset."""
    config = h2.config.H2Configuration(client_side=True, validate_outbound_headers=False,
                                       normalize_outbound_headers=False)
    connection = h2.connection.H2Connection(config)
    common = [(b":method", b"GET"), (b":path", b"/v1/models"), (b":scheme", b"http"), (b":authority", b"x")]
    key = f"Bearer {gateway.secret}".encode()
    events: dict[int, list[str]] = {1: [], 3: [], 5: []}
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as sock:
        connection.initiate_connection()
        connection.send_headers(1, [*common, (b"Authorization", key)], end_stream=True)  # malformed
        sock.sendall(connection.data_to_send())
        time.sleep(0.2)
        for stream in (3, 5):
            connection.send_headers(stream, [*common, (b"authorization", key)], end_stream=True)
        sock.sendall(connection.data_to_send())
        while not all(events[s] and events[s][-1] in ("ended", "reset") for s in events):
            data = sock.recv(65536)
            assert data, f"the connection was closed: {events}"
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    events[event.stream_id].append(dict(event.headers)[b":status"].decode())
                elif isinstance(event, h2.events.StreamEnded):
                    events[event.stream_id].append("ended")
                elif isinstance(event, h2.events.StreamReset):
                    events[event.stream_id].append("reset")
                elif isinstance(event, h2.events.DataReceived):
                    connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            sock.sendall(connection.data_to_send())
    assert events[1][-1] == "reset" or events[1][0] == "400", events
    assert events[3] == events[5] == ["200", "ended"], events


def _ledger(gateway, request_ids: set[str]) -> dict[str, tuple[int, str]]:
    """(status, code) of the usage ledger's rows for these requests, once all are written (every second)."""
    for _ in range(100):
        with sqlite3.connect(gateway.data_dir / "keys.db", timeout=10) as db:
            rows = db.execute("SELECT request_id, status, code FROM usage_ledger").fetchall()
        found = {request_id: (status, code) for request_id, status, code in rows if request_id in request_ids}
        if len(found) == len(request_ids):
            return found
        time.sleep(0.1)
    raise AssertionError(f"ledger rows missing: {request_ids - set(found)}")


def test_a_stream_reset_by_its_caller_leaves_the_others_on_its_connection_whole(gateway):
    """RST_STREAM of one of several streams on one connection: that one is a 499 `cancelled`, once, in the ledger;
    the others are answered to their end."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding="utf-8"))
    payload = json.dumps({"model": "family-a-5.5", "max_tokens": 24, "stream": True,
                          "messages": [{"role": "user", "content": "Count to twenty."}]}).encode()
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=60) as sock:
        connection.initiate_connection()
        streams = []
        for _ in range(5):
            stream = connection.get_next_available_stream_id()
            streams.append(stream)
            connection.send_headers(stream, [(":method", "POST"), (":path", CHAT), (":scheme", "http"),
                                             (":authority", "x"), ("content-type", "application/json"),
                                             ("authorization", f"Bearer {gateway.secret}"),
                                             ("content-length", str(len(payload)))])
            connection.send_data(stream, payload, end_stream=True)
        sock.sendall(connection.data_to_send())
        cut = streams[2]
        ids, bodies, ended = {}, {stream: b"" for stream in streams}, set()
        while len(ended) < len(streams):
            data = sock.recv(65536)
            assert data, "the connection was closed"
            for event in connection.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived):
                    ids[event.stream_id] = dict(event.headers)["x-request-id"]
                    if event.stream_id == cut:
                        connection.reset_stream(cut)
                        ended.add(cut)
                elif isinstance(event, h2.events.DataReceived):
                    bodies[event.stream_id] += event.data
                    connection.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                elif isinstance(event, h2.events.StreamEnded):
                    ended.add(event.stream_id)
            sock.sendall(connection.data_to_send())
    assert all(bodies[s].rstrip().endswith(b"data: [DONE]") for s in streams if s != cut)
    rows = _ledger(gateway, set(ids.values()))
    assert rows.pop(ids[cut]) == (499, "cancelled")
    assert set(rows.values()) == {(200, "")}
