"""Replies Envoy makes itself (bad JSON, wrong types, unknown paths, oversize bodies) carry the error object too;
requests whose headers never complete are cut off; a gRPC call on a REST path is refused in gRPC's own terms."""

from __future__ import annotations

import gzip
import json
import socket
import time

import grpc
import h2.config
import h2.connection
import h2.events
import httpx
import pytest

from tests.helpers import internal_headers


@pytest.fixture(scope="module")
def http(gateway) -> httpx.Client:
    with httpx.Client(base_url=gateway.base_url, headers={"Authorization": f"Bearer {gateway.secret}"},
                      timeout=30) as client:
        yield client


def _exchange(gateway, request: bytes) -> bytes:
    """`request` sent as raw bytes, and the answer read up to the end of its error object (a socket timeout, no
    answer, fails the test)."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5.0) as conn:
        conn.sendall(request)
        answer = b""
        while b"}}" not in answer:
            chunk = conn.recv(4096)
            if not chunk:
                break
            answer += chunk
    return answer


def _assert_error(response: httpx.Response, status: int, code: str, *, anthropic: bool = False) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert not internal_headers(response.headers)
    body = response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["code"] == code and body["error"]["message"]
    assert (body.get("type") == "error") == anthropic
    return body["error"]


def test_bad_json_is_400(http):
    response = http.post("/v1/chat/completions", content=b'{"model": "family-a-5.5", "messages": [',
                         headers={"content-type": "application/json"})
    _assert_error(response, 400, "invalid_request")


def test_a_body_that_is_not_utf8_is_400_saying_where(http):
    """A Latin-1 byte in a string was "str is not valid UTF-8: surrogates not allowed: line 1 column 1 (char 0)":
    no surrogate was sent, and the place named was the body's start."""
    body = b'{"model": "family-a-5.5", "messages": [{"role": "user", "content": "caf\xe9"}]}'
    error = _assert_error(http.post("/v1/chat/completions", content=body,
                                    headers={"content-type": "application/json"}), 400, "invalid_request")
    assert error["message"] == "Invalid JSON body: it is not valid UTF-8 (byte 0xe9 at position 71)."
    assert error["param"] == "messages[0].content"  # the string, as a typed gRPC request's is named


@pytest.mark.parametrize("opening", [b"[", b'{"a":'])
def test_a_body_nested_10000_levels_deep_is_400_saying_so(http, opening):
    """Past orjson's own limit (1,024 levels) the 400 said "depth limit exceeded: line 1 column 1112", not the
    documented limit of 32 levels."""
    closing = b"]" if opening == b"[" else b"}"
    body = b'{"model": "family-a-5.5", "x": ' + opening * 10_000 + b"1" + closing * 10_000 + b"}"
    error = _assert_error(http.post("/v1/chat/completions", content=body,
                                    headers={"content-type": "application/json"}), 400, "invalid_request")
    assert error["message"] == "The request body is nested more than 32 levels deep."


@pytest.mark.parametrize(("path", "anthropic"), [("/v1/chat/completions", False), ("/v1/messages", True)])
def test_a_compressed_body_is_400_saying_so(http, path, anthropic):
    """A gzip body was read as JSON text: "str is not valid UTF-8", which says nothing of the cause."""
    body = json.dumps({"model": "family-a-5.5", "max_tokens": 4, "messages": [{"role": "user", "content": "x"}]})
    response = http.post(path, content=gzip.compress(body.encode()),
                         headers={"content-type": "application/json", "content-encoding": "gzip"})
    error = _assert_error(response, 400, "invalid_request", anthropic=anthropic)
    assert "Content-Encoding: gzip" in error["message"] and "uncompressed" in error["message"]
    identity = http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json",
                                                                        "content-encoding": "identity"})
    assert identity.status_code == 200, identity.text


@pytest.mark.parametrize("headers", [[b"Content-Encoding: \r\n"], [b"Content-Encoding: identity, Identity\r\n"],
                                     [b"Content-Encoding: identity\r\n", b"Content-Encoding: identity\r\n"]])
def test_a_body_whose_content_encoding_names_no_coding_is_read(gateway, headers):
    """An empty Content-Encoding, or one listing only `identity` (twice, in two fields), says the body is as sent;
    it was refused as "Compressed request bodies are not supported (Content-Encoding: )"."""
    body = json.dumps({"model": "family-a-5.5", "max_tokens": 2,
                       "messages": [{"role": "user", "content": "x"}]}).encode()
    request = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: portico\r\nConnection: close\r\n"
               b"Authorization: Bearer " + gateway.secret.encode() + b"\r\nContent-Type: application/json\r\n"
               + b"".join(headers) + b"Content-Length: %d\r\n\r\n" % len(body) + body)
    answer = _exchange(gateway, request)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:600]


