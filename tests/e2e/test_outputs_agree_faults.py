"""The outputs agree when things go wrong: an upstream failing after retries, timing out, broken mid-stream,
refusing; a fallback that answered or failed too; a caller gone before admission, mid-stream or before a priced
answer; the limit store down: the access-log line, the usage-ledger row, the trace and the metrics name the same
request, key, model, status, code, tokens and cost, a retried attempt is no second request, and the budget gauge is
the budget less the ledger's costs (tests/e2e/outputs_support.py)."""

from __future__ import annotations

import signal
import time

import anthropic
import grpc
import httpx
import openai
import pytest

from portico.v1 import chat_service_pb2_grpc
from tests.helpers import chat_request
from tests.e2e.outputs_support import (
    HI, agree, labels, limited_key, observe, openai_caller, rid, scrape, setup, totals_agree,
)
from tests.upstream_double import Cue

__all__ = ["setup"]  # the module-scoped gateway fixture

# An upstream's chunk of text, as an OpenAI-compatible server streams it.
HEL = (b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"solo-model","choices":'
       b'[{"index":0,"delta":{"role":"assistant","content":"Hel"},"finish_reason":null}]}\n\n')


def failing(status: int, times: int) -> list[Cue]:
    """An upstream failing `times` times in a row with `status` (a server error it may be retried on)."""
    return [Cue(status=status, body={"error": {"message": "busy", "type": "server_error"}})] * times


def test_an_upstream_failing_after_retries(setup):
    request_id, before = rid("502"), scrape(setup.gateway)
    setup.double.reset()
    setup.double.cue(*failing(500, 3))
    with pytest.raises(openai.InternalServerError):
        openai_caller(setup, request_id).chat.completions.create(model="solo", messages=HI, max_tokens=5)
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="solo", status=502, code="upstream_error")
    assert out.line["upstream_attempts"] == out.row["upstream_attempts"] if "upstream_attempts" in out.row else True
    assert out.line["upstream_attempts"] == 3
    assert len([s for s in out.spans if s.kind == "client"]) == 3
    assert out.metrics[("portico_upstream_retries_total", labels(model="solo", reason="500"))] == 2


def test_an_upstream_timeout(setup):
    request_id, before = rid("504"), scrape(setup.gateway)
    setup.double.reset()
    setup.double.cue(Cue(delay=1.5))
    with pytest.raises(openai.APIStatusError) as raised:
        openai_caller(setup, request_id).chat.completions.create(model="solo", messages=HI, max_tokens=5)
    assert raised.value.status_code == 504
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="solo", status=504, code="upstream_timeout")


def test_a_fallback_that_answered(setup):
    request_id, before = rid("fallback"), scrape(setup.gateway)
    setup.double.reset()
    setup.double.cue(*failing(503, 3))
    openai_caller(setup, request_id).chat.completions.create(model="priced", messages=HI, max_tokens=5)
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="priced", status=200, code=None)
    assert (out.row["upstream"], out.span.attributes["gen_ai.response.model"], out.line["upstream_attempts"]) == \
        ("backup", "backup", 4), (out.row, out.line, [s.attributes for s in out.spans])
    assert out.metrics[("portico_upstream_fallbacks_total", labels(model="priced", fallback="backup"))] == 1
    # the fallback's price: 5 $/M input, 20 $/M output
    assert out.row["cost_microdollars"] == 5 * out.row["input_tokens"] + 20 * out.row["output_tokens"]


def test_a_caller_gone_mid_stream(setup):
    request_id, before = rid("499"), scrape(setup.gateway)
    frames = [b'data: {"id":"c1","object":"chat.completion.chunk","created":1,"model":"main-model","choices":'
              b'[{"index":0,"delta":{"role":"assistant","content":"Hel"},"finish_reason":null}]}\n\n'] * 6
    setup.double.reset()
    setup.double.cue(Cue(frames=frames, frame_delay=0.5))
    stream = openai_caller(setup, request_id).chat.completions.create(
        model="priced", messages=HI, max_tokens=50, stream=True, stream_options={"include_usage": True})
    next(iter(stream))
    stream.close()
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="priced", status=499, code="cancelled")


