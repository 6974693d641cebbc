"""Upstream answers compressed although Portico asks for `accept-encoding: identity` (a compressing proxy in front of
the upstream, say), from a real local HTTP/1.1 server: gzip and deflate decoded for JSON answers, streams (event by
event, as the compressed bytes arrive), error bodies and fetched links; other codings and corrupt data a 502 that
says so, whose connection is not reused; a highly compressed answer held a bounded piece at a time."""

from __future__ import annotations

import asyncio
import gzip
import re
import ssl
import tracemalloc
import zlib

import orjson
import pytest

from server.domain_models import Timeouts
from server.errors import ServiceUnavailable, UpstreamError
from server.providers.http_client import HttpClient, Origin
from server.providers.http_decoding import DECODED_BYTES
from server.render.sse_decoder import SseEvent
from tests.service.test_http_upstream import KEY, Answer, Upstream, client, read_until_done, sse, whole

ANSWER = {"id": "chatcmpl-1", "choices": [{"message": {"content": "hello " * 200}}]}


def deflated(data: bytes, wbits: int) -> bytes:
    compressor = zlib.compressobj(wbits=wbits)
    return compressor.compress(data) + compressor.flush()


CODINGS = [  # content-encoding, and how the server compresses
    pytest.param("gzip", gzip.compress, id="gzip"),
    pytest.param("X-Gzip", gzip.compress, id="x-gzip"),
    pytest.param("deflate", lambda data: deflated(data, zlib.MAX_WBITS), id="deflate-zlib"),  # as RFC 9110 means it
    pytest.param("deflate", lambda data: deflated(data, -zlib.MAX_WBITS), id="deflate-raw"),  # as some servers send it
]


def compressed_stream(events: list[bytes], coding: str, wbits: int, *, gate: asyncio.Event | None = None) -> Answer:
    """A chunked text/event-stream answer compressed as a compressing proxy does: each event flushed into its own
    chunk. With `gate`, the events after the first wait for it."""
    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-encoding: %s\r\n"
                     b"transfer-encoding: chunked\r\n\r\n" % coding.encode())
        compressor = zlib.compressobj(wbits=wbits)
        for i, event in enumerate(events):
            if i == 1 and gate is not None:
                await gate.wait()
            piece = compressor.compress(event) + compressor.flush(zlib.Z_SYNC_FLUSH)
            writer.write(b"%x\r\n%s\r\n" % (len(piece), piece))
            await writer.drain()
        piece = compressor.flush()
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(piece), piece))
        await writer.drain()
    return answer


@pytest.fixture
async def server():
    upstream = await Upstream().start()
    yield upstream
    await upstream.stop()


@pytest.fixture
async def upstream(server):
    http = client(server.url, timeouts=Timeouts(read=3, answer=3))  # a hang fails the test instead
    yield http
    await http.close()


@pytest.mark.parametrize(("coding", "compress"), CODINGS)
async def test_a_json_answer_compressed_regardless_is_decoded_and_its_connection_reused(server, upstream, coding,
                                                                                        compress):
    for _ in range(2):
        server.answers.append(whole(200, compress(orjson.dumps(ANSWER)),
                                    {"content-type": "application/json", "content-encoding": coding}))
        assert await upstream.post_json("chat/completions", {}, model_id="up") == ANSWER
    assert server.accepted == 1
    assert server.seen[0][2]["accept-encoding"] == "identity"  # still asked for: decoding costs the loop


async def test_gzip_members_one_after_another_are_one_body(server, upstream):
    body = orjson.dumps(ANSWER)
    server.answers.append(whole(200, gzip.compress(body[:50]) + gzip.compress(body[50:]), {"content-encoding": "gzip"}))
    assert await upstream.post_json("chat/completions", {}, model_id="up") == ANSWER


