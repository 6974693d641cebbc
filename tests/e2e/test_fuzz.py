"""Fuzzing the REST front door: over 10,000 hypothesis-made requests per run, sent concurrently through Envoy.

Bodies for every REST endpoint with wrong types in every field, nesting thousands deep, huge numbers, NaN and
Infinity literals, invalid UTF-8, broken and non-object JSON, oversized headers. What a caller sees is all that is
asserted (so the suite holds whatever parses the body): no 5xx, every non-2xx a documented error object (a row of
server/errors.py's table, the Anthropic shape on /v1/messages), and the gateway answers normally afterwards.
The models are served by a local upstream double, so a request that happens to be valid is cheap.
"""

from __future__ import annotations

import http.client
import json
import re
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from server.errors import TABLE
from tests.e2e.conftest import running_gateway
from tests.upstream_support import UPSTREAM_KEY, UPSTREAM_KEY_ENV, cross_dialect_models, write_config

BATCH = 16  # requests in flight at once
EXAMPLES = 660  # batches: BATCH * EXAMPLES >= 10,000 requests
DOCUMENTED = {(kind.http_status, kind.code) for kind in TABLE}
RAW = "\u0000raw\u0000"  # stands for a raw JSON token (NaN, 1e400, invalid UTF-8...) spliced in after encoding
MARKER = json.dumps(RAW).encode()

CHAT_BASE = {"model": "chat-on-openai", "messages": [{"role": "user", "content": "hi there"}], "max_tokens": 3}
CHAT_FIELDS = ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
               "stream", "stream_options", "tools", "tool_choice", "response_format", "logit_bias", "metadata",
               "seed", "user", "frequency_penalty", "presence_penalty", "logprobs", "top_logprobs",
               "parallel_tool_calls", "store", "modalities", "prediction", "reasoning_effort", "unknown_field"]
MESSAGES_BASE = {"model": "messages-on-anthropic", "max_tokens": 3, "messages": [{"role": "user", "content": "hi"}]}
MESSAGES_FIELDS = ["model", "max_tokens", "messages", "system", "stop_sequences", "stream", "temperature", "top_k",
                   "top_p", "tools", "tool_choice", "thinking", "metadata", "service_tier", "unknown_field"]
IMAGES_BASE = {"model": "family-a-image-2", "prompt": "a lighthouse", "size": "256x256"}
IMAGES_FIELDS = ["model", "prompt", "n", "size", "response_format", "quality", "style", "output_format",
                 "background", "user", "unknown_field"]
ENDPOINTS = {"/v1/chat/completions": (CHAT_BASE, CHAT_FIELDS), "/v1/messages": (MESSAGES_BASE, MESSAGES_FIELDS),
             "/v1/images/generations": (IMAGES_BASE, IMAGES_FIELDS)}
# Where inside a message a value may go wrong too: content parts, tool definitions, tool calls.
INNER_PATHS = [("messages", 0, "content"), ("messages", 0, "role"), ("messages", 0, "name"),
               ("messages", 0, "tool_calls"), ("messages", 0, "content", 0, "text"),
               ("messages", 0, "content", 0, "type"), ("messages", 0, "content", 0, "extra"),
               ("tools", 0, "function", "parameters"), ("tools", 0, "input_schema"), ("tools", 0, "type")]


def _deep(depth: int, shape: str) -> bytes:
    if shape == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


RAW_TOKENS = st.one_of(
    st.sampled_from([b"NaN", b"Infinity", b"-Infinity", b"1e400", b"-1e400", b"123456789012345678901234567890",
                     b"-0", b"0.0000000000000000000001", b'"\\ud800"', b'"\\u0000"', b"tru", b"nul", b"01",
                     b"+1", b'"\xff\xfe"', b"\xc3\x28", b'"\x80abc"', b"''", b"[1,]", b"{,}", b'{"a"}']),
    st.builds(_deep, st.sampled_from([20, 33, 64, 100, 101, 200, 1000, 5000]), st.sampled_from(["list", "dict"])),
)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**70), max_value=2**70)
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20) | st.just(RAW),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def _set(body: dict, path: tuple, value) -> None:
    """Put `value` at `path`, building the containers on the way (a content string becomes a list of parts)."""
    node = body
    for step, nxt in zip(path, path[1:]):
        child = node[step] if isinstance(node, dict) and step in node else None
        if isinstance(node, list):
            while len(node) <= step:
                node.append({})
            child = node[step]
        want_list = isinstance(nxt, int)
        if want_list and not isinstance(child, list) or not want_list and not isinstance(child, dict):
            child = [] if want_list else {}
            node[step] = child
        node = child
    if isinstance(node, list):
        while len(node) <= path[-1]:
            node.append({})
    node[path[-1]] = value


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    body: bytes
    headers: tuple[tuple[str, str], ...]


