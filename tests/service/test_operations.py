"""Observability and readiness over real stubs: what one request leaves in the metrics and the access log, bounded
labels, cancelled streams, and grpc.health.v1 / ProbeService following the stores and draining."""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import socket

import grpc
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from portico.v1 import (
    key_pb2, key_service_pb2_grpc, limit_pb2, limit_service_pb2_grpc, probe_pb2, probe_service_pb2_grpc,
)
from server.app import start_server
from server.config import load_config
from server.domain_keys import KEY_LIMIT_NAMES, KeyLimits
from server.observability.metrics import Metrics
from tests.helpers import bearer, chat_request

CHAT = "/v1/chat/completions"


def sample(running, name: str, **labels: str) -> float:
    return running.telemetry.metrics.registry.get_sample_value(name, labels) or 0.0


def access_log_text(running) -> str:
    """The access log the server wrote (the service tests' server writes it to a file)."""
    with open(running.telemetry.access_log.target, encoding="utf-8") as log:
        return log.read()


def access_lines(running, *, skip: int = 0) -> list[dict]:
    return [orjson.loads(line) for line in access_log_text(running).splitlines()[skip:]]


async def test_a_request_is_counted_timed_and_logged_once_without_its_secret(chat, running, caplog):
    key, secret = await running.store.create("observed", all_models=True, env="billing")
    requests = dict(endpoint=CHAT, model="family-a-5.5", status="200", code="")
    before = sample(running, "portico_requests_total", **requests)
    metadata = (*bearer(secret), ("x-request-id", "req-123"))
    await chat.CreateChatCompletion(chat_request(max_tokens=3), metadata=metadata)

    assert sample(running, "portico_requests_total", **requests) == before + 1
    tokens = dict(model="family-a-5.5", key_id=key.id)
    assert sample(running, "portico_output_tokens_total", **tokens) == 3
    assert sample(running, "portico_input_tokens_total", **tokens) > 5
    assert sample(running, "portico_time_to_first_token_seconds_count", endpoint=CHAT, model="family-a-5.5") >= 1
    assert sample(running, "portico_upstream_duration_seconds_count", model="family-a-5.5") >= 1
    assert sample(running, "portico_requests_in_flight", endpoint=CHAT) == 0
    (line,) = [line for line in access_lines(running) if line["request_id"] == "req-123"]
    assert line["key_id"] == key.id and line["key_env"] == "billing" and line["model"] == "family-a-5.5"
    assert (line["status"], line["code"], line["endpoint"]) == (200, None, CHAT)
    assert line["rpc"] == "ChatService/CreateChatCompletion"
    assert (line["output_tokens"], line["upstream_attempts"]) == (3, 1)
    assert line["input_tokens"] > 5 and 0 < line["upstream_ms"] <= line["duration_ms"]
    assert 0 < line["first_token_ms"] <= line["duration_ms"]
    assert secret not in caplog.text and "Say hello" not in caplog.text
    assert secret not in access_log_text(running) and "Say hello" not in access_log_text(running)