def test_wrong_type_is_400_naming_the_field(http):
    response = http.post("/v1/chat/completions",
                         json={"model": "family-a-5.5", "messages": [{"role": "user", "content": "x"}],
                               "temperature": "hot"})
    error = _assert_error(response, 400, "invalid_request")
    assert error["param"] == "temperature"


@pytest.mark.parametrize(("path", "param", "headers", "anthropic", "bounds"), [
    # (The anthropic SDK's models `limit` gets its own range's message: test_anthropic_sdk.py.)
    ("/v1/images/content/a.png?signature=x&expires=9223372036854775808", "expires", {}, False,
     "-9223372036854775808 to 9223372036854775807"),
])
def test_an_integer_out_of_range_is_not_called_a_non_integer(http, path, param, headers, anthropic, bounds):
    """Both were "expected an integer", about an integer."""
    error = _assert_error(http.get(path, headers=headers), 400, "invalid_request", anthropic=anthropic)
    assert error["param"] == param
    assert error["message"].endswith(f"for {param}: expected an integer from {bounds}."), error["message"]


@pytest.mark.parametrize("signature", ["%C3%A9", "%E2%82%AC" * 32])
def test_an_image_link_with_a_signature_that_is_not_ascii_is_not_valid_not_a_500(http, signature):
    """The name has the shape of a stored image's, so the signature is checked: the comparison took only ASCII."""
    error = _assert_error(http.get(f"/v1/images/content/{'a' * 24}.png?expires=9999999999&signature={signature}"),
                          404, "not_found")
    assert error["message"] == "This image link is not valid."


@pytest.mark.parametrize(("path", "param"), [
    ("/v1/models/%ff", "model"), ("/v1/admin/keys/caf%e9", "id"), ("/console/%c3", "path"),
    ("/v1/organization/costs?start_time=1&group_by=%ff", "group_by[0]"),
])
def test_a_url_that_is_not_utf8_once_decoded_is_400_saying_so(http, path, param):
    """`/v1/models/%ff` was "The request could not be decoded: model is not a valid protobuf encoding": the
    caller sent a URL, not protobuf."""
    error = _assert_error(http.get(path), 400, "invalid_request")
    assert error["message"] == f"The request could not be decoded: {param} is not valid UTF-8."
    assert error["param"] == param


@pytest.mark.parametrize("chunked", [False, True])
@pytest.mark.parametrize(("path", "body"), [
    ("/v1/organization/costs", b'{"start_time": 1}'),  # answered as if ?start_time=1, past the query's checks
    ("/v1/models/family-a-5.5", b"abc"),  # was "Invalid JSON body: Unexpected token."
])
def test_a_get_with_a_body_is_400_saying_to_use_the_query(http, path, body, chunked):
    """The transcoder read a GET's body as its request message: fields the query string's checks never saw."""
    content = iter([body]) if chunked else body
    error = _assert_error(http.request("GET", path, content=content), 400, "invalid_request")
    assert error["message"] == f"GET {path} takes no body: its parameters go in the URL."
    assert http.get("/v1/models/family-a-5.5", headers={"content-length": "0"}).status_code == 200


def test_unknown_path_is_404(http):
    _assert_error(http.post("/v1/nothing-here", json={}), 404, "not_found")
    _assert_error(http.get("/elsewhere"), 404, "not_found")


@pytest.mark.parametrize(("method", "path", "allow", "anthropic"), [
    ("GET", "/v1/chat/completions", "POST", False), ("PUT", "/v1/messages", "POST", True),
    ("DELETE", "/v1/messages/count_tokens", "POST", True), ("OPTIONS", "/v1/images/generations", "POST", False),
    ("POST", "/v1/models", "GET, HEAD", False), ("DELETE", "/v1/models/family-a-5.5", "GET, HEAD", False),
    ("PUT", "/v1/admin/keys", "GET, HEAD, POST", False), ("DELETE", "/v1/admin/keys/key_1", "GET, HEAD, PATCH", False),
    ("GET", "/v1/admin/keys/key_1/rotate", "POST", False), ("POST", "/v1/organization/costs", "GET, HEAD", False),
    ("POST", "/healthz", "GET, HEAD", False), ("PATCH", "/console/", "GET, HEAD", False),
    ("GET", "/v1/chat/completions/", "POST", False),
])
def test_a_method_a_known_path_does_not_take_is_named_with_the_ones_it_does(http, method, path, allow, anthropic):
    """`curl URL` without -d (a GET) on /v1/chat/completions was told "Unknown request URL", as if the path were
    mistyped. Still a 404 (as OpenAI's API answers a wrong method), but saying which methods the path takes, in the
    message and in an `allow` header."""
    response = http.request(method, path)
    error = _assert_error(response, 404, "not_found", anthropic=anthropic)
    takes = " or ".join(name for name in allow.split(", ") if name != "HEAD")
    assert error["message"] == f"{method} is not a method of {path}: it takes {takes}."
    assert response.headers["allow"] == allow


