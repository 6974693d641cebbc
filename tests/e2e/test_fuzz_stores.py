"""Fuzzing what reaches the shared stores: keys and the usage ledger in PostgreSQL, limits in Redis.

PostgreSQL refuses what SQLite takes (a NUL in text, a number beyond its column), so test_fuzz.py's run on the
default stores cannot tell whether hostile input reaching them is a 500 here. Hypothesis makes admin key requests
(create, update, rotate, revoke, get, limits: hostile names, ids, numbers, unicode, NULs, lone surrogates, huge
values), usage/costs/requests queries (every parameter, times at and beyond the range, forged page cursors) and
model requests with hostile x-request-id, user, metadata and model ids, sent concurrently through Envoy. Asserted
is what a caller sees: no 5xx, only documented error objects, the gateway fine afterwards, and a ledger row in
PostgreSQL, carrying the request id the caller got, for every model request answered 200.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from urllib.parse import quote

import grpc
import httpx
import pytest
from hypothesis import strategies as st

from portico.v1 import organization_usage_pb2 as ou
from portico.v1 import usage_service_pb2_grpc
from tests.e2e.conftest import running_gateway
from tests.e2e.test_fuzz import MARKER, RAW, RAW_TOKENS, Request, _problem, exchange, fuzzed
from tests.helpers import bearer, error_details
from tests.postgres_support import PASSWORD_ENV
from tests.upstream_support import UPSTREAM_KEY, UPSTREAM_KEY_ENV, cross_dialect_models, write_config

BATCH = 8
EXAMPLES = 300  # batches: 2,400 requests
LAST_TIME = 253_402_300_800

HOSTILE = st.one_of(
    st.text(max_size=12),
    st.text(st.characters(codec="utf-8", categories=["Cc", "Cs", "Co", "Cf", "Zs", "So"]), max_size=6),
    st.sampled_from(["\x00", "a\x00b", "key_\x00", "\ud800", "x\udfff", "\ud83d", "pk-\x00", "pk-\ud800",
                     "key_0123456789abcdef", "pk-" + "a" * 43, "%00", "'; DROP TABLE api_keys; --", "\\", "\u202e",
                     "\ufeff", "😀" * 50, "é", "", " ", "x" * 201, "x" * 70_000, "model", "api_key_id",
                     "project_id", "line_item", "chat-on-openai", "true", "1e3", "-1"]),
)
NUMBERS = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70), st.integers(min_value=1, max_value=3),
    st.sampled_from([0, 1, -1, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1, 2**63, 2**64, 315_360_000,
                     315_360_001, 1_000_000_000, 1_000_000_001, LAST_TIME, LAST_TIME + 1]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([1e-7, 0.0000001, 1e308, 1000000000.000001]),
    st.just(RAW),
)
VALUES = st.one_of(HOSTILE, NUMBERS, st.booleans(), st.none(), st.lists(HOSTILE, max_size=3),
                   st.dictionaries(HOSTILE, HOSTILE | NUMBERS, max_size=2))
LIMIT_NAMES = ["requests_per_minute", "tokens_per_minute", "concurrent_requests", "daily_tokens", "daily_requests",
               "max_spend_day", "max_spend_month", "models", "unknown"]
KEY_FIELDS = ["name", "env", "models", "all_models", "admin", "limits", "id", "grace_seconds", "unknown"]
USAGE_PATHS = ["/v1/organization/usage/completions", "/v1/organization/costs", "/v1/organization/requests"]
USAGE_PARAMS = ["start_time", "end_time", "bucket_width", "group_by", "group_by[]", "api_key_ids", "api_key_ids[]",
                "models", "project_ids", "user_ids", "batch", "limit", "page", "errors_only", "line_items",
                "service_tier", "unknown"]
MODEL_PATHS = {"/v1/chat/completions": {"model": "chat-on-openai", "max_tokens": 3,
                                        "messages": [{"role": "user", "content": "hi"}]},
               "/v1/messages": {"model": "messages-on-anthropic", "max_tokens": 3,
                                "messages": [{"role": "user", "content": "hi"}]}}


def _segment(text: str) -> str:
    return quote(text.encode("utf-8", "surrogatepass"), safe="")


def _cursor(content: str) -> str:
    return "page_" + base64.urlsafe_b64encode(content.encode("utf-8", "surrogatepass")).decode().rstrip("=")


def _body(document, raw_tokens: list[bytes]) -> bytes:
    """JSON as a hostile caller writes it: lone surrogates as \\ud800 escapes, RAW spliced with raw tokens."""
    body = json.dumps(document).encode()
    for token in raw_tokens:
        body = body.replace(MARKER, token, 1)
    return body.replace(MARKER, b"1")


@dataclasses.dataclass(frozen=True)
class Target:
    """What the draws may aim at: keys that may be changed and revoked, and a non-admin key's secret."""

    victims: tuple[str, ...]
    victim_secrets: tuple[str, ...]  # their limits are what the fuzzed updates left: Redis counts against them
    user_secret: str
    user_key: str