def test_a_stream_that_breaks_after_its_first_bytes(setup):
    request_id, before = rid("broken"), scrape(setup.gateway)
    frames = [HEL] * 4
    setup.double.reset()
    setup.double.cue(Cue(frames=frames, drop_after=2))
    with pytest.raises(openai.APIError):
        list(openai_caller(setup, request_id).chat.completions.create(
            model="solo", messages=HI, max_tokens=50, stream=True, stream_options={"include_usage": True}))
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="solo", status=200, code="upstream_error")


def test_a_streamed_fallback(setup):
    request_id, before = rid("sfallback"), scrape(setup.gateway)
    setup.double.reset()
    setup.double.cue(*failing(503, 3))
    list(openai_caller(setup, request_id).chat.completions.create(
        model="priced", messages=HI, max_tokens=5, stream=True, stream_options={"include_usage": True}))
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="priced", status=200, code=None)
    assert out.row["upstream"] == "backup"
    assert out.row["cost_microdollars"] == 5 * out.row["input_tokens"] + 20 * out.row["output_tokens"]


def test_a_retry_that_then_answered_is_one_request(setup):
    request_id, before = rid("retried"), scrape(setup.gateway)
    setup.double.reset()
    setup.double.cue(Cue(status=500, body={"error": {"message": "boom", "type": "server_error"}}))
    openai_caller(setup, request_id).chat.completions.create(model="solo", messages=HI, max_tokens=5)
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="solo", status=200, code=None)
    assert out.line["upstream_attempts"] == 2 == len([s for s in out.spans if s.kind == "client"])
    after = scrape(setup.gateway)
    assert after[("portico_deployment_requests_total", labels(model="solo", deployment="openai"))] - \
        before.get(("portico_deployment_requests_total", labels(model="solo", deployment="openai")), 0) == 2
    assert out.row["deployment"] == "openai"


def test_a_caller_gone_before_a_priced_unary_answer(setup):
    """operations.md: its row comes when the upstream's answer is in, with its tokens and cost; metrics count it
    then."""
    request_id, before = rid("499u"), scrape(setup.gateway)
    setup.double.reset()
    setup.double.cue(Cue(frame_delay=1.0))
    with pytest.raises(openai.APITimeoutError):
        openai_caller(setup, request_id).with_options(timeout=0.4).chat.completions.create(
            model="priced", messages=HI, max_tokens=5)
    time.sleep(1.5)
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="priced", status=499, code="cancelled")
    assert out.row["output_tokens"] > 0 and out.row["cost_microdollars"] > 0, out.row


def test_an_upstreams_own_rate_limit_is_no_limit_of_portico(setup):
    request_id, before = rid("up429"), scrape(setup.gateway)
    setup.double.reset()
    refusal = {"error": {"message": "slow down", "type": "requests", "code": "rate_limit_exceeded"}}
    setup.double.cue(*[Cue(status=429, headers={"retry-after": "0"}, body=refusal)] * 3)
    with pytest.raises(openai.RateLimitError):
        openai_caller(setup, request_id).chat.completions.create(model="solo", messages=HI, max_tokens=5)
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="solo", status=429, code="rate_limit_exceeded")
    assert out.line["limit"] is None and "portico.limit" not in out.span.attributes, (out.line, out.span.attributes)
    assert not [k for k in out.metrics if k[0] == "portico_rate_limit_rejections_total"], out.metrics


def test_an_upstreams_specific_code_is_the_tables_in_log_ledger_and_metrics(setup):
    request_id, before = rid("up400"), scrape(setup.gateway)
    setup.double.reset()
    setup.double.cue(Cue(status=400, body={"error": {"message": "too long", "type": "invalid_request_error",
                                                     "param": "messages", "code": "context_length_exceeded"}}))
    with pytest.raises(openai.BadRequestError) as raised:
        openai_caller(setup, request_id).chat.completions.create(model="solo", messages=HI, max_tokens=5)
    assert raised.value.code == "context_length_exceeded"
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="solo", status=400, code="invalid_request")
    assert out.span.attributes["error.type"] == "context_length_exceeded"


