"""The outputs agree on answers and refusals: a JSON answer, a stream, Messages, images, a token count, the embedded
model, response-cache hits, a bad body, key or model, a non-admin, each of Portico's own limits: the access-log line,
the usage-ledger row, the trace and the metrics name the same request, key, model, status, code, tokens and cost
(tests/e2e/outputs_support.py)."""

from __future__ import annotations

import time

import anthropic
import grpc
import httpx
import openai
import pytest

from portico.v1 import chat_service_pb2_grpc
from tests.e2e.outputs_support import (
    HI, access_line, agree, changed, labels, limited_key, observe, openai_caller, rid, scrape, setup, totals_agree,
    ttft_moved,
)
from tests.helpers import chat_request
from tests.upstream_double import Cue

__all__ = ["setup"]  # the module-scoped gateway fixture


def test_a_json_answer(setup):
    request_id, before = rid("json"), scrape(setup.gateway)
    answer = openai_caller(setup, request_id).chat.completions.create(model="priced", messages=HI, max_tokens=5)
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="priced", status=200, code=None)
    assert (out.row["input_tokens"], out.row["output_tokens"]) == \
        (answer.usage.prompt_tokens, answer.usage.completion_tokens)
    assert out.row["upstream"] == "priced" and out.row["cost_microdollars"] > 0


def test_a_stream(setup):
    request_id, before = rid("stream"), scrape(setup.gateway)
    chunks = list(openai_caller(setup, request_id).chat.completions.create(
        model="priced", messages=HI, max_tokens=5, stream=True, stream_options={"include_usage": True}))
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="priced", status=200, code=None)
    usage = chunks[-1].usage
    assert (out.row["input_tokens"], out.row["output_tokens"]) == (usage.prompt_tokens, usage.completion_tokens)


def test_a_messages_answer(setup):
    request_id, before = rid("msgs"), scrape(setup.gateway)
    anthropic.Anthropic(base_url=setup.gateway.base_url, api_key=setup.secret, max_retries=0,
                        default_headers={"x-request-id": request_id}).messages.create(
        model="msgs", messages=HI, max_tokens=20)
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="msgs", status=200, code=None,
          endpoint="/v1/messages")


def test_a_bad_body(setup):
    request_id, before = rid("bad"), scrape(setup.gateway)
    with pytest.raises(openai.BadRequestError):
        openai_caller(setup, request_id).chat.completions.create(model="priced", messages=HI, max_tokens=-3)
    out = observe(setup, request_id, before, row=False)
    agree(out, request_id=request_id, key_id=setup.key_id, model="priced", status=400, code="invalid_request")


def test_a_bad_key(setup):
    request_id, before = rid("401"), scrape(setup.gateway)
    with pytest.raises(openai.AuthenticationError):
        openai_caller(setup, request_id, "pk-nobody-0000").chat.completions.create(model="priced", messages=HI)
    out = observe(setup, request_id, before, row=False)
    agree(out, request_id=request_id, key_id=None, model="", status=401, code="invalid_api_key")


@pytest.mark.parametrize("model", ["no-such-model", "secret-model"])
def test_an_unknown_or_ungranted_model(setup, model):
    request_id, before = rid("404"), scrape(setup.gateway)
    with pytest.raises(openai.NotFoundError):
        openai_caller(setup, request_id).chat.completions.create(model=model, messages=HI)
    out = observe(setup, request_id, before, row=False)
    agree(out, request_id=request_id, key_id=setup.key_id, model="", status=404, code="model_not_found")
    assert "gen_ai.request.model" not in out.span.attributes


def test_a_cache_hit(setup):
    first, second = rid("miss"), rid("hit")
    openai_caller(setup, first).chat.completions.create(model="cached", messages=HI, max_tokens=5)
    access_line(setup.gateway, first)
    before = scrape(setup.gateway)
    openai_caller(setup, second).chat.completions.create(model="cached", messages=HI, max_tokens=5)
    out = observe(setup, second, before)
    agree(out, request_id=second, key_id=setup.key_id, model="cached", status=200, code=None)
    assert out.line["cache"] == "hit" == out.span.attributes["portico.cache"]
    assert out.metrics[("portico_cache_lookups_total", labels(model="cached", result="hit"))] == 1


def test_a_non_admin_on_the_admin_api(setup):
    request_id, before = rid("403"), scrape(setup.gateway)
    answer = httpx.get(f"{setup.gateway.base_url}/v1/admin/keys", timeout=30,
                       headers={"authorization": f"Bearer {setup.secret}", "x-request-id": request_id})
    assert answer.status_code == 403
    out = observe(setup, request_id, before, row=False)
    agree(out, request_id=request_id, key_id=setup.key_id, model="", status=403, code="permission_denied",
          endpoint="/v1/admin/keys")


