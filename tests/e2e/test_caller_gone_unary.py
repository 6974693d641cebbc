"""A caller that leaves a non-streamed request to an HTTP upstream (a REST client that disconnects, a gRPC deadline
that passes) while the upstream is generating: the upstream goes on and bills the whole answer, so Portico lets the
exchange run to its end and counts what the upstream answered (api.md, Rate limits; operations.md, Usage ledger).
The row says 499 `cancelled`, with the answer's tokens and cost; the key's concurrency slot is held until then;
no retry or fallback starts after the caller left; a drain gives such an exchange `drain_seconds`, then cuts it.
The embedded model, which stops when asked and costs nothing, still stops at once."""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import grpc
import httpx
import orjson
import pytest
import yaml

from portico.v1 import chat_service_pb2_grpc, message_service_pb2_grpc
from server.db import StoreSettings
from server.usage.stores import open_ledger
from tests.e2e.conftest import Gateway, running_gateway, upstream_gateway
from tests.e2e.test_operations import scrape, value
from tests.helpers import bearer, chat_request, http_body, message_request
from tests.upstream_double import Cue
from tests.upstream_support import UPSTREAM_KEY_ENV

HI = [{"role": "user", "content": "Say hello to the whole world"}]
PRICE = {"input": 3, "output": 7}  # dollars per million tokens: a token costs 3 or 7 micro-dollars
UPSTREAM_SECONDS = 3.0  # the upstream's answer comes this long after the request; the caller leaves after 0.5 s


def models(url: str) -> str:
    openai = f"kind: openai, base_url: '{url}', api_key_env: {UPSTREAM_KEY_ENV}"
    anthropic = f"kind: anthropic, base_url: '{url.removesuffix('/v1')}', api_key_env: {UPSTREAM_KEY_ENV}"
    retry = "{attempts: 3, initial_backoff: 0.02, max_backoff: 0.1, total_seconds: 10}"
    price = f"{{input: {PRICE['input']}, output: {PRICE['output']}}}"
    return f"""\
  - {{id: chat-up, endpoint: /v1/chat/completions, provider: {{{openai}, model: m}}, price: {price}}}
  - {{id: messages-up, endpoint: /v1/messages, provider: {{{anthropic}, model: m}}, price: {price}}}
  - id: flaky-up
    endpoint: /v1/chat/completions
    provider: {{{openai}, model: flaky, retry: {retry}}}
    fallbacks: [chat-up]
    price: {price}
  - id: pooled-up
    endpoint: /v1/chat/completions
    provider: {{{openai}, model: m, max_connections: 1}}
    price: {price}
  - id: bounded-up
    endpoint: /v1/chat/completions
    provider: {{{openai}, model: m, timeouts: {{answer: 1}}}}
    price: {price}
  - {{id: unpriced-up, endpoint: /v1/chat/completions, provider: {{{openai}, model: m}}}}
  - id: unpriced-flaky-up
    endpoint: /v1/chat/completions
    provider: {{{openai}, model: flaky, retry: {{attempts: 1}}}}
    fallbacks: [chat-up]
"""


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    with upstream_gateway(tmp_path_factory.mktemp("caller-gone"), models(double.url)) as gateway:
        yield gateway


def key(gateway: Gateway, name: str) -> tuple[str, str]:
    out = gateway.cli("keys", "create", "--name", name, "--all-models", "--concurrency", "5",
                      "--daily-tokens", "1000000").stdout
    return out.split()[2], out.split()[-1]


def admin(gateway: Gateway) -> dict[str, str]:
    secret = gateway.cli("keys", "create", "--name", "admin", "--admin", "--all-models").stdout.split()[-1]
    return {"authorization": f"Bearer {secret}"}


def standing(gateway: Gateway, key_id: str, headers: dict[str, str]) -> dict[str, int]:
    limits = httpx.get(f"{gateway.base_url}/v1/admin/keys/{key_id}/limits", headers=headers, timeout=30).json()
    return {limit["limit"]: limit["used"] for limit in limits["limits"] if not limit["model"]}