@pytest.mark.parametrize(("path", "query", "param", "anthropic"), [
    ("/v1/organization/costs/", "start_time=1&start_time=2", "start_time", False),
    ("/v1/organization/costs/", "start_time=1&bogus=1", "bogus", False),
    ("/v1/organization/requests/", "limit=1&limit=2", "limit", False),
    ("/v1/admin/keys/", "page_size=1&page_size=2", "page_size", False),
    ("/v1/models/", "limit=1&limit=2", "limit", True),
    # The transcoder serves any number of trailing slashes so: the checks skipped two or more.
    ("/v1/organization/costs//", "start_time=1&line_items=x", "line_items", False),
    ("/v1/organization/requests///", "limit=1&limit=2", "limit", False),
    ("/v1/models//", "limit=1&limit=2", "limit", True),
    ("/v1/models//", "lifecycle[]=bogus", "lifecycle", True),
])
def test_a_path_with_a_trailing_slash_gets_the_query_checks_of_the_path_without(http, path, query, param, anthropic):
    """The transcoder serves `/v1/organization/costs/` as `/v1/organization/costs`, but the query's checks looked
    the path up as sent: a parameter given twice got protobuf's words, `Invalid JSON body: invalid value oneof field
    '_start_time' is already set ...` with `param` null, and an unknown one was skipped instead of named."""
    headers = {"anthropic-version": "2023-06-01"} if anthropic else {}
    error = _assert_error(http.get(f"{path}?{query}", headers=headers), 400, "invalid_request", anthropic=anthropic)
    assert error["param"] == param
    assert "oneof" not in error["message"] and "JSON body" not in error["message"]


def test_an_unknown_path_says_so_and_allows_nothing(http):
    response = http.get("/v1/chat/completion")
    assert _assert_error(response, 404, "not_found")["message"] == "Unknown request URL: GET /v1/chat/completion."
    assert "allow" not in response.headers


@pytest.mark.parametrize(("method", "path"), [
    ("GET", "/v1/" + "y" * 5000),  # unknown
    ("DELETE", "/v1/models/" + "y" * 5000),  # a method the path does not take
    ("GET", "/v1/admin/keys/" + "y" * 5000 + "/rotate"),
])
def test_a_message_quoting_a_long_url_is_cut_to_2000_characters(http, method, path):
    """api.md: a message is at most 2,000 characters, what it quotes of the request cut short, ending in `…`. Envoy's
    404s quoted the whole URL (up to the 60 KiB of headers)."""
    response = http.request(method, path)
    message = _assert_error(response, 404, "not_found")["message"]
    assert len(message) == 2000 and message.endswith("y…")
    if method == "GET":
        assert http.head(path).headers["content-length"] == response.headers["content-length"]


