"""Passive health as the outcomes of several requests at once shape it, through the real gRPC server against real
HTTP upstreams: requests in flight when a deployment is ejected, an upstream's retry-after beside failures, a rate
limit passed on rather than retried; and readiness seeing the embedded model wherever it serves."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from portico.v1 import chat_service_pb2_grpc
from portico.v1.probe_pb2 import GetReadinessRequest
from portico.v1.probe_service_pb2_grpc import ProbeServiceStub
from tests.helpers import bearer, chat_body, http_body
from tests.service.test_deployments import ask, provider
from tests.upstream_double import Cue
from tests.upstream_support import upstream_server


@pytest.fixture(scope="module")
def west(other_double):
    return other_double


async def test_readiness_sees_the_embedded_model_behind_fallbacks_and_beside_an_upstream(double, tmp_path):
    """The embedded model serving a model with fallbacks, or as one of its deployments, is loaded all the same: /readyz
    said `"model": "none"` ("upstreams serve every model"), and stayed ready once it was closed."""
    upstream = provider(double.url, retry=None)
    models_yaml = f"""\
  - {{id: local, endpoint: /v1/chat/completions, provider: {{kind: llamacpp}}, fallbacks: [remote]}}
  - {{id: remote, endpoint: /v1/chat/completions, provider: {upstream}}}
  - id: mixed
    endpoint: /v1/chat/completions
    deployments: [{{name: here, provider: {{kind: llamacpp}}}}, {{name: there, provider: {upstream}}}]
"""
    async with upstream_server(tmp_path, models_yaml) as server:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            probes = ProbeServiceStub(channel)
            ready = await probes.GetReadiness(GetReadinessRequest())
            assert (ready.status, ready.checks["model"]) == ("ready", "loaded")
            for each in server.providers:
                await each.close()  # the embedded model among them, wherever it serves
            await server.readiness.refresh()
            with pytest.raises(grpc.aio.AioRpcError) as unready:
                await probes.GetReadiness(GetReadinessRequest())
            assert unready.value.code() == grpc.StatusCode.UNAVAILABLE
            assert unready.value.details() == "Not ready: model not_loaded."


async def test_a_429_with_retry_after_takes_its_deployment_out_even_when_not_retried(double, west, tmp_path):
    """An operator who passes rate limits on rather than retrying them (429 left out of `retry.on_status`) still has
    a deployment that answered "429, retry-after: 30" taken out for that long: it went on getting requests, each
    caller sent to it meeting the same 429 while the other deployment sat idle."""
    no_429 = "{attempts: 1, on_status: [500, 502, 503, 529]}"
    models_yaml = f"""\
  - id: passing
    endpoint: /v1/chat/completions
    deployments:
      - {{name: east, provider: {provider(double.url, retry=no_429)}}}
      - {{name: west, provider: {provider(west.url, retry=no_429)}}}
"""
    double.reset()
    west.reset()
    slow_down = Cue(429, {"error": {"message": "slow down"}}, headers={"retry-after": "30"})
    double.cue(slow_down)
    west.cue(slow_down)
    async with upstream_server(tmp_path, models_yaml) as server:
        secret = (await server.store.create("passing", all_models=True))[1]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            chat = chat_service_pb2_grpc.ChatServiceStub(channel)
            for _ in range(2):  # each deployment met once: the 429 is the caller's, not retried elsewhere
                with pytest.raises(grpc.aio.AioRpcError) as limited:
                    await ask(chat, secret, "passing")
                assert limited.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert {state for _, _, state in server.core.health.states()} == {"ejected"}
            with pytest.raises(grpc.aio.AioRpcError) as out:
                await ask(chat, secret, "passing")
            assert out.value.code() == grpc.StatusCode.UNAVAILABLE and "out of service" in out.value.details()
            registry = server.telemetry.metrics.registry
            assert [registry.get_sample_value("portico_deployment_failures_total",
                                              {"model": "passing", "deployment": name, "reason": "429"})
                    for name in ("east", "west")] == [1, 1]
    assert len(double.seen) == len(west.seen) == 1


def east_weighted(model_id: str, double, west, *, cooldown: float) -> str:
    """A model whose east deployment weighs 1000 to west's 1 (nearly every request goes east), ejected by one
    failure for `cooldown` s."""
    return f"""\
  - id: {model_id}
    endpoint: /v1/chat/completions
    deployments:
      - {{name: east, weight: 1000, provider: {provider(double.url)}}}
      - {{name: west, weight: 1, provider: {provider(west.url)}}}
    health: {{consecutive_failures: 1, cooldown_seconds: {cooldown}}}
