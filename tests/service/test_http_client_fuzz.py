"""Fuzzing the upstream client (server/providers/http_upstream.py over http_client.py and http_connection.py) with
answers made by hypothesis and served byte for byte by a real server on 127.0.0.1: valid and invalid status lines,
interim answers, right, wrong, repeated and conflicting framing headers, long headers, trailers, bodies framed by
length, by chunks (with extensions, bad sizes) or by the close, compressed or not, written in pieces with pauses,
cut off, or followed by stray bytes. Whatever the answer, a call returns or raises a PorticoError (never anything
else, never hangs), shows the caller no key, frees its pool slot, and the same client then serves a plain answer."""

from __future__ import annotations

import asyncio
import gzip
import math
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Self

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server.domain_models import Timeouts
from server.errors import PorticoError
from server.providers.http_upstream import HttpUpstream
from server.render.sse_decoder import SseDecoder, SseEvent
from server.wire_json import is_json
from tests.service.test_http_upstream import KEY, client

MAX_CONNECTIONS = 4
TIMEOUTS = Timeouts(read=0.3, answer=0.3, connect=1, pool=1)
K = KEY.encode()


def whole(status: bytes, body: bytes, *fields: bytes) -> bytes:
    lines = b"".join(f + b"\r\n" for f in fields)
    return b"HTTP/1.1 %s\r\ncontent-length: %d\r\n%s\r\n%s" % (status, len(body), lines, body)


PLAIN = {b"/v1/json": whole(b"200 OK", b'{"ok": true}'),
         b"/v1/sse": whole(b"200 OK", b'data: {"ok": true}\n\ndata: [DONE]\n\n')}

# The parts of an answer: what every HTTP/1.1 client must read as meant, then (BAD_...) what it need not.
INTERIM = [b"HTTP/1.1 100 Continue\r\n\r\n", b"HTTP/1.1 103 Early Hints\r\nlink: </a.css>\r\n\r\n"]
BAD_INTERIM = [b"HTTP/1.1 101 Switching Protocols\r\nupgrade: h2c\r\nconnection: upgrade\r\n\r\n"]
STATUS_OK = [b"HTTP/1.1 200 OK", b"HTTP/1.1 200", b"HTTP/1.1 201 Created"]
STATUS_ERROR = [b"HTTP/1.1 %d X" % n for n in (302, 400, 401, 404, 408, 413, 429, 500, 503, 529, 599)]
BAD_STATUS = st.binary(max_size=16) | st.sampled_from([
    b"HTTP/1.0 200 OK", b"HTTP/1.1 204 No Content", b"HTTP/1.1 304 Not Modified", b"HTTP/1.1 100 Continue",
    b"HTTP/1.1 999 Odd", b"HTTP/1.1 20 OK", b"HTTP/1.1 2000 OK", b"HTTP/2 200", b"HTTP/1.1 abc", b"ICY 200 OK",
    b"http/1.1 200 ok", b"HTTP/1.1 200 \xff\x00", b""])
BODIES = [b'{"id": 1, "echo": "' + K + b'"}', b'{"error": {"message": "bad key ' + K + b'", "type": "x"}}',
          b'{"detail": [{"loc": ["body", "x"], "msg": "' + K + b'"}]}', b"[1, 2]", b"", b"not json \xff\xfe " + K,
          b'data: {"n": 1}\n\ndata: [DONE]\n\n', b"event: e\r\ndata: " + K + b"\r\n\r\n",
          b'{"t": "' + b"x" * 20000 + b'"}']  # most with the key where an error's message is taken from
HEADERS = [[b"content-type: application/json", b"content-type: text/event-stream"],
           [b"connection: close", b"connection: keep-alive"], [b"x-long: " + b"a" * 9000],
           [b"x-echo: " + K, b"retry-after: 3", b"retry-after-ms: nan", b"retry-after: Wed, 21 Oct 2015 07:28:00 GMT"]]
STRAY = [b"\r\n", b"garbage", b"HTTP/1.1 2", b"0\r\n\r\n", whole(b"200 OK", b"{}")]