@pytest.mark.parametrize("request_bytes", [
    b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Note: a\x00b\r\n\r\n",  # a NUL in a header
    b"GET /healthz HTTP/1.1\r\n\r\n",  # no Host
    b"get /healthz HTTP/1.1\r\nHost: x\r\n\r\n",  # a method in lower case
    b"GET /heal thz HTTP/1.1\r\nHost: x\r\n\r\n",  # a space in the path
    # a smuggling attempt: both framings (the GET hidden in the body must not be answered)
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"0\r\n\r\nGET /healthz HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 9\r\n\r\n{}",
])
def test_malformed_http_is_400_saying_so_and_the_connection_closes(gateway, request_bytes):
    """Envoy's codec refuses these before any filter sees them; the answer said only "The request is invalid."."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5.0) as conn:
        conn.sendall(request_bytes)
        answer = b""
        while chunk := conn.recv(4096):  # to the end: the connection closes, with one answer
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400 ") and b"\nHTTP/1.1 " not in answer  # one answer, no smuggled one
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_request"
    assert error["message"] == ("The request is not well-formed HTTP/1.1 (its request line, a header, or the body's "
                                "framing: Content-Length and Transfer-Encoding together, say).")


def test_connect_is_404_at_once(gateway):
    """CONNECT, as curl sends it when told the gateway is its proxy (`curl -x`): the body filter waited for the end
    of a tunnel that never ends, and the caller got nothing until Envoy's timeouts (minutes)."""
    answer = _exchange(gateway, b"CONNECT example.com:443 HTTP/1.1\r\nHost: example.com:443\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line, *lines = head.decode().split("\r\n")
    assert status_line == "HTTP/1.1 404 Not Found"
    headers = dict(line.lower().split(": ", 1) for line in lines)
    assert headers["request-id"] == headers["x-request-id"]
    error = json.loads(body)["error"]
    assert error["code"] == "not_found"
    assert error["message"] == "Unknown request URL: CONNECT example.com:443."


@pytest.mark.parametrize(("path", "content_type"), [
    ("/elsewhere", "application/json"), ("/", "application/json"), ("/healthzz", "application/json"),
    ("/v1/nothing-here", "application/json"), ("/v1/chat/completions", "application/grpc"),
])
def test_replies_envoy_makes_carry_the_request_id_twice(http, path, content_type):
    """api.md: every answer to a request Envoy read carries its id as `request-id` too (the anthropic SDK's
    header), also Envoy's own 404s outside the routes and its refusal of a gRPC call on a REST path."""
    response = http.post(path, content=b"{}", headers={"content-type": content_type, "x-request-id": "mine-1"})
    assert response.status_code == 404
    assert response.headers["x-request-id"] == response.headers.get("request-id") == "mine-1"


@pytest.mark.parametrize("content_type", [
    None, "application/x-www-form-urlencoded", "text/plain", "multipart/form-data; boundary=x",
    "application/json; charset=utf-8",
])
@pytest.mark.parametrize(("path", "model", "anthropic"), [
    ("/v1/chat/completions", "family-a-5.5", False), ("/v1/messages", "family-b-haiku-4-5-20251001", True),
])
def test_a_json_body_is_read_whatever_its_content_type_says(http, content_type, path, model, anthropic):
    """api.md, Request bodies: the body is JSON whatever `content-type` says (`curl -d` labels it a form); a body
    that is not JSON is the 400 of bad JSON under any label."""
    headers = {"content-type": content_type} if content_type else {}
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    response = http.post(path, content=json.dumps(body).encode(), headers=headers)
    assert response.status_code == 200, response.text
    assert response.json()["model"] == model
    error = _assert_error(http.post(path, content=b"model=" + model.encode(), headers=headers), 400,
                          "invalid_request", anthropic=anthropic)
    assert error["message"].startswith("Invalid JSON body")


@pytest.mark.parametrize("content_type", [b"text/plain; charset=\xe9", b"application/json\x80"])
@pytest.mark.parametrize(("path", "model"), [
    ("/v1/chat/completions", "family-a-5.5"), ("/v1/messages", "family-b-haiku-4-5-20251001"),
    ("/v1/messages/count_tokens", "family-b-haiku-4-5-20251001"),
])
def test_a_json_body_is_read_whatever_bytes_its_content_type_holds(http, content_type, path, model):
    """A content-type that is not UTF-8 (a Latin-1 byte) was a 400 "The request could not be decoded: content_type
    is not valid UTF-8", `param` `content_type`: the name of the field of google.api.HttpBody that the transcoder
    copies the header into, no field of the caller's body; the body is read whatever the header says."""
    body = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]}
    response = http.post(path, content=json.dumps(body).encode(), headers={"content-type": content_type})
    assert response.status_code == 200, response.text
    assert response.json()["input_tokens" if path.endswith("count_tokens") else "model"]


def test_oversize_body_is_413(http):
    big = "x" * (9 * 1024 * 1024)
    response = http.post("/v1/chat/completions",
                         json={"model": "family-a-5.5", "messages": [{"role": "user", "content": big}]})
    _assert_error(response, 413, "request_too_large")


