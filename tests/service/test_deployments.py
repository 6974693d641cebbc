"""Several deployments behind one model, through the real gRPC server, against two real HTTP upstreams that fail on
cue: weights, moving to the other deployment before the first byte, ejection after the threshold, the trial that
brings a deployment back, retry-after cooling exactly that long, and the state in /readyz and the metrics."""

from __future__ import annotations

import asyncio
import errno
import subprocess
import sys
import time
from pathlib import Path

import grpc
import pytest

from portico.v1.probe_pb2 import GetReadinessRequest
from portico.v1.probe_service_pb2_grpc import ProbeServiceStub
from portico.v1 import chat_service_pb2_grpc, message_service_pb2_grpc
from tests.helpers import bearer, chat_body, chat_request, http_body, message_body
from tests.upstream_double import Cue
from tests.upstream_support import UPSTREAM_KEY_ENV, upstream_server

HELLO = [{"role": "user", "content": "Say hello."}]
FAST = "{attempts: 2, initial_backoff: 0.01, max_backoff: 0.02, total_seconds: 5}"
ONCE = "{attempts: 1}"
BUSY = Cue(503, {"error": {"message": "busy"}})


def provider(url: str, *, kind: str = "openai", model: str = "m", retry: str | None = FAST) -> str:
    """A provider as a YAML flow mapping, on the upstream at `url` (an Anthropic one's base URL without /v1)."""
    base_url = url.removesuffix("/v1") if kind == "anthropic" else url
    retry_setting = f", retry: {retry}" if retry else ""
    return f"{{kind: {kind}, base_url: '{base_url}', api_key_env: {UPSTREAM_KEY_ENV}, model: {model}{retry_setting}}}"


def models(east: str, west: str) -> str:
    return f"""\
  - id: pair
    endpoint: /v1/chat/completions
    deployments:
      - {{name: east, provider: {provider(east)}}}
      - {{name: west, provider: {provider(west)}}}
    health: {{consecutive_failures: 3, cooldown_seconds: 0.6}}
  - id: weighted
    endpoint: /v1/chat/completions
    deployments:
      - {{name: east, weight: 3, provider: {provider(east)}}}
      - {{name: west, weight: 1, provider: {provider(west)}}}
  - id: lopsided
    endpoint: /v1/chat/completions
    deployments:
      - {{name: east, weight: 0.9, provider: {provider(east)}}}
      - {{name: west, weight: 0.1, provider: {provider(west)}}}
  - id: fragile
    endpoint: /v1/chat/completions
    deployments:
      - {{name: east, provider: {provider(east)}}}
      - {{name: west, provider: {provider(west)}}}
    health: {{consecutive_failures: 1, cooldown_seconds: 1}}
"""


@pytest.fixture(scope="module")
def west(other_double):
    return other_double


@pytest.fixture(scope="module")
async def running(double, west, tmp_path_factory):
    async with upstream_server(tmp_path_factory.mktemp("deployments"), models(double.url, west.url)) as server:
        yield server


@pytest.fixture
def east(double, west, running):
    """Both upstreams start each test answering, with nothing seen; the health board starts healthy."""
    west.reset()
    board = running.core.health
    for slot in range(len(board)):
        with board._change(slot) as h:
            h.__init__()
    return double


async def ask(chat, secret, model="pair"):
    return await chat.CreateChatCompletion(chat_request(model=model, messages=HELLO), metadata=bearer(secret))


async def ask_until(chat, secret, done, most=200):
    for _ in range(most):
        if done():
            return
        await ask(chat, secret)
    assert done()


async def test_weights_are_honoured_over_a_thousand_requests(chat, east, west, key):
    for _ in range(1000):
        await ask(chat, key[1], "weighted")
    assert len(east.seen) + len(west.seen) == 1000
    assert 690 <= len(east.seen) <= 810  # 750 expected; the binomial's standard deviation is ~14


async def test_weights_are_honoured_under_concurrent_load_too(chat, east, west, key):
    """16 callers at once on two deployments equally fast (50 ms): 9:1 was ~77:23 (requests in flight + 1 divided
    each weight), so the small deployment's quota took twice its share as soon as requests overlapped."""
    east.default_cue = west.default_cue = Cue(delay=0.05)
    try:
        async def caller():
            for _ in range(25):
                await ask(chat, key[1], "lopsided")
        await asyncio.gather(*(caller() for _ in range(16)))
    finally:
        east.default_cue = west.default_cue = Cue()
    assert len(east.seen) + len(west.seen) == 400
    assert len(west.seen) <= 62  # 40 expected (10%); ~92 before