@pytest.mark.parametrize(("options", "limit"), [
    (("--rpm", "1"), "requests_per_minute"),
    (("--daily-requests", "1"), "daily_requests"),
    (("--tpm", "60"), "tokens_per_minute"),
    (("--max-spend-day", "0.0002"), "max_spend_day"),
])
def test_a_limit_refusal(setup, options, limit):
    key_id, secret = limited_key(setup, *options)
    openai_caller(setup, rid("first"), secret).chat.completions.create(model="priced", messages=HI, max_tokens=5)
    request_id, before = rid("429"), scrape(setup.gateway)
    with pytest.raises(openai.RateLimitError):
        openai_caller(setup, request_id, secret).chat.completions.create(model="priced", messages=HI, max_tokens=1000)
    setup.secret, saved = secret, setup.secret  # the ledger rows of this key
    try:
        out = observe(setup, request_id, before)
    finally:
        setup.secret = saved
    agree(out, request_id=request_id, key_id=key_id, model="priced", status=429, code="rate_limit_exceeded")
    assert out.line["limit"] == limit == out.span.attributes.get("portico.limit"), (out.line, out.span.attributes)
    assert out.metrics[("portico_rate_limit_rejections_total", labels(limit=limit, scope="key"))] == 1, out.metrics
    assert out.row["upstream"] is None and out.row["cost_microdollars"] == 0


def test_a_streamed_cache_hit(setup):
    first, second = rid("smiss"), rid("shit")
    body = {"model": "cached", "messages": [{"role": "user", "content": "stream me"}], "max_tokens": 5,
            "stream": True, "stream_options": {"include_usage": True}}
    list(openai_caller(setup, first).chat.completions.create(**body))
    access_line(setup.gateway, first)
    before = scrape(setup.gateway)
    list(openai_caller(setup, second).chat.completions.create(**body))
    out = observe(setup, second, before)
    agree(out, request_id=second, key_id=setup.key_id, model="cached", status=200, code=None)
    assert out.line["cache"] == "hit"


def test_times_agree(setup):
    request_id, before = rid("times"), scrape(setup.gateway)
    setup.double.reset()
    setup.double.cue(Cue(delay=0.3))
    openai_caller(setup, request_id).chat.completions.create(model="solo", messages=HI, max_tokens=5)
    out = observe(setup, request_id, before)
    span_ms = (out.span.end - out.span.start) / 1e6
    assert abs(out.row["latency_ms"] - out.line["duration_ms"]) < 2, (out.row, out.line)
    assert abs(span_ms - out.line["duration_ms"]) < 5, (span_ms, out.line)
    assert abs(out.row["first_token_ms"] - out.line["first_token_ms"]) < 2, (out.row, out.line)
    assert abs(out.span.attributes["portico.time_to_first_token_ms"] - out.line["first_token_ms"]) < 2
    assert ttft_moved(out) == 1


def test_a_cache_hit_has_no_first_token_anywhere(setup):
    body = {"model": "cached", "messages": [{"role": "user", "content": "no first token"}], "max_tokens": 5}
    openai_caller(setup, rid("m")).chat.completions.create(**body)
    request_id = rid("h")
    time.sleep(0.3)
    before = scrape(setup.gateway)
    openai_caller(setup, request_id).chat.completions.create(**body)
    out = observe(setup, request_id, before)
    assert out.line["cache"] == "hit"
    assert (out.line["first_token_ms"], out.row["first_token_ms"],
            out.span.attributes.get("portico.time_to_first_token_ms"), ttft_moved(out)) == (None, None, None, 0)


def test_cached_prompt_tokens_agree(setup):
    request_id, before = rid("pcache"), scrape(setup.gateway)
    setup.double.reset()
    setup.double.cue(Cue(body={
        "id": "chatcmpl-x", "object": "chat.completion", "created": 1, "model": "solo-model",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 100, "completion_tokens": 2, "total_tokens": 102,
                  "prompt_tokens_details": {"cached_tokens": 60}}}))
    openai_caller(setup, request_id).chat.completions.create(model="solo", messages=HI, max_tokens=5)
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="solo", status=200, code=None)
    assert out.row["input_cached_tokens"] == 60 == out.span.attributes["gen_ai.usage.cache_read.input_tokens"]
    assert out.row["input_tokens"] == 100