@pytest.mark.parametrize("path, anthropic", [("/v1/chat/completions", False), ("/v1/messages", True)])
def test_a_body_announced_over_the_cap_is_413_before_it_is_sent(gateway, path, anthropic):
    """A content-length over 8 MiB is refused on the headers: a client that then sent nothing got no answer at all,
    Envoy waiting for the body (and one that sends it would have 8 MiB read first)."""
    head = (f"POST {path} HTTP/1.1\r\nHost: portico\r\nAuthorization: Bearer {gateway.secret}\r\n"
            "Content-Type: application/json\r\nContent-Length: 9000000\r\n\r\n")
    answer = _exchange(gateway, head.encode())
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line == b"HTTP/1.1 413 Payload Too Large"
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert body["error"]["code"] == "request_too_large" and (body.get("type") == "error") == anthropic


def test_messages_path_errors_carry_top_level_type(http):
    response = http.post("/v1/messages?beta=true", content=b"{not json", headers={"content-type": "application/json"})
    _assert_error(response, 400, "invalid_request", anthropic=True)
    response = http.post("/v1/messages", json={"model": "family-b-opus-4-6", "messages": []},
                         headers={"x-api-key": "pk-nope", "Authorization": ""})
    _assert_error(response, 401, "invalid_api_key", anthropic=True)


def test_admin_keys_over_rest_need_an_admin_key(http, gateway):
    _assert_error(http.get("/v1/admin/keys"), 403, "permission_denied")
    created = gateway.cli("keys", "create", "--name", "ops", "--all-models", "--admin")
    admin = {"Authorization": f"Bearer {created.stdout.strip().splitlines()[-1]}"}
    listed = http.get("/v1/admin/keys", headers=admin)
    assert listed.status_code == 200
    assert "ops" in {key["name"] for key in listed.json()["keys"]}
    made = http.post("/v1/admin/keys", headers=admin, json={"name": "via-rest", "models": ["family-a-5.5"]})
    assert made.status_code == 200 and made.json()["secret"].startswith("pk-")
    key_id = made.json()["key"]["id"]
    revoked = http.post(f"/v1/admin/keys/{key_id}/revoke", headers=admin)
    assert revoked.json()["key"]["revoked_at"] > 0
    _assert_error(http.get("/v1/admin/keys/key_missing", headers=admin), 404, "not_found")


def test_a_revoke_with_a_body_naming_another_key_revokes_nothing(http, gateway):
    """POST /v1/admin/keys/A/revoke with {"id": "B"} revoked key B: the transcoder read the body into the request
    message, over the URL's id. The route takes no body; one is refused, and neither key is revoked."""
    created = gateway.cli("keys", "create", "--name", "ops-revoke", "--all-models", "--admin")
    admin = {"Authorization": f"Bearer {created.stdout.strip().splitlines()[-1]}"}
    first, second = (http.post("/v1/admin/keys", headers=admin, json={"name": name, "all_models": True})
                     .json()["key"]["id"] for name in ("first", "second"))
    path = f"/v1/admin/keys/{first}/revoke"
    error = _assert_error(http.post(path, headers=admin, json={"id": second}), 400, "invalid_request")
    assert error["message"] == f"POST {path} takes no body: its parameters go in the URL."
    for key_id in (first, second):
        assert http.get(f"/v1/admin/keys/{key_id}", headers=admin).json()["key"]["revoked_at"] == 0
    # An empty object names nothing: the console and SDKs send `{}` with a POST that has no parameters.
    assert http.post(path, headers=admin, json={}).json()["key"]["revoked_at"] > 0
    assert http.get(f"/v1/admin/keys/{second}", headers=admin).json()["key"]["revoked_at"] == 0


def test_a_get_with_a_body_on_an_unknown_url_is_still_a_404(http):
    """The check for a body where none belongs is of known routes only: an unknown URL stays a 404."""
    _assert_error(http.request("GET", "/v1/nothing/here", json={"model": "m"}), 404, "not_found")


def test_a_request_whose_headers_trickle_in_is_cut_off(gateway):
    """Slowloris: a byte of header every second would keep a connection open for ever; Envoy allows 10 s."""
    started = time.monotonic()
    answer = b""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=1.0) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: portico\r\nX-Slow: ")
        while time.monotonic() - started < 20:
            try:
                chunk = conn.recv(4096)
            except TimeoutError:
                conn.sendall(b"x")  # never a complete header line
                continue
            except OSError:
                break
            if not chunk:
                break
            answer += chunk
    assert 9 <= time.monotonic() - started < 15
    assert answer.startswith(b"HTTP/1.1 408")
    assert b"\"code\":\"request_timeout\"" in answer


# (method, path) of REST paths, known and unknown, that a gRPC caller might call by mistake.
_REST_PATHS = [("POST", "/v1/chat/completions"), ("POST", "/v1/messages"), ("GET", "/v1/models"),
               ("POST", "/v1/nothing-here"), ("GET", "/healthz")]