@st.composite
def key_requests(draw, target: Target) -> Request:
    verb = draw(st.sampled_from(["create", "create", "update", "update", "rotate", "revoke", "get", "limits"]))
    # Only the first victim is rotated or revoked: the others' secrets keep sending model requests.
    victims = target.victims[:1] if verb in ("rotate", "revoke") else target.victims
    key_id = draw(st.sampled_from(victims) | HOSTILE)
    document: dict = {"name": "fuzzed", "all_models": True} if verb == "create" else {}
    for field in draw(st.lists(st.sampled_from(KEY_FIELDS), max_size=3)):
        if field == "limits":
            document["limits"] = {name: draw(VALUES) for name in draw(st.lists(st.sampled_from(LIMIT_NAMES),
                                                                                max_size=3))}
        else:
            document[field] = draw(VALUES)
    body = _body(document, draw(st.lists(RAW_TOKENS, max_size=2)))
    path = f"/v1/admin/keys/{_segment(key_id)}"
    method, path, body = {"create": ("POST", "/v1/admin/keys", body), "update": ("PATCH", path, body),
                          "rotate": ("POST", path + "/rotate", body), "revoke": ("POST", path + "/revoke", b""),
                          "get": ("GET", path, b""), "limits": ("GET", path + "/limits", b"")}[verb]
    return Request(method, path, body, (("content-type", "application/json"),))


@st.composite
def usage_requests(draw, target: Target) -> Request:
    pairs = [("start_time", str(draw(st.sampled_from([0, int(time.time()) - 3600, LAST_TIME - 60]))))]
    for name in draw(st.lists(st.sampled_from(USAGE_PARAMS), max_size=4)):
        value = draw(st.one_of(
            HOSTILE, NUMBERS.map(str), st.sampled_from(["1m", "1h", "1d", "1w", "", "true", "false"]),
            HOSTILE.map(_cursor), st.sampled_from([-1, 0, 60, 10**30, LAST_TIME * 1000]).map(lambda n: _cursor(str(n))),
            st.builds(lambda at, row: _cursor(f"{at}:{row}"), NUMBERS.map(str), HOSTILE)))
        pairs.append((name, value))
    if draw(st.booleans()):
        pairs = pairs[1:]
    query = "&".join(f"{_segment(name)}={_segment(value)}" for name, value in pairs)
    secret = draw(st.sampled_from([None, None, target.user_secret]))
    headers = (("authorization", f"Bearer {secret}"),) if secret else ()
    return Request("GET", f"{draw(st.sampled_from(USAGE_PATHS))}?{query}", b"", headers)


REQUEST_IDS = st.one_of(st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40),
                        st.sampled_from(["x" * 4000, "é", "\u00ff\u00fe", "pk-" + "b" * 43, " id ", "a,b"]))


@st.composite
def model_requests(draw, target: Target) -> Request:
    path = draw(st.sampled_from(sorted(MODEL_PATHS)))
    document = json.loads(json.dumps(MODEL_PATHS[path]))
    for field in draw(st.lists(st.sampled_from(["user", "metadata", "model", "messages"]), max_size=2)):
        if field == "metadata":
            document["metadata"] = draw(st.dictionaries(HOSTILE, HOSTILE, max_size=2) | st.fixed_dictionaries(
                {"user_id": HOSTILE}))
        elif field == "messages":
            document["messages"] = [{"role": "user", "content": draw(HOSTILE.filter(bool))}]
        else:
            document[field] = draw(HOSTILE)
    headers = [("content-type", "application/json")]
    if draw(st.booleans()):
        headers.append(("authorization", f"Bearer {draw(st.sampled_from(target.victim_secrets[1:]))}"))
    if draw(st.booleans()):  # a caller's own request id, which Envoy keeps and the ledger records
        headers.append(("x-request-id", draw(REQUEST_IDS)))
    if draw(st.booleans()):
        headers.append((draw(st.sampled_from(["x-portico-user", "openai-organization", "anthropic-version",
                                              "traceparent", "x-stainless-lang"])), draw(REQUEST_IDS)))
    return Request("POST", path, _body(document, []), tuple(headers))