@pytest.mark.parametrize("model", ["img", "up-img"])
def test_an_image_request(setup, model):
    request_id, before = rid("img"), scrape(setup.gateway)
    answer = openai_caller(setup, request_id).images.generate(model=model, prompt="a buoy", n=2, size="256x256",
                                                              response_format="b64_json")
    assert len(answer.data) == 2
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model=model, status=200, code=None,
          endpoint="/v1/images/generations")
    assert out.line["images"] == out.row["images"] == 2
    assert out.row["cost_microdollars"] == {"img": 80000, "up-img": 20000}[model]


def test_a_token_count(setup):
    request_id, before = rid("count"), scrape(setup.gateway)
    counted = anthropic.Anthropic(base_url=setup.gateway.base_url, api_key=setup.secret, max_retries=0,
                                  default_headers={"x-request-id": request_id}).messages.count_tokens(
        model="msgs", messages=HI)
    out = observe(setup, request_id, before, row=False)
    agree(out, request_id=request_id, key_id=setup.key_id, model="msgs", status=200, code=None,
          endpoint="/v1/messages/count_tokens")
    assert out.line["input_tokens"] in (0, counted.input_tokens)


def test_a_concurrency_refusal(setup):
    key_id, secret = limited_key(setup, "--concurrency", "1")
    setup.double.reset()
    setup.double.cue(Cue(frame_delay=5))
    holder = openai_caller(setup, rid("holder"), secret).chat.completions.create(
        model="priced", messages=HI, max_tokens=5, stream=True)
    next(iter(holder))
    request_id, before = rid("429c"), scrape(setup.gateway)
    with pytest.raises(openai.RateLimitError):
        openai_caller(setup, request_id, secret).chat.completions.create(model="priced", messages=HI, max_tokens=5)
    setup.secret, saved = secret, setup.secret
    try:
        out = observe(setup, request_id, before)
    finally:
        setup.secret = saved
        holder.close()
    agree(out, request_id=request_id, key_id=key_id, model="priced", status=429, code="rate_limit_exceeded")
    assert out.line["limit"] == "concurrent_requests" == out.span.attributes.get("portico.limit")


def test_an_anthropic_prompt_cache_agrees(setup):
    """Anthropic's input_tokens leave out the prompt-cache parts; every output counts the whole prompt."""
    request_id, before = rid("acache"), scrape(setup.gateway)
    setup.double.reset()
    setup.double.cue(Cue(body={
        "id": "msg_x", "type": "message", "role": "assistant", "model": "claude-up",
        "content": [{"type": "text", "text": "hi"}], "stop_reason": "end_turn", "stop_sequence": None,
        "usage": {"input_tokens": 10, "output_tokens": 2, "cache_read_input_tokens": 50,
                  "cache_creation_input_tokens": 40}}))
    message = anthropic.Anthropic(base_url=setup.gateway.base_url, api_key=setup.secret, max_retries=0,
                                  default_headers={"x-request-id": request_id}).messages.create(
        model="msgs", messages=HI, max_tokens=20)
    assert message.usage.cache_read_input_tokens == 50
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="msgs", status=200, code=None,
          endpoint="/v1/messages")
    assert (out.row["input_tokens"], out.row["input_cached_tokens"]) == (100, 50), out.row
    attrs = out.span.attributes
    assert (attrs["gen_ai.usage.cache_read.input_tokens"], attrs["gen_ai.usage.cache_creation.input_tokens"]) == \
        (50, 40), attrs
    # msgs: input 3, output 15 $/M; no cached_input or cache_write price: those tokens at the input price
    assert out.row["cost_microdollars"] == 3 * 100 + 15 * 2, out.row


def test_a_model_on_the_wrong_path(setup):
    request_id, before = rid("wrongpath"), scrape(setup.gateway)
    with pytest.raises(openai.NotFoundError):
        openai_caller(setup, request_id).chat.completions.create(model="msgs", messages=HI, max_tokens=5)
    out = observe(setup, request_id, before, row=False)
    model = out.line["model"] or ""
    agree(out, request_id=request_id, key_id=setup.key_id, model=model, status=404, code="model_not_found")


def test_an_image_prompt_too_large(setup):
    request_id, before = rid("413"), scrape(setup.gateway)
    with pytest.raises(openai.APIStatusError) as raised:
        openai_caller(setup, request_id).images.generate(model="img", prompt="a" * (4 * 1024 * 1024 + 1), n=1,
                                                         size="256x256")
    assert raised.value.status_code == 413
    out = observe(setup, request_id, before, row=False)
    agree(out, request_id=request_id, key_id=setup.key_id, model="img", status=413, code="request_too_large",
          endpoint="/v1/images/generations")