async def test_concurrent_requests_prefer_the_deployment_with_fewer_in_flight(chat, east, west, key):
    east.cue(*[Cue(delay=2.0)] * 40)  # east answers slowly: its requests pile up in flight, west's end at once
    calls = []
    for _ in range(40):
        calls.append(asyncio.ensure_future(ask(chat, key[1])))
        await asyncio.sleep(0.02)
    await asyncio.gather(*calls)
    # Equal weights alone would give east ~20 of 40; weight / (in flight + 1) gives it ~8 (over 14: p < 1e-4).
    assert len(east.seen) <= 14 and len(east.seen) + len(west.seen) == 40


async def test_a_failing_deployment_is_ejected_after_the_threshold_and_callers_see_none_of_it(chat, channel, running,
                                                                                              east, west, key):
    east.cue(*[BUSY] * 100)
    for _ in range(30):
        response = await ask(chat, key[1])  # every caller is answered: east's failures move to west
        assert response.choices[0].message.content == "echo Say hello."
    assert len(east.seen) == 3  # the ejection threshold, then no more requests to it
    states = {f"{m}/{d}": s for m, d, s in running.core.health.states()}
    assert (states["pair/east"], states["pair/west"], states["weighted/east"]) == ("ejected", "healthy", "healthy")
    await running.readiness.refresh()
    ready = await ProbeServiceStub(channel).GetReadiness(GetReadinessRequest())
    assert ready.status == "ready"  # an ejected deployment is shown, and the gateway stays ready
    assert (ready.checks["deployment:pair/east"], ready.checks["deployment:pair/west"]) == ("ejected", "healthy")

    east.reset()  # it recovers
    await asyncio.sleep(0.7)  # the cooldown ends: the next request to pick it is its trial
    assert running.core.health.states()[0][2] == "trial"
    for _ in range(40):
        await ask(chat, key[1])
    assert len(east.seen) >= 10  # traffic came back after the trial
    assert running.core.health.states()[0][2] == "healthy"


async def test_a_failed_trial_ejects_it_again_for_longer(chat, running, east, west, key):
    east.cue(*[BUSY] * 100)
    # Each request goes to east or west by a random draw: ask until east has had its share, not a fixed number of
    # times (ten asks missed east's trial about once in a thousand runs, more often on a loaded machine).
    await ask_until(chat, key[1], lambda: len(east.seen) >= 3)
    assert len(east.seen) == 3  # the threshold: ejected
    await asyncio.sleep(0.7)
    await ask_until(chat, key[1], lambda: len(east.seen) >= 4)
    assert len(east.seen) == 4  # the threshold, then one trial
    await asyncio.sleep(0.7)  # the first cooldown's length: not enough now (1.2 s)
    for _ in range(10):
        await ask(chat, key[1])
    assert len(east.seen) == 4
    with running.core.health._change(0) as h:
        assert h.ejections == 2


@pytest.mark.parametrize("status", [429, 503, 529])  # 529: Anthropic's "overloaded"
async def test_retry_after_cools_that_deployment_for_exactly_that_long(chat, east, west, key, status):
    east.cue(Cue(status, {"error": {"message": "slow down"}}, headers={"retry-after": "2"}))
    while not east.seen:  # until a request meets the 429 (and is answered by west)
        await ask(chat, key[1])
    cooled = time.monotonic()
    while time.monotonic() - cooled < 1.8:
        await ask(chat, key[1])
        await asyncio.sleep(0.01)
    assert len(east.seen) == 1  # nothing for 2 s
    await asyncio.sleep(max(0.0, 2.05 - (time.monotonic() - cooled)))
    for _ in range(30):
        await ask(chat, key[1])
    assert len(east.seen) > 1  # and then traffic again, with no trial needed


async def test_both_deployments_failing_is_the_upstreams_error(chat, east, west, key):
    east.cue(*[BUSY] * 2)
    west.cue(*[BUSY] * 2)
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ask(chat, key[1])
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert len(east.seen) == len(west.seen) == 2  # each deployment's own retries