@pytest.mark.parametrize(("method", "path"), _REST_PATHS)
@pytest.mark.parametrize("content_type", ["application/grpc", "application/grpc+proto"])
def test_grpc_content_on_a_rest_path_is_a_clean_unimplemented(http, method, path, content_type):
    """curl -H 'content-type: application/grpc' on a REST path: not a 200 with Envoy's reset text, but a 404 that
    gRPC clients read as UNIMPLEMENTED, naming the path and what to do instead."""
    for auth in ({}, {"Authorization": ""}):  # with the key, and without
        response = http.request(method, path, content=b"{}", headers={"content-type": content_type, **auth})
        assert response.status_code == 404
        assert response.headers["content-type"] == "application/grpc"
        assert response.headers["grpc-status"] == str(grpc.StatusCode.UNIMPLEMENTED.value[0])
        message = response.headers["grpc-message"]
        assert path in message and "JSON" in message and "portico.v1" in message
        assert "reset" not in message and "upstream" not in message
        assert response.headers["x-request-id"]
        assert not [name for name in response.headers if name.startswith("portico-")]
        assert response.content == b""


@pytest.mark.parametrize("content_type", ["application/grpc-web", "application/grpc; charset=utf-8"])
def test_content_types_that_are_not_grpc_keep_the_json_error_object(http, content_type):
    """Only what Envoy takes for gRPC (application/grpc, application/grpc+...) is answered in gRPC's terms."""
    response = http.get("/v1/models", headers={"content-type": content_type, "Authorization": ""})
    _assert_error(response, 401, "invalid_api_key")


def test_a_grpc_client_on_a_rest_path_gets_unimplemented_naming_it(gateway):
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        call = channel.unary_unary("/v1/chat/completions", request_serializer=bytes, response_deserializer=bytes)
        with pytest.raises(grpc.RpcError) as caught:
            call(b"", metadata=(("authorization", f"Bearer {gateway.secret}"),), timeout=10)
    assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert "/v1/chat/completions is a REST path" in caught.value.details()


def test_a_grpc_call_on_a_rest_path_is_in_the_access_log(http, gateway):
    """The server never sees it: Envoy logs it, like its other replies."""
    request_id = "grpc-on-rest-" + str(time.time_ns())
    response = http.post("/v1/models", content=b"", headers={"content-type": "application/grpc",
                                                             "x-request-id": request_id})
    assert response.headers["grpc-status"] == "12"
    log = gateway.data_dir / "envoy-access.log"
    deadline = time.monotonic() + 15  # each Envoy worker flushes its access-log lines every second or so
    while time.monotonic() < deadline and request_id not in (log.read_text() if log.exists() else ""):
        time.sleep(0.2)
    line = next(json.loads(line) for line in log.read_text().splitlines() if request_id in line)
    assert (line["request"], line["status"], line["code"]) == ("POST /v1/models", 404, "not_found")


@pytest.mark.parametrize("method, path, headers, body", [
    ("POST", "/v1/chat/completions", {"content-encoding": "gzip"}, gzip.compress(b'{"model": "family-a-5.5"}')),
    ("GET", "/v1/models", {"content-type": "application/json"}, b'{"limit": 1}'),
    ("GET", "/v1/organization/costs?start_time=soon", {}, b""),
], ids=["compressed", "body-on-get", "query-parameter"])
def test_the_lua_filters_400s_are_envoys_lines_and_in_no_portico_metric(http, gateway, method, path, headers, body):
    """An operator looking for a caller's 400 finds these refusals in Envoy's access-log lines (operations.md, Logs),
    never in portico_requests_total: the server never sees them."""
    from tests.e2e.test_operations import scrape

    request_id = "lua-400-" + str(time.time_ns())
    before = sum(v for (name, _), v in scrape(gateway).items() if name == "portico_requests_total")
    response = http.request(method, path, content=body, headers={**headers, "x-request-id": request_id})
    assert response.status_code == 400, response.text
    log = gateway.data_dir / "envoy-access.log"
    deadline = time.monotonic() + 15  # each Envoy worker flushes its access-log lines every second or so
    while time.monotonic() < deadline and request_id not in (log.read_text() if log.exists() else ""):
        time.sleep(0.2)
    line = next(json.loads(line) for line in log.read_text().splitlines() if request_id in line)
    assert (line["source"], line["request"], line["status"], line["code"]) == (
        "envoy", f"{method} {path.partition('?')[0]}", 400, "invalid_request")
    assert request_id not in gateway.log_path.read_text()  # no line of the server's
    after = sum(v for (name, _), v in scrape(gateway).items() if name == "portico_requests_total")
    assert after == before


