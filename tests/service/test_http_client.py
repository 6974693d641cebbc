"""The framing of answers the upstream client (server/providers/http_client.py) must read as an upstream sends them,
against a real local HTTP/1.1 server: answers delimited by the connection's end, `connection: close`, an interim
100 Continue, a read timeout that restarts with every byte, bodies larger than the buffer, malformed answers and
idle connections dropped after their keep-alive time."""

from __future__ import annotations

import asyncio

import pytest

from server.config_providers import ConfigError, upstream_key
from server.domain_models import Timeouts, UpstreamSpec
from server.errors import RateLimited, UpstreamError, UpstreamTimeout
from server.providers import http_upstream
from server.providers.http_connection import PAUSE_BYTES
from tests.service.test_http_upstream import Upstream, chunked, client, eventually, read_until_done, sse, whole


def raw(data: bytes, *, close: bool = False):
    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(data)
        await writer.drain()
        if close:
            raise ConnectionAbortedError("closed on cue")
    return answer


@pytest.fixture
async def server():
    upstream = await Upstream().start()
    yield upstream
    await upstream.stop()


async def test_an_answer_delimited_by_the_connection_s_end_is_whole_and_its_connection_is_not_reused(server):
    http = client(server.url)
    try:
        server.answers.append(raw(b'HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n{"a": 1}', close=True))
        assert await http.post_json("chat/completions", {}, model_id="up") == {"a": 1}
        await read_until_done(http)
        assert server.accepted == 2
    finally:
        await http.close()


async def test_connection_close_and_an_interim_answer(server):
    http = client(server.url)
    try:
        server.answers.append(whole(200, b'{"b": 2}', {"connection": "close"}))
        assert await http.post_json("chat/completions", {}, model_id="up") == {"b": 2}
        server.answers.append(raw(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 200 OK\r\ncontent-length: 8\r\n\r\n"
                                  b'{"c": 3}'))
        assert await http.post_json("chat/completions", {}, model_id="up") == {"c": 3}
        await read_until_done(http)
        assert server.accepted == 2  # closed after the first answer; the interim answer's connection kept
    finally:
        await http.close()


async def test_the_read_timeout_runs_between_bytes_not_over_the_whole_answer(server):
    http = client(server.url, timeouts=Timeouts(read=0.4))
    try:
        pieces = [sse({"n": i}) for i in range(8)] + [sse("[DONE]")]
        server.answers.append(chunked(pieces, pause=0.15))  # 1.2 s in all, never 0.4 s quiet
        assert len(await read_until_done(http)) == 8
        server.answers.append(chunked([sse({"n": 1}), sse({"n": 2})], pause=1.0))
        with pytest.raises(UpstreamTimeout):
            await read_until_done(http)
    finally:
        await http.close()


