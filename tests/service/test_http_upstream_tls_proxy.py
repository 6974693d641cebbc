"""The upstreams' HTTP client (server/providers/http_upstream.py) over HTTPS and through the environment's proxies:
a TLS upstream whose certificate a throwaway CA signed (trusted through SSL_CERT_FILE, refused without it), an HTTP
forward proxy (HTTP_PROXY, NO_PROXY, credentials in its URL) and an HTTPS tunnel through it (HTTPS_PROXY, CONNECT).
The environment is read when an HttpUpstream is built, so each test sets it first."""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import ssl
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from server.errors import ServiceUnavailable, UpstreamError
from tests.service.test_http_upstream import KEY, Upstream, client, eventually, read_until_done, whole


@pytest.fixture(scope="session")
def certificates(tmp_path_factory) -> Path:
    """A folder with ca.pem, and server.pem + server.key for 127.0.0.1 and localhost signed by it (other.pem +
    other.key: signed by it too, for another host name only)."""
    folder = tmp_path_factory.mktemp("tls")
    usage = ("basicConstraints = critical, CA:FALSE\nkeyUsage = critical, digitalSignature\n"
             "extendedKeyUsage = serverAuth\nsubjectKeyIdentifier = hash\nauthorityKeyIdentifier = keyid\n")
    (folder / "server.ext").write_text("subjectAltName = IP:127.0.0.1, DNS:localhost\n" + usage)
    (folder / "other.ext").write_text("subjectAltName = DNS:upstream.internal\n" + usage)
    key = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for command in (
        ["req", "-x509", *key, "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=Portico test CA",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        *(step for name in ("server", "other") for step in (
            ["req", *key, "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}"],
            ["x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", f"{name}.ext", "-out", f"{name}.pem"])),
    ):
        subprocess.run(["openssl", *command], cwd=folder, check=True, capture_output=True)
    return folder


@pytest.fixture(autouse=True)
def no_proxy_settings(monkeypatch) -> None:
    """No proxy from the machine's own environment (either case); CGI's REQUEST_METHOD would hide HTTP_PROXY."""
    for name in list(os.environ):
        if name.lower().endswith("_proxy") or name == "REQUEST_METHOD":
            monkeypatch.delenv(name)


@pytest.fixture
def trusted(certificates, monkeypatch) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(certificates / "ca.pem"))


class TlsUpstream(Upstream):
    """The keep-alive Upstream, behind TLS with the CA-signed certificate (`name`: server, or other)."""

    def __init__(self, certificates: Path, name: str = "server") -> None:
        super().__init__()
        self._context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        self._context.load_cert_chain(certificates / f"{name}.pem", certificates / f"{name}.key")

    async def start(self) -> TlsUpstream:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0, ssl=self._context)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}/v1"


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, tap: bytearray | None = None) -> None:
    """Bytes from `reader` to `writer` (and into `tap`) until either side ends; then `writer` is closed."""
    try:
        while data := await reader.read(65536):
            if tap is not None:
                tap += data
            writer.write(data)
            await writer.drain()
    except ConnectionError:
        pass
    finally:
        writer.close()


class Proxy:
    """An HTTP forward proxy on 127.0.0.1. It records each request's line and headers; an absolute-form request goes
    on in origin form to its host (one connection there per client connection, whose answers are relayed as they
    come), a CONNECT opens a tunnel whose client-to-upstream bytes are kept in `tunnelled`."""

    def __init__(self) -> None:
        self.accepted = 0
        self.seen: list[tuple[str, str, dict[str, str]]] = []
        self.tunnelled = bytearray()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._relays: set[asyncio.Task] = set()

    async def start(self) -> Proxy:
        self._server = await asyncio.start_server(self._connection, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def stop(self) -> None:
        self._server.close()
        for task in list(self._relays):
            task.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)

    def url(self, credentials: str = "") -> str:
        return f"http://{credentials}127.0.0.1:{self.port}"

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.accepted += 1
        self._relays.add(asyncio.current_task())
        onward: asyncio.StreamWriter | None = None
        try:
            while True:
                head = (await reader.readuntil(b"\r\n\r\n")).decode()
                line, _, rest = head.partition("\r\n")
                method, target, _ = line.split(" ")
                fields = (field.split(": ", 1) for field in rest.split("\r\n") if field)
                headers = {name.lower(): value for name, value in fields}
                self.seen.append((method, target, headers))
                if method == "CONNECT":
                    host, port = target.rsplit(":", 1)
                    back, onward = await asyncio.open_connection(host, int(port))
                    writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                    await asyncio.gather(pipe(reader, onward, self.tunnelled), pipe(back, writer))
                    return
                url = urlsplit(target)
                if onward is None:
                    back, onward = await asyncio.open_connection(url.hostname, url.port)
                    relay = asyncio.create_task(pipe(back, writer))
                    self._relays.add(relay)
                    relay.add_done_callback(self._relays.discard)
                body = await reader.readexactly(int(headers.get("content-length", 0)))
                target = url.path + (f"?{url.query}" if url.query else "")
                onward.write(f"{method} {target} HTTP/1.1\r\n{rest}".encode() + body)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the client closed the connection
        finally:
            self._relays.discard(asyncio.current_task())
            if onward is not None:
                onward.close()
            writer.close()


