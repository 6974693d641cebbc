"""Secrets sent where Portico does not expect them stay out of every log: a key header with a byte that is not
printable ASCII (grpc logged such metadata whole), and a secret pasted into an unknown URL (Envoy's access log kept
the path). The session's scan (conftest.py) checks every log at the end too; these name what they sent."""

from __future__ import annotations

import json
import re
import secrets
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from gateway.envoy import free_ports
from tests.e2e.conftest import Gateway, running_gateway, upstream_gateway
from tests.upstream_double import Cue
from tests.upstream_support import upstream_models

LATIN1_E = b"\xe9"  # "é" as a browser sending Latin-1 puts it


KEY_HEADER_CASES = [  # method, path, header, anthropic
    ("GET", "/v1/models", "authorization", False),
    ("POST", "/v1/messages", "x-api-key", True),
    ("POST", "/v1/messages", "authorization", True),
]
URL_CASES = [("GET", "/v1/{}/chat"), ("DELETE", "/v1/admin/keys/{}"), ("POST", "/v1/chat/completions/{}")]
# A secret percent-encoded in the path (as a client that escapes every `-` writes it) was kept in Envoy's log whole.
# Escaping a letter too (`%70k-`, `p%6B-`) is allowed by RFC 3986 and means the same path: it was kept whole.
ENCODED_URL_CASES = [("GET", "/v1/{}/chat", "pk%2Ddev-"), ("POST", "/v1/chat/completions/{}", "pk%2ddev%2D"),
                     ("GET", "/v1/{}/chat", "%70k-dev-"), ("DELETE", "/v1/admin/keys/{}", "p%6B%2Ddev-")]


@dataclass(frozen=True)
class Sent:
    tail: str  # the secret's random part
    response: httpx.Response
    envoy_line: dict  # its line in Envoy's access log


def _logs(gateway: Gateway) -> str:
    """The server's stderr (its diagnostics and access log), Envoy's own log and Envoy's access log."""
    paths = [gateway.log_path, gateway.envoy_log_path, gateway.data_dir / "envoy-access.log"]
    return "".join(path.read_bytes().decode("latin-1") for path in paths if path.exists())


def _envoy_lines(gateway: Gateway, request_ids: list[str]) -> dict[str, dict]:
    log = gateway.data_dir / "envoy-access.log"
    deadline = time.monotonic() + 20  # Envoy flushes its access log every few seconds: wait once for all
    while True:
        lines = [json.loads(line) for line in (log.read_text().splitlines() if log.exists() else ())]
        found = {line["request_id"]: line for line in lines if line["request_id"] in request_ids}
        if len(found) == len(request_ids):
            return found
        assert time.monotonic() < deadline, f"no Envoy access-log lines for {set(request_ids) - set(found)}"
        time.sleep(0.2)


def _assert_absent(gateway: Gateway, tail: str) -> None:
    text = _logs(gateway)
    for start in range(len(tail) - 7):  # no 8 characters of the secret's random part anywhere
        assert tail[start:start + 8] not in text, "a part of the secret is in a log"


def _send(gateway: Gateway, method: str, path: str, headers: dict) -> tuple[str, httpx.Response]:
    request_id = f"secrets-out-of-logs-{secrets.token_hex(8)}"
    response = httpx.request(method, gateway.base_url + path, headers={**headers, "x-request-id": request_id},
                             json={"model": "family-a-5.5", "messages": [{"role": "user", "content": "Hi"}]},
                             timeout=30)
    return request_id, response