def test_a_limit_store_that_is_down(setup):
    request_id = rid("503")
    openai_caller(setup, rid("warm")).chat.completions.create(model="solo", messages=HI, max_tokens=5)
    time.sleep(0.3)
    before = scrape(setup.gateway)
    setup.redis.stop()
    try:
        with pytest.raises(openai.InternalServerError) as raised:
            openai_caller(setup, request_id).chat.completions.create(model="solo", messages=HI, max_tokens=5)
        assert raised.value.status_code == 503
    finally:
        setup.redis.restart()
    time.sleep(1.2)  # Silence: one command a second tries Redis again
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="solo", status=503, code="service_unavailable")


def test_a_typed_grpc_stream_that_breaks(setup):
    request_id, before = rid("grpc"), scrape(setup.gateway)
    frames = [HEL] * 4
    setup.double.reset()
    setup.double.cue(Cue(frames=frames, drop_after=2))
    with grpc.insecure_channel(f"127.0.0.1:{setup.gateway.port}") as channel:
        stub = chat_service_pb2_grpc.ChatServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            list(stub.StreamChatCompletion(chat_request(model="solo", max_tokens=50), timeout=30, metadata=(
                ("authorization", f"Bearer {setup.secret}"), ("x-request-id", request_id))))
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="solo", status=502, code="upstream_error")


def test_a_grpc_deadline_on_a_priced_unary_answer(setup):
    request_id, before = rid("deadline"), scrape(setup.gateway)
    setup.double.reset()
    setup.double.cue(Cue(frame_delay=1.0))
    with grpc.insecure_channel(f"127.0.0.1:{setup.gateway.port}") as channel:
        stub = chat_service_pb2_grpc.ChatServiceStub(channel)
        with pytest.raises(grpc.RpcError) as raised:
            stub.CreateChatCompletion(chat_request(model="priced", max_tokens=5), timeout=0.4, metadata=(
                ("authorization", f"Bearer {setup.secret}"), ("x-request-id", request_id)))
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    time.sleep(1.5)
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="priced", status=499, code="cancelled")
    assert out.row["cost_microdollars"] > 0


def test_a_streamed_fallback_left_mid_stream(setup):
    request_id, before = rid("sf499"), scrape(setup.gateway)
    setup.double.reset()
    setup.double.cue(*failing(503, 3),
                     Cue(frame_delay=0.5))
    stream = openai_caller(setup, request_id).chat.completions.create(
        model="priced", messages=[{"role": "user", "content": "one two three four five"}], max_tokens=50,
        stream=True, stream_options={"include_usage": True})
    next(iter(stream))
    next(iter(stream))
    stream.close()
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="priced", status=499, code="cancelled")
    assert out.row["upstream"] == "backup"
    assert out.row["cost_microdollars"] == 5 * out.row["input_tokens"] + 20 * out.row["output_tokens"]


def test_the_embedded_model_left_mid_stream(setup):
    request_id, before = rid("local499"), scrape(setup.gateway)
    stream = openai_caller(setup, request_id).chat.completions.create(
        model="local", messages=[{"role": "user", "content": "Write a long story about the sea."}], max_tokens=200,
        stream=True)
    next(iter(stream))
    next(iter(stream))
    stream.close()
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="local", status=499, code="cancelled")