@pytest.mark.parametrize(("coding", "wbits"), [("gzip", 16 + zlib.MAX_WBITS), ("deflate", zlib.MAX_WBITS)])
async def test_a_compressed_stream_delivers_each_event_as_it_arrives(server, upstream, coding, wbits):
    gate = asyncio.Event()
    server.answers.append(compressed_stream([sse({"n": 1}), sse({"n": 2}), sse("[DONE]")], coding, wbits, gate=gate))
    try:
        async with asyncio.timeout(3), upstream.stream("chat/completions", {}, model_id="up") as events:
            first = await anext(events)  # while the server holds the rest back
            gate.set()
            rest = [event.data async for event in events]
    finally:
        gate.set()
    assert (first, rest) == (SseEvent("message", b'{"n":1}'), [b'{"n":2}', b"[DONE]"])
    await read_until_done(upstream)
    assert server.accepted == 1


async def test_a_compressed_error_body_still_names_the_upstream_s_reason(server, upstream):
    error = b'{"error": {"message": "overloaded, try later ' + KEY.encode() + b'"}}'
    server.answers.append(whole(503, gzip.compress(error), {"content-encoding": "gzip"}))
    with pytest.raises(ServiceUnavailable, match="overloaded, try later") as caught:
        await read_until_done(upstream)
    assert KEY not in str(caught.value) and caught.value.retry_reason == "503"


async def test_a_fetched_link_compressed_regardless_is_decoded(server, upstream):
    image = b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 100
    server.answers.append(whole(200, gzip.compress(image), {"content-type": "image/png", "content-encoding": "gzip"}))
    assert await upstream.fetch(f"http://127.0.0.1:{server.port}/a.png", model_id="up", media_type="image") == image


HEAD = "HTTP/1.1 200 OK\r\ncontent-type: {}\r\ncontent-encoding: {}\r\ntransfer-encoding: chunked\r\n\r\n"


def endless(content_type: str, coding: str, piece: bytes) -> Answer:
    """A chunked answer that never ends: an error must come from its first bytes, not a timeout."""
    async def answer(writer: asyncio.StreamWriter) -> None:
        writer.write(HEAD.format(content_type, coding).encode() + b"%x\r\n%s\r\n" % (len(piece), piece))
        await writer.drain()
        await asyncio.sleep(10)
    return answer


@pytest.mark.parametrize(("coding", "named"), [("br", "br"), ("zstd", "zstd"), ("gzip, gzip", "gzip, gzip"),
                                               ("identity, BR", "br")])
@pytest.mark.parametrize("streamed", [False, True])
async def test_a_coding_portico_does_not_decode_is_a_502_naming_it(server, upstream, coding, named, streamed):
    if streamed:
        server.answers.append(endless("text/event-stream", coding, b"\x8b\x02\x80data: {}\n\n\x03"))
    else:
        server.answers.append(whole(200, b"\x8b\x02\x80{}\x03", {"content-encoding": coding}))
    started = asyncio.get_running_loop().time()
    with pytest.raises(UpstreamError) as caught:
        if streamed:
            await read_until_done(upstream)
        else:
            await upstream.post_json("chat/completions", {}, model_id="up")
    assert str(caught.value) == (f"The upstream serving `up` answered with content-encoding {named}, which Portico "
                                 "does not decode.")
    assert caught.value.kind.http_status == 502 and not caught.value.retryable
    assert asyncio.get_running_loop().time() - started < 1  # at once, not at the read timeout
    await read_until_done(upstream)
    assert server.accepted == 2  # that connection was not reused


GZIPPED = gzip.compress(orjson.dumps(ANSWER))


