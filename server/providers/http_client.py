"""The HTTP/1.1 client under the upstream providers: keep-alive connections per origin, answers parsed by httptools.

Why not a general client library: the upstream exchange runs on the server's one event-loop thread, which bounds
the gateway's requests per second (docs/performance.md, "Per process"). aiohttp 3.14, the cheapest of the asyncio
clients measured there, costs that thread ~80-100 us per JSON answer in its request, header and payload layers;
this client, which does only what an upstream exchange needs, ~20 us. The parsing is not ours: httptools is
llhttp (Node's parser, also under uvicorn), so what is hand-written is the pool and the framing of one request.

What it does: POST and GET with a whole body; answers of any framing (content-length, chunked, or to the close);
plain TCP or TLS (the caller's SSLContext); HTTP proxies, as an absolute-form request for http:// origins and a
CONNECT tunnel for https:// ones; a connect timeout (the TCP, proxy and TLS handshakes together) and a read timeout
that runs while the answer is awaited and restarts with every byte that arrives (aiohttp's sock_read). Idle
connections are dropped after `keepalive` seconds. No redirects, cookies or compression (`accept-encoding:
identity`): the upstreams' APIs use none of them. How many connections may be open is the caller's limit
(server/providers/http_upstream.py holds one slot per exchange).
"""

from __future__ import annotations

import asyncio
import base64
import ssl
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

import httptools

PAUSE_BYTES = 1024 * 1024  # an answer buffered this far and not read yet stops reading from the socket
# An answer's status line and headers (or a proxy's answer to CONNECT) may not be longer: an upstream sending header
# lines without end would otherwise be buffered whole (aiohttp refused lines over 8 KiB).
MAX_HEAD_BYTES = 64 * 1024


class TransportError(Exception):
    """The exchange failed below HTTP: no answer, or not a whole one."""


class ConnectFailed(TransportError):
    """No connection could be opened (refused, unknown host, TLS or proxy refused)."""


class ConnectTimeout(TransportError):
    pass


class ReadTimeout(TransportError):
    """Nothing arrived within the read timeout while an answer was awaited."""


class ConnectionBroken(TransportError):
    """The connection closed or reset before the answer was whole, or the answer was not HTTP."""


@dataclass(frozen=True)
class Origin:
    scheme: str  # "http" or "https"
    host: str
    port: int

    @classmethod
    def of(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url[:100]}")
        return cls(parts.scheme, parts.hostname, parts.port or (443 if parts.scheme == "https" else 80))

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == (443 if self.scheme == "https" else 80) else f"{host}:{self.port}"


@dataclass(frozen=True)
class Proxy:
    origin: Origin
    authorization: str | None  # the `proxy-authorization` value, from the proxy URL's user:password

    @classmethod
    def of(cls, url: str) -> Proxy:
        parts = urlsplit(url)
        credentials = None
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            credentials = "Basic " + base64.b64encode(pair.encode()).decode()
        return cls(Origin.of(url), credentials)


def header_lines(headers: Iterable[tuple[str, str]]) -> bytes:
    """Header fields as they go on the wire. A value with a line break would end the head early (a second request
    smuggled into the connection): refused, wherever it came from."""
    lines = []
    for name, value in headers:
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            raise ValueError(f"header {name[:40]!r} cannot be sent: it holds a line break")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines).encode()


