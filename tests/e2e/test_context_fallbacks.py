"""A prompt over a model's context window goes down its `fallbacks` (a longer window may take it), through the whole
stack (real Envoy, `portico serve --config FILE`) with the official SDKs: an OpenAI-compatible upstream's 400
`context_length_exceeded`, an Anthropic upstream's "prompt is too long", and the embedded model's own refusal. The
model's other deployments are not tried for it (a deployment is the same model), and other 400s are not fallen back."""

from __future__ import annotations

import dataclasses
import time

import anthropic
import httpx
import openai
import pytest

from tests.e2e.conftest import upstream_gateway
from tests.upstream_double import Cue
from tests.upstream_support import FAST_RETRY, UPSTREAM_KEY_ENV

HELLO = [{"role": "user", "content": "Say hello."}]
OPENAI_TOO_LONG = Cue(400, {"error": {
    "message": "This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens. "
               "Please reduce the length of the messages.",
    "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}})
FALLBACK_TOO_LONG = Cue(400, {"error": {
    "message": "This model's maximum context length is 128000 tokens. However, your messages resulted in 130000 "
               "tokens. Please reduce the length of the messages.",
    "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}})
ANTHROPIC_TOO_LONG = Cue(400, {"type": "error", "error": {
    "type": "invalid_request_error", "message": "prompt is too long: 209353 tokens > 199999 maximum"}})
# llama.cpp's server (llama-server), an OpenAI-compatible upstream configuration.md names, in its own words.
LLAMA_SERVER_TOO_LONG = Cue(400, {"error": {
    "code": 400, "message": "request (9000 tokens) exceeds the available context size (8192 tokens)",
    "type": "exceed_context_size_error", "n_prompt_tokens": 9000, "n_ctx": 8192}})
# Text Generation Inference (TGI): a 422 of its own shape, and inside a 200 stream an event with `http_status_code`.
TGI_TOO_LONG = Cue(422, {
    "error": "Input validation error: `inputs` tokens + `max_new_tokens` must be <= 4096. Given: 4000 `inputs` tokens "
             "and 200 `max_new_tokens`", "error_type": "validation"})
TGI_STREAM_TOO_LONG = Cue(200, headers={"content-type": "text/event-stream"}, frames=[
    b'data: {"error":{"message":"Input validation error: `inputs` must have less than 4095 tokens. Given: 5000",'
    b'"http_status_code":422}}\n\n', b"data: [DONE]\n\n"])
# Ollama's OpenAI-compatible API, when the model's context shift is off.
OLLAMA_TOO_LONG = Cue(400, {"error": {
    "message": "the prompt is longer than the context length currently available to the model; shorten the prompt, "
               "adjust the context length in settings, or use a model with a longer context length",
    "type": "invalid_request_error", "param": None, "code": None}})
UNAVAILABLE = Cue(503, {"error": {"message": "overloaded", "type": "server_error"}})
BAD_ROLE = Cue(400, {"error": {"message": "messages: bad role", "param": "messages", "type": "invalid_request_error"}})


def models_yaml(url: str) -> str:
    openai_kind = f"kind: openai, base_url: '{url}', api_key_env: {UPSTREAM_KEY_ENV}"
    claude = f"kind: anthropic, base_url: '{url.removesuffix('/v1')}', api_key_env: {UPSTREAM_KEY_ENV}"
    return f"""\
  - {{id: short, endpoint: /v1/chat/completions, provider: {{{openai_kind}, model: short-up, retry: {FAST_RETRY}}},
      fallbacks: [long]}}
  - {{id: long, endpoint: /v1/chat/completions, provider: {{{openai_kind}, model: long-up, retry: {{attempts: 1}}}}}}
  - {{id: solo, endpoint: /v1/chat/completions, provider: {{{openai_kind}, model: solo-up, retry: {FAST_RETRY}}}}}
  - id: pair
    endpoint: /v1/chat/completions
    deployments:
      - {{name: east, provider: {{{openai_kind}, model: east-up, retry: {FAST_RETRY}}}}}
      - {{name: west, provider: {{{openai_kind}, model: west-up, retry: {FAST_RETRY}}}}}
    fallbacks: [long]
  - {{id: tiny, endpoint: /v1/chat/completions, provider: {{kind: llamacpp}}, fallbacks: [long]}}
  - {{id: tiny-priced, endpoint: /v1/chat/completions, provider: {{kind: llamacpp}}, fallbacks: [long],
      price: {{input: 100, output: 100}}}}
  - {{id: claude-short, endpoint: /v1/messages, provider: {{{claude}, model: claude-short-up, retry: {FAST_RETRY}}},
      fallbacks: [claude-long]}}
  - {{id: claude-long, endpoint: /v1/messages, provider: {{{claude}, model: claude-long-up}}}}
  - {{id: brief, endpoint: /v1/chat/completions, provider: {{{openai_kind}, model: brief-up, retry: {FAST_RETRY}}},
      fallbacks: [wide]}}
  - id: wide
    endpoint: /v1/chat/completions
    deployments:
      - {{name: east, provider: {{{openai_kind}, model: wide-east-up, retry: {{attempts: 1}}}}}}
      - {{name: west, provider: {{{openai_kind}, model: wide-west-up, retry: {{attempts: 1}}}}}}
    health: {{consecutive_failures: 1, cooldown_seconds: 30}}
"""


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    with upstream_gateway(tmp_path_factory.mktemp("context-fallbacks"), models_yaml(double.url)) as gateway:
        yield gateway


@pytest.fixture(autouse=True)
def fresh(double):
    double.reset()


def asked(double) -> list[str]:
    return [seen.body["model"] for seen in double.seen]


def ledger_row(gateway, request_id: str) -> dict:
    """The usage ledger's row of one request (rows are written within usage.flush_seconds)."""
    deadline = time.monotonic() + 10
    while True:
        rows = httpx.get(f"{gateway.base_url}/v1/organization/requests", params={"start_time": 0, "limit": 20},
                         headers={"Authorization": f"Bearer {gateway.secret}"}, timeout=30).json()["data"]
        found = [row for row in rows if row["request_id"] == request_id]
        if found or time.monotonic() > deadline:
            assert found, rows
            return found[0]
        time.sleep(0.2)


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_over_the_window_is_answered_by_the_fallback(gateway, oai, double, stream):
    double.cue(OPENAI_TOO_LONG)
    raw = oai.chat.completions.with_raw_response.create(model="short", messages=HELLO, max_tokens=8, stream=stream)
    answer = raw.parse()
    if stream:
        text = "".join(chunk.choices[0].delta.content or "" for chunk in answer if chunk.choices)
    else:
        text = answer.choices[0].message.content
        assert answer.model == "short"  # the model the caller asked for, as for any fallback
    assert text == "echo Say hello."
    assert asked(double) == ["short-up", "long-up"]  # not retried: the same prompt would not fit again
    row = ledger_row(gateway, raw.headers["x-request-id"])
    assert (row["model"], row["upstream"], row["status"]) == ("short", "long", 200)


def test_a_messages_prompt_too_long_for_an_anthropic_upstream_goes_to_the_fallback(gateway, claude, double):
    double.cue(ANTHROPIC_TOO_LONG)
    raw = claude.messages.with_raw_response.create(model="claude-short", max_tokens=8, messages=HELLO)
    assert raw.parse().content[0].text == "echo Say hello."
    assert asked(double) == ["claude-short-up", "claude-long-up"]
    assert ledger_row(gateway, raw.headers["x-request-id"])["upstream"] == "claude-long"
    metrics = httpx.get(f"http://127.0.0.1:{gateway.metrics_port}/metrics", timeout=30).text
    assert 'portico_upstream_fallbacks_total{fallback="claude-long",model="claude-short"} 1.0' in metrics


def test_a_model_without_fallbacks_still_refuses_with_context_length_exceeded(oai, double):
    double.cue(OPENAI_TOO_LONG)
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="solo", messages=HELLO, max_tokens=8)
    error = caught.value.body
    assert (caught.value.status_code, error["code"], error["param"]) == (400, "context_length_exceeded", "messages")
    assert asked(double) == ["solo-up"]


def test_when_the_fallback_refuses_too_the_caller_gets_the_asked_models_refusal(gateway, oai, double):
    double.cue(OPENAI_TOO_LONG, FALLBACK_TOO_LONG)
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="short", messages=HELLO, max_tokens=8)
    error = caught.value.body
    assert (caught.value.status_code, error["code"], error["param"]) == (400, "context_length_exceeded", "messages")
    assert "maximum context length is 8192 tokens" in error["message"]  # the model the caller named
    assert asked(double) == ["short-up", "long-up"]


def test_another_400_is_not_fallen_back(oai, double):
    double.cue(BAD_ROLE)
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="short", messages=HELLO, max_tokens=8)
    assert (caught.value.body["code"], caught.value.body["message"]) == ("invalid_request", "messages: bad role")
    assert asked(double) == ["short-up"]


def test_the_models_other_deployment_is_not_tried_for_it(oai, double):
    double.cue(OPENAI_TOO_LONG)
    answer = oai.chat.completions.create(model="pair", messages=HELLO, max_tokens=8)
    assert answer.choices[0].message.content == "echo Say hello."
    assert len(double.seen) == 2 and asked(double)[0] in ("east-up", "west-up") and asked(double)[1] == "long-up"


def test_a_prompt_over_the_embedded_models_window_goes_to_the_fallback(gateway, oai, double):
    long_prompt = [{"role": "user", "content": "word " * 3000}]  # over embedded.context_size (2048)
    raw = oai.chat.completions.with_raw_response.create(model="tiny", messages=long_prompt, max_tokens=8)
    assert raw.parse().choices[0].message.content.startswith("echo word")
    assert asked(double) == ["long-up"]
    assert ledger_row(gateway, raw.headers["x-request-id"])["upstream"] == "long"
    double.cue(FALLBACK_TOO_LONG)
    with pytest.raises(openai.BadRequestError) as caught:  # the embedded model's own refusal, as without fallbacks
        oai.chat.completions.create(model="tiny", messages=long_prompt, max_tokens=8)
    assert caught.value.body["code"] == "context_length_exceeded"
    assert "maximum context length is 2048 tokens" in caught.value.body["message"]


def test_a_refusal_whose_fallback_is_out_of_service_is_a_503_that_says_so_and_counts_the_attempt(gateway, oai, double):
    """The model asked for refused the prompt as too long, and its fallback's deployments were all out of service:
    the caller heard "Every deployment of the model (and of its fallbacks) is out of service", though the model had
    answered, and its ledger row and access log said no upstream was asked (0 attempts, no `upstream`)."""
    double.cue(UNAVAILABLE, UNAVAILABLE)
    with pytest.raises(openai.InternalServerError):  # takes both of `wide`'s deployments out of service for 30 s
        oai.chat.completions.create(model="wide", messages=HELLO, max_tokens=8)
    double.reset()
    double.cue(OPENAI_TOO_LONG)
    with pytest.raises(openai.InternalServerError) as caught:
        oai.chat.completions.create(model="brief", messages=HELLO, max_tokens=8)
    error, headers = caught.value.body, caught.value.response.headers
    assert (caught.value.status_code, error["code"]) == (503, "service_unavailable")
    assert 0 < int(headers["retry-after"]) <= 30  # a later try may reach the fallback
    assert "context window" in error["message"] and "Every deployment of the model" not in error["message"]
    assert asked(double) == ["brief-up"]
    row = ledger_row(gateway, headers["x-request-id"])
    assert (row["upstream"], row["status"]) == ("brief", 503)  # its upstream was asked


def test_llama_servers_refusal_of_a_prompt_too_long_is_one_too(oai, double):
    """llama.cpp's server says it its own way (`exceed_context_size_error`, `"code": 400`): its refusal was a plain
    400 `invalid_request`, never handed to the fallback, and a framework catching `context_length_exceeded` missed it."""
    double.cue(LLAMA_SERVER_TOO_LONG)
    answer = oai.chat.completions.create(model="short", messages=HELLO, max_tokens=8)
    assert answer.choices[0].message.content == "echo Say hello."
    assert asked(double) == ["short-up", "long-up"]
    double.reset()
    double.cue(LLAMA_SERVER_TOO_LONG)
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="solo", messages=HELLO, max_tokens=8)
    error = caught.value.body
    assert (error["code"], error["param"], error["message"]) == (
        "context_length_exceeded", "messages", "request (9000 tokens) exceeds the available context size (8192 tokens)")


def test_a_key_granted_only_the_model_is_served_by_its_fallback(gateway, double):
    """Fallbacks are the operator's (configuration.md): a key's grants name what it may ask for, not what serves it."""
    configured = dataclasses.replace(gateway, config=gateway.data_dir.parent / "portico.yaml")
    secret = configured.cli("keys", "create", "--name", "short-only", "--models", "short").stdout.split()[-1]
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=secret, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="long", messages=HELLO, max_tokens=8)
    double.cue(OPENAI_TOO_LONG)
    answer = client.chat.completions.create(model="short", messages=HELLO, max_tokens=8)
    assert answer.choices[0].message.content == "echo Say hello." and asked(double) == ["short-up", "long-up"]


@pytest.mark.parametrize("cue", [TGI_TOO_LONG, TGI_STREAM_TOO_LONG, OLLAMA_TOO_LONG],
                         ids=["tgi", "tgi-stream", "ollama"])
def test_tgis_and_ollamas_refusals_of_a_prompt_too_long_are_ones_too(oai, double, cue):
    """TGI's 422 (and its in-stream error) and Ollama's 400 say it in words of their own: the caller got a plain
    `invalid_request` (TGI's stream: a 500 `upstream_error`), never handed to the fallback."""
    stream = cue is TGI_STREAM_TOO_LONG
    double.cue(cue)
    answer = oai.chat.completions.create(model="short", messages=HELLO, max_tokens=8, stream=stream)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in answer if chunk.choices) if stream else \
        answer.choices[0].message.content
    assert text == "echo Say hello."
    assert asked(double) == ["short-up", "long-up"]
    double.reset()
    double.cue(cue)
    with pytest.raises(openai.BadRequestError) as caught:
        answer = oai.chat.completions.create(model="solo", messages=HELLO, max_tokens=8, stream=stream)
        list(answer)
    error = caught.value.body
    assert (caught.value.status_code, error["code"], error["param"]) == (400, "context_length_exceeded", "messages")
    assert "context length" in error["message"] or "Input validation error" in error["message"]