def _answers(raw: bytes) -> list[tuple[int, dict]]:
    """(status, JSON body) of each HTTP/1.1 answer in `raw`, in order (content-length or chunked bodies)."""
    answers = []
    while raw:
        head, _, raw = raw.partition(b"\r\n\r\n")
        status_line, *lines = head.decode().split("\r\n")
        headers = dict(line.lower().split(": ", 1) for line in lines)
        if "content-length" in headers:
            body, raw = raw[:int(headers["content-length"])], raw[int(headers["content-length"]):]
        else:
            body = b""
            while (size := int(raw.partition(b"\r\n")[0], 16)) > 0:
                start = raw.index(b"\r\n") + 2
                body, raw = body + raw[start:start + size], raw[start + size + 2:]
            raw = raw.partition(b"\r\n\r\n")[2]  # the last chunk and the (empty) trailers
        answers.append((int(status_line.split()[1]), json.loads(body)))
    return answers


def test_pipelined_requests_after_errors_of_every_layer_are_each_answered_in_order(gateway):
    """Refusals made by Envoy (unknown URL, bad JSON), the key check and the server's validation, sent back to back
    on one keep-alive connection ahead of a good request: none may swallow, corrupt or close it for the next."""
    good = json.dumps({"model": "family-a-5.5", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})

    def request(path: str, body: str, key: str = gateway.secret, last: bool = False) -> bytes:
        close = "Connection: close\r\n" if last else ""
        return (f"POST {path} HTTP/1.1\r\nHost: portico\r\nAuthorization: Bearer {key}\r\n"
                f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{close}\r\n{body}").encode()

    two_choices = good[:-1] + ', "n": 2}'
    pipelined = (request("/v1/nothing-here", "{}") + request("/v1/chat/completions", "{bad")
                 + request("/v1/messages", good, key="pk-nope") + request("/v1/chat/completions", two_choices)
                 + request("/v1/chat/completions", good, last=True))
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as conn:
        conn.sendall(pipelined)
        raw = b""
        while chunk := conn.recv(65536):
            raw += chunk
    answers = _answers(raw)
    assert [(status, body.get("error", {}).get("code"), body.get("error", {}).get("param"), body.get("type"))
            for status, body in answers] == [
        (404, "not_found", None, None), (400, "invalid_request", None, None),
        (401, "invalid_api_key", None, "error"), (400, "invalid_request", "n", None),
        (200, None, None, None)]
    assert answers[-1][1]["object"] == "chat.completion"


def test_a_chunked_body_with_extensions_and_trailers_after_100_continue_is_read(gateway):
    """HTTP/1.1 lets a chunk carry extensions (`;name=value`) and the body end with trailer fields; a client may
    ask for `100 Continue` first (curl does for bodies over 1 MiB): the JSON is the chunks' data, nothing more."""
    body = json.dumps({"model": "family-a-5.5", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]})
    head = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: portico\r\nAuthorization: Bearer {gateway.secret}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\nExpect: 100-continue\r\n"
            "Connection: close\r\n\r\n").encode()
    half = len(body) // 2
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as conn:
        conn.sendall(head)
        assert conn.recv(4096).startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        conn.sendall(b"%x;note=first\r\n%s\r\n%x\r\n%s\r\n0\r\nX-Checksum: none\r\n\r\n"
                     % (half, body[:half].encode(), len(body) - half, body[half:].encode()))
        raw = b""
        while chunk := conn.recv(65536):
            raw += chunk
    [(status, answer)] = _answers(raw)
    assert status == 200 and answer["object"] == "chat.completion", answer


def test_options_star_is_404_saying_why(gateway):
    """`OPTIONS *` (HTTP's whole-server probe): Envoy's codec refuses a target that is not a path before any filter
    sees it, and the answer said only "Not found.", naming nothing."""
    answer = _exchange(gateway, b"OPTIONS * HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 404 ") and b"\r\nx-request-id: " in head, head
    error = json.loads(body)["error"]
    assert error["code"] == "not_found"
    assert error["message"] == "Unknown request URL: the request's target is not a path (such as /v1/models)."


# Refused by the Lua filter from the request's headers alone: a compressed body, a key that is not ASCII text.
EARLY_REFUSALS = [(b"content-encoding", b"gzip", 400), (b"authorization", b"Bearer pk-caf\xe9", 401)]


