"""The upstreams' HTTP client (server/providers/http_upstream.py) against a real local HTTP/1.1 server that counts its
connections: keep-alive reuse after a complete answer, a closed connection for an abandoned one, the SSE parser on
bytes split anywhere, and each transport failure's error."""

from __future__ import annotations

import asyncio
import collections
import logging
import socket
from collections.abc import Awaitable, Callable

import orjson
import pytest

from server.domain_models import Timeouts, UpstreamSpec
from server.errors import RateLimited, ServiceUnavailable, UpstreamError, UpstreamTimeout
from server.providers.http_connection import ConnectFailed, ConnectionBroken, ConnectTimeout, ReadTimeout
from server.providers.http_upstream import HttpUpstream
from server.providers.transport_errors import TransportErrors
from server.render.sse_decoder import SseEvent

KEY = "sk-http-upstream-test-0123456789"
Answer = Callable[[asyncio.StreamWriter], Awaitable[None]]


def chunked(pieces: list[bytes], *, pause: float = 0.0, end_delay: float = 0.0, end: bool = True) -> Answer:
    """A 200 text/event-stream answer, each piece its own HTTP chunk (sent `pause` apart, so that each arrives on
    its own), then the last chunk after `end_delay`; without `end`, the connection is dropped instead."""
    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for i, piece in enumerate(pieces):
            if i and pause:
                await asyncio.sleep(pause)
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        if not end:
            raise ConnectionAbortedError("dropped on cue")
        await asyncio.sleep(end_delay)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
    return answer


def whole(status: int, body: bytes, headers: dict[str, str] | None = None, *, delay: float = 0.0) -> Answer:
    async def answer(writer: asyncio.StreamWriter) -> None:
        await asyncio.sleep(delay)
        head = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        writer.write(f"HTTP/1.1 {status} X\r\ncontent-length: {len(body)}\r\n{head}\r\n".encode() + body)
        await writer.drain()
    return answer


def sse(data: dict | str) -> bytes:
    return b"data: " + (data.encode() if isinstance(data, str) else orjson.dumps(data)) + b"\n\n"


COMPLETE = [sse({"n": 1}), sse({"n": 2}), sse("[DONE]")]


class Upstream:
    """Keep-alive HTTP/1.1 on 127.0.0.1: answers are queued per request; every connection is counted when accepted
    and when it ends."""

    def __init__(self) -> None:
        self.accepted = 0
        self.ended = 0
        self.seen: list[tuple[str, str, dict[str, str], bytes]] = []
        self.answers: collections.deque[Answer] = collections.deque()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def start(self) -> Upstream:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self._server.close()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                method, path, _ = head.split("\r\n")[0].split(" ")
                fields = (line.split(": ", 1) for line in head.split("\r\n")[1:] if line)
                headers = {name.lower(): value for name, value in fields}
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                self.seen.append((method, path, headers, body))
                await (self.answers.popleft() if self.answers else chunked(COMPLETE))(writer)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection, or an answer dropped it
        finally:
            self.ended += 1
            writer.close()


@pytest.fixture
async def server():
    upstream = await Upstream().start()
    yield upstream
    await upstream.stop()


def client(url: str, **spec) -> HttpUpstream:
    return HttpUpstream(UpstreamSpec(base_url=url, model="m", **spec), auth_headers={"authorization": f"Bearer {KEY}"},
                        secret=KEY)


@pytest.fixture
async def upstream(server):
    http = client(server.url)
    yield http
    await http.close()


async def read_until_done(http: HttpUpstream) -> list[SseEvent]:
    """As OpenAIProvider reads: up to `data: [DONE]`, then out of the block before the body's end is read."""
    seen = []
    async with http.stream("chat/completions", {"q": 1}, model_id="up") as events:
        async for event in events:
            if event.data == b"[DONE]":
                break
            seen.append(event)
    return seen