@dataclass(frozen=True)
class Answer:
    writes: tuple[tuple[bytes, float], ...]  # each piece written, then a pause (seconds)
    end: str  # then "close" the connection, "linger" 30 ms and close it, or "keep" it for the next request
    status: int = 0  # of an answer every client must read as meant (0: not such an answer)
    body: bytes = b""  # its body (decoded, when it was sent compressed)
    cut_short: bool = False  # such an answer but cut short: not a whole one
    json: bool = False  # labelled application/json: a whole answer, no event stream (a stream call's error)


@st.composite
def answers(draw: st.DrawFn) -> Answer:
    """An answer's bytes, and when it is made of good parts only, what any client must make of it."""
    clean = True

    def pick(good: list, bad: list | st.SearchStrategy | None = None, odds: int = 8):
        nonlocal clean
        if bad is not None and draw(st.integers(0, odds - 1)) == odds - 1:  # shrinks towards the good parts
            clean = False
            return draw(bad if isinstance(bad, st.SearchStrategy) else st.sampled_from(bad))
        return draw(st.sampled_from(good))

    eol = pick([b"\r\n"], [b"\n"])
    head = b"".join(pick(INTERIM, BAD_INTERIM) for _ in range(draw(st.sampled_from([0, 0, 0, 1, 2]))))
    status_line = pick(draw(st.sampled_from([STATUS_OK, STATUS_ERROR])), BAD_STATUS)
    fields = [pick([b""] + options) for options in HEADERS] + [pick([b""], [b"x-huge: " + b"b" * 70000], 20)]
    body = draw(st.sampled_from(BODIES))
    # Compressed although identity was asked for (a compressing proxy): read as the plain body; br is not.
    coding = pick([b""] * 4 + [b"gzip", b"deflate"], [b"br", b"gzip, br"], 10)
    compress = {b"gzip": lambda data: gzip.compress(data, mtime=0), b"deflate": zlib.compress}.get(coding)
    payload = compress(body) if compress else body
    if coding:
        fields.append(b"content-encoding: " + coding)
    framing = draw(st.sampled_from(["length", "chunked", "close"]))
    # An answer framed by the close is followed by it (kept open, it would only wait for the read timeout).
    end = draw(st.sampled_from(["close", "linger"] + (["close", "keep"] if framing != "close" else [])))
    framed = payload
    if framing == "length":
        n = len(payload)
        lengths = pick([[n]], [[max(0, n - 3)], [n + 3], [n, n], [n, n + 1], [-1], ["0x10"], ["9" * 30], []], 4)
        fields += [b"content-length: %s" % str(length).encode() for length in lengths]
    elif framing == "chunked":
        fields.append(pick([b"transfer-encoding: chunked", b"Transfer-Encoding: Chunked"],
                           [b"transfer-encoding: gzip, chunked", b"transfer-encoding: chunked, x",
                            b"transfer-encoding: chunked" + eol + b"content-length: 3"], 6))
        cuts = sorted(set(draw(st.lists(st.integers(1, max(1, len(payload) - 1)), min_size=1, max_size=3))))
        framed = b""
        for piece in (payload[a:b] for a, b in zip([0, *cuts], [*cuts, len(payload)]) if payload[a:b]):
            size = pick([b"%x" % len(piece)], [b"%x" % (len(piece) + 1), b"zz", b"-1", b"f" * 20], 12)
            framed += size + pick([b"", b";ext=1", b';a="b"']) + eol + piece + eol
        framed += pick([b"0" + eol + eol, b"0;last" + eol + b"x-trailer: " + K + eol + eol], [b""])
    else:  # to the connection's end
        fields.append(pick([b"", b"transfer-encoding: identity"], [b"transfer-encoding: gzip"]))
    data = head + status_line + eol + b"".join(f + eol for f in fields if f) + eol + framed
    # Cut off in the body, before the end its length or chunks announce, or (less often) anywhere.
    cut_short = draw(st.integers(0, 2)) == 2 and clean and framing != "close"
    if cut_short or draw(st.integers(0, 15)) == 15:
        body_start = len(data) - len(framed) if cut_short and framed else 0
        data, clean = data[:draw(st.integers(body_start, len(data) - 1))], False
    stray = b"" if cut_short else draw(st.sampled_from([b""] * 10 + STRAY))  # (stray bytes could end a cut body)
    clean = clean and not (stray and framing == "close")  # for an answer framed by the close, stray bytes are body
    splits = sorted(set(draw(st.lists(st.integers(1, len(data)), max_size=4)))) if data else []
    writes = [(data[a:b], draw(st.sampled_from([0.0, 0.0, 0.002, 0.01])))
              for a, b in zip([0, *splits], [*splits, len(data)]) if data[a:b]]
    if stray:  # in a write of its own, 10 ms later (in the answer's last segment: FOUND_FAULTS)
        writes[-1:] = [(writes[-1][0], 0.01), (stray, 0.0)] if writes else [(stray, 0.0)]
    return Answer(tuple(writes), end, int(status_line.split()[1]) if clean else 0, body, cut_short,
                  json=fields[0] == b"content-type: application/json")