@pytest.mark.parametrize(("coding", "body", "problem"), [
    pytest.param("gzip", GZIPPED[:10] + b"\xff" * 40 + GZIPPED[50:], "sent gzip data that does not decode",
                 id="gzip-corrupt"),
    pytest.param("gzip", b"{}", "sent gzip data that does not decode (incorrect header check)", id="gzip-plain"),
    pytest.param("gzip", GZIPPED[:-9], "sent gzip data that is cut short", id="gzip-cut"),  # the HTTP body whole
    pytest.param("gzip", GZIPPED + b"<html>", "sent bytes after the end of its gzip data", id="gzip-trailing"),
    pytest.param("deflate", b"\x78\x9c\xff\xff\xff\xff", "sent deflate data that does not decode",
                 id="deflate-corrupt"),
    pytest.param("deflate", zlib.compress(b"{}") + b"{}", "sent bytes after the end of its deflate data",
                 id="deflate-trailing"),
])
async def test_corrupt_compressed_data_is_a_502_and_its_connection_is_not_reused(server, upstream, coding, body,
                                                                                 problem):
    server.answers.append(whole(200, body, {"content-encoding": coding}))
    with pytest.raises(UpstreamError, match="^" + re.escape(f"The upstream serving `up` {problem}")) as caught:
        await upstream.post_json("chat/completions", {}, model_id="up")
    assert caught.value.kind.http_status == 502
    await read_until_done(upstream)
    assert server.accepted == 2


async def test_a_highly_compressed_answer_is_held_a_bounded_piece_at_a_time(server):
    """64 MiB of zeros in 64 KiB of gzip, read by a slow reader: never more than a few MiB in memory."""
    compressor, zeros = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS), bytes(1024 * 1024)
    bomb = b"".join(compressor.compress(zeros) for _ in range(64)) + compressor.flush()
    server.answers.append(whole(200, bomb, {"content-encoding": "gzip"}))
    http = HttpClient(ssl_context=ssl.create_default_context, connect_timeout=3, keepalive=4)
    tracemalloc.start()
    try:
        response = await http.pool(Origin.of(server.url), None).request("GET", "/bomb", headers=b"", body=b"",
                                                                         read_timeout=3)
        total, largest = 0, 0
        while piece := await response.readany():
            total, largest = total + len(piece), max(largest, len(piece))
            await asyncio.sleep(0)
        _, peak = tracemalloc.get_traced_memory()
        response.release()
    finally:
        tracemalloc.stop()
        http.close()
    assert total == 64 * 1024 * 1024 and largest <= DECODED_BYTES
    assert peak < 8 * 1024 * 1024


def gzip_bomb(mebibytes: int, byte: bytes, start: bytes = b"") -> bytes:
    compressor, block = zlib.compressobj(9, zlib.DEFLATED, 16 + zlib.MAX_WBITS), byte * (1024 * 1024)
    return (compressor.compress(start) + b"".join(compressor.compress(block) for _ in range(mebibytes))
            + compressor.flush())


async def test_an_answer_bigger_than_any_caller_could_get_is_a_502_not_the_gateway_s_memory(server, upstream):
    """80 MiB of JSON in 80 KiB of gzip: refused past 64 MiB (the most a gRPC message of Portico's carries)."""
    server.answers.append(whole(200, gzip_bomb(80, b" "), {"content-type": "application/json",
                                                          "content-encoding": "gzip"}))
    tracemalloc.start()
    try:
        with pytest.raises(UpstreamError) as caught:
            await upstream.post_json("chat/completions", {}, model_id="up")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert str(caught.value) == "The upstream serving `up` answered with more than 64 MiB."
    assert caught.value.kind.http_status == 502 and not caught.value.retryable
    assert peak < 80 * 1024 * 1024
    await read_until_done(upstream)
    assert server.accepted == 2  # that connection was not reused


async def test_a_streamed_line_that_never_ends_is_a_502_past_64_mib(server, upstream):
    """An event's line of 80 MiB (in 80 KiB of gzip), never ended: refused once it passes 64 MiB."""
    server.answers.append(whole(200, gzip_bomb(80, b"a", start=b"data: "),
                                {"content-type": "text/event-stream", "content-encoding": "gzip"}))
    with pytest.raises(UpstreamError) as caught:
        await read_until_done(upstream)
    assert str(caught.value) == "The upstream serving `up` sent an event of more than 64 MiB."
    assert caught.value.kind.http_status == 502
    assert len(await read_until_done(upstream)) == 2  # the next request is answered