async def test_an_answer_larger_than_the_buffer_arrives_whole(server):
    http = client(server.url)
    try:
        pieces = [sse({"text": "x" * 60_000, "n": i}) for i in range(3 * PAUSE_BYTES // 60_000)]
        server.answers.append(chunked(pieces + [sse("[DONE]")]))
        async with http.stream("chat/completions", {}, model_id="up") as events:
            seen = 0
            async for event in events:
                if event.data == b"[DONE]":
                    break
                seen += 1
                await asyncio.sleep(0.001)  # a slow reader: the socket is paused and resumed
        assert seen == len(pieces)
    finally:
        await http.close()


async def test_a_whole_answer_larger_than_the_buffer_is_read_to_its_end(server):
    http = client(server.url, timeouts=Timeouts(read=2, answer=2))  # a reader that stalls fails, not hangs
    try:
        big = b'{"text": "' + b"y" * (3 * PAUSE_BYTES) + b'"}'
        server.answers.append(whole(200, big))
        assert len((await http.post_json("chat/completions", {}, model_id="up"))["text"]) == 3 * PAUSE_BYTES
        server.answers.append(whole(200, b"\x89PNG" + b"z" * (3 * PAUSE_BYTES), {"content-type": "image/png"}))
        image = await http.fetch(f"http://127.0.0.1:{server.port}/a.png", model_id="up", media_type="image")
        assert len(image) == 3 * PAUSE_BYTES + 4
    finally:
        await http.close()


@pytest.mark.parametrize("answer", [b"garbage\r\n\r\n", b"HTTP/1.1 200 OK\r\ncontent-length: 99\r\n\r\n{}"])
async def test_an_answer_that_is_not_http_or_is_cut_short_is_an_upstream_error(server, answer):
    http = client(server.url)
    try:
        server.answers.append(raw(answer, close=True))
        with pytest.raises(UpstreamError, match="broke off") as caught:
            await http.post_json("chat/completions", {}, model_id="up")
        assert caught.value.retry_reason == "broken"
    finally:
        await http.close()


async def test_idle_connections_are_closed_after_their_keep_alive_time(server, monkeypatch):
    monkeypatch.setattr(http_upstream, "KEEPALIVE_SECONDS", 0.3)
    http = client(server.url)
    try:
        await read_until_done(http)
        await eventually(lambda: server.ended == 1, 2.0)  # closed by the client, not the server
        await read_until_done(http)
        assert server.accepted == 2
    finally:
        await http.close()


def test_an_upstream_key_with_a_line_break_is_a_configuration_error():
    spec = UpstreamSpec(base_url="http://127.0.0.1:1/v1", model="m", api_key_env="UPSTREAM_KEY")
    with pytest.raises(ConfigError, match="UPSTREAM_KEY") as caught:
        upstream_key(spec, {"UPSTREAM_KEY": "sk-secret\r\nx-injected: 1"})
    assert "sk-secret" not in str(caught.value)


async def test_endless_headers_are_refused_before_they_fill_the_memory(server):
    async def endless(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for _ in range(2000):  # 2 MB of header lines, never ended
            writer.write(b"x-filler: " + b"f" * 1000 + b"\r\n")
            await writer.drain()
        await asyncio.sleep(5)
    http = client(server.url, timeouts=Timeouts(read=5, answer=5))
    try:
        server.answers.append(endless)
        started = asyncio.get_running_loop().time()
        with pytest.raises(UpstreamError, match="broke off"):
            await http.post_json("chat/completions", {}, model_id="up")
        assert asyncio.get_running_loop().time() - started < 3  # at 64 KiB, not at the read timeout
    finally:
        await http.close()


async def test_a_chunked_answer_s_trailer_is_not_the_next_answer_s_header(server):
    http = client(server.url)
    try:
        server.answers.append(raw(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n"
                                  b"retry-after: 120\r\n\r\n"))
        assert await http.post_json("chat/completions", {}, model_id="up") == {}
        server.answers.append(whole(429, b"{}"))
        with pytest.raises(RateLimited) as caught:
            await http.post_json("chat/completions", {}, model_id="up")
        assert not caught.value.retry_after and server.accepted == 1
    finally:
        await http.close()


@pytest.mark.parametrize(("answer", "expected"), [
    # A transfer-encoding other than chunked runs to the connection's end (RFC 9112 6.3).
    (raw(b'HTTP/1.1 200 OK\r\ntransfer-encoding: identity\r\n\r\n{"ok": 1}', close=True), {"ok": 1}),
    # An error body cut short still names the upstream's reason.
    (raw(b'HTTP/1.1 500 X\r\ncontent-length: 99\r\n\r\n{"error": {"message": "disk full"}}', close=True),
     "disk full"),
    (raw(b"HTTP/1.1 101 Switching Protocols\r\nupgrade: websocket\r\nconnection: upgrade\r\n\r\n\x81\x05hello"),
     "broke off"),
    (whole(302, b"", {"location": "http://elsewhere/"}), "HTTP 302 instead of an answer"),
])
async def test_answers_at_the_edges_of_http(server, caplog, answer, expected):
    http = client(server.url, timeouts=Timeouts(read=2, answer=2))
    try:
        server.answers.append(answer)
        if isinstance(expected, dict):
            assert await http.post_json("chat/completions", {}, model_id="up") == expected
        else:
            with pytest.raises(UpstreamError, match=expected) as caught:
                await http.post_json("chat/completions", {}, model_id="up")
            assert caught.value.kind.http_status == 502
    finally:
        await http.close()
    assert not [r for r in caplog.records if r.levelname == "ERROR"]  # no "Fatal error on transport"


async def test_links_are_escaped_on_the_request_line_and_relative_ones_join_the_base_url(server):
    http = client(server.url)
    try:
        for _ in range(3):
            server.answers.append(whole(200, b"PNG!", {"content-type": "image/png"}))
        for link in (f"http://127.0.0.1:{server.port}/pic one.png", f"http://127.0.0.1:{server.port}/pic-ü.png?a=b c",
                     "/files/a%20b.png"):
            assert await http.fetch(link, model_id="up", media_type="image") == b"PNG!"
    finally:
        await http.close()
    assert [path for _, path, _, _ in server.seen] == ["/pic%20one.png", "/pic-%C3%BC.png?a=b%20c",
                                                       "/v1/files/a%20b.png"]


async def test_a_plain_http_upstream_never_loads_the_tls_settings(server, monkeypatch):
    def refuse():  # loading the CA stores costs the first request ~50 ms: only an https upstream or proxy needs it
        raise AssertionError("TLS settings loaded for a plain-HTTP upstream")
    monkeypatch.setattr(http_upstream, "_ssl_context", refuse)
    http = client(server.url)
    try:
        assert len(await read_until_done(http)) == 2
    finally:
        await http.close()