@pytest.mark.usefixtures("no_collector_pauses")
async def test_deployments_a_request_ejected_itself_are_not_waited_for_nor_given_its_trial(chat, east, west, key):
    east.cue(BUSY, BUSY)  # their own retry would meet the second
    west.cue(BUSY, BUSY)
    began = time.monotonic()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ask(chat, key[1], "fragile")
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
    assert time.monotonic() - began < 0.5  # the upstreams' error at once, not after sitting out the 1 s cooldown
    assert len(east.seen) == len(west.seen) == 1  # each ejected by its first failure: out of service, not retried
    east.reset()
    west.reset()
    await asyncio.sleep(1.05)  # the cooldown as configured (a trial spent inside that request would have doubled it)
    response = await ask(chat, key[1], "fragile")
    assert response.choices[0].message.content == "echo Say hello."


async def test_a_request_no_deployment_could_take_reached_no_model_and_counts_nothing(chat, running, east, west, key):
    east.cue(BUSY)
    west.cue(BUSY)
    with pytest.raises(grpc.aio.AioRpcError):
        await ask(chat, key[1], "fragile")  # both tried, both ejected: a model request that failed
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ask(chat, key[1], "fragile")  # nothing in service: refused by the gateway itself
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE and "out of service" in caught.value.details()
    assert len(east.seen) == len(west.seen) == 1
    counts = await running.limiter.store.counts(key[0])
    assert len(counts.window) == counts.day_requests == 1  # like a request refused by a limit: not counted
    await running.core.ledger.flush()
    rows = [r for r in running.core.usage.rows() if r.key_id == key[0]]
    assert [(r.status, r.upstream, r.upstream_attempts > 0) for r in rows] == [(503, "fragile", True),
                                                                              (503, "", False)]


async def test_metrics_count_attempts_and_failures_per_deployment(chat, running, east, west, key):
    registry = running.telemetry.metrics.registry

    def value(name, **labels):
        return registry.get_sample_value(name, {"model": "pair", **labels}) or 0

    before = value("portico_deployment_failures_total", deployment="east", reason="503")
    east.cue(BUSY)
    while not east.seen:
        await ask(chat, key[1])
    assert value("portico_deployment_failures_total", deployment="east", reason="503") == before + 1
    assert value("portico_deployment_requests_total", deployment="west") >= 1
    await running.readiness.refresh()
    assert value("portico_deployment_state", deployment="east", state="healthy") == 1
    assert value("portico_deployment_state", deployment="east", state="ejected") == 0


@pytest.fixture
def doomed():
    """An upstream in its own process, answering slowly (0.1 s between frames), to be killed mid-load."""
    process = subprocess.Popen([sys.executable, "-m", "tests.upstream_process", "0.1"], stdout=subprocess.PIPE,
                               cwd=Path(__file__).resolve().parents[2])
    port = int(process.stdout.readline())
    yield process, f"http://127.0.0.1:{port}/v1"
    process.kill()
    process.wait()


async def test_killing_one_of_two_deployments_mid_load_costs_at_most_its_requests_in_flight(doomed, west,
                                                                                              tmp_path):
    process, url = doomed
    async with upstream_server(tmp_path, models(url, west.url)) as server:
        secret = (await server.store.create("load", all_models=True))[1]
        router = server.core.pipeline._providers["pair"]
        outcomes: list[bool] = []  # per request: did the caller get a whole answer?
        stop = time.monotonic() + 3.0

        async def caller(stub):
            while time.monotonic() < stop:
                request = http_body(chat_body(model="pair", messages=HELLO, stream=True))
                try:
                    data = b"".join([b.data async for b in stub.CreateChatCompletionHttp(request,
                                                                                         metadata=bearer(secret))])
                    outcomes.append(b"[DONE]" in data and b'"error"' not in data)
                except grpc.aio.AioRpcError:
                    outcomes.append(False)

        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = chat_service_pb2_grpc.ChatServiceStub(channel)
            callers = [asyncio.ensure_future(caller(stub)) for _ in range(10)]
            await asyncio.sleep(1.2)
            in_flight = router._in_flight.get(("pair", "east"), 0)
            process.kill()
            await asyncio.gather(*callers)
        failed = outcomes.count(False)
        assert in_flight > 0 and failed <= in_flight, (failed, in_flight)
        assert len(outcomes) > 40 and all(outcomes[-10:])  # and the load goes on, on west
        # Out of service, or awaiting the trial that will eject it again (its cooldown, 0.6 s and then twice as long
        # after each failed trial, may just have ended): never healthy.
        assert server.core.health.states()[0][2] in ("ejected", "trial")


