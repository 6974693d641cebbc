"""Replies a caller gets from faults outside the request body: big headers, old HTTP versions, slow headers.

Each is a row of the one error table (server/errors.py), with its own truthful code, never a 429 or a 500.
"""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from server.errors import kind_by_status
from tests.helpers import internal_headers


@pytest.fixture(scope="module")
def http(gateway) -> httpx.Client:
    with httpx.Client(base_url=gateway.base_url, headers={"Authorization": f"Bearer {gateway.secret}"},
                      timeout=30) as client:
        yield client


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert not internal_headers(response.headers)
    error = response.json()["error"]
    kind = kind_by_status()[status]
    assert (error["code"], error["type"]) == (kind.code, kind.type)
    return error


@pytest.mark.parametrize("size_kb", [9, 14, 30, 55])
def test_headers_envoy_accepts_reach_the_server(http, size_kb):
    """A long cookie or JWT is no reason to refuse a request (gRPC's 8 KiB metadata limit used to make it a 429)."""
    response = http.get("/v1/models", headers={"cookie": "c=" + "x" * (size_kb * 1024)})
    assert response.status_code == 200, response.text
    assert response.json()["data"]


def test_headers_over_the_limit_are_431_naming_no_internals(http):
    response = http.get("/v1/models", headers={"cookie": "c=" + "x" * (70 * 1024)})
    error = _error(response, 431)
    assert error["code"] == "request_header_fields_too_large"
    assert "grpc" not in error["message"].lower() and "metadata" not in error["message"].lower()


@pytest.mark.parametrize("http2", [False, True])
def test_many_small_headers_envoy_accepts_reach_the_server(gateway, http2):
    """Envoy's default of 100 header fields refused 2 KiB of headers with a 431 claiming they were over 60 KiB (a
    tracing proxy's baggage, or HTTP/2 cookie crumbs, go past 100 fields quickly). 950 fields, 52 KiB in all, also
    fit the server's metadata limit, where grpc counts 32 bytes more per field."""
    headers = {"Authorization": f"Bearer {gateway.secret}", **{f"x-h{i:03}": "v" * 50 for i in range(950)}}
    with httpx.Client(base_url=gateway.base_url, http1=not http2, http2=http2, timeout=30) as client:
        response = client.get("/v1/models", headers=headers)
    assert response.status_code == 200, response.text
    assert response.http_version == ("HTTP/2" if http2 else "HTTP/1.1")


def test_too_many_header_fields_are_431_saying_so(http):
    response = http.get("/v1/models", headers={f"x-h{i}": "v" for i in range(1100)})
    error = _error(response, 431)
    assert "1,000 header fields" in error["message"]