def test_the_embedded_model(setup):
    request_id, before = rid("local"), scrape(setup.gateway)
    openai_caller(setup, request_id).chat.completions.create(model="local", messages=HI, max_tokens=3)
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="local", status=200, code=None)
    assert out.row["deployment"] == "llamacpp"


@pytest.mark.parametrize("chosen", ["a" * 200, "é" * 100, "z" * 127 + "é", "x-pk-abcdefghijklmnopqrstuvwxyz0123-y"])
def test_a_request_id_the_gateway_changed_is_the_same_everywhere(setup, chosen):
    """api.md: the caller's x-request-id is kept, cut to 128 bytes, a key shape redacted, as the logs and ledger
    keep it: the id the caller got back finds its line, row and span."""
    before = scrape(setup.gateway)
    answer = httpx.post(f"{setup.gateway.base_url}/v1/chat/completions", timeout=30,
                        headers={"authorization": f"Bearer {setup.secret}", "x-request-id": chosen.encode()},
                        json={"model": "solo", "messages": HI, "max_tokens": 3})
    assert answer.status_code == 200, answer.text
    got = next(value for name, value in answer.headers.raw if name.lower() == b"x-request-id").decode()
    assert len(got.encode()) <= 128 and "abcdefghijklmnop" not in got, got
    out = observe(setup, got, before)
    agree(out, request_id=got, key_id=setup.key_id, model="solo", status=200, code=None)


@pytest.mark.parametrize("chosen", ["g" * 200, "grpc-pk-abcdefghijklmnopqrstuvwxyz0123-y"])
def test_a_grpc_callers_request_id_is_the_same_everywhere(setup, chosen):
    before = scrape(setup.gateway)
    with grpc.insecure_channel(f"127.0.0.1:{setup.gateway.port}") as channel:
        stub = chat_service_pb2_grpc.ChatServiceStub(channel)
        _, call = stub.CreateChatCompletion.with_call(chat_request(model="solo", max_tokens=3), timeout=30, metadata=(
            ("authorization", f"Bearer {setup.secret}"), ("x-request-id", chosen)))
    got = dict(call.initial_metadata())["x-request-id"]
    assert len(got) <= 128 and "abcdefghijklmnop" not in got, got
    out = observe(setup, got, before)
    agree(out, request_id=got, key_id=setup.key_id, model="solo", status=200, code=None)


def test_a_per_model_limit_refusal(setup):
    openai_caller(setup, rid("cap1")).chat.completions.create(model="capped", messages=HI, max_tokens=3)
    request_id, before = rid("cap2"), scrape(setup.gateway)
    with pytest.raises(openai.RateLimitError):
        openai_caller(setup, request_id).chat.completions.create(model="capped", messages=HI, max_tokens=3)
    out = observe(setup, request_id, before)
    agree(out, request_id=request_id, key_id=setup.key_id, model="capped", status=429, code="rate_limit_exceeded")
    assert out.line["limit"] == "requests_per_minute" == out.span.attributes.get("portico.limit")
    assert out.metrics[("portico_rate_limit_rejections_total", labels(limit="requests_per_minute",
                                                                       scope="key_model"))] == 1, out.metrics


def test_a_body_over_the_limit_is_envoys_line_only(setup):
    """operations.md: Envoy answers it; its line (envoy-access.log when access_log is stderr) has the caller's request
    id and the error table's code; Portico's metrics, log and ledger have nothing of it."""
    request_id, before = rid("413e"), scrape(setup.gateway)
    with pytest.raises(openai.APIStatusError) as raised:
        openai_caller(setup, request_id).chat.completions.create(
            model="priced", messages=[{"role": "user", "content": "a" * (8 * 1024 * 1024 + 10)}], max_tokens=3)
    assert raised.value.status_code == 413
    assert raised.value.response.headers["x-request-id"] == request_id
    (line,) = setup.gateway.envoy_access_lines(request_id)
    assert (line["status"], line["code"], line["request"]) == (413, "request_too_large", "POST /v1/chat/completions")
    assert request_id not in setup.gateway.log_path.read_text()
    moved = {k: v for k, v in changed(before, scrape(setup.gateway), "portico_requests_total").items()}
    assert not moved, moved


def test_zzz_the_keys_totals_agree_everywhere(setup):
    totals_agree(setup)