async def test_a_request_only_some_deployments_can_honour_goes_to_them_rather_than_being_refused(double, tmp_path):
    """Kinds mixed: an Anthropic upstream beside the embedded model. A penalty only the embedded model honours is
    answered by it, a required tool call by the upstream; only what neither can honour is a 400."""
    anthropic = provider(double.url, kind="anthropic", retry=None)
    mixed = f"""\
  - id: mixed
    endpoint: /v1/chat/completions
    deployments:
      - {{name: vendor, provider: {anthropic}}}
      - {{name: local, provider: {{kind: llamacpp}}}}
"""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    async with upstream_server(tmp_path, mixed) as server:
        secret = (await server.store.create("mixed", all_models=True))[1]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            chat = chat_service_pb2_grpc.ChatServiceStub(channel)

            async def ask(**fields):
                call = chat.CreateChatCompletionHttpUnary(
                    http_body(chat_body(model="mixed", messages=HELLO, max_tokens=2, **fields)),
                    metadata=bearer(secret))
                return await call

            double.reset()
            for _ in range(4):
                assert (await ask(frequency_penalty=0.5)).data  # the embedded model answers: nothing upstream
            assert double.seen == []
            await ask(tools=tools, tool_choice="required")
            assert len(double.seen) == 1
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await ask(frequency_penalty=0.5, tools=tools, tool_choice="required")
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and len(double.seen) == 1


async def test_a_count_an_openai_deployment_estimates_is_no_attempt_on_it_and_decides_no_trial(double, west, tmp_path):
    """A messages model on an Anthropic and an OpenAI-compatible upstream: a token count the OpenAI deployment answers
    is Portico's own estimate, made without asking it, so it says nothing of that deployment's health (an ejected
    one stays out until a real request succeeds) and is no upstream attempt in its metrics."""
    mixed = f"""\
  - id: counted
    endpoint: /v1/messages
    deployments:
      - {{name: vendor, provider: {provider(double.url, kind='anthropic', retry=ONCE)}}}
      - {{name: compat, provider: {provider(west.url, retry=ONCE)}}}
    health: {{consecutive_failures: 1, cooldown_seconds: 0.3}}
"""
    async with upstream_server(tmp_path, mixed) as server:
        secret = (await server.store.create("counts", all_models=True))[1]
        registry = server.telemetry.metrics.registry
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            messages = message_service_pb2_grpc.MessageServiceStub(channel)
            double.reset()
            west.reset()
            west.cue(BUSY)
            while not west.seen:  # a message meets compat's failure: ejected
                await messages.CreateMessageHttpUnary(http_body(message_body(model="counted")), metadata=bearer(secret))
            await asyncio.sleep(0.35)  # its cooldown is over: the next request to pick it is its trial
            attempts = registry.get_sample_value("portico_deployment_requests_total",
                                                 {"model": "counted", "deployment": "compat"})
            for _ in range(20):
                await messages.CountMessageTokensHttp(http_body(message_body(model="counted")),
                                                      metadata=bearer(secret))
        assert len(west.seen) == 1  # no count asked it anything
        assert dict(((m, d), s) for m, d, s in server.core.health.states())[("counted", "compat")] == "trial"
        assert registry.get_sample_value("portico_deployment_requests_total",
                                         {"model": "counted", "deployment": "compat"}) == attempts