def test_a_caller_gone_during_admission(setup):
    request_id = rid("499a")
    openai_caller(setup, rid("warm")).chat.completions.create(model="solo", messages=HI, max_tokens=5)
    time.sleep(0.3)
    before = scrape(setup.gateway)
    setup.redis.process.send_signal(signal.SIGSTOP)
    try:
        with pytest.raises(openai.APITimeoutError):
            openai_caller(setup, request_id).with_options(timeout=0.2).chat.completions.create(
                model="solo", messages=HI, max_tokens=5)
        time.sleep(0.6)
    finally:
        setup.redis.process.send_signal(signal.SIGCONT)
    time.sleep(1.2)
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="solo", status=499, code="cancelled")
    assert out.row["upstream"] is None and out.line["upstream_attempts"] == 0


def test_a_budgets_gauge_is_the_budget_less_the_ledgers_costs(setup):
    key_id, secret = limited_key(setup, "--max-spend-day", "1", "--max-spend-month", "2")
    caller = openai_caller(setup, rid("b1"), secret)
    caller.chat.completions.create(model="priced", messages=HI, max_tokens=5)
    _spend_unanswered(setup, caller)
    time.sleep(1.0)
    rows = httpx.get(f"{setup.gateway.base_url}/v1/organization/requests", params={"start_time": 0},
                     headers={"authorization": f"Bearer {secret}"}, timeout=30).json()["data"]
    assert len(rows) == 4, rows
    spent = sum(row["cost_microdollars"] for row in rows)
    samples = scrape(setup.gateway)
    assert samples[("portico_budget_remaining_microdollars", labels(key_id=key_id, budget="day"))] == \
        1_000_000 - spent, (spent, [(r["status"], r["upstream"], r["cost_microdollars"]) for r in rows])
    assert samples[("portico_budget_remaining_microdollars", labels(key_id=key_id, budget="month"))] == \
        2_000_000 - spent
    assert samples[("portico_spend_microdollars_total", labels(model="priced", key_id=key_id))] == spent


def _spend_unanswered(setup, caller) -> None:
    """Three requests that cost without the caller getting what it asked: a fallback's answer (at its price), an
    answer the caller stopped waiting for, a stream it left after its first chunk."""
    setup.double.reset()
    setup.double.cue(*failing(503, 3))
    caller.chat.completions.create(model="priced", messages=HI, max_tokens=5)
    setup.double.reset()
    setup.double.cue(Cue(frame_delay=1.0))
    with pytest.raises(openai.APITimeoutError):
        caller.with_options(timeout=0.4).chat.completions.create(model="priced", messages=HI, max_tokens=5)
    time.sleep(1.5)
    setup.double.reset()
    setup.double.cue(Cue(frame_delay=0.5))
    stream = caller.chat.completions.create(model="priced", max_tokens=50, stream=True, messages=[
        {"role": "user", "content": "one two three four"}])
    next(iter(stream))
    stream.close()


def test_a_fallback_that_failed_too(setup):
    request_id, before = rid("allfail"), scrape(setup.gateway)
    setup.double.reset()
    setup.double.cue(*failing(500, 4))
    with pytest.raises(openai.InternalServerError):
        openai_caller(setup, request_id).chat.completions.create(model="priced", messages=HI, max_tokens=5)
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="priced", status=502, code="upstream_error")
    # operations.md: the row's upstream is the last model tried; the span names no model that answered
    assert (out.row["upstream"], out.row["deployment"], out.line["upstream_attempts"]) == ("backup", "openai", 4)
    assert "gen_ai.response.model" not in out.span.attributes


