"""Upstreams that misbehave below the API, through the real gateway: a raw socket server that answers byte by byte,
with a page instead of a stream, with headers without end or no HTTP at all; hosts that do not resolve, refuse the
connection or fail TLS. What the caller sees must say what went wrong (never where the upstream is), at the
configured time, without sending the request again when the upstream has answered it."""

from __future__ import annotations

import collections
import concurrent.futures
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import Callable

import httpx
import pytest

from tests.e2e.conftest import upstream_gateway
from tests.upstream_double import Cue, UpstreamDouble
from tests.upstream_echo import sse
from tests.upstream_support import UPSTREAM_KEY_ENV

ANSWER = (b'{"id":"x","object":"chat.completion","created":1,"model":"m","choices":[{"index":0,"message":'
          b'{"role":"assistant","content":"hi"},"finish_reason":"stop"}],"usage":{"prompt_tokens":1,'
          b'"completion_tokens":1,"total_tokens":2}}')


def _whole(status: int, content_type: bytes, body: bytes) -> bytes:
    return b"HTTP/1.1 %d X\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s" % (status, content_type, len(body),
                                                                                   body)


def _trickle(connection: socket.socket) -> None:
    """A whole JSON answer, one byte every 0.1 s: never silent for long, but never done in time."""
    connection.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                       % len(ANSWER))
    for byte in ANSWER:
        time.sleep(0.1)
        connection.sendall(bytes([byte]))


def _closed_when_reused(connection: socket.socket) -> None:
    """Answers, keeps the connection open, and closes it unanswered when the next request comes: a server whose
    keep-alive timeout (gunicorn's 2 s, say) ran out just as the gateway reused the connection."""
    connection.sendall(_whole(200, b"application/json", ANSWER))
    connection.recv(65536)


def _dropped_while_working(connection: socket.socket) -> None:
    """Answers, then reads the next request on the connection and works on it for a while before the connection
    goes unanswered: a server that crashed, or a proxy that cut it, after the request had reached the model."""
    connection.sendall(_whole(200, b"application/json", ANSWER))
    connection.recv(65536)
    time.sleep(1.5)


def _comments(connection: socket.socket) -> None:
    """A stream kept open by comments alone, as a proxy keeps it while its model thinks (OpenRouter's
    `: OPENROUTER PROCESSING`): bytes that satisfy the read timeout, and no event ever."""
    connection.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    for _ in range(100):
        connection.sendall(b"e\r\n: PROCESSING\n\n\r\n")
        time.sleep(0.1)