def rows(gateway: Gateway, key_id: str, headers: dict[str, str], want: int = 1) -> list[dict]:
    deadline = time.monotonic() + 15
    while True:
        found = httpx.get(f"{gateway.base_url}/v1/organization/requests", headers=headers, timeout=30,
                          params={"start_time": 0, "api_key_ids": key_id}).json()["data"]
        if len(found) >= want or time.monotonic() > deadline:
            return found
        time.sleep(0.2)


def leave(url: str, body: dict, headers: dict[str, str], *, once: Callable[[], bool] | None = None) -> None:
    """Send a non-streamed request and go away before its answer, as a client with a short timeout does: once
    `once()` says so (the upstream has the request: `reached`), else after 0.2 s. A fixed half second let a
    loaded machine's caller leave before the request was sent, which is another case."""
    target = urlsplit(url)
    data = orjson.dumps(body)
    head = (f"POST {target.path} HTTP/1.1\r\nhost: {target.netloc}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(data)}\r\n" + "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n")
    with socket.create_connection((target.hostname, target.port), timeout=10) as caller:
        caller.sendall(head.encode() + data)
        if once is None:
            time.sleep(0.2)  # the embedded model may write a short answer whole within half a second
        deadline = time.monotonic() + 10
        while once is not None and not once():
            assert time.monotonic() < deadline, "the request never reached the upstream"
            time.sleep(0.01)
        caller.setblocking(False)
        with pytest.raises(BlockingIOError):  # no answer yet: the caller leaves before it
            caller.recv(1)


def reached(double, requests: int = 1) -> Callable[[], bool]:
    """The upstream double has seen `requests` requests since its reset."""
    return lambda: len(double.seen) >= requests


@pytest.mark.parametrize("endpoint, model", [("/v1/chat/completions", "chat-up"), ("/v1/messages", "messages-up")])
def test_a_rest_caller_who_leaves_is_counted_with_what_the_upstream_answered(gateway, double, endpoint, model):
    double.reset()
    double.cue(Cue(delay=UPSTREAM_SECONDS))
    key_id, secret = key(gateway, f"leaves-{model}")
    headers = admin(gateway)
    before = scrape(gateway)
    leave(f"{gateway.base_url}{endpoint}", {"model": model, "messages": HI, "max_tokens": 50},
          {"authorization": f"Bearer {secret}"}, once=reached(double))
    time.sleep(0.5)
    # The upstream is still working for this key: its slot stays taken until the answer is in.
    assert standing(gateway, key_id, headers)["concurrent_requests"] == 1
    (row,) = rows(gateway, key_id, headers)
    assert (row["status"], row["code"]) == (499, "cancelled")
    assert row["input_tokens"] > 0 and row["output_tokens"] > 0, row
    assert row["cost_microdollars"] == row["input_tokens"] * PRICE["input"] + row["output_tokens"] * PRICE["output"]
    assert double.gone == 0  # the upstream's answer was read to its end
    used = standing(gateway, key_id, headers)
    assert used["concurrent_requests"] == 0 and used["daily_tokens"] == row["input_tokens"] + row["output_tokens"]
    after = scrape(gateway)
    for name, counted in (("portico_input_tokens_total", row["input_tokens"]),
                          ("portico_output_tokens_total", row["output_tokens"]),
                          ("portico_spend_microdollars_total", row["cost_microdollars"])):
        assert value(after, name, model=model, key_id=key_id) - value(before, name, model=model, key_id=key_id) \
            == counted, name
    assert value(after, "portico_requests_total", endpoint=endpoint, model=model, status="499", code="cancelled") \
        - value(before, "portico_requests_total", endpoint=endpoint, model=model, status="499", code="cancelled") == 1


