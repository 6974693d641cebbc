"""CORS (configuration.md `cors:`): a web app on another origin calls the gateway from a real browser (Debian
chromium via Playwright) with fetch, as the openai and anthropic JS SDKs do in a browser; and the preflight's answer
as curl sees it. Off unless configured: without `cors:` the browser blocks the same call."""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

import server
from gateway.envoy import free_ports
from tests.e2e.browser import chromium
from tests.e2e.conftest import running_gateway

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

PAGE_PORT = free_ports(1)[0]
APP_ORIGIN = f"http://127.0.0.1:{PAGE_PORT}"  # the allowed web app
OTHER_ORIGIN = f"http://localhost:{PAGE_PORT}"  # the same page under a name no one allowed: another origin
# What the openai and anthropic JS SDKs send besides the key (their x-stainless-* platform headers among them).
SDK_HEADERS = {
    "x-stainless-lang": "js", "x-stainless-package-version": "5.0.0", "x-stainless-os": "Linux",
    "x-stainless-arch": "x64", "x-stainless-runtime": "browser:chrome", "x-stainless-runtime-version": "140",
    "x-stainless-retry-count": "0", "x-stainless-timeout": "600",
}
CHAT = {"model": "family-a-5.4", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 4}


@contextlib.contextmanager
def web_app(port: int) -> Iterator[None]:
    """A blank page on another port of 127.0.0.1: another origin than the gateway's."""

    class Page(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = b"<!doctype html><title>web app</title>"
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:
            pass

    page_server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Page)
    thread = threading.Thread(target=page_server.serve_forever, daemon=True)
    thread.start()
    try:
        yield
    finally:
        page_server.shutdown()
        page_server.server_close()
        thread.join()


def cors_config(directory: Path, cors: dict | None) -> Path:
    config = yaml.safe_load((Path(server.__file__).parent / "default.yaml").read_text())
    if cors is not None:
        config["cors"] = cors
    path = directory / "portico.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    directory = tmp_path_factory.mktemp("cors")
    with running_gateway(directory / "data", config=cors_config(directory, {"allow_origins": [APP_ORIGIN]})) as gw:
        yield gw


@pytest.fixture(scope="module")
def browser():
    with web_app(PAGE_PORT), chromium() as browser:
        yield browser


@pytest.fixture
def page(browser):
    context = browser.new_context()
    page = context.new_page()
    page.set_default_timeout(30_000)
    yield page
    context.close()


# fetch from the page; what the page can read of the answer, or the error fetch rejected with.
FETCH = """async ([url, init, stream]) => {
  try {
    const response = await fetch(url, init);
    let text = "";
    if (stream) {  // an SSE stream read as it arrives, through the body's reader
      const reader = response.body.getReader();
      const decoder = new TextDecoder();
      for (let part = await reader.read(); !part.done; part = await reader.read()) {
        text += decoder.decode(part.value, {stream: true});
      }
    } else {
      text = await response.text();
    }
    const headers = {};
    response.headers.forEach((value, name) => { headers[name] = value; });
    return {status: response.status, text, headers};
  } catch (error) {
    return {rejected: String(error)};
  }
}"""


def call(page, origin: str, url: str, *, method: str = "POST", headers: dict | None = None, body: str | None = None,
         stream: bool = False) -> dict:
    page.goto(f"{origin}/")
    init = {"method": method, "headers": headers or {}}
    if body is not None:
        init["body"] = body
    return page.evaluate(FETCH, [url, init, stream])


def json_body(body: dict) -> str:
    return json.dumps(body)


def openai_headers(secret: str) -> dict:
    return {"authorization": f"Bearer {secret}", "content-type": "application/json", **SDK_HEADERS}


def test_a_chat_completion_from_an_allowed_origin(page, gateway):
    got = call(page, APP_ORIGIN, f"{gateway.base_url}/v1/chat/completions", headers=openai_headers(gateway.secret),
               body=json_body(CHAT))
    assert got.get("status") == 200, got
    answer = json.loads(got["text"])
    assert answer["object"] == "chat.completion" and answer["choices"][0]["message"]["role"] == "assistant"
    # Exposed: the SDKs read the request id and the rate-limit headers.
    assert got["headers"]["x-request-id"] and got["headers"]["request-id"] == got["headers"]["x-request-id"]
    assert "x-ratelimit-remaining-requests" in got["headers"]


def test_a_streamed_chat_completion_read_through_the_body_reader(page, gateway):
    got = call(page, APP_ORIGIN, f"{gateway.base_url}/v1/chat/completions", headers=openai_headers(gateway.secret),
               body=json_body({**CHAT, "stream": True}), stream=True)
    assert got.get("status") == 200, got
    assert got["headers"]["content-type"].startswith("text/event-stream")
    assert '"chat.completion.chunk"' in got["text"] and got["text"].rstrip().endswith("data: [DONE]")