def _slow_stream(connection: socket.socket) -> None:
    """A stream that begins at once and takes 2 s in all, an event every 0.25 s."""
    connection.sendall(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n\r\n")
    for delta, finish in [({"role": "assistant", "content": ""}, None), *[({"content": "w "}, None)] * 8,
                          ({}, "stop")]:
        connection.sendall(sse({"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m",
                                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}))
        time.sleep(0.25)
    connection.sendall(b"data: [DONE]\n\n")


MODES: dict[str, Callable[[socket.socket], None]] = {
    "trickle": _trickle,
    "page": lambda c: c.sendall(_whole(200, b"text/html", b"<html><body>Maintenance</body></html>")),
    "whole": lambda c: c.sendall(_whole(200, b"application/json", ANSWER)),  # a server that ignores `stream`
    "hugeheader": lambda c: c.sendall(b"HTTP/1.1 200 OK\r\nx-big: " + b"a" * 100_000 + b"\r\n\r\n"),
    "garbled": lambda c: c.sendall(b"NOT HTTP AT ALL\r\n\r\n"),
    "stale": _closed_when_reused,
    "dropped": _dropped_while_working,
    "comments": _comments,
    "slow-stream": _slow_stream,
    "bom": lambda c: c.sendall(_whole(200, b"application/json; charset=utf-8", b"\xef\xbb\xbf" + ANSWER)),
}


class RawUpstream:
    """Reads one request per connection and answers as the path's first segment says; counts requests per mode."""

    def __init__(self, context: ssl.SSLContext | None = None) -> None:
        self._socket = socket.create_server(("127.0.0.1", 0))
        self._context = context
        self.port = self._socket.getsockname()[1]
        self.hits: collections.Counter[str] = collections.Counter()
        threading.Thread(target=self._accept, daemon=True).start()

    def url(self, mode: str) -> str:
        return f"{'https' if self._context else 'http'}://127.0.0.1:{self.port}/{mode}/v1"

    def close(self) -> None:
        self._socket.close()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._socket.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(connection,), daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        with connection:
            try:
                if self._context is not None:
                    connection = self._context.wrap_socket(connection, server_side=True)
                data = b""
                while b"\r\n\r\n" not in data and (chunk := connection.recv(65536)):
                    data += chunk
                mode = data.split(b" ")[1].decode().strip("/").split("/")[0] if data else ""
                self.hits[mode] += 1
                if mode in MODES:
                    MODES[mode](connection)
            except (OSError, ssl.SSLError):
                pass  # the gateway went away, or refused our certificate: what the tests look at


def _model(model_id: str, url: str, *, timeouts: str = "{connect: 2, read: 5, answer: 5}",
           retry: str = "{attempts: 3, initial_backoff: 0.02, max_backoff: 0.05, total_seconds: 5}") -> str:
    return (f"  - {{id: {model_id}, endpoint: /v1/chat/completions, provider: {{kind: openai, base_url: '{url}', "
            f"model: up-{model_id}, api_key_env: {UPSTREAM_KEY_ENV}, retry: {retry}, timeouts: {timeouts}}}}}\n")


@pytest.fixture(scope="module")
def raw():
    upstream = RawUpstream()
    yield upstream
    upstream.close()


@pytest.fixture(scope="module")
def self_signed(tmp_path_factory):
    """A TLS upstream whose certificate nobody signed."""
    folder = tmp_path_factory.mktemp("self-signed")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
                    "-keyout", "key.pem", "-out", "cert.pem", "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], cwd=folder, check=True, capture_output=True)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(folder / "cert.pem", folder / "key.pem")
    upstream = RawUpstream(context)
    yield upstream
    upstream.close()


@pytest.fixture(scope="module")
def double():
    upstream = UpstreamDouble().start()
    yield upstream
    upstream.stop()


@pytest.fixture(scope="module")
def gateway(tmp_path_factory, raw, self_signed, double):
    models = "".join(_model(mode, raw.url(mode)) for mode in MODES if mode not in ("trickle", "stale", "dropped",
                                                                                     "comments", "slow-stream"))
    for mode in ("comments", "slow-stream"):
        models += _model(mode, raw.url(mode), timeouts="{connect: 2, read: 5, answer: 1}")
    models += _model("stale", raw.url("stale"), retry="{attempts: 1}")
    models += _model("dropped", raw.url("dropped"), retry="{attempts: 1}")
    models += _model("trickle", raw.url("trickle"), timeouts="{connect: 2, read: 5, answer: 1}")
    models += _model("nodns", "http://no-such-host.invalid/v1")
    models += _model("refused", f"http://127.0.0.1:{_closed_port()}/v1")
    models += _model("plain-as-tls", f"https://127.0.0.1:{double.port}/v1")
    models += _model("self-signed", self_signed.url("whole"))
    models += ("  - {id: overloaded, endpoint: /v1/messages, provider: {kind: anthropic, "
               f"base_url: 'http://127.0.0.1:{double.port}', model: up-overloaded, api_key_env: {UPSTREAM_KEY_ENV}, "
               "retry: {attempts: 2, initial_backoff: 0.02, max_backoff: 0.05}}}\n")
    with upstream_gateway(tmp_path_factory.mktemp("misbehaviour"), models) as gateway:
        yield gateway


@pytest.fixture(scope="module")
def http(gateway):
    with httpx.Client(base_url=gateway.base_url, headers={"authorization": f"Bearer {gateway.secret}"},
                      timeout=60) as client:
        yield client


def _closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as s:
        return s.getsockname()[1]


def _chat(http: httpx.Client, model: str, *, stream: bool = False) -> httpx.Response:
    return http.post("/v1/chat/completions", json={"model": model, "stream": stream,
                                                   "messages": [{"role": "user", "content": "hi"}]})


def test_a_json_answer_trickled_in_is_cut_at_timeouts_answer(http, raw):
    started = time.monotonic()
    answer = _chat(http, "trickle")
    elapsed = time.monotonic() - started
    # `timeouts.answer: 1` bounds the whole answer, not each silence between its bytes (22 s of them here).
    assert (answer.status_code, answer.json()["error"]["code"]) == (504, "upstream_timeout"), answer.text
    assert 0.9 < elapsed < 3, elapsed
    assert raw.hits["trickle"] == 1  # an answer under way is never asked for again


@pytest.mark.parametrize(("model", "why"), [
    ("nodns", "does not resolve"),
    ("refused", "refused the connection"),
    ("plain-as-tls", "TLS handshake failed"),
    ("self-signed", "TLS certificate is not trusted"),
])
def test_a_connection_that_cannot_be_made_says_why_without_naming_the_upstream(http, gateway, model, why):
    answer = _chat(http, model)
    error = answer.json()["error"]
    assert (answer.status_code, error["code"]) == (503, "service_unavailable"), answer.text
    assert f"`{model}`" in error["message"] and why in error["message"], error["message"]
    assert "127.0.0.1" not in answer.text and "invalid" not in answer.text and "up-" not in answer.text


def test_a_host_that_does_not_resolve_logs_no_line_per_request_from_the_event_loop(http, gateway):
    """uvloop's create_connection leaves its failed name lookup's future unread: every request to an upstream whose
    host did not resolve (a DNS outage, a typo in base_url) logged 'ERROR asyncio: Future exception was never
    retrieved' and two more lines of socket.gaierror, naming no upstream (17 such errors for 100 requests)."""
    with open(gateway.log_path, encoding="utf-8", errors="replace") as log:
        log.seek(0, 2)
        with concurrent.futures.ThreadPoolExecutor(10) as pool:
            answers = list(pool.map(lambda _: _chat(http, "nodns"), range(40)))
        assert {answer.status_code for answer in answers} <= {503, 504}  # 504: a lookup slower than connect
        time.sleep(1)  # futures are reported when collected
        _chat(http, "refused")
        added = log.read()
    assert "never retrieved" not in added and "gaierror" not in added, added[:2000]


@pytest.mark.parametrize(("mode", "what"), [("page", "text/html"), ("whole", "application/json")])
def test_a_stream_request_answered_with_no_stream_is_a_502_saying_so_and_not_sent_again(http, raw, mode, what):
    before = raw.hits[mode]
    answer = _chat(http, mode, stream=True)
    assert (answer.status_code, answer.json()["error"]["code"]) == (502, "upstream_error"), answer.text
    assert what in answer.json()["error"]["message"] and f"`{mode}`" in answer.json()["error"]["message"]
    assert raw.hits[mode] - before == 1  # it answered (and may have billed): asking again would get the same


@pytest.mark.parametrize(("mode", "why"), [("hugeheader", "headers are longer than 64 KiB"),
                                            ("garbled", "not valid HTTP")])
def test_an_answer_that_is_no_http_says_what_was_wrong(http, mode, why):
    answer = _chat(http, mode)
    assert (answer.status_code, answer.json()["error"]["code"]) == (502, "upstream_error"), answer.text
    assert why in answer.json()["error"]["message"]


def test_a_kept_alive_connection_the_upstream_closes_as_it_is_reused_fails_no_request(http, gateway, raw):
    # `retry.attempts: 1`: no retry of the model's may hide it; the request is sent again on a new connection.
    for _ in range(3):
        answer = _chat(http, "stale")
        assert answer.status_code == 200, answer.text
    assert raw.hits["stale"] == 3  # three connections, the second and third made when the one before was closed
    metrics = httpx.get(f"http://127.0.0.1:{gateway.metrics_port}/metrics").text
    # Neither a retry nor a failure of the deployment (passive health would count it).
    assert not [line for line in metrics.splitlines() if 'model="stale"' in line and "reason=" in line]


def test_a_kept_alive_connection_dropped_while_the_upstream_worked_is_not_sent_again(http, raw):
    # The upstream had the request, and worked on it, before the connection went: sent again, it could be answered,
    # and billed, twice. Only a close that comes as the request is sent (an idle timeout's race) is sent again.
    assert _chat(http, "dropped").status_code == 200
    answer = _chat(http, "dropped")
    assert (answer.status_code, answer.json()["error"]["code"]) == (502, "upstream_error"), answer.text
    assert raw.hits["dropped"] == 1


def test_a_stream_kept_open_by_comments_alone_is_cut_at_timeouts_answer(http, gateway, raw):
    # Every comment restarts the read timeout; nothing reaches Envoy, which cut such a stream at its own limit (635 s
    # by default) with a 504 the ledger called a 499 `cancelled`. The first event must come within `timeouts.answer`.
    started = time.monotonic()
    answer = _chat(http, "comments", stream=True)
    elapsed = time.monotonic() - started
    assert (answer.status_code, answer.json()["error"]["code"]) == (504, "upstream_timeout"), answer.text
    assert 0.9 < elapsed < 3, elapsed
    assert raw.hits["comments"] == 1


def test_a_stream_that_has_begun_may_last_longer_than_timeouts_answer(http):
    answer = _chat(http, "slow-stream", stream=True)
    assert answer.status_code == 200 and answer.text.count('"content":"w "') == 8, answer.text
    assert answer.text.endswith("data: [DONE]\n\n") and '"error"' not in answer.text


def test_a_page_answered_to_a_request_for_json_is_called_so(http, raw):
    answer = _chat(http, "page")
    assert (answer.status_code, answer.json()["error"]["code"]) == (502, "upstream_error"), answer.text
    assert "`page` answered with text/html, not JSON" in answer.json()["error"]["message"]


def test_a_json_answer_beginning_with_a_byte_order_mark_is_read(http):
    # The openai SDK reads such an answer (json.loads of bytes skips it), so a gateway in front must too.
    answer = _chat(http, "bom")
    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "hi"


def test_retries_of_an_overloaded_upstream_are_counted_as_529(http, gateway, double):
    double.cue(*[Cue(status=529, body={"type": "error", "error": {"type": "overloaded_error", "message": "busy"}})]
               * 2)
    answer = http.post("/v1/messages", headers={"anthropic-version": "2023-06-01"},
                       json={"model": "overloaded", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}]})
    assert (answer.status_code, answer.json()["error"]["type"]) == (503, "overloaded_error"), answer.text
    metrics = httpx.get(f"http://127.0.0.1:{gateway.metrics_port}/metrics").text
    assert 'portico_upstream_retries_total{model="overloaded",reason="529"} 1.0' in metrics
    assert 'portico_deployment_failures_total{deployment="anthropic",model="overloaded",reason="529"} 2.0' in metrics
