"""One HTTP/1.1 exchange at a time on one connection: the request out, the answer parsed by httptools as its bytes
arrive (server/providers/http_client.py keeps these connections in pools), and the errors of a failed exchange.

An answer's body is buffered as it arrives and taken by `Response.readany`/`read`; past PAUSE_BYTES unread, reading
from the socket stops until the reader catches up. A body with a content-encoding is decoded as it is read, a
bounded piece at a time (server/providers/http_decoding.py); one without costs nothing more. The read timeout runs
while a reader waits and restarts with every byte that arrives (aiohttp's sock_read); an answer may also have a
deadline, which no byte moves (a non-streamed answer's `timeouts.answer`: an upstream trickling it in is cut there).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

import httptools

from server.providers.http_decoding import Decoder, DecodingError, decoder_for

if TYPE_CHECKING:
    from server.providers.http_client import Pool

PAUSE_BYTES = 1024 * 1024  # an answer buffered this far and not read yet stops reading from the socket
# An answer's status line and headers (or a proxy's answer to CONNECT) may not be longer: an upstream sending header
# lines without end would otherwise be buffered whole (aiohttp refused lines over 8 KiB).
MAX_HEAD_BYTES = 64 * 1024


class TransportError(Exception):
    """The exchange failed: no answer, not a whole one, or one whose body cannot be decoded."""


class ConnectFailed(TransportError):
    """No connection could be opened (refused, unknown host, TLS or proxy refused)."""


class OwnLimitReached(TransportError):
    """This process cannot open another connection (no file descriptor, or no kernel memory, left): the gateway's
    trouble, which another deployment would meet too, not the upstream's."""


class ConnectTimeout(TransportError):
    pass


class ReadTimeout(TransportError):
    """Nothing arrived within the read timeout while an answer was awaited."""


class ConnectionBroken(TransportError):
    """The connection closed or reset before the answer was whole, or the answer was not HTTP."""


class Undecodable(TransportError):
    """The answer's content-encoding is one Portico does not decode, or its compressed data is corrupt or cut short.
    The message completes "The upstream serving `model` ..."."""


class TooLarge(TransportError):
    """The answer is bigger than its reader takes. The message completes "The upstream serving `model` ..."."""


class Response:
    """One answer: its status and headers, then its body as it arrives. Exactly one of `release` (the connection
    goes back to its pool if the answer was read whole) or `close` must end it."""

    # Asked when a wait for this answer is cancelled: True when the reader's caller left and the exchange runs on
    # (server/cutoff.py Cutoff.outlast, for non-streamed answers the upstream bills whatever its client does).
    outlast: Callable[[], bool] | None = None

    def __init__(self, connection: Connection, read_timeout: float | None, deadline: float | None = None) -> None:
        """`deadline`: the loop time by which the whole answer must have arrived (None: none)."""
        self.status = 0
        self.headers: dict[str, str] = {}  # names in lower case; repeated fields joined with ", "
        self._connection = connection
        self._read_timeout = read_timeout
        self._deadline = deadline
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._started = False
        self._complete = False
        self._error: TransportError | None = None
        self._waiter: asyncio.Future | None = None
        self._decoder: Decoder | None = None  # set with the headers when they name a content-encoding

    @property
    def content_type(self) -> str:
        """The media type alone, in lower case ("" when there is none)."""
        return self.headers.get("content-type", "").partition(";")[0].strip().lower()

    def is_eof(self) -> bool:
        """The whole body has arrived (it may not all have been read)."""
        return self._complete

    async def readany(self) -> bytes:
        """What has arrived and not been read (decoded), waiting for some if nothing has; b"" at the end of the body."""
        if self._decoder is not None:
            return await self._read_decoded(self._decoder)
        while not self._chunks:
            if self._complete:
                return b""
            await self._wait()
        chunks, self._chunks, self._buffered = self._chunks, [], 0
        self._connection.resume()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def read(self, limit: int) -> bytes:
        """The whole body, of at most `limit` bytes (decoded): a bigger one is TooLarge, and its connection is not
        reused."""
        parts: list[bytes] = []
        size = 0
        while chunk := await self.readany():
            size += len(chunk)
            if size > limit:
                self._connection.reusable = False
                raise TooLarge(f"answered with more than {limit >> 20} MiB")
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    async def _read_decoded(self, decoder: Decoder) -> bytes:
        """The next piece of a compressed body. What arrived is taken (and the socket resumed) only once the decoder
        has used up what it was given: a reader that stops stops the decoding, then the socket. The taking is
        readany's, written out again: a coroutine shared by both costs every plain read (the JSON path) one more
        await, +0.6 % instructions per JSON request under callgrind."""
        try:
            while True:
                if decoder.hungry:
                    while not self._chunks:
                        if self._complete:
                            decoder.end()
                            return b""
                        await self._wait()
                    chunks, self._chunks, self._buffered = self._chunks, [], 0
                    self._connection.resume()
                    decoder.feed(chunks[0] if len(chunks) == 1 else b"".join(chunks))
                if data := decoder.decode():
                    return data
        except DecodingError as exc:
            self._connection.reusable = False  # an upstream that answers so is asked nothing more on this connection
            raise Undecodable(str(exc)) from None

    def lift_deadline(self) -> None:
        """No deadline from now on: the read timeout alone bounds the rest of the answer."""
        self._deadline = None

    def release(self) -> None:
        self._connection.finish(self, reuse=self._complete)

    def close(self) -> None:
        self._connection.finish(self, reuse=False)

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        waiter = self._waiter = self._connection.loop.create_future()
        self._connection.watch(self._read_timeout, self._deadline)
        try:
            await waiter
        except asyncio.CancelledError:
            if self.outlast is None or not self.outlast():
                raise
            # Run on: the readers loop back to another wait, under the same timer (its timeouts still apply).
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, error: TransportError) -> None:
        if not self._complete and self._error is None:
            self._error = error
            self._wake()