class Sender:
    """One keep-alive connection per thread; each answer checked as it arrives; the request ids of model requests
    answered 200, as the caller got them."""

    def __init__(self, port: int, secret: str) -> None:
        self.port, self.secret = port, secret
        self.local = threading.local()
        self.lock = threading.Lock()
        self.statuses: dict[str, dict[int, int]] = {}
        self.answered: set[str] = set()

    def send(self, request: Request) -> str | None:
        answered = exchange(self.local, self.port, self.secret, request)
        if isinstance(answered, str):
            return answered
        answer, body = answered
        kind = ("model" if request.path in MODEL_PATHS else request.method if "admin" in request.path
                else request.path.split("?")[0].rsplit("/", 1)[-1])
        with self.lock:
            counts = self.statuses.setdefault(kind, {})
            counts[answer.status] = counts.get(answer.status, 0) + 1
            if answer.status in (200, 429) and request.path in MODEL_PATHS:  # admitted: answered or refused
                # http.client reads header bytes as latin-1; the caller sent (and got back) UTF-8.
                self.answered.add(answer.getheader("x-request-id").encode("latin-1").decode("utf-8", "replace"))
        return _problem(request, answer.status, answer.getheader("content-type") or "", body)


@pytest.fixture(scope="module")
def stores_gateway(tmp_path_factory, double, postgres_server, redis_server):
    directory = tmp_path_factory.mktemp("fuzz-stores")
    store = postgres_server.new_database()
    config = write_config(directory, cross_dialect_models(double.url, openai_model="up-gpt",
                                                          anthropic_model="up-claude"))
    config.write_text(config.read_text() + f"keys: {{store: '{store}', password_env: {PASSWORD_ENV}}}\n"
                      f"limits: {{store: '{redis_server.url}'}}\nusage: {{flush_seconds: 0.2}}\n")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(UPSTREAM_KEY_ENV, UPSTREAM_KEY)
        with running_gateway(directory / "data", config=config) as gateway:
            gateway = dataclasses.replace(gateway, config=config)
            admin = gateway.cli("keys", "create", "--name", "fuzz-admin", "--all-models", "--admin", "--rpm",
                                "1000000", "--tpm", "100000000", "--concurrency", "1000").stdout.split()[-1]
            # Limits at both ends of their range, which fuzzed updates may change: Redis counts against them.
            victims = [gateway.cli("keys", "create", "--name", f"victim-{i}", "--all-models", *limits).stdout.split()
                       for i, limits in enumerate([(), ("--rpm", "3", "--daily-tokens", "100"),
                                                   ("--rpm", "2147483647", "--tpm", "2147483647",
                                                    "--max-spend-day", "1000000000")])]
            user = gateway.cli("keys", "create", "--name", "user", "--all-models", "--rpm", "1000000").stdout.split()
            target = Target(tuple(v[2] for v in victims), tuple(v[-1] for v in victims), user[-1], user[2])
            yield gateway, admin, target, postgres_server, store


def test_hostile_admin_usage_and_model_requests_on_postgresql_and_redis(stores_gateway):
    gateway, admin, target, postgres, store = stores_gateway
    sender = Sender(gateway.port, admin)
    draws = st.one_of(key_requests(target), key_requests(target), usage_requests(target), usage_requests(target),
                      model_requests(target))
    problems = fuzzed(draws, sender.send, batch_size=BATCH, examples=EXAMPLES)
    print(f"fuzz on PostgreSQL and Redis: statuses {sender.statuses}")
    assert not problems, "\n".join(problems)
    for kind in ("POST", "PATCH", "GET", "completions", "costs", "requests", "model"):
        assert 200 in sender.statuses[kind] and any(s >= 400 for s in sender.statuses[kind]), sender.statuses

    # Every model request answered 200 or refused by a limit (429) has its ledger row in PostgreSQL, under the
    # request id the caller got.
    deadline = time.monotonic() + 10
    while True:
        with postgres.connect(store.rsplit("/", 1)[-1]) as conn:
            stored = {row[0] for row in conn.execute("SELECT request_id FROM usage_ledger")}
        if sender.answered <= stored or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert sender.answered and sender.answered <= stored, sorted(sender.answered - stored)[:5]

    # ... and the gateway answers normally, without a traceback or a dropped row in its log.
    normal = Sender(gateway.port, admin)
    assert normal.send(Request("POST", "/v1/chat/completions", json.dumps(MODEL_PATHS["/v1/chat/completions"])
                               .encode(), (("content-type", "application/json"),))) is None
    assert normal.send(Request("GET", "/v1/admin/keys", b"", ())) is None
    assert normal.statuses == {"model": {200: 1}, "GET": {200: 1}}
    log = gateway.log_path.read_text()
    assert "Traceback" not in log and "usage ledger: dropped" not in log and "refuses row" not in log