async def test_an_admin_call_on_a_key_names_that_key_in_its_line(channel, running, admin_secret):
    """"Who revoked key X?": a line named the admin key that called and /v1/admin/keys, never the key acted on."""
    keys, limits = key_service_pb2_grpc.KeyServiceStub(channel), limit_service_pb2_grpc.LimitServiceStub(channel)
    admin = bearer(admin_secret)
    created = await keys.CreateKey(key_pb2.CreateKeyRequest(name="audited", all_models=True),
                                   metadata=(*admin, ("x-request-id", "audit-create")))
    target = created.key.id
    # In this order, one after the other: a grpc.aio call starts when made (a revoke made with the rest could
    # land before the rotate, which a revoked key refuses).
    def meta(request_id: str) -> tuple:
        return (*admin, ("x-request-id", request_id))

    calls = {
        "audit-update": lambda: keys.UpdateKey(key_pb2.UpdateKeyRequest(id=target, name="audited-2"),
                                               metadata=meta("audit-update")),
        "audit-rotate": lambda: keys.RotateKey(key_pb2.RotateKeyRequest(id=target, grace_seconds=0),
                                               metadata=meta("audit-rotate")),
        "audit-get": lambda: keys.GetKey(key_pb2.GetKeyRequest(id=target), metadata=meta("audit-get")),
        "audit-limits": lambda: limits.GetKeyLimitStatus(limit_pb2.GetKeyLimitStatusRequest(id=target),
                                                         metadata=meta("audit-limits")),
        "audit-revoke": lambda: keys.RevokeKey(key_pb2.RevokeKeyRequest(id=target), metadata=meta("audit-revoke")),
    }
    for call in calls.values():
        await call()
    with pytest.raises(grpc.aio.AioRpcError):  # an unknown key: the attempt is named too
        await keys.RevokeKey(key_pb2.RevokeKeyRequest(id="key_0000000000000000"),
                             metadata=(*admin, ("x-request-id", "audit-unknown")))
    with pytest.raises(grpc.aio.AioRpcError):  # a secret pasted where the id goes stays out of the log
        await keys.GetKey(key_pb2.GetKeyRequest(id=created.secret), metadata=(*admin, ("x-request-id", "audit-pasted")))
    lines = {line["request_id"]: line for line in access_lines(running)}
    assert lines["audit-pasted"]["target_key_id"] is None and created.secret not in access_log_text(running)
    admin_id = lines["audit-create"]["key_id"]
    for request_id in ("audit-create", *calls):
        assert (lines[request_id]["key_id"], lines[request_id]["target_key_id"]) == (admin_id, target), request_id
    assert lines["audit-unknown"]["target_key_id"] == "key_0000000000000000"
    assert lines["audit-unknown"]["status"] == 404


async def test_an_admin_call_on_a_key_id_pasted_with_space_around_it_names_that_key(channel, running, admin_secret):
    """api.md: the key calls take an id with spaces or a line end around it (copied from a log line) as the id. They
    read, changed and rotated that key, but its line named no target_key_id: "who rotated key X?" missed them."""
    keys, limits = key_service_pb2_grpc.KeyServiceStub(channel), limit_service_pb2_grpc.LimitServiceStub(channel)
    admin = bearer(admin_secret)
    created = await keys.CreateKey(key_pb2.CreateKeyRequest(name="pasted", all_models=True), metadata=admin)
    target = created.key.id
    pasted = f" {target}\n"

    def meta(request_id: str) -> tuple:
        return (*admin, ("x-request-id", request_id))

    await keys.GetKey(key_pb2.GetKeyRequest(id=pasted), metadata=meta("pasted-get"))
    await keys.UpdateKey(key_pb2.UpdateKeyRequest(id=pasted, name="pasted-2"), metadata=meta("pasted-update"))
    await keys.RotateKey(key_pb2.RotateKeyRequest(id=pasted, grace_seconds=0), metadata=meta("pasted-rotate"))
    await limits.GetKeyLimitStatus(limit_pb2.GetKeyLimitStatusRequest(id=pasted), metadata=meta("pasted-limits"))
    with pytest.raises(grpc.aio.AioRpcError):  # a secret pasted so stays out of the log
        await keys.GetKey(key_pb2.GetKeyRequest(id=f" {created.secret}\n"), metadata=meta("pasted-secret"))
    lines = {line["request_id"]: line for line in access_lines(running)}
    for request_id in ("pasted-get", "pasted-update", "pasted-rotate", "pasted-limits"):
        assert (lines[request_id]["status"], lines[request_id]["target_key_id"]) == (200, target), request_id
    assert lines["pasted-secret"]["target_key_id"] is None and created.secret not in access_log_text(running)


async def test_a_revocation_by_secret_names_the_key_it_revoked(channel, running, admin_secret):
    """A leaked secret revoked as it is (`portico keys revoke pk-...`, POST /v1/admin/keys/pk-.../revoke): the line
    names the key revoked, found by its secret, never the secret; one that names no key names nothing."""
    keys = key_service_pb2_grpc.KeyServiceStub(channel)
    admin = bearer(admin_secret)
    created = await keys.CreateKey(key_pb2.CreateKeyRequest(name="leaked", all_models=True), metadata=admin)
    await keys.RevokeKey(key_pb2.RevokeKeyRequest(id=created.secret),
                         metadata=(*admin, ("x-request-id", "audit-by-secret")))
    with pytest.raises(grpc.aio.AioRpcError):
        await keys.RevokeKey(key_pb2.RevokeKeyRequest(id=created.secret + "x"),
                             metadata=(*admin, ("x-request-id", "audit-no-such-secret")))
    lines = {line["request_id"]: line for line in access_lines(running)}
    assert lines["audit-by-secret"]["target_key_id"] == created.key.id
    assert lines["audit-no-such-secret"]["target_key_id"] is None
    assert created.secret not in access_log_text(running)