"""


@pytest.mark.usefixtures("no_collector_pauses")
async def test_requests_already_in_flight_failing_during_the_cooldown_do_not_lengthen_it(double, west, tmp_path):
    """Six requests in flight on a deployment that starts failing: the first failure ejected it, and each of the
    other five, sent before the ejection and failing during its cooldown, counted as a failed trial and doubled it
    (0.5 s became 16 s; with the defaults, ten such made 5 s the 300 s maximum). Now the cooldown is as configured."""
    models_yaml = east_weighted("burst", double, west, cooldown=0.5)
    double.reset()
    west.reset()
    double.cue(*[Cue(503, {"error": {"message": "busy"}}, delay=0.2)] * 6)
    async with upstream_server(tmp_path, models_yaml) as server:
        secret = (await server.store.create("burst", all_models=True))[1]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            chat = chat_service_pb2_grpc.ChatServiceStub(channel)
            answers = await asyncio.gather(*(ask(chat, secret, "burst") for _ in range(6)))
            assert {a.choices[0].message.content for a in answers} == {"echo Say hello."}  # west answered them
            assert len(double.seen) >= 2  # nearly always all six: east's weight is 1000 to 1
            ejected = time.monotonic()
            await asyncio.sleep(0.6)
            assert [state for _, name, state in server.core.health.states() if name == "east"] == ["trial"]
            assert time.monotonic() - ejected < 1.0
    double.reset()  # a cue a request that went to west left unused


async def _east_after_two_at_once(double, west, tmp_path, cooldown: float, cues: list[Cue],
                                  after: float) -> list[str] | None:
    """Two requests at once to a model whose east deployment (weight 1000 to west's 1: nearly always both go there)
    answers them by `cues`, ejected by one failure for `cooldown` s: east's state `after` s from when they were
    sent, or None when one went to west."""
    models_yaml = east_weighted("halves", double, west, cooldown=cooldown)
    double.reset()
    west.reset()
    double.cue(*cues)
    try:
        async with upstream_server(tmp_path, models_yaml) as server:
            secret = (await server.store.create("halves", all_models=True))[1]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                chat = chat_service_pb2_grpc.ChatServiceStub(channel)
                began = time.monotonic()
                await asyncio.gather(*(ask(chat, secret, "halves") for _ in range(2)))
                if len(double.seen) != 2:
                    return None
                await asyncio.sleep(max(0.0, after - (time.monotonic() - began)))
                return [state for _, name, state in server.core.health.states() if name == "east"]
    finally:
        double.reset()


async def test_a_request_in_flight_succeeding_during_the_cooldown_is_no_trial(double, west, tmp_path):
    """Two requests in flight on a deployment: one fails and ejects it, the other, sent before, succeeds during the
    cooldown. That success made the deployment healthy with no trial, and wiped its record of failed trials, so a
    deployment failing every other request came back in full each cooldown; now a trial decides, as documented."""
    cues = [Cue(503, {"error": {"message": "busy"}}, delay=0.1), Cue(delay=0.3)]
    assert await _east_after_two_at_once(double, west, tmp_path, 0.6, cues, after=0.75) in (["trial"], None)


async def test_failures_in_flight_do_not_cut_short_an_upstreams_retry_after(double, west, tmp_path):
    """An upstream said "429, retry-after: 3"; a request sent before, failing a moment later, ejected the deployment
    for the (shorter) cooldown in its place, and it had traffic again after 0.5 s. Now it stays out the 3 s."""
    cues = [Cue(429, {"error": {"message": "slow down"}}, headers={"retry-after": "3"}),
            Cue(500, {"error": {"message": "broken"}}, delay=0.2)]
    assert await _east_after_two_at_once(double, west, tmp_path, 0.5, cues, after=1.0) in (["ejected"], None)


async def test_a_request_in_flight_failing_after_the_cooldown_is_no_failed_trial(double, west, tmp_path):
    """Two requests in flight on a deployment: one fails and ejects it for 0.3 s, the other, sent before the ejection,
    fails only after the cooldown (a slow upstream's timeout, say). That late failure counted as a failed trial and
    ejected the deployment again for twice as long, though no request had been sent to it since (a burst of slow
    failures kept a recovered upstream out for minutes); now the trial the cooldown ended with still decides."""
    cues = [Cue(503, {"error": {"message": "busy"}}), Cue(503, {"error": {"message": "busy"}}, delay=0.8)]
    assert await _east_after_two_at_once(double, west, tmp_path, 0.3, cues, after=0.0) in (["trial"], None)


async def test_requests_in_flight_through_a_fallback_count_for_the_deployments_balancing(double, west, tmp_path):
    """The balance reads each deployment's requests in flight in this process; a model's router counted only its own,
    so requests reaching a deployment as another model's fallback were invisible to it, and the reverse: ten held
    on `pair`'s east left `front`, falling back to `pair`, sending half its requests there all the same."""
    models_yaml = f"""\
  - id: front
    endpoint: /v1/chat/completions
    provider: {provider('http://127.0.0.1:9/v1', retry="{attempts: 1}")}
    fallbacks: [pair]
  - id: pair
    endpoint: /v1/chat/completions
    deployments:
      - {{name: east, provider: {provider(double.url, retry="{attempts: 1}")}}}
      - {{name: west, provider: {provider(west.url, retry="{attempts: 1}")}}}
"""
    double.reset()
    west.reset()
    double.default_cue = Cue(delay=3.0)  # east holds what it gets
    west.default_cue = Cue(delay=0.3)  # west too, briefly: the requests to hold split about evenly
    try:
        async with upstream_server(tmp_path, models_yaml) as server:
            secret = (await server.store.create("balance", all_models=True))[1]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                chat = chat_service_pb2_grpc.ChatServiceStub(channel)
                held = [asyncio.ensure_future(ask(chat, secret, "pair")) for _ in range(24)]
                while len(double.seen) + len(west.seen) < 24:
                    await asyncio.sleep(0.01)
                assert len(double.seen) >= 8  # about half of them, now in flight on east
                double.default_cue = west.default_cue = Cue()
                await asyncio.sleep(0.4)  # west's are answered
                before = len(double.seen)
                for _ in range(40):
                    await ask(chat, secret, "front")
                assert len(double.seen) - before < 12  # weight 1 / (8 + 1) at most (about 4), not even (about 20)
                await asyncio.gather(*held)
    finally:
        double.default_cue = west.default_cue = Cue()
        double.reset()
        west.reset()


@pytest.mark.parametrize("refusal", [
    Cue(401, {"error": {"message": "Incorrect API key provided: sk-up...1234"}}),
    Cue(402, {"type": "error", "error": {"type": "billing_error", "message": "Your credit balance is too low."}}),
])
async def test_a_deployment_that_refuses_the_gateways_key_or_account_passes_the_request_on(double, west, tmp_path,
                                                                                          refusal):
    """A bad upstream key (401) or an account out of credit (402) is that deployment's, not the request's: the same
    request goes at once to the model's other deployment, or to its fallback, instead of half the callers getting a
    502 until passive health takes the deployment out. The refusing one is not asked twice for one request."""
    models_yaml = f"""\
  - id: pair
    endpoint: /v1/chat/completions
    deployments:
      - {{name: east, provider: {provider(double.url)}}}
      - {{name: west, provider: {provider(west.url)}}}
  - {{id: alone, endpoint: /v1/chat/completions, provider: {provider(double.url)}, fallbacks: [spare]}}
  - {{id: spare, endpoint: /v1/chat/completions, provider: {provider(west.url)}}}
"""
    double.reset()
    west.reset()
    double.default_cue = refusal
    try:
        async with upstream_server(tmp_path, models_yaml) as server:
            secret = (await server.store.create("refused", all_models=True))[1]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                chat = chat_service_pb2_grpc.ChatServiceStub(channel)
                for model in ("pair",) * 6 + ("alone",) * 2:
                    asked = len(double.seen)
                    await ask(chat, secret, model)  # answered by the other deployment, or the fallback
                    assert len(double.seen) - asked <= 1
                assert len(west.seen) == 8
    finally:
        double.default_cue = Cue()


async def test_a_trial_answering_well_brings_its_deployment_back_before_its_answer_ends(double, west, tmp_path):
    """Both deployments failed and were ejected; after the cooldown each one's trial was a long stream, answering
    well. Until those answers ended (a reasoning model's: minutes; the trial is given up after 60 s) every other
    caller got 503 'out of service' with a retry-after of up to a minute from a model whose upstreams both answered.
    The trial now decides at its first content, as Envoy's outlier detection judges an answer by its status."""
    once = "{attempts: 1}"
    models_yaml = f"""\
  - id: slow-trials
    endpoint: /v1/chat/completions
    deployments:
      - {{name: east, provider: {provider(double.url, retry=once)}}}
      - {{name: west, provider: {provider(west.url, retry=once)}}}
    health: {{consecutive_failures: 1, cooldown_seconds: 0.5}}
"""
    double.reset()
    west.reset()
    busy = Cue(503, {"error": {"message": "busy"}})
    double.cue(busy)
    west.cue(busy)
    try:
        async with upstream_server(tmp_path, models_yaml) as server:
            secret = (await server.store.create("slow-trials", all_models=True))[1]
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                chat = chat_service_pb2_grpc.ChatServiceStub(channel)
                with pytest.raises(grpc.aio.AioRpcError):
                    await ask(chat, secret, "slow-trials")  # both tried, both ejected
                await asyncio.sleep(0.55)
                slow = Cue(frame_delay=0.4)  # answers at once, its text over ~2.5 s
                double.cue(slow)
                west.cue(slow)

                async def stream() -> bytes:
                    call = chat.CreateChatCompletionHttp(http_body(chat_body(
                        model="slow-trials", messages=[{"role": "user", "content": "Say hello."}], stream=True)),
                        metadata=bearer(secret))
                    return b"".join([body.data async for body in call])

                trials = [asyncio.ensure_future(stream()) for _ in range(2)]
                await asyncio.sleep(0.8)  # both trials have sent their first words
                assert len(double.seen) == len(west.seen) == 2
                answer = await ask(chat, secret, "slow-trials")
                assert answer.choices[0].message.content == "echo Say hello."
                assert all(b"[DONE]" in body for body in await asyncio.gather(*trials))
    finally:
        double.reset()
        west.reset()