class Connection(asyncio.Protocol):
    """One keep-alive connection: at most one exchange at a time, fed to httptools as its bytes arrive."""

    def __init__(self, pool: Pool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.idle_since = 0.0
        self.reusable = True
        self._parser = httptools.HttpResponseParser(self)
        self._response: Response | None = None
        self._header_names: list[bytes] = []
        self._header_values: list[bytes] = []
        self._framed = False  # the answer states its length (content-length or chunked), or has none by its status
        self._head_bytes = 0  # of the answer's head, so far
        self._last_data = 0.0
        self._timer: asyncio.TimerHandle | None = None
        self._paused = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def send(self, request: bytes, read_timeout: float | None, answer_within: float | None = None) -> Response:
        """`answer_within`: seconds from now by which the whole answer must have arrived (None: no such bound)."""
        self._last_data = self.loop.time()
        deadline = None if answer_within is None else self._last_data + answer_within
        response = self._response = Response(self, read_timeout, deadline)
        self._head_bytes = 0
        self.transport.write(request)
        return response

    @property
    def heard(self) -> bool:
        """A byte of the current answer has arrived."""
        return self._head_bytes > 0

    async def started(self, response: Response) -> None:
        while not response._started:
            await response._wait()

    def data_received(self, data: bytes) -> None:
        self._last_data = self.loop.time()
        if self._response is None or self._response._complete:  # bytes nobody asked for: framing lost
            self.reusable = False
            self.transport.close()
            return
        response = self._response
        if not response._started:
            self._head_bytes += len(data)  # before parsing: on_headers_complete reads it
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:  # an upgrade (101) is no answer
            self._broken(response, "the answer is not valid HTTP/1.1")
            return
        if not response._started and self._head_bytes > MAX_HEAD_BYTES:
            self._broken(response, "the answer's headers are longer than 64 KiB")

    def _broken(self, response: Response, reason: str) -> None:
        self.reusable = False
        response._fail(ConnectionBroken(reason))
        self.transport.close()

    def eof_received(self) -> bool:
        return False  # close our side too: an HTTP/1.1 answer cannot go on after the peer's half-close

    def connection_lost(self, exc: Exception | None) -> None:
        self.reusable = False
        self.pool.forget(self)
        self._cancel_timer()
        response = self._response
        if response is None or response._complete:
            return
        if response._started and not self._framed and exc is None:
            self.on_message_complete()  # an answer delimited by the connection's end: this was its end
        else:
            response._fail(ConnectionBroken("it closed before the answer was whole"))

    # httptools' callbacks
    def on_message_begin(self) -> None:
        if self._response._complete:  # bytes after a whole answer begin another: this connection's framing is lost
            self.reusable = False
        self._header_names.clear()
        self._header_values.clear()

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self._response._started:  # after the body, a chunked answer's trailer fields: not headers
            self._header_names.append(name)
            self._header_values.append(value)

    def on_headers_complete(self) -> None:
        response = self._response
        if response._complete:  # a second answer to one request: this connection's framing is lost
            self.reusable = False
            return
        status = self._parser.get_status_code()
        if status < 200:  # an interim answer (100 Continue, 103 Early Hints): the real one follows
            self._header_names.clear()
            self._header_values.clear()
            return
        # A head that arrived in one read with more (its body) is measured itself: only when what was read could
        # hold one that long (summing every answer's fields cost the JSON path 1 %).
        if self._head_bytes > MAX_HEAD_BYTES and (
                sum(map(len, self._header_names)) + sum(map(len, self._header_values)) > MAX_HEAD_BYTES):
            self._broken(response, "the answer's headers are longer than 64 KiB")
            return
        headers: dict[str, str] = {}
        for raw_name, raw_value in zip(self._header_names, self._header_values):
            name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        self._header_names.clear()
        self._header_values.clear()
        # Else the answer runs to the connection's end (RFC 9112 6.3), as with a transfer-encoding other than chunked.
        self._framed = ("content-length" in headers or "chunked" in headers.get("transfer-encoding", "").lower()
                        or status in (204, 304))
        coding = headers.get("content-encoding")
        if coding is not None:
            response._decoder = decoder_for(coding)
        response.status, response.headers, response._started = status, headers, True
        response._wake()

    def on_body(self, body: bytes) -> None:
        response = self._response
        if response._complete:
            return
        response._chunks.append(body)
        response._buffered += len(body)
        if response._buffered > PAUSE_BYTES and not self._paused:
            self._paused = True
            self.transport.pause_reading()
        response._wake()

    def on_message_complete(self) -> None:
        response = self._response
        if response is None or not response._started:
            return  # the end of an interim answer
        response._complete = True
        self.reusable = self.reusable and self._framed and self._parser.should_keep_alive()
        self._cancel_timer()
        response._wake()

    # the exchange's life
    def watch(self, timeout: float | None, deadline: float | None = None) -> None:
        """Fail the answer once `timeout` passes without a byte arriving, or at `deadline` (one timer, moved on only
        when it fires, then to the answer's deadline as it is then: `Response.lift_deadline` may have lifted it)."""
        if self._timer is None and timeout is not None:
            self._timer = self.loop.call_at(_until(self._last_data + timeout, deadline), self._check_timer, timeout)

    def _check_timer(self, timeout: float) -> None:
        self._timer = None
        response = self._response
        if response is None or response._complete or response._waiter is None:
            return  # nobody is waiting: the next wait starts a timer of its own
        quiet_until = _until(self._last_data + timeout, response._deadline)
        if self.loop.time() < quiet_until:
            self._timer = self.loop.call_at(quiet_until, self._check_timer, timeout)
            return
        self.reusable = False
        response._fail(ReadTimeout("no answer within the read timeout"))
        self.transport.close()

    def _cancel_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def resume(self) -> None:
        if self._paused:
            self._paused = False
            self._last_data = self.loop.time()  # the silence while paused was ours, not the upstream's
            self.transport.resume_reading()

    def finish(self, response: Response, *, reuse: bool) -> None:
        if response is not self._response:
            return  # already finished
        self._response = None
        self._cancel_timer()
        if reuse and self.reusable and not self.transport.is_closing():
            self.resume()  # an answer left unread past PAUSE_BYTES paused the socket; the next one needs it read
            self.pool.put(self)
        else:
            self.reusable = False
            self.transport.close()


def _until(quiet_until: float, deadline: float | None) -> float:
    return quiet_until if deadline is None else min(quiet_until, deadline)