class Response:
    """One answer: its status and headers, then its body as it arrives. Exactly one of `release` (the connection
    goes back to its pool if the answer was read whole) or `close` must end it."""

    def __init__(self, connection: _Connection, read_timeout: float | None) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}  # names in lower case; repeated fields joined with ", "
        self._connection = connection
        self._read_timeout = read_timeout
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._started = False
        self._complete = False
        self._error: TransportError | None = None
        self._waiter: asyncio.Future | None = None

    @property
    def content_type(self) -> str:
        """The media type alone, in lower case ("" when there is none)."""
        return self.headers.get("content-type", "").partition(";")[0].strip().lower()

    def is_eof(self) -> bool:
        """The whole body has arrived (it may not all have been read)."""
        return self._complete

    async def readany(self) -> bytes:
        """What has arrived and not been read, waiting for some if nothing has; b"" at the end of the body."""
        while not self._chunks:
            if self._complete:
                return b""
            await self._wait()
        chunks, self._chunks, self._buffered = self._chunks, [], 0
        self._connection.resume()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body, or (with `limit`) at least that much of it if it is longer."""
        parts: list[bytes] = []
        size = 0
        while (limit is None or size < limit) and (chunk := await self.readany()):
            parts.append(chunk)
            size += len(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def release(self) -> None:
        self._connection.finish(self, reuse=self._complete)

    def close(self) -> None:
        self._connection.finish(self, reuse=False)

    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        waiter = self._waiter = self._connection.loop.create_future()
        self._connection.watch(self._read_timeout)
        try:
            await waiter
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


class _Connection(asyncio.Protocol):
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

    def send(self, request: bytes, read_timeout: float | None) -> Response:
        response = self._response = Response(self, read_timeout)
        self._head_bytes = 0
        self._last_data = self.loop.time()
        self.transport.write(request)
        return response

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
        try:
            self._parser.feed_data(data)
        except (httptools.HttpParserError, httptools.HttpParserUpgrade) as exc:  # an upgrade (101) is no answer
            self._broken(response, f"the answer is not valid HTTP/1.1 ({type(exc).__name__})")
            return
        if not response._started:
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
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
            response._fail(ConnectionBroken("the connection closed before the answer was whole"))

    # httptools' callbacks
    def on_message_begin(self) -> None:
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
        headers: dict[str, str] = {}
        for raw_name, raw_value in zip(self._header_names, self._header_values):
            name, value = raw_name.decode("latin-1").lower(), raw_value.decode("latin-1")
            headers[name] = f"{headers[name]}, {value}" if name in headers else value
        self._header_names.clear()
        self._header_values.clear()
        # Else the answer runs to the connection's end (RFC 9112 6.3), as with a transfer-encoding other than chunked.
        self._framed = ("content-length" in headers or "chunked" in headers.get("transfer-encoding", "").lower()
                        or status in (204, 304))
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
    def watch(self, timeout: float | None) -> None:
        """Fail the answer once `timeout` passes without a byte arriving (one timer, moved on only when it fires)."""
        if self._timer is None and timeout is not None:
            self._timer = self.loop.call_at(self._last_data + timeout, self._check_timer, timeout)

    def _check_timer(self, timeout: float) -> None:
        self._timer = None
        response = self._response
        if response is None or response._complete or response._waiter is None:
            return  # nobody is waiting: the next wait starts a timer of its own
        quiet_until = self._last_data + timeout
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


class Pool:
    """The idle connections to one origin, through one proxy or none; the most recently used is taken first."""

    def __init__(self, origin: Origin, proxy: Proxy | None, *, ssl_context: ssl.SSLContext | None,
                 connect_timeout: float | None, keepalive: float) -> None:
        self.loop = asyncio.get_running_loop()
        self._origin = origin
        self._proxy = proxy
        self._ssl = ssl_context if origin.scheme == "https" else None
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()
        self._sweep: asyncio.TimerHandle | None = None
        # The request line's target: the path, or the whole URL for a plain proxy (absolute form).
        self.target_prefix = f"http://{origin.authority}" if proxy is not None and origin.scheme == "http" else ""
        fields = [("host", origin.authority)]
        if proxy is not None and proxy.authorization and origin.scheme == "http":
            fields.append(("proxy-authorization", proxy.authorization))
        self.host_lines = header_lines(fields)

    async def request(self, method: str, path: str, *, headers: bytes, body: bytes,
                      read_timeout: float | None) -> Response:
        """Send a request and await its answer's status and headers. `path` starts with "/"; `headers` are whole
        lines (`header_lines`) without host or content-length. Cancelled or failed before the answer, the
        connection is closed."""
        connection = await self._connection()
        head = (f"{method} {self.target_prefix}{path} HTTP/1.1\r\n".encode() + self.host_lines + headers
                + (b"content-length: %d\r\n\r\n" % len(body) if body or method == "POST" else b"\r\n"))
        response = connection.send(head + body, read_timeout)
        try:
            await connection.started(response)
        except BaseException:
            response.close()
            raise
        return response

    async def _connection(self) -> _Connection:
        now = self.loop.time()
        while self._idle:
            connection = self._idle.pop()
            if connection.reusable and now - connection.idle_since < self._keepalive:
                return connection
            connection.transport.close()
        return await self._connect()

    def put(self, connection: _Connection) -> None:
        connection.idle_since = self.loop.time()
        self._idle.append(connection)
        if self._sweep is None:
            self._sweep = self.loop.call_later(self._keepalive, self._drop_idle)

    def forget(self, connection: _Connection) -> None:
        self._open.discard(connection)

    def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
        for connection in list(self._open):
            connection.transport.close()
        self._idle.clear()

    def _drop_idle(self) -> None:
        self._sweep = None
        now = self.loop.time()
        keep = [c for c in self._idle if c.reusable and now - c.idle_since < self._keepalive]
        for connection in self._idle:
            if connection not in keep:
                connection.transport.close()
        self._idle = keep
        if keep:
            self._sweep = self.loop.call_at(keep[0].idle_since + self._keepalive, self._drop_idle)

    async def _connect(self) -> _Connection:
        try:
            async with asyncio.timeout(self._connect_timeout):
                connection = await self._handshakes()
        except TimeoutError:
            raise ConnectTimeout("connecting timed out") from None
        except (OSError, ssl.SSLError) as exc:  # refused, unreachable, unknown host, a certificate refused
            raise ConnectFailed(f"cannot connect: {type(exc).__name__}") from exc
        self._open.add(connection)
        return connection

    async def _handshakes(self) -> _Connection:
        origin, proxy = self._origin, self._proxy
        if proxy is None:
            _, connection = await self.loop.create_connection(
                lambda: _Connection(self), origin.host, origin.port, ssl=self._ssl,
                server_hostname=origin.host if self._ssl else None)
            return connection
        proxy_tls = _proxy_context(self._ssl, proxy)
        if origin.scheme == "http":
            _, connection = await self.loop.create_connection(
                lambda: _Connection(self), proxy.origin.host, proxy.origin.port, ssl=proxy_tls,
                server_hostname=proxy.origin.host if proxy_tls else None)
            return connection
        transport, tunnel = await self.loop.create_connection(
            _TunnelReply, proxy.origin.host, proxy.origin.port, ssl=proxy_tls,
            server_hostname=proxy.origin.host if proxy_tls else None)
        try:
            fields = [("host", f"{origin.host}:{origin.port}")]
            if proxy.authorization:
                fields.append(("proxy-authorization", proxy.authorization))
            transport.write(f"CONNECT {origin.host}:{origin.port} HTTP/1.1\r\n".encode() + header_lines(fields)
                            + b"\r\n")
            await tunnel.established
            connection = _Connection(self)
            tls = await self.loop.start_tls(transport, connection, self._ssl, server_hostname=origin.host)
        except BaseException:
            transport.close()
            raise
        connection.connection_made(tls)
        return connection


def _proxy_context(origin_context: ssl.SSLContext | None, proxy: Proxy) -> ssl.SSLContext | None:
    if proxy.origin.scheme != "https":
        return None
    return origin_context or ssl.create_default_context()


class _TunnelReply(asyncio.Protocol):
    """Reads a proxy's answer to CONNECT: a 2xx opens the tunnel; anything else is a refusal."""

    def __init__(self) -> None:
        self.established: asyncio.Future = asyncio.get_running_loop().create_future()
        self._head = b""

    def data_received(self, data: bytes) -> None:
        if self.established.done():
            return
        self._head += data
        if b"\r\n\r\n" not in self._head:
            if len(self._head) > MAX_HEAD_BYTES:
                self.established.set_exception(ConnectionRefusedError("the proxy's answer to CONNECT is too long"))
            return
        status_line = self._head.split(b"\r\n", 1)[0].split()
        if len(status_line) >= 2 and status_line[1][:1] == b"2":
            self.established.set_result(None)
        else:
            reason = status_line[1].decode("latin-1")[:3] if len(status_line) >= 2 else "no status"
            self.established.set_exception(ConnectionRefusedError(f"the proxy refused the tunnel ({reason})"))

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.established.done():
            self.established.set_exception(ConnectionResetError("the proxy closed the connection"))


class HttpClient:
    """Keep-alive pools, one per origin and proxy, each made on first use inside the running loop."""

    def __init__(self, *, ssl_context: ssl.SSLContext, connect_timeout: float | None, keepalive: float) -> None:
        self._ssl = ssl_context
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive
        self._pools: dict[tuple[Origin, Proxy | None], Pool] = {}

    def pool(self, origin: Origin, proxy: Proxy | None) -> Pool:
        pool = self._pools.get((origin, proxy))
        if pool is None:
            pool = self._pools[(origin, proxy)] = Pool(origin, proxy, ssl_context=self._ssl,
                                                       connect_timeout=self._connect_timeout,
                                                       keepalive=self._keepalive)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