def test_a_usage_filter_of_too_many_values_is_a_400_naming_it_not_an_unreachable_ledger(stores_gateway):
    """A gRPC caller's filter is not bounded by a URL: 70,000 model ids were more parameters than PostgreSQL takes
    in one statement (65,535; SQLite 32,766), and the caller was told the ledger was unreachable (503, retry)."""
    gateway, admin, target, _, _ = stores_gateway
    many = [f"m{i}" for i in range(70_000)]
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        usage = usage_service_pb2_grpc.UsageServiceStub(channel)
        for call, request, param in (
                (usage.GetCompletionsUsage, ou.GetCompletionsUsageRequest(start_time=0, models=many), "models"),
                (usage.GetCosts, ou.GetCostsRequest(start_time=0, api_key_ids=many), "api_key_ids"),
                (usage.ListRequests, ou.ListRequestsRequest(start_time=0, project_ids=many), "project_ids")):
            with pytest.raises(grpc.RpcError) as refused:
                call(request, metadata=bearer(admin))
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
            assert error_details(refused.value).error.param == param
            assert "at most 1000" in refused.value.details()
        # The same value repeated is one value.
        answer = usage.ListRequests(ou.ListRequestsRequest(start_time=0, models=["chat-on-openai"] * 70_000),
                                    metadata=bearer(admin))
        assert answer.object == "list"


def test_command_line_ids_and_filters_that_are_not_utf8_are_answered_not_a_traceback(stores_gateway):
    """A key id, secret or usage filter pasted in another encoding reaches Python as lone surrogates, which no
    database driver encodes: `portico keys get/revoke/update/rotate` and `portico usage` printed a traceback."""
    gateway, _, target, _, _ = stores_gateway

    def cli(*args: bytes) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable.encode(), b"-m", b"server.cli", b"--config", bytes(gateway.config),
                               b"--data-dir", bytes(gateway.data_dir), *args], capture_output=True, timeout=60)

    for args in ([b"keys", b"get", b"key_\xff"], [b"keys", b"revoke", b"key_\xff"], [b"keys", b"rotate", b"key_\xff"],
                 [b"keys", b"update", b"key_\xff", b"--name", b"x"], [b"keys", b"revoke", b"pk-\xff"]):
        answer = cli(*args)
        assert answer.returncode != 0 and b"Traceback" not in answer.stderr, answer.stderr
        assert answer.stderr.startswith(b"portico: No key "), answer.stderr
    for option in (b"--model", b"--key", b"--project"):
        answer = cli(b"usage", b"--start", b"0", option, b"\xff")
        assert answer.returncode == 0, answer.stderr
    assert cli(b"keys", b"get", target.victims[0].encode()).returncode == 0


def test_rotations_of_one_key_at_the_same_time_all_succeed_and_every_secret_works(stores_gateway):
    """PostgreSQL runs them side by side (SQLite one after the other): each retired the secret it read as current,
    the same one, and all but the first got a 500 (a duplicate retired secret)."""
    gateway, admin, target, _, _ = stores_gateway
    created = httpx.post(f"{gateway.base_url}/v1/admin/keys", json={"name": "rotated", "all_models": True},
                         headers={"authorization": f"Bearer {admin}"}, timeout=30).json()
    rotate = f"{gateway.base_url}/v1/admin/keys/{created['key']['id']}/rotate"
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda _: httpx.post(rotate, json={}, headers={"authorization": f"Bearer {admin}"},
                                                     timeout=30), range(32)))
    assert [answer.status_code for answer in answers] == [200] * 32, [a.text for a in answers if a.status_code != 200]
    secrets = [created["secret"], *(answer.json()["secret"] for answer in answers)]
    for secret in secrets:  # the newest is current, the others in their grace period
        listed = httpx.get(f"{gateway.base_url}/v1/models", headers={"authorization": f"Bearer {secret}"}, timeout=30)
        assert listed.status_code == 200, listed.text