@pytest.mark.parametrize("limit", [("--max-spend-day", "1"), ("--tpm", "10000")], ids=["budget", "tpm"])
def test_a_prompt_too_long_for_the_embedded_model_is_reserved_as_its_fallback_may_count_it(gateway, double, limit):
    """The embedded model counts a prompt too long for its window by its size alone, as at least bytes / 32 tokens
    (llamacpp.count_tokens): the reservation of one its fallback then served held 2,200 tokens of a prompt the
    fallback counted as 14,000, and a $1 budget was spent to $1.40 (a 10,000 tokens-per-minute limit to 14,000) by
    one request. Now it is reserved as for an upstream, and refused as too large for the limit."""
    configured = dataclasses.replace(gateway, config=gateway.data_dir.parent / "portico.yaml")
    secret = configured.cli("keys", "create", "--name", "limited", "--all-models", *limit).stdout.split()[-1]
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=secret, max_retries=0)
    long_prompt = [{"role": "user", "content": "word " * 14_000}]  # 70,000 bytes: 14,000 tokens upstream
    with pytest.raises(openai.RateLimitError) as caught:
        client.chat.completions.create(model="tiny-priced", messages=long_prompt, max_tokens=8)
    assert caught.value.body["message"].startswith("Request too large")
    assert double.seen == []