@pytest.fixture(scope="module")
def sent(gateway) -> dict[tuple, Sent]:
    """Every case's request, sent before any log is read, so that the wait for Envoy's log is paid once."""
    pending = {}
    for method, path, header, anthropic in KEY_HEADER_CASES:
        tail = secrets.token_urlsafe(24)
        secret = b"pk-caf" + LATIN1_E + b"-" + tail.encode()
        value = b"Bearer " + secret if header == "authorization" else secret
        pending[(method, path, header, anthropic)] = (tail, *_send(gateway, method, path, {header: value}))
    for method, template in URL_CASES:
        tail = secrets.token_urlsafe(24)
        pending[(method, template)] = (tail, *_send(gateway, method, template.format(f"pk-dev-{tail}"), {}))
    for method, template, start in ENCODED_URL_CASES:
        tail = secrets.token_urlsafe(24)
        pending[(method, template, start)] = (tail, *_send(gateway, method, template.format(start + tail), {}))
    lines = _envoy_lines(gateway, [request_id for _, request_id, _ in pending.values()])
    return {case: Sent(tail, response, lines[request_id]) for case, (tail, request_id, response) in pending.items()}


@pytest.mark.parametrize("case", KEY_HEADER_CASES, ids=lambda case: f"{case[0]} {case[1]} {case[2]}")
def test_a_key_header_that_is_not_ascii_is_a_401_and_stays_out_of_the_logs(gateway, sent, case):
    _, _, _, anthropic = case
    response = sent[case].response
    assert response.status_code == 401
    body = response.json()
    assert body["error"]["code"] == "invalid_api_key" and body["error"]["type"] == "authentication_error"
    assert (body.get("type") == "error") == anthropic
    assert sent[case].envoy_line["code"] == "invalid_api_key"
    _assert_absent(gateway, sent[case].tail)


def test_an_x_api_key_that_is_not_ascii_where_it_is_not_read_is_dropped_unread_and_stays_out_of_the_logs(gateway):
    """/v1/chat/completions reads only Authorization: its x-api-key never reaches grpc, which would log it."""
    tail = secrets.token_urlsafe(24)
    request_id, response = _send(gateway, "POST", "/v1/chat/completions",
                                 {"x-api-key": b"pk-caf" + LATIN1_E + b"-" + tail.encode()})
    assert response.status_code == 401 and response.json()["error"]["message"].startswith("You didn't provide")
    assert _line_of(gateway, request_id)["status"] == 401
    _assert_absent(gateway, tail)


def test_a_key_header_that_is_not_ascii_on_a_path_that_takes_no_key_is_dropped_unread(gateway):
    """/healthz, /readyz, the console's files and image links need no key, and a wrong one is not looked at; one
    that is not ASCII text was a 401 `invalid_api_key` all the same (a monitor's or a page's request refused)."""
    answer = httpx.post(gateway.base_url + "/v1/images/generations", timeout=60,
                        headers={"authorization": f"Bearer {gateway.secret}"},
                        json={"model": "family-a-image-2", "prompt": "a gate", "response_format": "url"})
    link = answer.json()["data"][0]["url"]
    for url in (gateway.base_url + "/healthz", gateway.base_url + "/readyz", gateway.base_url + "/console/", link):
        for header in ("authorization", "x-api-key"):
            tail = secrets.token_urlsafe(24)
            value = b"pk-caf" + LATIN1_E + b"-" + tail.encode()
            response = httpx.get(url, timeout=30, headers={header: b"Bearer " + value if header == "authorization"
                                                                   else value})
            assert response.status_code == 200, (url, header, response.text)
            _assert_absent(gateway, tail)


def test_native_grpc_metadata_that_is_not_utf8_is_redacted_in_the_server_log(gateway):
    """Envoy passes a native gRPC call's metadata through untouched: the server's own filter on grpc's logger keeps
    the value out and the fact in."""
    tail = secrets.token_urlsafe(24)
    request_id = f"secrets-out-of-logs-{secrets.token_hex(8)}"
    with httpx.Client(http1=False, http2=True, timeout=30) as client:  # h2c, as gRPC callers speak it
        response = client.post(
            gateway.base_url + "/portico.v1.ModelService/ListModels", content=b"\x00\x00\x00\x00\x00",
            headers={"content-type": "application/grpc", "te": "trailers", "x-request-id": request_id,
                     "authorization": b"Bearer pk-caf" + LATIN1_E + b"-" + tail.encode()})
    assert response.headers["grpc-status"] == "16"  # UNAUTHENTICATED
    deadline = time.monotonic() + 5
    while request_id not in gateway.log_path.read_text(errors="replace"):  # the access-log line ends the call
        assert time.monotonic() < deadline, "no access-log line for the call"
        time.sleep(0.05)
    assert "Invalid encoding on a value of" in gateway.log_path.read_text(errors="replace")
    _assert_absent(gateway, tail)