def _raw(gateway, request: bytes) -> tuple[int, dict[str, str], dict]:
    """Status, headers (lowercase names) and JSON body of the answer to bytes sent as they are."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=10) as conn:
        conn.sendall(request)
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    headers = {name.strip().lower(): value.strip() for name, _, value in (line.partition(":") for line in lines)}
    return int(status_line.split(" ")[1]), headers, json.loads(body)


def test_an_oversized_url_is_431(gateway):
    status, _, body = _raw(gateway, b"GET /v1/models?q=" + b"x" * (70 * 1024) + b" HTTP/1.1\r\nHost: portico\r\n"
                           b"Connection: close\r\n\r\n")
    assert status == 431 and body["error"]["code"] == "request_header_fields_too_large"


def test_a_websocket_upgrade_is_400_saying_so(gateway):
    """A WebSocket client (an OpenAI Realtime client, say) got Envoy's 403 as `permission_denied`, blaming its key."""
    status, headers, body = _raw(gateway, b"GET /v1/realtime HTTP/1.1\r\nHost: portico\r\nConnection: Upgrade\r\n"
                                 b"Upgrade: websocket\r\nSec-WebSocket-Version: 13\r\n"
                                 b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
    assert status == 400 and headers["x-request-id"]
    assert body["error"]["code"] == "invalid_request" and body["error"]["type"] == "invalid_request_error"
    assert "WebSocket" in body["error"]["message"]


@pytest.mark.parametrize("request_line", [b"GET /v1/models", b"POST /v1/chat/completions"])
@pytest.mark.parametrize("upgrade", [b"connect-udp", b"CONNECT-UDP"])
def test_a_connect_udp_upgrade_is_the_400_of_every_upgrade(gateway, request_line, upgrade):
    """`Upgrade: connect-udp` (a MASQUE client, RFC 9298) was a 404 `not_found` saying the request's target "is not
    a path", though it was one: Envoy reads the path as a UDP proxy's target template before any filter."""
    status, headers, body = _raw(gateway, request_line + b" HTTP/1.1\r\nHost: portico\r\nConnection: Upgrade\r\n"
                                 b"Upgrade: " + upgrade + b"\r\nContent-Length: 2\r\n\r\n{}")
    assert status == 400 and headers["x-request-id"]
    assert body["error"]["code"] == "invalid_request" and body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"].startswith("Connection upgrades (WebSocket) are not supported")


@pytest.mark.parametrize("version", [b"HTTP/1.0", b"HTTP/1.2"])
def test_http_1_0_is_426_http_version_not_supported(gateway, version):
    status, _, body = _raw(gateway, b"GET /v1/models %s\r\nHost: portico\r\n\r\n" % version)
    assert status == 426
    assert body["error"]["code"] == "http_version_not_supported"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["message"] == "This HTTP version is not supported: use HTTP/1.1 or HTTP/2."


# Requests Envoy's HTTP codec refuses before its filters (and so the path and a request id) ever see them.
_REFUSED_BY_THE_CODEC = {
    426: b"POST /v1/messages HTTP/1.0\r\nHost: portico\r\nContent-Length: 2\r\n\r\n{}",
    431: b"POST /v1/messages HTTP/1.1\r\nHost: portico\r\nCookie: c=" + b"x" * (62 * 1024) +
         b"\r\nContent-Length: 2\r\n\r\n{}",
    400: b"POST /v1/messages HTTP/1.1\r\nHost: portico\r\nnot a header line\r\n\r\n",
}


@pytest.mark.parametrize("status", sorted(_REFUSED_BY_THE_CODEC))
def test_replies_the_codec_makes_carry_a_request_id(gateway, status):
    """api.md: every answer carries x-request-id, also one Envoy made before it had read the request."""
    got, headers, body = _raw(gateway, _REFUSED_BY_THE_CODEC[status])
    assert got == status and body["error"]["code"] == kind_by_status()[status].code
    assert headers.get("x-request-id")


@pytest.mark.parametrize("status", sorted(_REFUSED_BY_THE_CODEC))
def test_replies_the_codec_makes_on_v1_messages_carry_the_top_level_type(gateway, status):
    """The Anthropic shape on /v1/messages, like every other error there: Envoy cannot know the path, so these
    replies take it on every path (OpenAI clients read only "error")."""
    _, headers, body = _raw(gateway, _REFUSED_BY_THE_CODEC[status])
    assert headers["content-type"].startswith("application/json")
    assert body["type"] == "error"
    assert set(body["error"]) == {"message", "type", "param", "code"}


@pytest.mark.parametrize("coding", [b"gzip, chunked", b"bogus"])
def test_a_transfer_coding_envoy_cannot_read_is_400_saying_so(gateway, coding):
    """Envoy's codec answers a transfer coding other than chunked with 501, which read as a 500 `internal_error`
    ("The server had an error"): a server fault for what the caller sent."""
    status, headers, body = _raw(gateway, b"POST /v1/chat/completions HTTP/1.1\r\nHost: portico\r\n"
                                 b"Content-Type: application/json\r\nTransfer-Encoding: " + coding +
                                 b"\r\n\r\n2\r\n{}\r\n0\r\n\r\n")
    assert status == 400 and headers["x-request-id"]
    assert body["error"]["code"] == "invalid_request" and body["error"]["type"] == "invalid_request_error"
    assert "Transfer-Encoding" in body["error"]["message"]


def test_a_malformed_chunked_body_is_400_not_called_bad_json(gateway):
    """A chunk size that is not hexadecimal breaks the HTTP framing: the JSON inside was never read."""
    status, _, body = _raw(gateway, b"POST /v1/chat/completions HTTP/1.1\r\nHost: portico\r\n"
                           b"Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                           b"zz\r\n{}\r\n0\r\n\r\n")
    assert status == 400 and body["error"]["code"] == "invalid_request"
    assert "JSON" not in body["error"]["message"]


def test_every_file_in_the_data_dir_is_private(http, gateway, tmp_path):
    """Keys (hashes), the ledger, images and logs are for the service's user alone."""
    made = http.post("/v1/images/generations", json={"model": "family-a-image-2", "prompt": "a lighthouse",
                                                      "size": "256x256", "response_format": "url"})
    assert made.status_code == 200, made.text
    assert http.get("/v1/models").status_code == 200
    paths = [gateway.data_dir, *gateway.data_dir.rglob("*")]
    assert any(p.name == "keys.db" for p in paths) and any(p.parent.name == "images" for p in paths)
    loose = [f"{p} {p.stat().st_mode & 0o777:o}" for p in paths if p.exists() and p.stat().st_mode & 0o077]
    assert not loose

    # What an older version left readable is tightened on the next start (here: any CLI command).
    data_dir = tmp_path / "old"
    data_dir.mkdir(mode=0o755)
    (data_dir / "keys.db").touch(mode=0o644)
    (data_dir / "keys.db").chmod(0o644)
    data_dir.chmod(0o755)
    gateway.__class__(0, 0, "", data_dir, tmp_path / "unused.log").cli("keys", "list")
    assert data_dir.stat().st_mode & 0o777 == 0o700
    assert {p.name: p.stat().st_mode & 0o777 for p in data_dir.iterdir()}["keys.db"] == 0o600


def test_replies_envoy_makes_itself_are_in_the_access_log(http, gateway):
    """Unknown URLs, oversize headers, bad HTTP: the server never sees them, Envoy's access log has them, under the
    request id their caller got."""
    marker = "envoy-reply-" + str(time.time_ns())
    log = gateway.data_dir / "envoy-access.log"
    assert http.get("/v1/nothing-here", headers={"x-request-id": marker + "-404"}).status_code == 404
    too_big = http.get("/v1/models", headers={"x-request-id": marker + "-431", "cookie": "c=" + "x" * (70 * 1024)})
    assert too_big.status_code == 431
    too_big_id = too_big.headers["x-request-id"]  # Envoy's own: it never read the caller's
    assert http.get("/v1/models", headers={"x-request-id": marker + "-200"}).status_code == 200
    deadline = time.monotonic() + 3  # Envoy flushes its access-log lines every second (its default is ten)

    def both_logged() -> bool:
        text = log.read_text() if log.exists() else ""
        return marker + "-404" in text and too_big_id in text

    while time.monotonic() < deadline and not both_logged():
        time.sleep(0.2)
    lines = {line["request_id"]: line for line in map(json.loads, log.read_text().splitlines())
             if (line["request_id"] or "").startswith(marker) or line["request_id"] == too_big_id}
    assert lines[marker + "-404"]["status"] == 404 and lines[marker + "-404"]["code"] == "not_found"
    assert lines[marker + "-404"]["source"] == "envoy" and lines[marker + "-404"]["request"] == "GET /v1/nothing-here"
    assert lines[too_big_id]["status"] == 431 and lines[too_big_id]["code"] == "request_header_fields_too_large"
    assert lines[too_big_id]["request"] is None  # Envoy could not read it
    assert marker + "-200" not in lines  # the server's own access log has that one