@pytest.fixture
async def tls(certificates):
    upstream = await TlsUpstream(certificates).start()
    yield upstream
    await upstream.stop()


@pytest.fixture
async def plain():
    upstream = await Upstream().start()
    yield upstream
    await upstream.stop()


@pytest.fixture
async def proxy():
    server = await Proxy().start()
    yield server
    await server.stop()


async def test_https_verifies_the_certificate_against_ssl_cert_file_and_keeps_one_connection(tls, trusted):
    http = client(tls.url)
    try:
        for _ in range(3):
            assert [event.data for event in await read_until_done(http)] == [b'{"n":1}', b'{"n":2}']
            await eventually(lambda: not http._settling)  # the body's end may come after [DONE], in a TLS record
        tls.answers.append(whole(200, b'{"data": []}'))
        assert await http.post_json("images/generations", {"p": 1}, model_id="up") == {"data": []}
        tls.answers.append(whole(200, b"\x89PNG..."))
        link = f"https://127.0.0.1:{tls.port}/files/a.png"
        assert await http.fetch(link, model_id="up", media_type="image") == b"\x89PNG..."
    finally:
        await http.close()
    assert tls.accepted == 1
    assert [(method, path) for method, path, _, _ in tls.seen] == [("POST", "/v1/chat/completions")] * 3 + [
        ("POST", "/v1/images/generations"), ("GET", "/files/a.png")]
    assert all(headers["authorization"] == f"Bearer {KEY}" for _, _, headers, _ in tls.seen[:4])
    assert "authorization" not in tls.seen[4][2]


async def test_https_with_a_certificate_from_an_unknown_ca_fails_without_showing_the_key(tls, monkeypatch, caplog):
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)  # the system's CAs and certifi's: not the test CA
    http = client(tls.url)
    try:
        for _ in range(2):
            with pytest.raises(ServiceUnavailable) as caught:
                await read_until_done(http)
    finally:
        await http.close()
    assert type(caught.value) is ServiceUnavailable and caught.value.retry_reason == "connect"
    assert "`up`" in str(caught.value) and KEY not in str(caught.value)
    assert tls.seen == []
    # The caller's message names no host; the operator's one line does, with what OpenSSL found and what to do.
    # Only the access log's status said so before, and the operator learnt why from a caller.
    (line,) = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert f"https://127.0.0.1:{tls.port}" in line and "`up`" in line and "SSL_CERT_FILE" in line, line
    assert "unable to get local issuer certificate" in line and KEY not in line, line


async def test_https_to_a_certificate_for_another_host_name_says_so_in_the_log(certificates, trusted, caplog):
    upstream = await TlsUpstream(certificates, "other").start()
    http = client(upstream.url)
    try:
        with pytest.raises(ServiceUnavailable) as caught:
            await read_until_done(http)
    finally:
        await http.close()
        await upstream.stop()
    assert "TLS certificate is not trusted" in str(caught.value) and "127.0.0.1" not in str(caught.value)
    (line,) = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert f"https://127.0.0.1:{upstream.port}" in line and "IP address mismatch" in line, line