@st.composite
def requests(draw) -> Request:
    kind = draw(st.sampled_from(["field", "field", "field", "inner", "inner", "whole", "headers", "other"]))
    path = draw(st.sampled_from(sorted(ENDPOINTS)))
    base, fields = ENDPOINTS[path]
    body = json.loads(json.dumps(base))
    headers = [("content-type", "application/json")]
    raw_body: bytes | None = None
    if kind == "field":
        for field in draw(st.lists(st.sampled_from(fields), min_size=1, max_size=3)):
            body[field] = draw(JSON)
    elif kind == "inner":
        _set(body, draw(st.sampled_from(INNER_PATHS)), draw(JSON))
    elif kind == "whole":
        raw_body = draw(st.one_of(
            st.binary(max_size=64), st.sampled_from([b"", b"null", b"[]", b"1", b'"x"', b"{", b"{}"]),
            RAW_TOKENS,
            st.builds(lambda n: json.dumps(body).encode()[:n], st.integers(0, 40)),  # cut short
        ))
        headers = draw(st.sampled_from([headers, [("content-type", "text/plain")], []]))
    elif kind == "headers":
        size = draw(st.sampled_from([1, 8, 9, 16, 17, 40, 59, 61, 70, 100]))
        headers.append((draw(st.sampled_from(["cookie", "x-long", "authorization-extra"])), "c" * (size * 1024)))
    else:
        method, path = draw(st.sampled_from([("GET", "/v1/models"), ("GET", "/v1/chat/completions"),
                                             ("DELETE", "/v1/messages"), ("POST", "/v1/models"),
                                             ("GET", "/v1/nothing"), ("POST", "/v1/chat/completions/x"),
                                             ("GET", "/v1/models/" + "m" * 300), ("PUT", "/healthz")]))
        return Request(method, path, b"", tuple(headers))
    if raw_body is None:
        raw_body = json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass")
        while MARKER in raw_body:
            raw_body = raw_body.replace(MARKER, draw(RAW_TOKENS), 1)
    return Request("POST", path, raw_body, tuple(headers))


def fuzzed(draws: st.SearchStrategy[Request], send: Callable[[Request], str | None], *, batch_size: int,
           examples: int) -> list[str]:
    """`examples` batches of `batch_size` requests drawn from `draws`, each batch sent at once; what was wrong with
    the answers (`send`'s verdicts), each problem once, at most 20."""
    problems: list[str] = []
    with ThreadPoolExecutor(batch_size) as pool:

        @settings(max_examples=examples, deadline=None, database=None, phases=(Phase.generate,),
                  suppress_health_check=list(HealthCheck))
        @given(st.lists(draws, min_size=batch_size, max_size=batch_size))
        def batch(requests_: list[Request]) -> None:
            for request, problem in zip(requests_, pool.map(send, requests_)):
                if problem and len(problems) < 20 and problem not in str(problems):
                    problems.append(f"{request.method} {request.path[:300]} {request.body[:300]!r}: {problem}")

        batch()
    return problems


def exchange(local: threading.local, port: int, secret: str,
             request: Request) -> tuple[http.client.HTTPResponse, bytes] | str:
    """`request` on this thread's keep-alive HTTP/1.1 connection (header values sent as UTF-8): the answer and its
    body, or what went wrong when no answer came, twice."""
    for attempt in range(2):
        conn = getattr(local, "conn", None) or http.client.HTTPConnection("127.0.0.1", port, timeout=60)
        local.conn = conn
        try:
            headers = {"authorization": f"Bearer {secret}", **dict(request.headers)}
            conn.putrequest(request.method, request.path, skip_accept_encoding=True)
            for name, value in {**headers, "content-length": str(len(request.body))}.items():
                conn.putheader(name, value.encode("utf-8"))
            conn.endheaders(request.body)
            answer = conn.getresponse()
            body = answer.read()
            if answer.getheader("connection", "").lower() == "close":
                conn.close()
                local.conn = None
            return answer, body
        except (ConnectionError, http.client.HTTPException, OSError) as exc:
            conn.close()
            local.conn = None
            if attempt:  # a reused keep-alive connection may have been closed by Envoy: retried once
                return f"no answer: {exc!r}"
    raise AssertionError("unreachable")