@pytest.mark.parametrize("case", URL_CASES, ids=" ".join)
def test_a_secret_in_an_unknown_url_is_cut_out_of_the_access_log_and_the_message(gateway, sent, case):
    method, template = case
    response = sent[case].response
    assert response.status_code == 404
    assert sent[case].tail not in response.text and "pk-[redacted]" in response.json()["error"]["message"]
    assert sent[case].envoy_line["request"] == f"{method} {template.format('pk-[redacted]')}"
    _assert_absent(gateway, sent[case].tail)


@pytest.mark.parametrize("case", ENCODED_URL_CASES, ids=" ".join)
def test_a_percent_encoded_secret_in_an_unknown_url_is_cut_out_too(gateway, sent, case):
    method, template, _ = case
    response = sent[case].response
    assert response.status_code == 404 and sent[case].tail not in response.text
    assert sent[case].envoy_line["request"] == f"{method} {template.format('pk-[redacted]')}"
    _assert_absent(gateway, sent[case].tail)


def test_a_secret_escaped_byte_by_byte_in_an_unknown_url_is_cut_out_too(gateway):
    """A client that %-escapes every byte of a path sends the same URL: it was logged and quoted whole, escaped."""
    tail = secrets.token_urlsafe(24)
    escaped = "".join(f"%{byte:02X}" for byte in f"pk-dev-{tail}".encode())
    request_id, response = _send(gateway, "GET", f"/v1/{escaped}/chat", {})
    line = _envoy_lines(gateway, [request_id])[request_id]
    assert response.status_code == 404 and escaped not in response.text
    assert "pk-[redacted]" in response.json()["error"]["message"] and line["request"] == "GET /v1/pk-[redacted]/chat"
    _assert_absent(gateway, tail)
    _assert_absent(gateway, escaped)


def _line_of(gateway: Gateway, request_id: str) -> dict:
    deadline = time.monotonic() + 5
    while True:
        found = [json.loads(line) for line in gateway.log_path.read_text(errors="replace").splitlines()
                 if line.startswith('{"ts":') and json.loads(line)["request_id"] == request_id]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no access-log line for {request_id!r}"
        time.sleep(0.05)


@pytest.mark.parametrize("shape", ["a key", "too long"])
def test_a_request_id_the_caller_chose_is_logged_as_it_came_back_and_never_holds_a_key(gateway, shape):
    """The caller's own x-request-id goes on, but never a key (one pasted there by mistake) into a log, and the
    id the access log records is the one the caller got back, however long the one it sent."""
    tail = secrets.token_urlsafe(24)
    chosen = f"mine-pk-dev-{tail}" if shape == "a key" else "r" * 300
    response = httpx.get(gateway.base_url + "/v1/models", timeout=30,
                         headers={"Authorization": f"Bearer {gateway.secret}", "x-request-id": chosen})
    assert response.status_code == 200
    got = response.headers["x-request-id"]
    assert got == response.headers["request-id"] and tail not in got and len(got) <= 128
    assert _line_of(gateway, got)["status"] == 200
    with httpx.Client(http1=False, http2=True, timeout=30) as client:  # a native gRPC caller, past the Lua filter
        client.post(gateway.base_url + "/portico.v1.ModelService/ListModels", content=b"\x00\x00\x00\x00\x00",
                    headers={"content-type": "application/grpc", "te": "trailers", "x-request-id": chosen,
                             "authorization": f"Bearer {gateway.secret}"})
    time.sleep(0.5)
    _assert_absent(gateway, tail)