def test_the_limits_count_what_the_ledger_holds(setup):
    """operations.md: the limits count as requests exactly the rows with upstream attempts plus cache hits and token
    counts (a retried attempt is no second request), and settle the ledger's tokens and cost."""
    out = setup.gateway.cli("keys", "create", "--name", "agree-counted", "--models", "priced,solo,cached,msgs",
                            "--daily-requests", "1000", "--daily-tokens", "1000000", "--max-spend-day", "10").stdout
    key_id, secret = out.split()[2], out.strip().splitlines()[-1]
    admin = setup.gateway.cli("keys", "create", "--name", "agree-admin", "--all-models", "--admin").stdout
    admin_secret = admin.strip().splitlines()[-1]
    caller = openai_caller(setup, rid("c"), secret)
    caller.chat.completions.create(model="priced", messages=HI, max_tokens=5)
    setup.double.reset()
    setup.double.cue(*failing(500, 3))
    with pytest.raises(openai.InternalServerError):
        caller.chat.completions.create(model="solo", messages=HI, max_tokens=5)
    setup.double.reset()
    for _ in range(2):
        caller.chat.completions.create(model="cached", messages=[{"role": "user", "content": "counted"}], max_tokens=5)
    with pytest.raises(openai.BadRequestError):
        caller.chat.completions.create(model="priced", messages=HI, max_tokens=-1)
    _spend_unanswered(setup, caller)
    setup.double.reset()
    anthropic.Anthropic(base_url=setup.gateway.base_url, api_key=secret, max_retries=0).messages.count_tokens(
        model="msgs", messages=HI)
    time.sleep(1.0)
    rows = httpx.get(f"{setup.gateway.base_url}/v1/organization/requests", params={"start_time": 0},
                     headers={"authorization": f"Bearer {secret}"}, timeout=30).json()["data"]
    limits = httpx.get(f"{setup.gateway.base_url}/v1/admin/keys/{key_id}/limits", timeout=30,
                       headers={"authorization": f"Bearer {admin_secret}"}).json()["limits"]
    used = {limit["limit"]: limit["used"] for limit in limits if not limit["model"]}
    hits = [row for row in rows if row["model"] == "cached" and row["upstream"] is None and row["status"] == 200]
    reached = [row for row in rows if row["upstream"] is not None]
    assert used["daily_requests"] == len(reached) + len(hits) + 1, (used, [
        (r["model"], r["status"], r["upstream"]) for r in rows])
    assert used["daily_tokens"] == sum(r["input_tokens"] + r["output_tokens"] for r in rows), (used, rows)
    assert round(used["max_spend_day"] * 1_000_000) == sum(r["cost_microdollars"] for r in rows), (used, rows)


def _messages_frames(with_text: bool) -> list[bytes]:
    start = (b'event: message_start\ndata: {"type":"message_start","message":{"id":"msg_1","type":"message",'
             b'"role":"assistant","model":"claude-up","content":[],"stop_reason":null,"stop_sequence":null,'
             b'"usage":{"input_tokens":7,"output_tokens":1}}}\n\n')
    text = (b'event: content_block_start\ndata: {"type":"content_block_start","index":0,"content_block":{"type":"text",'
            b'"text":""}}\n\nevent: content_block_delta\ndata: {"type":"content_block_delta","index":0,"delta":'
            b'{"type":"text_delta","text":"Hel"}}\n\n')
    error = b'event: error\ndata: {"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}\n\n'
    return [start, *([text] if with_text else []), error]


@pytest.mark.parametrize("with_text", [True, False])
def test_an_anthropic_error_event_in_a_stream(setup, with_text):
    request_id, before = rid("evt"), scrape(setup.gateway)
    setup.double.reset()
    setup.double.cue(*[Cue(frames=_messages_frames(with_text))] * 3)
    client = anthropic.Anthropic(base_url=setup.gateway.base_url, api_key=setup.secret, max_retries=0,
                                 default_headers={"x-request-id": request_id})
    with pytest.raises(anthropic.APIError):
        with client.messages.stream(model="msgs", messages=HI, max_tokens=20) as stream:
            for _ in stream:
                pass
    out = observe(setup, request_id, before)
    status = 200 if with_text else 503
    agree(out, request_id=request_id, key_id=setup.key_id, model="msgs", status=status, code="service_unavailable",
          endpoint="/v1/messages")
    retries = {k: v for k, v in out.metrics.items() if k[0] == "portico_upstream_retries_total"}
    assert sum(retries.values()) == out.line["upstream_attempts"] - 1, (retries, out.line)


def test_zzz_the_keys_totals_agree_everywhere(setup):
    totals_agree(setup)