async def test_label_values_never_come_from_the_caller(chat, running, caplog):
    _, secret = await running.store.create("labels", all_models=True)
    lines_before = len(access_lines(running))
    before = sample(running, "portico_requests_total", endpoint=CHAT, model="", status="404", code="model_not_found")
    with pytest.raises(grpc.aio.AioRpcError):
        await chat.CreateChatCompletion(chat_request(model="made-up-model-7"), metadata=bearer(secret))
    with pytest.raises(grpc.aio.AioRpcError):
        await chat.CreateChatCompletion(chat_request(), metadata=bearer("pk-not-a-key"))
    after = sample(running, "portico_requests_total", endpoint=CHAT, model="", status="404", code="model_not_found")
    assert after == before + 1
    assert sample(running, "portico_requests_total", endpoint=CHAT, model="", status="401", code="invalid_api_key")
    exposition = running.telemetry.metrics.registry.collect()
    assert "made-up-model-7" not in str(list(exposition)) and "pk-not-a-key" not in caplog.text
    assert "pk-not-a-key" not in access_log_text(running)
    assert [line["code"] for line in access_lines(running, skip=lines_before)] == ["model_not_found",
                                                                                "invalid_api_key"]


async def test_rate_limit_refusals_are_counted_by_limit(chat, running):
    _, secret = await running.store.create("limited", all_models=True, limits=KeyLimits(daily_requests=1))
    before = sample(running, "portico_rate_limit_rejections_total", limit="daily_requests", scope="key")
    await chat.CreateChatCompletion(chat_request(max_tokens=1), metadata=bearer(secret))
    with pytest.raises(grpc.aio.AioRpcError):
        await chat.CreateChatCompletion(chat_request(max_tokens=1), metadata=bearer(secret))
    assert sample(running, "portico_rate_limit_rejections_total", limit="daily_requests", scope="key") == before + 1


async def test_a_stream_the_caller_abandons_is_a_499_with_what_it_used(chat, running):
    key, secret = await running.store.create("abandons", all_models=True)
    request = chat_request(max_tokens=500, messages=[{"role": "user", "content": "Write a very long story."}])
    call = chat.StreamChatCompletion(request, metadata=bearer(secret))
    for _ in range(4):
        await call.read()
    call.cancel()
    for _ in range(100):
        if lines := [line for line in access_lines(running) if line["key_id"] == key.id]:
            break
        await asyncio.sleep(0.02)
    assert (lines[0]["status"], lines[0]["code"]) == (499, "cancelled")
    assert 3 <= lines[0]["output_tokens"] < 500
    assert sample(running, "portico_requests_in_flight", endpoint=CHAT) == 0


async def test_upstream_retries_and_fallbacks_count_on_the_current_request(running):
    telemetry = running.telemetry

    def one_request() -> int:
        record = telemetry.begin("/portico.v1.ChatService/CreateChatCompletion", CHAT, ())
        record.upstream_call()
        telemetry.retry("family-a-5.5", "503")
        telemetry.retry("family-a-5.5", "a reason nobody listed")
        telemetry.fallback("family-a-5.5", "family-a-5.4")
        return record.upstream_attempts

    assert contextvars.copy_context().run(one_request) == 4
    assert sample(running, "portico_upstream_retries_total", model="family-a-5.5", reason="503") >= 1
    assert sample(running, "portico_upstream_retries_total", model="family-a-5.5", reason="other") >= 1
    assert sample(running, "portico_upstream_fallbacks_total", model="family-a-5.5", fallback="family-a-5.4") >= 1
    assert telemetry.current().upstream_attempts == 0  # outside that request: a throwaway record


async def health_of(address: str) -> tuple[int, grpc.StatusCode | None]:
    async with grpc.aio.insecure_channel(address) as channel:
        status = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        try:
            await probe_service_pb2_grpc.ProbeServiceStub(channel).GetReadiness(probe_pb2.GetReadinessRequest())
            return status.status, None
        except grpc.aio.AioRpcError as error:
            return status.status, error.code()