def test_envoy_is_not_given_the_environment_that_holds_secrets(tmp_path, monkeypatch):
    """Portico's environment carries the store's password and the upstreams' keys; Envoy, which needs neither, was
    started with all of it (readable in its /proc/PID/environ, and in any crash report of it)."""
    monkeypatch.setenv("PORTICO_TEST_UPSTREAM_API_KEY", "sk-upstream-secret")
    with running_gateway(tmp_path / "data") as gateway:
        children = subprocess.run(["pgrep", "-P", str(gateway.process.pid)], capture_output=True, text=True).stdout
        environments = {Path(f"/proc/{pid}/exe").resolve().name: Path(f"/proc/{pid}/environ").read_bytes()
                        for pid in children.split()}
        server = Path(f"/proc/{gateway.process.pid}/environ").read_bytes()
    assert b"sk-upstream-secret" in server  # the test's own check: the variable was there to leak
    (envoy,) = [environment for name, environment in environments.items() if name.startswith("envoy")]
    assert b"sk-upstream-secret" not in envoy and b"PATH=" in envoy


def test_an_upstream_message_quoting_the_prompt_stays_out_of_the_log(double, tmp_path):
    """An upstream's error message may quote the request (operations.md, Traces): the retries and the fallback it
    causes are logged at the default level with the error's code, never with that message, which only the caller
    may get."""
    prompt = f"prompt-{secrets.token_hex(8)}"
    quoting = Cue(status=503, body={"error": {"message": f"could not run: {prompt}"}})
    double.reset()
    double.cue(quoting, quoting, quoting)  # up-main's three attempts, then its fallback up-backup answers
    with upstream_gateway(tmp_path, upstream_models(double.url)) as gateway:
        response = httpx.post(f"{gateway.base_url}/v1/chat/completions", timeout=30,
                              headers={"Authorization": f"Bearer {gateway.secret}"},
                              json={"model": "up-main", "messages": [{"role": "user", "content": prompt}]})
    assert response.status_code == 200, response.text
    logs = _logs(gateway)
    assert "up-main/openai failed (service_unavailable" in logs and "falling back to up-backup" in logs
    assert prompt not in logs


def test_a_redis_password_in_the_urls_query_stays_out_of_the_log(tmp_path):
    """redis-py takes a password from the URL's query as from its user part (`redis://host/0?password=...`); the
    URL was logged with that password whenever it was named (the store unreachable at start, say)."""
    password = secrets.token_hex(12)
    (port,) = free_ports(1)  # nothing listens there: the start-up logs name the store
    config = tmp_path / "portico.yaml"
    config.write_text(Path("server/default.yaml").read_text().replace(
        "store: memory ", f"store: 'redis://127.0.0.1:{port}/0?password={password}' "))
    with running_gateway(tmp_path / "data", config=config) as gateway:
        ready = httpx.get(f"{gateway.base_url}/readyz", timeout=30)
    assert ready.status_code == 503
    logs = _logs(gateway)
    assert f"redis://127.0.0.1:{port}/0?password=***" in logs and password not in logs


@pytest.mark.parametrize("chosen", ["line\u2028separator", "next\u0085line", "c1\u009b31mcsi", "rtl\u202eoverride",
                                    "isolate\u2066x", b"caf\xe9".decode("latin-1")],
                         ids=["line-separator", "next-line", "c1-control", "right-to-left-override", "isolate",
                              "latin-1"])
def test_a_request_id_holding_a_control_or_a_separator_is_replaced_by_a_new_one(gateway, chosen):
    """Such an id went into every log as sent: a reader that splits lines as Python's `splitlines()` does (at
    U+2028 and U+0085) read two halves of a JSON line, a terminal may take a C1 control (U+009B) for an escape, and a
    direction control reorders the rest of the line. Like one that is not text, it is replaced by a new id, on a
    request Envoy refuses too (one that was not text got no id back there, and a null `request_id` in the log)."""
    sent = chosen.encode("latin-1" if chosen.startswith("caf") else "utf-8")
    headers = {"Authorization": f"Bearer {gateway.secret}", "x-request-id": sent}
    served = httpx.get(gateway.base_url + "/v1/models", timeout=30, headers=headers)
    refused = httpx.get(gateway.base_url + "/v1/nothing-here", timeout=30, headers=headers)  # Envoy's own reply
    assert (served.status_code, refused.status_code) == (200, 404)
    ids = [served.headers["x-request-id"], refused.headers["x-request-id"]]
    assert all(re.fullmatch(r"[0-9a-f-]{32,36}", got) for got in ids), ids
    assert _line_of(gateway, ids[0])["status"] == 200 and _envoy_lines(gateway, ids[1:])[ids[1]]["status"] == 404
    assert sent.decode("latin-1") not in _logs(gateway)