def test_a_key_refused_from_the_headers_keeps_an_http1_connection_for_the_next_request(gateway):
    """The refusal went before the body had arrived, so Envoy closed the connection after it (`connection: close`):
    a client's pooled connection was lost to a 401, and a pipelined next request went unanswered. (Envoy closes
    it after any 400 it makes itself over HTTP/1.1, a compressed body's included.)"""
    name, value, status = EARLY_REFUSALS[1]
    body = b'{"model": "family-a-5.5"}'
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5.0) as conn:
        conn.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n" +
                     name + b": " + value + b"\r\ncontent-length: " + str(len(body)).encode() + b"\r\n\r\n")
        time.sleep(0.2)  # the body comes a moment after the headers, as from a client that sends them apart
        conn.sendall(body + b"GET /healthz HTTP/1.1\r\nhost: x\r\n\r\n")
        answer = b""
        while answer.count(b"HTTP/1.1 ") < 2 or not answer.endswith(b"}"):
            chunk = conn.recv(65536)
            if not chunk:
                break
            answer += chunk
    refusal, _, health = answer.partition(b"}}")
    assert refusal.startswith(b"HTTP/1.1 %d " % status), answer
    assert b"connection: close" not in refusal.lower(), answer
    assert b"HTTP/1.1 200 OK" in health and health.endswith(b'{"status":"alive"}'), answer


@pytest.mark.parametrize(("name", "value", "status"), EARLY_REFUSALS)
def test_a_refusal_from_the_headers_over_http2_is_not_followed_by_a_reset(gateway, name, value, status):
    """Over HTTP/2 the early refusal was followed by a reset of its stream (RST_STREAM, NO_ERROR) while the body was
    still on its way: curl (7.88, Debian 12's) then reported "(92) Stream error in the HTTP/2 framing layer" and
    showed no answer at all, now and then, for the same request."""
    connection = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
    received = b""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=5.0) as conn:
        connection.initiate_connection()
        connection.send_headers(1, [(b":method", b"POST"), (b":path", b"/v1/chat/completions"), (b":scheme", b"http"),
                                    (b":authority", b"x"), (b"content-type", b"application/json"), (name, value),
                                    (b"content-length", b"2")])
        conn.sendall(connection.data_to_send())
        conn.settimeout(0.5)  # long enough for an answer (and a reset) that does not wait for the body
        try:
            while chunk := conn.recv(65536):
                received += chunk
        except TimeoutError:
            pass
        connection.send_data(1, b"{}", end_stream=True)
        conn.sendall(connection.data_to_send())
        conn.settimeout(5.0)
        events = connection.receive_data(received)
        while not any(isinstance(e, h2.events.StreamEnded) for e in events):
            chunk = conn.recv(65536)
            assert chunk, "the connection closed before the answer"
            received += chunk
            events += connection.receive_data(chunk)
    answers = [dict(e.headers) for e in events if isinstance(e, h2.events.ResponseReceived)]
    assert answers and answers[0][b":status"] == str(status).encode()
    frames = []  # (type, stream) of each frame: h2 keeps quiet about a reset of a stream it saw end
    while len(received) >= 9:
        length = int.from_bytes(received[:3], "big")
        frames.append((received[3], int.from_bytes(received[5:9], "big") & 0x7FFFFFFF))
        received = received[9 + length:]
    assert (0x3, 1) not in frames  # RST_STREAM


@pytest.mark.parametrize(("name", "value"), [("grpc-timeout", "garbage"), ("grpc-timeout", "1n"),
                                           ("grpc-encoding", "bogus"), ("x-trace-bin", "!!"), ("x-trace-bin", "AAAA"),
                                           ("x!note", "1"), ("x~note", "1")])
def test_headers_grpc_reads_or_refuses_are_not_passed_on_from_a_rest_caller(http, name, value):
    """They went on to grpc with the transcoded call, which read them before the server: one it could not parse was a
    500 `internal_error` ("Error parsing 'x-trace-bin' metadata: illegal base64 encoding", a bug by the table), and a
    tiny `grpc-timeout` a 504 `upstream_timeout` blaming an upstream. So was a name HTTP allows and gRPC does not
    (`x!note`: "Illegal header key")."""
    headers = {name: value}
    assert http.get("/v1/models", headers=headers).status_code == 200
    response = http.post("/v1/chat/completions", headers=headers, json={
        "model": "family-a-5.5", "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]})
    assert response.status_code == 200, response.text