@pytest.mark.parametrize("rpc", ["CreateChatCompletion", "CreateChatCompletionHttp"])
def test_a_grpc_deadline_that_passes_is_counted_with_what_the_upstream_answered(gateway, double, rpc):
    """The typed unary RPC, and the REST RPC that answers a body which does not stream in one message."""
    double.reset()
    double.cue(Cue(delay=UPSTREAM_SECONDS))
    key_id, secret = key(gateway, f"deadline-{rpc}")
    headers = admin(gateway)
    request = chat_request(model="chat-up", max_tokens=50)
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = chat_service_pb2_grpc.ChatServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            if rpc == "CreateChatCompletion":
                stub.CreateChatCompletion(request, metadata=bearer(secret), timeout=0.5)
            else:
                list(stub.CreateChatCompletionHttp(http_body(request), metadata=bearer(secret), timeout=0.5))
    assert raised.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    (row,) = rows(gateway, key_id, headers)
    assert (row["status"], row["code"]) == (499, "cancelled")
    assert row["input_tokens"] > 0 and row["output_tokens"] > 0 and row["cost_microdollars"] > 0, row
    used = standing(gateway, key_id, headers)
    assert used["concurrent_requests"] == 0 and used["daily_tokens"] == row["input_tokens"] + row["output_tokens"]