def test_a_message_with_the_anthropic_sdks_browser_headers(page, gateway):
    headers = {"x-api-key": gateway.secret, "anthropic-version": "2023-06-01", "content-type": "application/json",
               "anthropic-dangerous-direct-browser-access": "true", **SDK_HEADERS}
    body = {"model": "family-b-haiku-4-5-20251001", "messages": [{"role": "user", "content": "Say hi"}],
            "max_tokens": 4}
    got = call(page, APP_ORIGIN, f"{gateway.base_url}/v1/messages", headers=headers, body=json_body(body))
    assert got.get("status") == 200, got
    assert json.loads(got["text"])["type"] == "message" and got["headers"]["request-id"]
    # The models as the anthropic SDK lists them (its own route, chosen by anthropic-version).
    models = call(page, APP_ORIGIN, f"{gateway.base_url}/v1/models", method="GET", headers=headers)
    assert models.get("status") == 200 and '"has_more"' in models["text"], models


def test_the_headers_the_docs_let_a_caller_send_pass_the_preflight(page, gateway):
    """Headers api.md and configuration.md say a caller may send: the response cache's refusal (Cache-Control,
    Pragma), and the anthropic SDK's user_profile_id and workspace_id (accepted, ignored)."""
    headers = {"x-api-key": gateway.secret, "anthropic-version": "2023-06-01", "content-type": "application/json",
               "anthropic-dangerous-direct-browser-access": "true", "anthropic-user-profile-id": "up_1",
               "anthropic-workspace-id": "wrkspc_1", "cache-control": "no-cache", "pragma": "no-cache"}
    body = {"model": "family-b-haiku-4-5-20251001", "messages": [{"role": "user", "content": "Say hi"}],
            "max_tokens": 4}
    got = call(page, APP_ORIGIN, f"{gateway.base_url}/v1/messages", headers=headers, body=json_body(body))
    assert got.get("status") == 200 and json.loads(got["text"])["type"] == "message", got
    got = call(page, APP_ORIGIN, f"{gateway.base_url}/v1/chat/completions", body=json_body(CHAT),
               headers={**openai_headers(gateway.secret), "cache-control": "max-age=0"})
    assert got.get("status") == 200, got


def test_errors_are_readable_with_their_status_and_error_object(page, gateway):
    url = f"{gateway.base_url}/v1/chat/completions"
    # The server's 401 for an unknown key.
    got = call(page, APP_ORIGIN, url, headers=openai_headers("pk-not-a-key"), body=json_body(CHAT))
    assert got.get("status") == 401, got
    assert json.loads(got["text"])["error"]["code"] == "invalid_api_key" and got["headers"]["x-request-id"]
    # The Lua filter's own 401 (a key that is not ASCII), refused before the server.
    got = call(page, APP_ORIGIN, url, headers=openai_headers("pk-\u00e9"), body=json_body(CHAT))
    assert got.get("status") == 401 and json.loads(got["text"])["error"]["code"] == "invalid_api_key", got
    # Envoy's own replies the Lua filter shapes: a body that is no JSON, an unknown path.
    got = call(page, APP_ORIGIN, url, headers=openai_headers(gateway.secret), body="{")
    assert got.get("status") == 400 and json.loads(got["text"])["error"]["type"] == "invalid_request_error", got
    got = call(page, APP_ORIGIN, f"{gateway.base_url}/v1/nope", method="GET", headers=openai_headers(gateway.secret))
    assert got.get("status") == 404 and json.loads(got["text"])["error"]["code"] == "not_found", got


def test_a_rate_limit_refusal_is_readable_with_its_retry_hint(page, gateway):
    secret = gateway.cli("keys", "create", "--name", "browser-app", "--all-models", "--rpm", "1").stdout.split()[-1]
    url = f"{gateway.base_url}/v1/chat/completions"
    assert call(page, APP_ORIGIN, url, headers=openai_headers(secret), body=json_body(CHAT)).get("status") == 200
    got = call(page, APP_ORIGIN, url, headers=openai_headers(secret), body=json_body(CHAT))
    assert got.get("status") == 429 and json.loads(got["text"])["error"]["code"] == "rate_limit_exceeded", got
    assert int(got["headers"]["retry-after"]) >= 1 and got["headers"]["x-ratelimit-remaining-requests"] == "0"


def test_an_origin_not_allowed_is_blocked(page, gateway):
    got = call(page, OTHER_ORIGIN, f"{gateway.base_url}/v1/chat/completions",
               headers=openai_headers(gateway.secret), body=json_body(CHAT))
    assert "rejected" in got and "Failed to fetch" in got["rejected"], got


def test_the_admin_api_is_not_open_to_other_origins(page, gateway):
    got = call(page, APP_ORIGIN, f"{gateway.base_url}/v1/admin/keys", method="GET",
               headers=openai_headers(gateway.secret))
    assert "rejected" in got, got