class Sender:
    """One keep-alive HTTP/1.1 connection per thread; each answer is checked as it arrives."""

    def __init__(self, port: int, secret: str) -> None:
        self.port, self.secret = port, secret
        self.local = threading.local()
        self.sent = 0
        self.statuses: dict[int, int] = {}
        self.lock = threading.Lock()

    def send(self, request: Request) -> str | None:
        """None if the answer is what a caller may get, else what was wrong."""
        answered = exchange(self.local, self.port, self.secret, request)
        if isinstance(answered, str):
            return answered
        answer, body = answered
        with self.lock:
            self.sent += 1
            self.statuses[answer.status] = self.statuses.get(answer.status, 0) + 1
        return _problem(request, answer.status, answer.getheader("content-type") or "", body)


def _problem(request: Request, status: int, content_type: str, body: bytes) -> str | None:
    if status >= 500:
        return f"{status}: {body[:300]!r}"
    if status < 400:
        return None
    try:
        document = json.loads(body)
        error = document["error"]
    except (ValueError, KeyError, TypeError):
        return f"{status} without an error object: {content_type} {body[:300]!r}"
    if not content_type.startswith("application/json"):
        return f"{status} error object as {content_type}"
    if set(error) != {"message", "type", "param", "code"} or not error["message"]:
        return f"{status} malformed error object {error}"
    if (status, error["code"]) not in DOCUMENTED:
        return f"{status} {error['code']} is not a row of the error table"
    if request.path.startswith("/v1/messages") and document.get("type") != "error":
        return f"{status} on /v1/messages without the top-level type"
    # Unless the caller wrote the word: a field named "grpc" is echoed in its path (hypothesis draws the strings of
    # this module, this pattern's among them).
    leak = re.search(r"grpc|upb|DecodeError|Traceback", error["message"])
    if leak and leak.group(0).encode() not in (request.body or b""):
        return f"{status} message leaks internals: {error['message']}"
    return None


@pytest.fixture(scope="module")
def fuzzed_gateway(tmp_path_factory, double, monkeypatch_module):
    directory = tmp_path_factory.mktemp("fuzz")
    models = cross_dialect_models(double.url, openai_model="up-gpt", anthropic_model="up-claude")
    models += "  - {id: family-a-image-2, endpoint: /v1/images/generations, provider: {kind: dev-image}}\n"
    config = write_config(directory, models)
    monkeypatch_module.setenv(UPSTREAM_KEY_ENV, UPSTREAM_KEY)
    with running_gateway(directory / "data", config=config) as gateway:
        secret = gateway.cli("keys", "create", "--name", "fuzz", "--all-models", "--rpm", "1000000", "--tpm",
                             "100000000", "--concurrency", "1000").stdout.split()[-1]
        yield gateway, secret


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


def test_over_10000_fuzzed_requests_get_no_5xx_and_only_documented_errors(fuzzed_gateway):
    gateway, secret = fuzzed_gateway
    sender = Sender(gateway.port, secret)
    problems = fuzzed(requests(), sender.send, batch_size=BATCH, examples=EXAMPLES)
    print(f"fuzz: {sender.sent} requests, statuses {sorted(sender.statuses.items())}")
    assert not problems, "\n".join(problems)
    assert sender.sent >= 10_000, sender.statuses
    assert any(400 <= status < 500 for status in sender.statuses) and 200 in sender.statuses, sender.statuses

    # ... and the gateway still answers normally, without a traceback in its log.
    normal = Sender(gateway.port, secret)
    assert normal.send(Request("POST", "/v1/chat/completions", json.dumps(CHAT_BASE).encode(),
                               (("content-type", "application/json"),))) is None
    assert normal.statuses == {200: 1}
    assert Sender(gateway.port, secret).send(Request("GET", "/healthz", b"", ())) is None
    assert "Traceback" not in gateway.log_path.read_text()