async def test_ready_and_alive(channel, running):
    assert await health_of(f"127.0.0.1:{running.port}") == (health_pb2.HealthCheckResponse.SERVING, None)
    probes = probe_service_pb2_grpc.ProbeServiceStub(channel)
    ready = await probes.GetReadiness(probe_pb2.GetReadinessRequest())
    assert ready.status == "ready" and dict(ready.checks) == {"model": "loaded", "keys": "ok", "limits": "ok"}
    assert (await probes.GetLiveness(probe_pb2.GetLivenessRequest())).status == "alive"


@pytest.mark.parametrize("policy", ["closed", "open"])
async def test_unreachable_redis_is_not_ready_only_when_failing_closed(tmp_path, policy):
    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    config = load_config()
    limits = dataclasses.replace(config.limits, store=f"redis://127.0.0.1:{port}/0", store_timeout_seconds=0.1,
                                 on_store_error=policy)
    running = await start_server(dataclasses.replace(config, data_dir=tmp_path, limits=limits), "127.0.0.1:0")
    try:
        status, readiness = await health_of(f"127.0.0.1:{running.port}")
        if policy == "closed":
            assert (status, readiness) == (health_pb2.HealthCheckResponse.NOT_SERVING, grpc.StatusCode.UNAVAILABLE)
            assert running.readiness.report.reasons() == "limits unreachable"
        else:
            assert (status, readiness) == (health_pb2.HealthCheckResponse.SERVING, None)
    finally:
        await running.stop(0)


async def test_draining_is_not_serving(tmp_path):
    config = dataclasses.replace(load_config(), data_dir=tmp_path)
    running = await start_server(config, "127.0.0.1:0")
    try:
        await running.readiness.drain()
        await running.readiness.refresh()  # the periodic check must not undo it
        status, readiness = await health_of(f"127.0.0.1:{running.port}")
        assert (status, readiness) == (health_pb2.HealthCheckResponse.NOT_SERVING, grpc.StatusCode.UNAVAILABLE)
    finally:
        await running.stop(0)


async def test_the_start_up_line_names_where_the_server_listens(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="server.app")
    config = dataclasses.replace(load_config(), data_dir=tmp_path)
    for address in (f"unix:{tmp_path / 'grpc.sock'}", "127.0.0.1:0"):
        running = await start_server(config, address)
        try:
            where = address if address.startswith("unix:") else f"127.0.0.1:{running.port}"
            assert f"gRPC server listening on {where}" in caplog.text
        finally:
            await running.stop(0)


def test_help_texts_say_what_operations_md_says():
    """An operator reads a series' meaning in its HELP (Grafana's metrics browser shows it). The first-token
    histogram said 'the first generated text' while it also times an answer that is only a tool call or begins with
    thinking, and the limit refusals said 'a rate limit' while daily quotas and spend budgets are counted there too."""
    metrics = Metrics.create()
    first_token = metrics.first_token_seconds._documentation
    assert "tool call" in first_token and "thinking" in first_token and "generated text" not in first_token
    refusals = metrics.rate_limit_rejections._documentation
    assert all(word in refusals for word in ("rate", "concurrency", "quota", "budget"))


def test_alerting_series_are_there_at_zero_before_their_first_count():
    """`increase(portico_trace_spans_dropped_total[5m]) > 0` never fired for a gateway's first lost spans, nor a
    refusals alert for a limit's first refusals: a series born at its first increment has no earlier sample for
    increase() to compare with. Every limit, on either scope, and each reason spans are lost for, is 0 from the start."""
    from prometheus_client import generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    families = {f.name: f for f in text_string_to_metric_families(generate_latest(Metrics.create().registry).decode())}
    refusals = {(s.labels["limit"], s.labels["scope"]): s.value
                for s in families["portico_rate_limit_rejections"].samples if s.name.endswith("_total")}
    assert refusals == {(limit, scope): 0.0 for limit in KEY_LIMIT_NAMES for scope in ("key", "key_model")}
    dropped = {s.labels["reason"]: s.value
               for s in families["portico_trace_spans_dropped"].samples if s.name.endswith("_total")}
    assert dropped == {"queue_full": 0.0, "export_failed": 0.0}
