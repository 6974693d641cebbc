"""Replies Envoy makes itself (bad JSON, wrong types, unknown paths, oversize bodies) carry the error object too;
requests whose headers never complete are cut off."""

from __future__ import annotations

import socket
import time

import httpx
import pytest

from tests.helpers import internal_headers


@pytest.fixture(scope="module")
def http(gateway) -> httpx.Client:
    with httpx.Client(base_url=gateway.base_url, headers={"Authorization": f"Bearer {gateway.secret}"},
                      timeout=30) as client:
        yield client


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


def test_wrong_type_is_400_naming_the_field(http):
    response = http.post("/v1/chat/completions",
                         json={"model": "family-a-5.5", "messages": [{"role": "user", "content": "x"}],
                               "temperature": "hot"})
    error = _assert_error(response, 400, "invalid_request")
    assert error["param"] == "temperature"


def test_unknown_path_is_404(http):
    _assert_error(http.post("/v1/nothing-here", json={}), 404, "not_found")
    _assert_error(http.get("/elsewhere"), 404, "not_found")


def test_oversize_body_is_413(http):
    big = "x" * (9 * 1024 * 1024)
    response = http.post("/v1/chat/completions",
                         json={"model": "family-a-5.5", "messages": [{"role": "user", "content": big}]})
    _assert_error(response, 413, "request_too_large")


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
