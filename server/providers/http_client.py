"""The HTTP/1.1 client under the upstream providers: keep-alive connections per origin, answers parsed by httptools.

Why not a general client library: the upstream exchange runs on the server's one event-loop thread, which bounds
the gateway's requests per second (docs/performance.md, "Per process"). aiohttp 3.14, the cheapest of the asyncio
clients measured there, costs that thread ~80-100 us per JSON answer in its request, header and payload layers;
this client, which does only what an upstream exchange needs, ~20 us. The parsing is not ours: httptools is
llhttp (Node's parser, also under uvicorn), so what is hand-written is the pool and the framing of one request.

What it does: POST and GET with a whole body; answers of any framing (content-length, chunked, or to the close);
plain TCP or TLS (the caller's SSLContext); HTTP proxies, as an absolute-form request for http:// origins and a
CONNECT tunnel for https:// ones; a connect timeout (the TCP, proxy and TLS handshakes together) and the read
timeout of server/providers/http_connection.py, which holds one exchange on one connection. Idle connections are
dropped after `keepalive` seconds. No redirects or cookies: the upstreams' APIs use neither. Compression is not
asked for (the caller sends `accept-encoding: identity`), but a gzip or deflate answer is decoded as it is read
(server/providers/http_decoding.py). How many connections may be open is the caller's limit
(server/providers/http_upstream.py holds one slot per exchange).
"""

from __future__ import annotations

import asyncio
import base64
import errno
import os
import socket
import ssl
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from urllib.parse import unquote, urlsplit

from server.providers.http_connection import (MAX_HEAD_BYTES, ConnectFailed, Connection, ConnectionBroken,
                                              ConnectTimeout, OwnLimitReached, Response, TransportError)
from server.providers.link_addresses import address_class

_DEFAULT_PORTS = {"http": 80, "https": 443}
# A reused connection closed within this of the request being sent closed as it was reused: its server did not
# read the request (a round trip to a distant upstream included).
_CLOSED_AS_REUSED_SECONDS = 1.0