@pytest.mark.parametrize("rpc", ["CreateChatCompletion", "CreateMessage"])
def test_a_typed_unary_call_saying_stream_true_is_still_one_answer_read_to_its_end(gateway, double, rpc):
    """The typed unary RPCs answer once whatever `stream` says (api.md), so the exchange is a non-streamed one: the
    upstream is asked for its one JSON answer, whose own fields reach the caller, and a deadline that passes is
    counted with what it answered. It was a streamed exchange: the upstream's fields lost, and a caller who left
    cut it short, counted as nothing used while the upstream billed its answer."""
    double.reset()
    key_id, secret = key(gateway, f"unary-stream-{rpc}")
    chat = rpc == "CreateChatCompletion"
    request = (chat_request(model="chat-up", max_tokens=50, stream=True) if chat else
               message_request(model="messages-up", max_tokens=50, stream=True))
    stub = (chat_service_pb2_grpc.ChatServiceStub if chat else message_service_pb2_grpc.MessageServiceStub)
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        call = getattr(stub(channel), rpc)
        if chat:
            double.cue(Cue(body={"id": "u", "object": "chat.completion", "created": 1, "model": "m",
                                 "system_fingerprint": "fp_up", "choices": [{
                                     "index": 0, "message": {"role": "assistant", "content": "hi"},
                                     "finish_reason": "stop"}],
                                 "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6}}))
            assert call(request, metadata=bearer(secret), timeout=30).system_fingerprint == "fp_up"
        else:
            assert call(request, metadata=bearer(secret), timeout=30).content
        assert double.seen[-1].body.get("stream") in (False, None)
        double.cue(Cue(delay=UPSTREAM_SECONDS))
        with pytest.raises(grpc.RpcError) as raised:
            call(request, metadata=bearer(secret), timeout=0.5)
    assert raised.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    left = rows(gateway, key_id, admin(gateway), want=2)[0]
    assert (left["status"], left["code"]) == (499, "cancelled")
    assert left["input_tokens"] > 0 and left["output_tokens"] > 0, left


def test_no_retry_or_fallback_starts_after_the_caller_left(gateway, double):
    """The exchange under way runs on; one that then fails is not tried again, nor passed to the fallback: nobody is
    there for the answer. Its row says how it ended (the upstream's 503), with nothing used."""
    double.reset()
    down = {"error": {"message": "overloaded", "type": "server_error"}}
    double.cue(Cue(delay=1.5, status=503, body=down))
    key_id, secret = key(gateway, "no-retry")
    headers = admin(gateway)
    leave(f"{gateway.base_url}/v1/chat/completions", {"model": "flaky-up", "messages": HI},
          {"authorization": f"Bearer {secret}"}, once=reached(double))
    (row,) = rows(gateway, key_id, headers)
    assert len(double.seen) == 1, [seen.body["model"] for seen in double.seen]
    assert (row["status"], row["code"], row["input_tokens"], row["output_tokens"]) == (
        503, "service_unavailable", 0, 0)
    assert standing(gateway, key_id, headers)["concurrent_requests"] == 0


def test_a_caller_who_leaves_before_the_request_was_sent_ends_it_at_once(gateway, double):
    """Waiting for the one pooled connection, or in the pause before a retry: the upstream has nothing to bill, so
    the request ends when its caller leaves, with nothing used, and is never sent (nor retried, nor passed on)."""
    double.reset()
    busy = {"error": {"message": "overloaded", "type": "server_error"}}
    double.cue(Cue(delay=UPSTREAM_SECONDS), Cue(status=503, headers={"retry-after": "5"}, body=busy))
    key_id, secret = key(gateway, "never-sent")
    headers = admin(gateway)
    url, auth = f"{gateway.base_url}/v1/chat/completions", {"authorization": f"Bearer {secret}"}
    holder = threading.Thread(target=httpx.post, args=(url,), daemon=True, kwargs={
        "json": {"model": "pooled-up", "messages": HI}, "headers": {"authorization": f"Bearer {gateway.secret}"},
        "timeout": 30})
    holder.start()  # another key's request takes the one connection for UPSTREAM_SECONDS
    while not reached(double)():
        time.sleep(0.01)
    left = time.monotonic()
    leave(url, {"model": "pooled-up", "messages": HI}, auth)  # waits for the connection, then leaves
    # Leaves in the 5 s pause: half a second after the upstream had the first try, whose 503 is in by then (leaving
    # while that answer was still on its way, the caller outlasted it: a 503 row, no retry).
    first_try = reached(double, 2)
    since: dict[int, float] = {}
    leave(url, {"model": "flaky-up", "messages": HI}, auth,
          once=lambda: first_try() and time.monotonic() - since.setdefault(0, time.monotonic()) >= 0.5)
    found = rows(gateway, key_id, headers, want=2)
    assert time.monotonic() - left < UPSTREAM_SECONDS - 1  # neither waited for anything
    assert sorted((r["model"], r["status"], r["code"], r["input_tokens"], r["output_tokens"]) for r in found) == [
        ("flaky-up", 499, "cancelled", 0, 0), ("pooled-up", 499, "cancelled", 0, 0)], found
    assert len(double.seen) == 2  # the held request and flaky-up's first try
    holder.join(10)
    assert len(double.seen) == 2 and standing(gateway, key_id, headers)["concurrent_requests"] == 0


def _left_early(gateway: Gateway, double, model: str) -> tuple[dict, float]:
    """A caller leaves a request to `model` whose upstream answers after UPSTREAM_SECONDS, and the request ends
    sooner: its row, once its key's slot is free again, and when the caller left."""
    double.reset()
    double.cue(Cue(delay=UPSTREAM_SECONDS))
    key_id, secret = key(gateway, model)
    headers = admin(gateway)
    left = time.monotonic()
    leave(f"{gateway.base_url}/v1/chat/completions", {"model": model, "messages": HI},
          {"authorization": f"Bearer {secret}"}, once=reached(double))
    (row,) = rows(gateway, key_id, headers)
    assert time.monotonic() - left < UPSTREAM_SECONDS - 0.5  # not waiting for the upstream's answer
    assert standing(gateway, key_id, headers)["concurrent_requests"] == 0
    return row, left


def test_an_exchange_whose_caller_left_is_still_bounded_by_timeouts_answer(gateway, double):
    """It runs on within the deployment's timeouts: an upstream slower than `timeouts.answer` is given up as for a
    caller who stayed, and the row says so, with nothing used."""
    row, _ = _left_early(gateway, double, "bounded-up")
    assert (row["status"], row["code"], row["input_tokens"], row["output_tokens"]) == (504, "upstream_timeout", 0, 0)


def test_a_model_without_a_price_stops_when_its_caller_leaves(gateway, double):
    """Nothing is billed for it (a self-hosted server: vLLM stops generating when its client leaves): running on
    would keep its GPU busy for nobody. Its exchange ends with its caller, as a stream's does."""
    row, left = _left_early(gateway, double, "unpriced-up")
    assert (row["status"], row["code"], row["input_tokens"], row["output_tokens"]) == (499, "cancelled", 0, 0)
    # The double notes a client gone only when its delayed answer is due: wait for that, so that no later test sees it.
    time.sleep(max(0.0, left + UPSTREAM_SECONDS + 0.5 - time.monotonic()))
    assert double.gone >= 1


def test_a_priced_fallback_of_a_model_without_a_price_runs_on_to_be_counted(gateway, double):
    """The fallback's upstream bills its answer, which is priced at the fallback's price: it ran on. It was cut
    short with its caller, as for the free model asked for, and counted as nothing used."""
    double.reset()
    double.cue(Cue(status=503, body={"error": {"message": "overloaded", "type": "server_error"}}),
               Cue(delay=UPSTREAM_SECONDS))
    key_id, secret = key(gateway, "free-then-priced")
    headers = admin(gateway)
    leave(f"{gateway.base_url}/v1/chat/completions", {"model": "unpriced-flaky-up", "messages": HI},
          {"authorization": f"Bearer {secret}"}, once=reached(double, 2))
    (row,) = rows(gateway, key_id, headers)
    assert (row["upstream"], row["status"], row["code"]) == ("chat-up", 499, "cancelled"), row
    assert row["input_tokens"] > 0 and row["output_tokens"] > 0, row
    assert row["cost_microdollars"] == row["input_tokens"] * PRICE["input"] + row["output_tokens"] * PRICE["output"]
    assert double.gone == 0  # the fallback's answer was read to its end


def test_the_embedded_model_still_stops_when_its_caller_leaves(tmp_path):
    """It stops when asked and costs nothing: a caller's leaving still ends its generation at once."""
    with running_gateway(tmp_path / "data") as gateway:
        body = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Tell a long story."}],
                "max_tokens": 2000}
        left = time.monotonic()
        leave(f"{gateway.base_url}/v1/chat/completions", body, {"authorization": f"Bearer {gateway.secret}"})
        line = None
        while line is None and time.monotonic() - left < 10:
            time.sleep(0.1)
            line = next((entry for entry in _access_lines(gateway) if entry["model"] == "family-a-5.5"), None)
        assert line is not None and (line["status"], line["code"]) == (499, "cancelled")
        assert time.monotonic() - left < 5  # 2,000 tokens on two cores would take minutes


def _access_lines(gateway: Gateway) -> list[dict]:
    return [orjson.loads(line) for line in gateway.log_path.read_text().splitlines() if line.startswith('{"ts":')]


def _drain_config(directory: Path, url: str, drain_seconds: float) -> Path:
    raw = {"drain_seconds": drain_seconds, "usage": {"flush_seconds": 0.2},
           "models": [{"id": "chat-up", "endpoint": "/v1/chat/completions",
                       "provider": {"kind": "openai", "base_url": url, "api_key_env": UPSTREAM_KEY_ENV, "model": "m"},
                       "price": PRICE}]}
    path = directory / "portico.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _ledger_rows(data_dir: Path, key_id: str) -> list:
    ledger = open_ledger(StoreSettings(sqlite_path=data_dir / "keys.db"))
    try:
        return [row for row in ledger.rows() if row.key_id == key_id]
    finally:
        ledger.close()


@pytest.mark.parametrize("drain_seconds, upstream_seconds", [(30, UPSTREAM_SECONDS), (1, 60)],
                         ids=["finishes-within-the-drain", "cut-when-the-drain-ends"])
def test_a_drain_gives_an_exchange_whose_caller_left_drain_seconds(tmp_path, double, monkeypatch, drain_seconds,
                                                                    upstream_seconds):
    monkeypatch.setenv(UPSTREAM_KEY_ENV, "sk-test-drain")
    double.reset()
    double.cue(Cue(delay=upstream_seconds))
    data_dir = tmp_path / "data"
    with running_gateway(data_dir, config=_drain_config(tmp_path, double.url, drain_seconds)) as gateway:
        key_id, secret = key(gateway, "drained")
        left = time.monotonic()
        leave(f"{gateway.base_url}/v1/chat/completions", {"model": "chat-up", "messages": HI},
              {"authorization": f"Bearer {secret}"}, once=reached(double))
        gateway.process.send_signal(signal.SIGTERM)
        assert gateway.process.wait(timeout=30) == 0
        stopped = time.monotonic() - left
    (row,) = _ledger_rows(data_dir, key_id)
    if drain_seconds > upstream_seconds:
        assert stopped >= upstream_seconds - 0.5  # it waited for the answer ...
        assert (row.status, row.code) == (499, "cancelled")  # ... and counted it
        assert row.input_tokens > 0 and row.output_tokens > 0 and row.cost_micros > 0
        assert double.gone == 0
    else:
        assert stopped < 10  # cut when the drain ran out, as a request in flight is
        assert (row.status, row.code, row.input_tokens, row.output_tokens) == (503, "service_unavailable", 0, 0)


def test_a_caller_who_leaves_during_a_drain_is_given_the_rest_of_it(tmp_path, double, monkeypatch):
    """A client whose timeout runs out while the server drains (drain_seconds 30, an upstream that answers in 4 s):
    its exchange was cut at once, with a 503 and nothing counted, because grpc no longer waited for its call and the
    drain ended with it; the upstream bills it all the same."""
    monkeypatch.setenv(UPSTREAM_KEY_ENV, "sk-test-drain")
    double.reset()
    double.cue(Cue(delay=4))
    data_dir = tmp_path / "data"
    with running_gateway(data_dir, config=_drain_config(tmp_path, double.url, 30)) as gateway:
        key_id, secret = key(gateway, "drained")
        stopped_at: list[float] = []

        def drained_a_while() -> bool:  # the upstream has the request; the drain begins; the caller leaves 1 s later
            if not stopped_at and reached(double)():
                gateway.process.send_signal(signal.SIGTERM)
                stopped_at.append(time.monotonic())
            return bool(stopped_at) and time.monotonic() - stopped_at[0] > 1

        leave(f"{gateway.base_url}/v1/chat/completions", {"model": "chat-up", "messages": HI},
              {"authorization": f"Bearer {secret}"}, once=drained_a_while)
        assert gateway.process.wait(timeout=30) == 0
        assert time.monotonic() - stopped_at[0] >= 3  # it waited for the answer ...
    (row,) = _ledger_rows(data_dir, key_id)
    assert (row.status, row.code) == (499, "cancelled"), row  # ... and counted it
    assert row.input_tokens > 0 and row.output_tokens > 0 and row.cost_micros > 0
    assert double.gone == 0


def test_nothing_is_left_running_when_many_callers_leave(gateway, double):
    """Five callers leave at once: every exchange is counted once it ends, and no slot stays taken."""
    double.reset()
    double.default_cue = Cue(delay=1.5)
    try:
        key_id, secret = key(gateway, "many")
        headers = admin(gateway)
        callers = [threading.Thread(target=leave, args=(
            f"{gateway.base_url}/v1/chat/completions", {"model": "chat-up", "messages": HI},
            {"authorization": f"Bearer {secret}"})) for _ in range(5)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(10)
        found = rows(gateway, key_id, headers, want=5)
        assert len(found) == 5 and all((r["status"], r["code"]) == (499, "cancelled") and r["output_tokens"] > 0
                                       for r in found), found
        used = standing(gateway, key_id, headers)
        assert used["concurrent_requests"] == 0
        assert used["daily_tokens"] == sum(r["input_tokens"] + r["output_tokens"] for r in found)
    finally:
        double.default_cue = Cue()