async def eventually(condition: Callable[[], bool], seconds: float = 3.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def test_streams_read_to_their_last_event_reuse_one_connection(server, upstream):
    for _ in range(3):
        assert await read_until_done(upstream) == [SseEvent("message", b'{"n":1}'), SseEvent("message", b'{"n":2}')]
    assert (server.accepted, server.ended) == (1, 0)
    method, path, headers, body = server.seen[0]
    assert (method, path, orjson.loads(body)) == ("POST", "/v1/chat/completions", {"q": 1})
    assert headers["authorization"] == f"Bearer {KEY}" and headers["content-type"] == "application/json"


async def test_a_body_end_arriving_after_the_last_event_still_frees_the_connection_for_reuse(server, upstream):
    server.answers.append(chunked(COMPLETE, end_delay=0.2))  # [DONE], then the last chunk 0.2 s later
    await read_until_done(upstream)
    await eventually(lambda: not upstream._settling)
    await read_until_done(upstream)
    assert (server.accepted, server.ended) == (1, 0)


async def test_a_stream_abandoned_mid_answer_closes_its_connection(server, upstream):
    server.answers.append(chunked([sse({"n": i}) for i in range(300)], pause=0.02))
    with pytest.raises(asyncio.CancelledError):
        async with upstream.stream("chat/completions", {}, model_id="up") as events:
            async for event in events:
                if event.data == b'{"n":2}':
                    raise asyncio.CancelledError()  # the caller went away
    await eventually(lambda: server.ended == 1, 2.0)  # the upstream noticed: it can stop generating
    await read_until_done(upstream)
    assert server.accepted == 2


async def test_a_caller_that_leaves_normally_mid_answer_does_not_keep_the_upstream_going(server, upstream):
    server.answers.append(chunked([sse({"n": i}) for i in range(300)], pause=0.02))
    async with upstream.stream("chat/completions", {}, model_id="up") as events:
        async for _ in events:
            break
    await eventually(lambda: server.ended == 1, 3.0)  # after at most SETTLE_SECONDS


async def test_sse_lines_split_anywhere():
    pieces = [b"event: a\r", b"\ndata: 1\r\n\r\n", b"data:2\ndata: 3\n\n", b"data: x\r\rdata: 4", b"\n", b"\n",
              b": comment\nid: 7\nretry: 5\ndata: caf\xc3", b"\xa9\n\nevent: b\ndata: {\"last\": true}"]
    upstream = await Upstream().start()
    upstream.answers.append(chunked(pieces, pause=0.02))
    http = client(upstream.url)
    try:
        async with http.stream("v1/messages", {}, model_id="up") as events:
            seen = [event async for event in events]
    finally:
        await http.close()
        await upstream.stop()
    assert seen == [SseEvent("a", b"1"), SseEvent("message", b"2\n3"), SseEvent("message", b"x"),
                    SseEvent("message", b"4"), SseEvent("message", "café".encode()), SseEvent("b", b'{"last": true}')]


async def test_an_error_status_reads_a_bounded_body_and_keeps_a_complete_answer_s_connection(server, upstream):
    server.answers.append(whole(503, b'{"error": {"message": "busy ' + KEY.encode() + b'"}}'))
    with pytest.raises(ServiceUnavailable) as caught:
        await read_until_done(upstream)
    assert caught.value.retry_reason == "503" and KEY not in str(caught.value) and "busy" in str(caught.value)
    await read_until_done(upstream)
    assert server.accepted == 1  # the error's body was complete: its connection was reused

    server.answers.append(whole(429, b"x" * (1024 * 1024), {"retry-after": "2"}))
    with pytest.raises(RateLimited) as caught:
        await read_until_done(upstream)
    assert caught.value.retry_after == 2
    await read_until_done(upstream)
    assert server.accepted == 2  # 1 MB of error page was not read: that connection was closed


async def test_post_json_and_fetch(server, upstream):
    server.answers.append(whole(200, b'{"data": [{"url": "http://x/a.png"}]}'))
    assert await upstream.post_json("images/generations", {"p": 1}, model_id="up") == {
        "data": [{"url": "http://x/a.png"}]}
    server.answers.append(whole(200, b"\x89PNG..."))
    assert await upstream.fetch(f"http://127.0.0.1:{server.port}/files/a.png", model_id="up",
                                media_type="image") == b"\x89PNG..."
    (_, _, sent, _), (method, path, fetched, _) = server.seen
    assert sent["authorization"] == f"Bearer {KEY}"
    assert (method, path) == ("GET", "/files/a.png") and "authorization" not in fetched  # never the key elsewhere
    server.answers.append(whole(302, b"", {"location": "http://elsewhere/"}))
    with pytest.raises(UpstreamError, match="HTTP 302"):  # redirects are not followed
        await upstream.fetch(f"http://127.0.0.1:{server.port}/files/b.png", model_id="up", media_type="image")
    server.answers.append(whole(200, b"<html>", {"content-type": "text/html"}))
    with pytest.raises(UpstreamError, match=r"gave text/html, not image/\*"):  # a login page, say
        await upstream.fetch(f"http://127.0.0.1:{server.port}/files/c.png", model_id="up", media_type="image")
    server.answers.append(whole(200, b"<html>"))
    with pytest.raises(UpstreamError, match="invalid JSON"):
        await upstream.post_json("images/generations", {}, model_id="up")
    assert server.accepted == 1


REFUSED = "points at an address Portico does not fetch from"


@pytest.mark.parametrize("base", ["http://93.184.215.14/v1", "http://10.255.255.1/v1"])
async def test_a_link_into_another_address_class_is_refused_before_any_connection(server, base, caplog):
    """A public (or private) upstream's answer chooses its links: one into the gateway's loopback (its metrics, Envoy's
    admin port, anything on 127.0.0.1), in any spelling, is refused unconnected, saying nothing about the target,
    and logged once for the model and class, not once per refused link."""
    http = client(base)
    spellings = ["127.0.0.1", "2130706433", "0x7f.1", "127.1", "[::ffff:127.0.0.1]", "localhost"]
    try:
        with caplog.at_level(logging.WARNING, logger="server.providers.http_upstream"):
            for host in spellings * 2:
                with pytest.raises(UpstreamError, match=REFUSED) as caught:
                    await http.fetch(f"http://{host}:{server.port}/a.png", model_id="up", media_type="image")
                assert str(server.port) not in str(caught.value) and "127" not in str(caught.value)
                assert caught.value.retry_reason is None  # drawn and billed: never asked again
    finally:
        await http.close()
    assert server.accepted == 0  # nothing was connected to
    logged = [r.getMessage() for r in caplog.records if "not fetched" in r.getMessage()]
    assert len(logged) == 1 and "`up`" in logged[0] and "loopback" in logged[0]


@pytest.mark.parametrize("link", ["http://169.254.169.254/latest/meta-data/", "http://[fe80::1]/a.png",
                                  "http://0.0.0.0:{port}/a.png", "http://[::ffff:169.254.169.254]/a.png",
                                  "http://224.0.0.1/a.png"])
async def test_link_local_unspecified_and_multicast_links_are_refused_even_for_a_local_upstream(server, upstream,
                                                                                                 link):
    with pytest.raises(UpstreamError, match=REFUSED):
        await upstream.fetch(link.format(port=server.port), model_id="up", media_type="image")
    assert server.accepted == 0


async def test_a_local_upstreams_links_on_its_own_class_are_fetched(server, upstream):
    """vLLM on 127.0.0.1 linking its images on another loopback server (or name): fetched as before."""
    other = await Upstream().start()
    try:
        for host in ("127.0.0.1", "localhost"):
            other.answers.append(whole(200, b"\x89PNG..."))
            assert await upstream.fetch(f"http://{host}:{other.port}/a.png", model_id="up",
                                        media_type="image") == b"\x89PNG..."
    finally:
        await other.stop()
    assert other.accepted >= 1 and [seen[1] for seen in other.seen] == ["/a.png", "/a.png"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_transport_failures():
    http = client(f"http://127.0.0.1:{free_port()}/v1")
    with pytest.raises(ServiceUnavailable) as caught:  # nothing listens: may be retried
        await read_until_done(http)
    assert caught.value.retry_reason == "connect"
    await http.close()

    upstream = await Upstream().start()
    http = client(upstream.url, timeouts=Timeouts(read=0.3, pool=0.2), max_connections=1)
    try:
        upstream.answers.append(whole(200, b"{}", delay=2))
        with pytest.raises(UpstreamTimeout) as caught:  # silent: not retried (the upstream may be working on it)
            await read_until_done(http)
        assert not caught.value.retryable

        upstream.answers.append(chunked(COMPLETE[:2], end=False))
        with pytest.raises(UpstreamError) as caught:  # cut off mid-answer
            await read_until_done(http)
        assert caught.value.retry_reason == "broken"

        upstream.answers.append(chunked(COMPLETE, pause=0.1))
        async with http.stream("chat/completions", {}, model_id="up") as events:
            with pytest.raises(ServiceUnavailable) as caught:  # the one connection is busy
                await read_until_done(http)
            assert caught.value.retry_reason == "other"
            assert [event.data async for event in events] == [b'{"n":1}', b'{"n":2}', b"[DONE]"]
        await read_until_done(http)  # and free again
    finally:
        await http.close()
        await upstream.stop()


@pytest.mark.parametrize(("error", "kind", "reason"), [
    (ConnectTimeout(), UpstreamTimeout, "timeout"),
    (ReadTimeout(), UpstreamTimeout, None),
    (ConnectFailed(), ServiceUnavailable, "connect"),
    (ConnectionBroken(), UpstreamError, "broken"),
])
def test_the_error_for_each_transport_failure(error, kind, reason):
    mapped = TransportErrors().of(error, "up", before_answer=True)
    assert type(mapped) is kind and mapped.retry_reason == reason and "`up`" in str(mapped)


def test_built_outside_a_running_loop():
    client("http://127.0.0.1:1")  # the session comes with the first request, inside the server's loop


async def test_closing_twice_is_harmless(upstream):
    await read_until_done(upstream)
    await upstream.close()
    await upstream.close()
    with pytest.raises(RuntimeError):
        await read_until_done(upstream)