@dataclass(frozen=True)
class Origin:
    scheme: str  # "http" or "https"
    host: str
    port: int

    @classmethod
    def of(cls, url: str) -> Origin:
        parts = urlsplit(url)
        if parts.scheme not in _DEFAULT_PORTS or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {url[:100]}")
        return cls(parts.scheme, parts.hostname, parts.port or _DEFAULT_PORTS[parts.scheme])

    @property
    def authority(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == _DEFAULT_PORTS[self.scheme] else f"{host}:{self.port}"


@dataclass(frozen=True)
class Proxy:
    origin: Origin
    # The `proxy-authorization` value, from the proxy URL's user:password: out of repr, as a password.
    authorization: str | None = field(repr=False)

    @classmethod
    def of(cls, url: str) -> Proxy:
        parts = urlsplit(url)
        credentials = None
        if parts.username is not None:
            pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
            credentials = "Basic " + base64.b64encode(pair.encode()).decode()
        return cls(Origin.of(url), credentials)


class AddressRefused(TransportError):
    """The host resolved to an address of a class the pool may not connect to (server/providers/link_addresses.py):
    nothing was connected. `kind` is that class, for the operator's log; never for the caller."""

    def __init__(self, kind: str) -> None:
        super().__init__(kind)
        self.kind = kind


def header_lines(headers: Iterable[tuple[str, str]]) -> bytes:
    """Header fields as they go on the wire. A value with a line break would end the head early (a second request
    smuggled into the connection): refused, wherever it came from."""
    lines = []
    for name, value in headers:
        if "\r" in value or "\n" in value or "\r" in name or "\n" in name or ":" in name:
            raise ValueError(f"header {name[:40]!r} cannot be sent: it holds a line break")
        lines.append(f"{name}: {value}\r\n")
    return "".join(lines).encode()


class Pool:
    """The idle connections to one origin, through one proxy or none; the most recently used is taken first."""

    def __init__(self, origin: Origin, proxy: Proxy | None, *, ssl_context: Callable[[], ssl.SSLContext],
                 connect_timeout: float | None, keepalive: float, allowed: frozenset[str] | None = None) -> None:
        """`ssl_context` gives the TLS settings, called only for the origin or proxy that speaks TLS. `allowed`: the
        address classes (link_addresses.address_class) the origin's host may resolve to (None: any); checked on
        every address it resolves to, before connecting to any, and the connection made to those very addresses."""
        self.loop = asyncio.get_running_loop()
        self._origin = origin
        self._proxy = proxy
        self._allowed = allowed
        self._ssl = ssl_context() if origin.scheme == "https" else None
        self._proxy_tls = ssl_context() if proxy is not None and proxy.origin.scheme == "https" else None
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive
        self._idle: list[Connection] = []
        self._open: set[Connection] = set()
        self._sweep: asyncio.TimerHandle | None = None
        # The request line's target: the path, or the whole URL for a plain proxy (absolute form).
        self.target_prefix = f"http://{origin.authority}" if proxy is not None and origin.scheme == "http" else ""
        fields = [("host", origin.authority)]
        if proxy is not None and proxy.authorization and origin.scheme == "http":
            fields.append(("proxy-authorization", proxy.authorization))
        self.host_lines = header_lines(fields)

    async def request(self, method: str, path: str, *, headers: bytes, body: bytes,
                      read_timeout: float | None, answer_within: float | None = None,
                      outlast: Callable[[], bool] | None = None) -> Response:
        """Send a request and await its answer's status and headers. `path` starts with "/"; `headers` are whole
        lines (`header_lines`) without host or content-length; `answer_within`: seconds from sending by which the
        whole answer must have arrived; `outlast`: the answer's (Response.outlast). Cancelled or failed before the
        answer, the connection is closed."""
        head = (f"{method} {self.target_prefix}{path} HTTP/1.1\r\n".encode() + self.host_lines + headers
                + (b"content-length: %d\r\n\r\n" % len(body) if body or method == "POST" else b"\r\n"))
        connection = self._idle_connection()
        while True:
            reused = connection is not None
            if connection is None:
                connection = await self._connect()
            sent_at = self.loop.time()
            response = connection.send(head + body, read_timeout, answer_within)
            if outlast is not None:
                response.outlast = outlast
            try:
                await connection.started(response)
            except ConnectionBroken:
                response.close()
                # A kept-alive connection closed at once, before a byte of the answer: the server's idle timeout ran
                # out as the request was sent (gunicorn's is 2 s), and it dropped the request unread. Sent once more
                # on a new connection, this is no failure of the upstream's, to retry after a backoff or to fail
                # with. Not one that closed later: the server may have had the request, and a model may have run it.
                if not reused or connection.heard or self.loop.time() - sent_at > _CLOSED_AS_REUSED_SECONDS:
                    raise
                connection = None
                continue
            except BaseException:
                response.close()
                raise
            return response


    @property
    def origin(self) -> Origin:
        return self._origin
    def _idle_connection(self) -> Connection | None:
        now = self.loop.time()
        while self._idle:
            connection = self._idle.pop()
            if self._fresh(connection, now):
                return connection
            connection.transport.close()
        return None

    def _fresh(self, connection: Connection, now: float) -> bool:
        return connection.reusable and now - connection.idle_since < self._keepalive

    def put(self, connection: Connection) -> None:
        connection.idle_since = self.loop.time()
        self._idle.append(connection)
        if self._sweep is None:
            self._sweep = self.loop.call_later(self._keepalive, self._drop_idle)

    def forget(self, connection: Connection) -> None:
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
        keep = []
        for connection in self._idle:
            if self._fresh(connection, now):
                keep.append(connection)
            else:
                connection.transport.close()
        self._idle = keep
        if keep:
            self._sweep = self.loop.call_at(keep[0].idle_since + self._keepalive, self._drop_idle)

    async def _connect(self) -> Connection:
        try:
            async with asyncio.timeout(self._connect_timeout):
                connection = await self._handshakes()
        except TimeoutError:
            raise ConnectTimeout("connecting timed out") from None
        except (OSError, ssl.SSLError) as exc:  # refused, unreachable, unknown host, a certificate refused
            if exc.errno in _OWN_LIMITS:
                raise OwnLimitReached(os.strerror(exc.errno).lower()) from exc
            raise ConnectFailed(_why_not(exc)) from exc
        except ValueError as exc:  # a host name no resolver takes (a label over 63 characters, a NUL): a link's
            raise ConnectFailed("its host name does not resolve") from exc
        self._open.add(connection)
        return connection

    async def _handshakes(self) -> Connection:
        """To the origin, or to the proxy: the connection itself, or (an https origin behind a proxy) a CONNECT
        tunnel that TLS then runs through."""
        origin, proxy = self._origin, self._proxy
        to, tls = (origin, self._ssl) if proxy is None else (proxy.origin, self._proxy_tls)
        tunnelled = proxy is not None and origin.scheme == "https"
        protocol_factory = _TunnelReply if tunnelled else (lambda: Connection(self))
        checked = await self._checked_addresses() if self._allowed is not None else None
        # Through a proxy the proxy connects, to what it resolves the name to: checked above as we resolve it.
        transport, protocol = await self._open_to(to, protocol_factory, tls, checked if proxy is None else None)
        if not tunnelled:
            return protocol
        try:
            fields = [("host", f"{origin.host}:{origin.port}")]
            if proxy.authorization:
                fields.append(("proxy-authorization", proxy.authorization))
            transport.write(f"CONNECT {origin.host}:{origin.port} HTTP/1.1\r\n".encode() + header_lines(fields)
                            + b"\r\n")
            await protocol.established
            connection = Connection(self)
            inner = await self.loop.start_tls(transport, connection, self._ssl, server_hostname=origin.host)
        except BaseException:
            transport.close()
            raise
        connection.connection_made(inner)
        return connection

    async def _checked_addresses(self) -> list[tuple]:
        """Every address the origin's host resolves to, if all are of an allowed class: one that is not refuses the
        host (a name resolving both outward and inward is no public host)."""
        origin = self._origin
        try:
            infos = await self.loop.getaddrinfo(origin.host, origin.port, type=socket.SOCK_STREAM)
        except socket.gaierror:
            if self._proxy is None:
                raise
            return []  # a name only the proxy can resolve: the proxy, the operator's, decides what it reaches
        for *_, sockaddr in infos:
            kind = address_class(sockaddr[0])
            if kind not in self._allowed:
                raise AddressRefused(kind)
        return infos

    async def _open_to(self, to: Origin, protocol: Callable[[], asyncio.Protocol], tls: ssl.SSLContext | None,
                       checked: list[tuple] | None = None) -> tuple[asyncio.Transport, asyncio.Protocol]:
        """create_connection to each of the host's addresses in turn, by address: `checked` as _checked_addresses
        found them (not looked up again, where a second DNS answer might lead elsewhere), else looked up here, since
        uvloop's create_connection leaves a failed lookup's future unread, and asyncio then logs 'Future exception was
        never retrieved' (socket.gaierror) for nearly every request while a host does not resolve (uvloop#437)."""
        addresses = checked if checked is not None else await self.loop.getaddrinfo(to.host, to.port,
                                                                                   type=socket.SOCK_STREAM)
        first: OSError | None = None
        for *_, address in addresses:
            try:
                return await self.loop.create_connection(protocol, address[0], address[1], ssl=tls,
                                                         server_hostname=to.host if tls else None)
            except OSError as exc:  # the next address may answer, as create_connection would try it
                first = first or exc
        raise first or OSError(f"{to.host} has no address")


_OWN_LIMITS = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})  # this host's, not the upstream's