class Scripted:
    """HTTP/1.1 on 127.0.0.1: a request to /v1/fuzz gets the example's answer, byte for byte; /v1/json and /v1/sse a
    plain valid one."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.writing = 0  # fuzzed answers being written (or lingering before their close)
        self._handlers: set[asyncio.Task] = set()

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}/v1"
        return self

    async def __aexit__(self, *_: object) -> None:
        self._server.close()
        if self._handlers:  # each ends with its connection, which the client has closed by now
            _, late = await asyncio.wait(self._handlers, timeout=1)
            for task in late:
                task.cancel()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._handlers.add(asyncio.current_task())
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(int(re.search(rb"content-length: (\d+)", head)[1]))
                if (path := head.split(b" ")[1]) in PLAIN:
                    writer.write(PLAIN[path])
                    continue
                self.writing += 1
                try:
                    for data, pause in self.answer.writes:
                        writer.write(data)
                        await writer.drain()
                        await asyncio.sleep(pause)
                    await asyncio.sleep(0.03 if self.answer.end == "linger" else 0)
                finally:
                    self.writing -= 1
                if self.answer.end != "keep":
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection
        finally:
            writer.close()


async def until(condition: Callable[[], bool]) -> None:
    async with asyncio.timeout(3):
        while not condition():
            await asyncio.sleep(0.001)


async def events(http: HttpUpstream, path: str, *, leave_at_done: bool) -> list[SseEvent]:
    """The stream's events to its end, or (`leave_at_done`) as OpenAIProvider reads: out at `data: [DONE]`."""
    seen = []
    async with http.stream(path, {}, model_id="up") as stream:
        async for event in stream:
            seen.append(event)
            if leave_at_done and event.data == b"[DONE]":
                break
    return seen


async def outcome(call) -> object:
    """What a call gave: its result or the exception it raised (a hang is a TimeoutError)."""
    try:
        async with asyncio.timeout(3):
            return await call
    except Exception as exc:  # noqa: BLE001 - judged by the caller
        return exc


def expected_events(body: bytes, leave_at_done: bool) -> list[SseEvent] | None:
    """The events a stream of `body` gives, or None for a PorticoError: a last event cut short (the stream broke
    off), or no event but an error object (the upstream's error)."""
    decoder = SseDecoder()
    fed = decoder.feed(body)
    done = [i for i, event in enumerate(fed) if event.data == b"[DONE]"]
    if leave_at_done and done:
        return fed[:done[0] + 1]
    tail = decoder.end()
    if any(event.data != b"[DONE]" and not is_json(event.data) for event in tail):
        return None
    decoded = fed + tail
    done = [i for i, event in enumerate(decoded) if event.data == b"[DONE]"]
    if leave_at_done and done:
        return decoded[:done[0] + 1]
    if not decoded and is_json(whole := body.removeprefix(b"\xef\xbb\xbf").strip()):
        error = orjson.loads(whole)
        if isinstance(error, dict) and isinstance(error.get("error"), dict):
            return None
    return decoded