@pytest.mark.parametrize("chosen", [b"id-\xff\xfe-" + b"x" * 20, b"caf" + LATIN1_E, b"\xed\xa0\x80-surrogate",
                                    b"\xc0\xaf-overlong", b"cut-" + b"a" * 200 + b"\xc3"],
                         ids=["not-utf-8", "latin-1", "surrogate", "overlong", "cut-then-invalid"])
def test_a_request_id_that_is_not_text_is_replaced_by_a_new_one(gateway, chosen):
    """HTTP allows any byte above 0x7f in a header; an id that is not UTF-8 text was logged as Latin-1 (another id
    than the caller got back). Like a missing one, it is replaced by a new id, the same in the answer and the log."""
    response = httpx.get(gateway.base_url + "/v1/models", timeout=30,
                         headers={"Authorization": f"Bearer {gateway.secret}", "x-request-id": chosen})
    assert response.status_code == 200
    got = response.headers.raw  # bytes as sent
    (raw_id,) = [value for name, value in got if name.lower() == b"x-request-id"]
    (raw_anthropic,) = [value for name, value in got if name.lower() == b"request-id"]
    assert raw_id == raw_anthropic and re.fullmatch(rb"[0-9a-f-]{32,36}", raw_id), raw_id
    assert _line_of(gateway, raw_id.decode())["status"] == 200


@pytest.mark.parametrize(("chosen", "kept"), [("café-ünïcode-id", "café-ünïcode-id"),
                                              ("a" * 127 + "é-long", "a" * 127), ("€" * 50, "€" * 42)],
                         ids=["short", "cut-before-a-character", "three-byte-characters"])
def test_a_request_id_in_utf_8_is_kept_and_cut_between_characters(gateway, chosen, kept):
    """An id of 128 bytes or fewer is kept as sent; a longer one is cut to 128 bytes, never inside a character
    (half a character was logged as Latin-1: another id than the caller got back)."""
    response = httpx.get(gateway.base_url + "/v1/models", timeout=30,
                         headers={"Authorization": f"Bearer {gateway.secret}", "x-request-id": chosen.encode()})
    assert response.status_code == 200
    (raw_id,) = [value for name, value in response.headers.raw if name.lower() == b"x-request-id"]
    assert raw_id == kept.encode()
    assert _line_of(gateway, kept)["status"] == 200


def test_the_usage_ledger_keeps_the_id_the_caller_got_for_one_that_is_not_text(gateway):
    headers = {"Authorization": f"Bearer {gateway.secret}"}
    models = httpx.get(gateway.base_url + "/v1/models", headers=headers, timeout=30).json()["data"]
    model = next(m["id"] for m in models if m["endpoint"] == "/v1/chat/completions")
    response = httpx.post(gateway.base_url + "/v1/chat/completions", timeout=60,
                          headers={**headers, "x-request-id": b"ledger-\xff"},
                          json={"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "Hi"}]})
    assert response.status_code == 200, response.text
    got = response.headers["x-request-id"]
    assert re.fullmatch(r"[0-9a-f-]{32,36}", got)
    deadline = time.monotonic() + 10
    while not (rows := [row for row in httpx.get(gateway.base_url + "/v1/organization/requests?limit=20",
                                                 headers=headers, timeout=30).json()["data"]
                        if row["request_id"] == got]):
        assert time.monotonic() < deadline, "no ledger row with the id the caller got"
        time.sleep(0.1)
    assert rows[0]["model"] == model