def _why_not(exc: OSError | ssl.SSLError) -> str:
    """Why a connection could not be made, in words callers may read: never the host, address or port (an OSError's
    own text names them), which are the gateway's configuration."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        return "its TLS certificate is not trusted"
    if isinstance(exc, ssl.SSLError):
        return "the TLS handshake failed"
    if isinstance(exc, socket.gaierror):
        return "its host name does not resolve"
    if isinstance(exc, ConnectionRefusedError) and exc.errno is not None:
        return "it refused the connection"
    if exc.errno is None and exc.args and isinstance(exc.args[0], str) and exc.args[0].startswith("the proxy"):
        return exc.args[0]  # a proxy's refusal of the tunnel (_TunnelReply): our own words
    return os.strerror(exc.errno).lower() if exc.errno else "the connection failed"


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

    def __init__(self, *, ssl_context: Callable[[], ssl.SSLContext], connect_timeout: float | None,
                 keepalive: float) -> None:
        """`ssl_context` makes the TLS settings, once, when a pool first needs them: loading a CA store costs ~50 ms,
        which the first request to a plain-HTTP upstream should not wait for."""
        self._make_ssl = ssl_context
        self._ssl: ssl.SSLContext | None = None
        self._connect_timeout = connect_timeout
        self._keepalive = keepalive
        self._pools: dict[tuple[Origin, Proxy | None, frozenset[str] | None], Pool] = {}

    def pool(self, origin: Origin, proxy: Proxy | None, allowed: frozenset[str] | None = None) -> Pool:
        """`allowed`: as for Pool; a pool is kept per origin, proxy and allowed classes."""
        pool = self._pools.get((origin, proxy, allowed))
        if pool is None:
            pool = self._pools[(origin, proxy, allowed)] = Pool(origin, proxy, ssl_context=self._tls,
                                                                connect_timeout=self._connect_timeout,
                                                                keepalive=self._keepalive, allowed=allowed)
        return pool

    def _tls(self) -> ssl.SSLContext:
        if self._ssl is None:
            self._ssl = self._make_ssl()
        return self._ssl

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