def test_without_cors_the_browser_blocks_the_call(page, tmp_path):
    with running_gateway(tmp_path / "data", config=cors_config(tmp_path, None)) as plain:
        got = call(page, APP_ORIGIN, f"{plain.base_url}/v1/chat/completions", headers=openai_headers(plain.secret),
                   body=json_body(CHAT))
        assert "rejected" in got and "Failed to fetch" in got["rejected"], got
        preflight = httpx.options(f"{plain.base_url}/v1/chat/completions", headers={
            "origin": APP_ORIGIN, "access-control-request-method": "POST"}, timeout=10)
        assert "access-control-allow-origin" not in preflight.headers


def preflight(gateway, path: str, origin: str = APP_ORIGIN, headers: str = "authorization,content-type"):
    return httpx.options(f"{gateway.base_url}{path}", headers={
        "origin": origin, "access-control-request-method": "POST", "access-control-request-headers": headers},
        timeout=10)


def test_the_preflights_answer_as_curl_sees_it(gateway):
    answer = preflight(gateway, "/v1/chat/completions",
                       headers="authorization,content-type,x-stainless-os,anthropic-dangerous-direct-browser-access")
    assert answer.status_code == 200 and answer.content == b""
    assert answer.headers["access-control-allow-origin"] == APP_ORIGIN
    assert answer.headers["access-control-allow-methods"] == "GET, POST"
    allowed = {name.strip() for name in answer.headers["access-control-allow-headers"].split(",")}
    assert {"authorization", "x-api-key", "content-type", "anthropic-version", "anthropic-beta",
            "anthropic-dangerous-direct-browser-access", "x-stainless-os", "x-stainless-retry-count",
            "x-request-id", "openai-organization", "openai-project", "idempotency-key"} <= allowed
    assert answer.headers["access-control-max-age"] == "7200"
    assert "access-control-allow-credentials" not in answer.headers  # keys travel in headers, never cookies
    assert answer.headers["x-request-id"]
    # Another origin: answered, but with nothing that allows it; the admin API: no CORS at all.
    assert "access-control-allow-origin" not in preflight(gateway, "/v1/chat/completions", OTHER_ORIGIN).headers
    for path in ("/v1/admin/keys", "/v1/organization/costs", "/console/"):
        assert "access-control-allow-origin" not in preflight(gateway, path).headers, path


def test_an_actual_answer_names_the_origin_and_exposes_the_headers(gateway):
    answer = httpx.get(f"{gateway.base_url}/v1/models", headers={
        "origin": APP_ORIGIN, "authorization": f"Bearer {gateway.secret}"}, timeout=10)
    assert answer.status_code == 200 and answer.headers["access-control-allow-origin"] == APP_ORIGIN
    exposed = {name.strip() for name in answer.headers["access-control-expose-headers"].split(",")}
    assert {"x-request-id", "request-id", "retry-after", "retry-after-ms", "x-should-retry", "x-portico-cache",
            "x-ratelimit-limit-requests", "x-ratelimit-remaining-tokens", "x-ratelimit-reset-requests",
            "anthropic-ratelimit-requests-remaining", "anthropic-ratelimit-tokens-reset"} <= exposed
    assert "origin" in answer.headers.get("vary", "").lower()
    # No Origin header (curl, the SDKs outside a browser): the answer is as it always was.
    plain = httpx.get(f"{gateway.base_url}/v1/models", headers={"authorization": f"Bearer {gateway.secret}"},
                      timeout=10)
    assert not any(name.startswith("access-control-") for name in plain.headers)


def test_envoys_own_refusals_carry_cors_too(gateway):
    """Replies Envoy makes itself (configuration.md): a body announced over 8 MiB, a wrong method, HEAD's answer."""
    key = {"origin": APP_ORIGIN, "authorization": f"Bearer {gateway.secret}"}
    # Refused on its content-length, before any of the body is sent (httpx sends none that its body does not fit).
    connection = http.client.HTTPConnection(httpx.URL(gateway.base_url).host, httpx.URL(gateway.base_url).port,
                                            timeout=10)
    connection.request("POST", "/v1/chat/completions", headers={
        **key, "content-type": "application/json", "content-length": str(9 << 20)})
    response = connection.getresponse()
    too_large = httpx.Response(response.status, headers=response.getheaders(), content=response.read())
    connection.close()
    wrong_method = httpx.get(f"{gateway.base_url}/v1/chat/completions", headers=key, timeout=10)
    head = httpx.head(f"{gateway.base_url}/v1/models", headers=key, timeout=10)
    for answer, status in ((too_large, 413), (wrong_method, 404), (head, 200)):
        assert answer.status_code == status and answer.headers["access-control-allow-origin"] == APP_ORIGIN, answer
        assert "x-request-id" in answer.headers["access-control-expose-headers"]
        assert "origin" in answer.headers.get("vary", "").lower()
    assert too_large.json()["error"]["code"] == "request_too_large"