async def test_https_to_a_server_that_speaks_plain_http_says_so_in_the_log(caplog):
    """A base URL written https:// for a plain HTTP server: the caller's 503 says the TLS handshake failed; the log
    line names the upstream and that it may not speak TLS."""
    async def plain_http(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(1)  # the ClientHello, answered as an HTTP server answers bytes that are no request
        writer.write(b"HTTP/1.1 400 Bad Request\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(plain_http, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    http = client(f"https://127.0.0.1:{port}/v1")
    try:
        with pytest.raises(ServiceUnavailable) as caught:
            await read_until_done(http)
    finally:
        await http.close()
        server.close()
    assert "the TLS handshake failed" in str(caught.value)
    (line,) = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    assert f"https://127.0.0.1:{port}" in line and "http://" in line, line


async def test_http_proxy_from_the_environment_gets_absolute_form_requests_and_its_credentials(
        plain, proxy, monkeypatch):
    monkeypatch.setenv("HTTP_PROXY", proxy.url("porter:s3cret@"))
    http = client(plain.url)
    try:
        for _ in range(2):
            assert len(await read_until_done(http)) == 2
        plain.answers.append(whole(200, b'{"data": []}'))
        assert await http.post_json("images/generations", {}, model_id="up") == {"data": []}
        plain.answers.append(whole(200, b"\x89PNG..."))
        link = f"http://127.0.0.1:{plain.port}/files/a.png"
        assert await http.fetch(link, model_id="up", media_type="image") == b"\x89PNG..."
    finally:
        await http.close()
    origin = f"http://127.0.0.1:{plain.port}"
    assert [(method, target) for method, target, _ in proxy.seen] == [("POST", f"{origin}/v1/chat/completions")] * 2 + [
        ("POST", f"{origin}/v1/images/generations"), ("GET", f"{origin}/files/a.png")]
    basic = "Basic " + base64.b64encode(b"porter:s3cret").decode()
    assert all(headers["proxy-authorization"] == basic for _, _, headers in proxy.seen)
    assert all(headers["authorization"] == f"Bearer {KEY}" for _, _, headers in proxy.seen[:3])
    assert "authorization" not in proxy.seen[3][2]  # a link is fetched without the key, through the proxy too
    assert [path for _, path, _, _ in plain.seen] == ["/v1/chat/completions"] * 2 + [
        "/v1/images/generations", "/files/a.png"]
    assert (proxy.accepted, plain.accepted) == (1, 1)  # kept alive through the proxy


async def test_a_link_through_the_proxy_is_judged_by_where_its_host_resolves(plain, proxy, monkeypatch):
    """Through a proxy the proxy connects, but a link a public upstream sent into the gateway's loopback (in any
    spelling) is refused all the same, and the proxy is not asked: it would reach 127.0.0.1 on its host, or ours."""
    monkeypatch.setenv("HTTP_PROXY", proxy.url())
    http = client("http://93.184.215.14/v1")
    try:
        for host in ("127.0.0.1", "2130706433", "localhost"):
            with pytest.raises(UpstreamError, match="points at an address Portico does not fetch from"):
                await http.fetch(f"http://{host}:{plain.port}/files/a.png", model_id="up", media_type="image")
    finally:
        await http.close()
    assert (proxy.accepted, plain.accepted) == (0, 0)


@pytest.mark.parametrize("name", ["HTTP_PROXY", "http_proxy", "ALL_PROXY"])
async def test_a_proxy_named_without_a_scheme_is_an_http_proxy_as_httpx_and_curl_take_it(
        plain, proxy, monkeypatch, name):
    """`HTTP_PROXY=proxy.corp:3128`, as many environment files write it (curl, requests and httpx read it as
    http://proxy.corp:3128): the upstream was asked directly, without a word, where only the proxy may reach it."""
    monkeypatch.setenv(name, proxy.url("porter:s3cret@").removeprefix("http://"))
    http = client(plain.url)
    try:
        assert len(await read_until_done(http)) == 2
    finally:
        await http.close()
    [(method, target, headers)] = proxy.seen
    assert (method, target) == ("POST", f"http://127.0.0.1:{plain.port}/v1/chat/completions")
    assert headers["proxy-authorization"] == "Basic " + base64.b64encode(b"porter:s3cret").decode()


@pytest.mark.parametrize("settings", [
    {"HTTP_PROXY": "{proxy}", "NO_PROXY": "127.0.0.1"},
    {"http_proxy": "{proxy}", "no_proxy": "localhost,127.0.0.1"},
    {"HTTPS_PROXY": "{proxy}"},  # for https only
], ids=["NO_PROXY", "no_proxy", "HTTPS_PROXY"])
async def test_a_host_the_proxy_settings_leave_out_is_reached_directly(plain, proxy, monkeypatch, settings):
    for name, value in settings.items():
        monkeypatch.setenv(name, value.format(proxy=proxy.url()))
    http = client(plain.url)
    try:
        await read_until_done(http)
    finally:
        await http.close()
    assert proxy.accepted == 0 and len(plain.seen) == 1


async def test_https_through_a_connect_tunnel_kept_alive_for_every_request(tls, trusted, proxy, monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", proxy.url("porter:s3cret@"))
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:1")  # for http only: nothing listens there
    http = client(tls.url)
    try:
        for _ in range(3):
            assert len(await read_until_done(http)) == 2
            await eventually(lambda: not http._settling)
        tls.answers.append(whole(200, b'{"data": []}'))
        assert await http.post_json("images/generations", {}, model_id="up") == {"data": []}
    finally:
        await http.close()
    [(method, target, headers)] = proxy.seen
    assert (method, target) == ("CONNECT", f"127.0.0.1:{tls.port}")
    assert headers["proxy-authorization"] == "Basic " + base64.b64encode(b"porter:s3cret").decode()
    assert (proxy.accepted, tls.accepted, len(tls.seen)) == (1, 1, 4)
    assert tls.seen[0][2]["authorization"] == f"Bearer {KEY}"
    assert len(proxy.tunnelled) > 1000 and KEY.encode() not in proxy.tunnelled  # encrypted end to end
    assert b"chat/completions" not in proxy.tunnelled


def test_a_proxys_password_is_not_in_its_repr():
    """The proxy and its `proxy-authorization` (user:password in base64) key the connection pools: a pool or proxy
    shown with %r, or in a traceback's locals, gave the password away."""
    from server.providers.http_client import Proxy

    proxy = Proxy.of("http://portico:s3cret-pw@proxy.example:3128")
    assert proxy.authorization == "Basic " + base64.b64encode(b"portico:s3cret-pw").decode()
    assert proxy.authorization not in repr(proxy) and "proxy.example" in repr(proxy)