async def test_an_upstream_without_count_tokens_keeps_its_deployments_serving_messages(double, west, tmp_path):
    """An Anthropic-compatible server that has /v1/messages but no /v1/messages/count_tokens answers a count 404. Each
    such count was a failure against both deployments' health: a few counts ejected them, and every message of the
    model was a 503 `out of service` for the cooldown. Such a count is now Portico's estimate, from the deployment
    asked (no other is tried); and a count the upstream refuses for the gateway's key (401), still the 502 it was,
    says nothing of the deployment either: messages go on."""
    pair = f"""\
  - id: counted
    endpoint: /v1/messages
    deployments:
      - {{name: east, provider: {provider(double.url, kind='anthropic', retry=ONCE)}}}
      - {{name: west, provider: {provider(west.url, kind='anthropic', retry=ONCE)}}}
    health: {{consecutive_failures: 1, cooldown_seconds: 60}}
"""
    no_route = Cue(404, {"type": "error", "error": {"type": "not_found_error", "message": "Not Found"}})
    no_key = Cue(401, {"type": "error", "error": {"type": "authentication_error", "message": "invalid x-api-key"}})
    async with upstream_server(tmp_path, pair) as server:
        secret = (await server.store.create("counts", all_models=True))[1]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            messages = message_service_pb2_grpc.MessageServiceStub(channel)
            double.reset()
            west.reset()
            for _ in range(2):
                double.cue(no_route)
                west.cue(no_route)
                counted = await messages.CountMessageTokensHttp(http_body(message_body(model="counted")),
                                                                metadata=bearer(secret))
                assert counted.data == b'{"input_tokens":3}'  # "Say hello.": 10 characters, 4 a token
            assert len(double.seen) + len(west.seen) == 2  # one deployment asked for each
            double.reset()
            west.reset()
            for _ in range(2):
                double.cue(no_key)
                west.cue(no_key)
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await messages.CountMessageTokensHttp(http_body(message_body(model="counted")),
                                                          metadata=bearer(secret))
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE  # 502: each deployment asked once
            assert {state for _, _, state in server.core.health.states()} == {"healthy"}
            answer = await messages.CreateMessageHttpUnary(http_body(message_body(model="counted")),
                                                           metadata=bearer(secret))
            assert b'"type":"message"' in answer.data
        assert len(double.seen) + len(west.seen) == 5


async def test_a_request_sent_straight_to_a_fallback_counts_as_handed_to_it(double, west, tmp_path):
    """Every deployment out of service: the request goes to the fallback without trying them, and is counted in
    portico_upstream_fallbacks_total like one handed over after failures (its attempt span says fallback too)."""
    config = f"""\
  - id: pair
    endpoint: /v1/chat/completions
    deployments:
      - {{name: east, provider: {provider(double.url, retry=ONCE)}}}
      - {{name: west, provider: {provider(west.url, retry=ONCE)}}}
    health: {{consecutive_failures: 1, cooldown_seconds: 30}}
    fallbacks: [spare]
  - {{id: spare, endpoint: /v1/chat/completions, provider: {provider(double.url, model='spare-model', retry=ONCE)}}}
"""
    async with upstream_server(tmp_path, config) as server:
        secret = (await server.store.create("fallbacks", all_models=True))[1]
        registry = server.telemetry.metrics.registry
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            chat = chat_service_pb2_grpc.ChatServiceStub(channel)
            double.reset()
            west.reset()
            double.cue(BUSY)
            west.cue(BUSY)
            for _ in range(2):  # the first ejects both on its way to the fallback; the second goes there at once
                assert (await ask(chat, secret)).choices[0].message.content == "echo Say hello."
        assert [seen.body["model"] for seen in double.seen + west.seen].count("spare-model") == 2
        handed = registry.get_sample_value("portico_upstream_fallbacks_total", {"model": "pair", "fallback": "spare"})
        assert handed == 2
        # upstream_attempts (the ledger's, as the access log's and the span's): east, west and the fallback; then
        # the fallback's one attempt alone (it said 2, counting a hand-over that sent nothing to the ejected ones).
        await server.core.ledger.flush()
        rows = [row for row in server.core.usage.rows() if row.model == "pair"]
        assert [row.upstream_attempts for row in rows] == [3, 1]


async def test_a_gateway_out_of_file_descriptors_ejects_no_deployment(chat, running, east, west, key, monkeypatch):
    """EMFILE (this process's descriptors used up) is the gateway's trouble, not the upstream's: it was a `connect`
    failure, retried on the other deployment (which met it too) and counted against each deployment's health, so a
    descriptor storm ejected healthy deployments. Now: a 503 that says so, with retry-after, no retry, no ejection."""
    from server.providers.http_client import Pool

    async def no_descriptor(self):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(Pool, "_fresh", lambda self, connection, now: False)  # every request opens a connection
    monkeypatch.setattr(Pool, "_handshakes", no_descriptor)
    for _ in range(3):  # "fragile": one failure ejects a deployment
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await ask(chat, key[1], "fragile")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "too many open files" in refused.value.details()
        assert dict(refused.value.trailing_metadata())["retry-after"] == "1"
    monkeypatch.undo()
    assert {s for m, _, s in running.core.health.states() if m == "fragile"} == {"healthy"}
    assert (len(east.seen), len(west.seen)) == (0, 0)
    response = await ask(chat, key[1], "fragile")
    assert response.choices[0].message.content == "echo Say hello."