async def check(answer: Answer, leave_at_done: bool) -> None:
    """post_json and a stream against `answer` (each on its own connection), then a plain request of each kind."""
    loop = asyncio.get_running_loop()
    loop_errors: list[dict] = []  # "Fatal error on transport", "Task exception was never retrieved"...
    loop.set_exception_handler(lambda _, context: loop_errors.append(context))
    try:
        async with Scripted(answer) as server:
            http = client(server.url, timeouts=TIMEOUTS, max_connections=MAX_CONNECTIONS)
            try:
                got = await asyncio.gather(outcome(http.post_json("fuzz", {}, model_id="up")),
                                           outcome(events(http, "fuzz", leave_at_done=leave_at_done)))
                for result, kind in zip(got, (dict, list)):
                    assert isinstance(result, (kind, PorticoError)), f"{type(result).__name__}: {result}"
                    if isinstance(result, PorticoError):
                        assert KEY not in f"{result} {result.param}", "the upstream key reached the caller"
                        assert math.isfinite(result.retry_after) and result.retry_after >= 0, result.retry_after
                if 200 <= answer.status < 300:  # an answer every client must read as it is
                    json = orjson.loads(answer.body) if answer.body[:1] == b"{" else None
                    assert got[0] == json if isinstance(json, dict) else "JSON" in str(got[0]), got[0]
                    if answer.json:  # a whole answer to a streamed request: an error, the upstream's or naming it
                        assert isinstance(got[1], PorticoError), got[1]
                    elif (expected := expected_events(answer.body, leave_at_done)) is None:
                        assert isinstance(got[1], PorticoError), got[1]
                    else:
                        assert got[1] == expected
                elif answer.status:  # the upstream's error, with its message (401/403/404, 3xx: Portico's own)
                    said = b"bad key" in answer.body and answer.status not in (302, 401, 404)
                    assert all(isinstance(e, PorticoError) and "broke off" not in str(e) and "in time" not in str(e)
                               and (not said or "bad key [redacted]" in str(e)) for e in got), got
                elif answer.cut_short:  # never taken for a whole answer (a caller out at [DONE] may not see the cut)
                    assert all(isinstance(e, PorticoError) for e in got[:1 if leave_at_done else 2]), got
                # Once the server has written (and closed) all it was given: a connection it closes after a complete
                # answer cannot be told from a live one before its close arrives, by this client or any other.
                await until(lambda: server.writing == 0 and not http._settling)
                await asyncio.sleep(0.005)
                assert http._slots._value == MAX_CONNECTIONS, "a pool slot was not given back"
                # Both at once, so that each takes one of the connections the fuzzed answers may have left idle.
                again = await asyncio.gather(outcome(http.post_json("json", {}, model_id="up")),
                                             outcome(events(http, "sse", leave_at_done=False)))
                assert again == [{"ok": True}, [SseEvent("message", b'{"ok": true}'), SseEvent("message", b"[DONE]")]]
                assert http._slots._value == MAX_CONNECTIONS
                pool = http._pool
                await until(lambda: pool._open <= set(pool._idle))  # no connection open outside the pool
            finally:
                await http.close()
    finally:
        loop.set_exception_handler(None)
    assert not loop_errors, loop_errors


@settings(max_examples=200, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(answer=answers(), leave_at_done=st.booleans())
async def test_any_answer_gives_a_result_or_a_portico_error_and_leaves_the_pool_sound(answer, leave_at_done):
    await check(answer, leave_at_done)


# Faults the property found, each fixed, as the answers that showed them: the property may not draw them again.
FOUND_FAULTS = [
    # Bytes after a complete answer, in its last segment, that begin another left httptools mid-answer, yet the
    # connection was pooled: the next request on it broke off.
    pytest.param(Answer(((whole(b"200 OK", b"{}") + b"HTTP/1.1 2", 0.0),), "keep", 200, b"{}"), id="stray-bytes"),
    # An upstream error's `param` was passed on as it was, key and all.
    pytest.param(Answer(((whole(b"400 X", b'{"error": {"message": "no", "param": "' + K + b'"}}'), 0.0),), "keep"),
                 id="key-in-param"),
    # `retry-after: inf` was an infinite wait (trailing_metadata's OverflowError; the deployment ejected for good).
    pytest.param(Answer(((whole(b"429 X", b"{}", b"retry-after: inf"), 0.0),), "keep"), id="infinite-retry-after"),
]


@pytest.mark.parametrize("answer", FOUND_FAULTS)
async def test_faults_found_before(answer):
    await check(answer, leave_at_done=False)
