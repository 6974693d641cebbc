"""POST /v1/messages/count_tokens through the whole stack (real Envoy, `portico serve --config FILE`), called as the
official anthropic SDK calls it, on each provider kind: the embedded model (its exact count, the one its messages
report), an Anthropic upstream (the double: its own count, asked with the upstream's model name and the caller's
beta header; Portico's estimate where it has no count endpoint) and an OpenAI-compatible one (Portico's estimate);
the same keys, grants and 400s as /v1/messages; free of tokens and spend, and a gRPC stub call."""

from __future__ import annotations

import dataclasses
import time

import anthropic
import grpc
import httpx
import pytest

from portico.v1 import message_service_pb2_grpc, message_tokens_pb2
from server.domain import estimate_tokens
from tests.e2e.conftest import upstream_gateway
from tests.e2e.test_operations import wait_for_line
from tests.helpers import bearer, error_details
from tests.upstream_double import Cue
from tests.upstream_support import FAST_RETRY, UPSTREAM_KEY_ENV

WEATHER = {"name": "weather", "description": "The weather in a city, today and for the next seven days.",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}
HELLO = [{"role": "user", "content": "Say hello to the people of Oslo."}]


def models_yaml(double_url: str) -> str:
    gpt = f"kind: openai, base_url: '{double_url}', api_key_env: {UPSTREAM_KEY_ENV}, model: gpt-up"
    claude = (f"kind: anthropic, base_url: '{double_url.removesuffix('/v1')}', api_key_env: {UPSTREAM_KEY_ENV}, "
              "model: claude-up")
    rows = [
        ("messages-embedded", "/v1/messages", "{kind: llamacpp}", ""),
        ("chat-embedded", "/v1/chat/completions", "{kind: llamacpp}", ""),
        ("messages-claude", "/v1/messages", f"{{{claude}, retry: {{attempts: 1}}}}", ""),
        ("messages-gpt", "/v1/messages", f"{{{gpt}, retry: {{attempts: 1}}}}", ""),
        # Nothing listens on port 9: retried, then counted by its fallback.
        ("messages-down", "/v1/messages",
         f"{{kind: anthropic, base_url: 'http://127.0.0.1:9', model: x, retry: {FAST_RETRY}}}", "[messages-claude]"),
    ]
    return "".join(f"  - {{id: {i}, endpoint: {e}, provider: {p}{', fallbacks: ' + f if f else ''}}}\n"
                   for i, e, p, f in rows)


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    directory = tmp_path_factory.mktemp("count-tokens-gateway")
    with upstream_gateway(directory, models_yaml(double.url)) as gateway:
        # The CLI reads the catalog from the same file (keys create checks the models it grants).
        yield dataclasses.replace(gateway, config=directory / "portico.yaml")


@pytest.fixture(scope="module")
def client(gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.secret, max_retries=0)


@pytest.fixture(autouse=True)
def fresh(double):
    double.reset()


def test_the_embedded_count_is_the_input_tokens_its_message_reports(client):
    fields = dict(system="Answer in one short sentence.", messages=HELLO)
    count = client.messages.count_tokens(model="messages-embedded", **fields)
    message = client.messages.create(model="messages-embedded", max_tokens=1, **fields)
    assert count.input_tokens == message.usage.input_tokens > 0
    # The beta resource is the same path (with ?beta=true).
    assert client.beta.messages.count_tokens(model="messages-embedded", **fields).input_tokens == count.input_tokens


def test_the_count_grows_with_the_system_prompt_and_with_tools_where_the_model_reads_them(client):
    # Without a system prompt SmolLM2's chat template writes its own default one: compare two of ours.
    bare = client.messages.count_tokens(model="messages-embedded", messages=HELLO, system="Be brief.").input_tokens
    longer = client.messages.count_tokens(model="messages-embedded", messages=HELLO,
                                          system="Be brief, and answer in the language of the question.")
    assert longer.input_tokens > bare
    # The embedded model never sees tools (docs/api.md): they do not count there; the estimate counts them.
    assert client.messages.count_tokens(model="messages-embedded", messages=HELLO, system="Be brief.",
                                        tools=[WEATHER]).input_tokens == bare
    estimate = client.messages.count_tokens(model="messages-gpt", messages=HELLO).input_tokens
    assert client.messages.count_tokens(model="messages-gpt", messages=HELLO, tools=[WEATHER]).input_tokens > estimate


def test_an_anthropic_upstream_counts_with_its_model_name_and_the_caller_s_beta_header(client, double):
    double.cue(Cue(body={"input_tokens": 4321, "note": "counted by claude-up"}))
    count = client.beta.messages.count_tokens(model="messages-claude", messages=HELLO, system="Be brief.",
                                              tools=[WEATHER], betas=["context-management-2025-06-27"])
    assert count.input_tokens == 4321
    assert count.model_extra == {"note": "counted by messages-claude"}  # the upstream's name never reaches callers
    (seen,) = double.seen
    assert seen.path == "/v1/messages/count_tokens"
    # The SDK adds its own token-counting beta: every value reaches the upstream.
    assert "context-management-2025-06-27" in seen.headers["anthropic-beta"].split(",")
    assert seen.body == {"model": "claude-up", "messages": HELLO, "system": "Be brief.", "tools": [WEATHER]}


def test_fields_that_only_shape_a_generation_are_checked_and_not_sent_upstream(client, double, gateway):
    body = {"model": "messages-claude", "messages": HELLO, "max_tokens": 5, "stream": True, "temperature": 0.5,
            "metadata": {"user_id": "u1"}, "cache_control": {"type": "ephemeral"}}
    answer = httpx.post(f"{gateway.base_url}/v1/messages/count_tokens", json=body,
                        headers={"x-api-key": gateway.secret})
    assert answer.status_code == 200 and answer.json() == {"input_tokens": 7}  # the echo's words
    (seen,) = double.seen
    assert seen.body == {"model": "claude-up", "messages": HELLO, "cache_control": {"type": "ephemeral"}}
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.count_tokens(model="messages-claude", messages=HELLO, extra_body={"temperature": 3})
    assert caught.value.body["error"]["param"] == "temperature"


@pytest.mark.parametrize("model", ["messages-embedded", "messages-gpt", "messages-claude"])
def test_fields_that_only_shape_a_generation_are_no_refusal_on_any_model(client, double, model):
    """api.md lists `container` (and `stop_sequences`) among the fields a count accepts and then ignores: the embedded
    model and an OpenAI-compatible upstream refused them as they would refuse a generation (`container`, a
    whitespace-only stop), where an Anthropic upstream counted the same body. One body counts on every model."""
    bare = client.messages.count_tokens(model=model, messages=HELLO).input_tokens
    count = client.messages.count_tokens(model=model, messages=HELLO, extra_body={
        "container": "container_1", "stop_sequences": ["\n"], "max_tokens": 5})
    assert count.input_tokens == bare
    assert all(set(seen.body) == {"model", "messages"} for seen in double.seen)
    with pytest.raises(anthropic.BadRequestError) as caught:  # still checked as on /v1/messages
        client.messages.count_tokens(model=model, messages=HELLO, extra_body={"stop_sequences": [""]})
    assert caught.value.body["error"]["param"] == "stop_sequences[0]"


def test_an_upstream_failure_maps_as_for_messages_and_a_down_upstream_falls_back(client, double):
    double.cue(Cue(status=400, body={"type": "error", "error": {
        "type": "invalid_request_error", "message": "claude-up cannot count this"}}))
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.count_tokens(model="messages-claude", messages=HELLO)
    assert caught.value.body["error"]["message"] == "messages-claude cannot count this"
    assert caught.value.body["type"] == "error"
    double.reset()
    count = client.messages.count_tokens(model="messages-down", messages=HELLO)
    assert count.input_tokens == 7 and [s.body["model"] for s in double.seen] == ["claude-up"]


@pytest.mark.parametrize("answer", [{}, {"input_tokens": None}, {"input_tokens": "7"}])
def test_an_upstream_count_without_a_whole_number_is_a_502_on_rest_and_grpc(gateway, client, double, answer):
    """An upstream whose count is null passed it on: the SDK's `input_tokens` was None (a TypeError in the caller's
    arithmetic) and a gRPC caller read 0; it is the same 502 as a count left out."""
    double.cue(Cue(body=answer))
    with pytest.raises(anthropic.InternalServerError) as caught:
        client.messages.count_tokens(model="messages-claude", messages=HELLO)
    assert caught.value.status_code == 502 and caught.value.body["error"]["code"] == "upstream_error"
    double.cue(Cue(body=answer))
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        request = message_tokens_pb2.CountMessageTokensRequest(model="messages-claude")
        request.messages.add(role="user").content.string_value = HELLO[0]["content"]
        with pytest.raises(grpc.RpcError) as failed:
            message_service_pb2_grpc.MessageServiceStub(channel).CountMessageTokens(
                request, metadata=bearer(gateway.secret))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert error_details(failed.value).error.code == "upstream_error"


def test_an_upstream_without_a_count_endpoint_gets_portico_s_estimate_on_rest_and_grpc(gateway, client, double):
    """Many Anthropic-compatible servers serve /v1/messages but no /v1/messages/count_tokens (a 404, or 405, 501):
    each count was a 502 `upstream_error`, which the anthropic SDK raises (a coding agent counting before each turn
    broke on it), and logged "does not know the configured model or path" and then "answers again". Such a count is
    now Portico's estimate, as an OpenAI-compatible upstream's is, on REST and typed gRPC; the upstream is asked each
    time, and the log says once what it lacks."""
    logged = len(gateway.log_path.read_text())
    estimate = estimate_tokens(len(HELLO[0]["content"]))
    for status in (404, 405, 501):
        double.cue(Cue(status=status, body={"type": "error", "error": {"type": "not_found_error",
                                                                         "message": "Not Found"}}))
        raw = client.messages.with_raw_response.count_tokens(model="messages-claude", messages=HELLO)
        assert raw.status_code == 200 and raw.parse().input_tokens == estimate
    double.cue(Cue(status=404, body={"detail": "Not Found"}))  # FastAPI's, as many compatible servers answer
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        request = message_tokens_pb2.CountMessageTokensRequest(model="messages-claude")
        request.messages.add(role="user").content.string_value = HELLO[0]["content"]
        counted = message_service_pb2_grpc.MessageServiceStub(channel).CountMessageTokens(
            request, metadata=bearer(gateway.secret))
    assert counted.input_tokens == estimate
    assert [seen.path for seen in double.seen] == ["/v1/messages/count_tokens"] * 4
    assert client.messages.create(model="messages-claude", max_tokens=5, messages=HELLO).content  # messages go on
    log = gateway.log_path.read_text()
    assert log.count("has no count_tokens endpoint") == 1
    assert ("The upstream serving messages-claude has no count_tokens endpoint (HTTP 404): counts for its models are "
            "estimated") in log
    assert "does not know the configured model or path" not in log[logged:] and "answers again" not in log[logged:]


def test_a_count_refused_for_the_gateway_s_credentials_or_account_and_a_message_s_404_are_still_502s(client, double):
    """Only a count endpoint the upstream lacks is estimated: a refusal of the gateway's key or account is the
    gateway's configuration (a 502 that says so, not an estimate that hides it), and so is a message's 404."""
    for status, kind in ((401, "authentication_error"), (403, "permission_error"), (402, "billing_error")):
        double.cue(Cue(status=status, body={"type": "error", "error": {"type": kind, "message": "refused"}}))
        with pytest.raises(anthropic.InternalServerError) as caught:
            client.messages.count_tokens(model="messages-claude", messages=HELLO)
        assert caught.value.status_code == 502 and caught.value.body["error"]["code"] == "upstream_error"
    double.cue(Cue(status=404, body={"type": "error", "error": {"type": "not_found_error", "message": "Not Found"}}))
    with pytest.raises(anthropic.InternalServerError) as caught:
        client.messages.create(model="messages-claude", max_tokens=5, messages=HELLO)
    assert caught.value.status_code == 502 and "does not know the configured model" in caught.value.message


def test_an_openai_compatible_upstream_gets_portico_s_estimate_and_is_not_asked(client, double):
    count = client.messages.count_tokens(model="messages-gpt", messages=HELLO)
    assert count.input_tokens == estimate_tokens(len(HELLO[0]["content"])) > 0  # 4 characters a token
    assert double.seen == []


def test_the_access_log_counts_each_upstream_count_as_an_attempt(gateway, client):
    """A count an upstream makes is an upstream request: its access-log line says how many attempts it took and how
    long they took, as a message's does (the first attempt went uncounted: 0 for one, 3 for four)."""
    def line_of(model: str) -> dict:
        raw = client.messages.with_raw_response.count_tokens(model=model, messages=HELLO)
        return wait_for_line(gateway, raw.headers["x-request-id"])

    claude = line_of("messages-claude")
    assert claude["upstream_attempts"] == 1 and claude["duration_ms"] >= claude["upstream_ms"] > 0
    down = line_of("messages-down")  # three tries on port 9, then its fallback
    assert down["upstream_attempts"] == 4 and down["upstream_ms"] > 0
    for model in ("messages-gpt", "messages-embedded"):  # counted in the gateway: no upstream asked
        line = line_of(model)
        assert (line["upstream_attempts"], line["upstream_ms"]) == (0, None)


def test_keys_models_and_bodies_are_checked_as_on_messages(gateway, client):
    url = f"{gateway.base_url}/v1/messages/count_tokens"
    answer = httpx.post(url, json={"model": "messages-embedded", "messages": HELLO})
    assert answer.status_code == 401
    assert answer.json()["type"] == "error" and "x-api-key" in answer.json()["error"]["message"]
    for model in ("nope", "chat-embedded"):
        with pytest.raises(anthropic.NotFoundError) as caught:
            client.messages.count_tokens(model=model, messages=HELLO)
        assert caught.value.body["error"]["param"] == "model"
    assert "/v1/chat/completions" in caught.value.body["error"]["message"]  # the path the model is served at
    narrow = gateway.cli("keys", "create", "--name", "narrow", "--models", "messages-gpt").stdout.splitlines()[-1]
    with pytest.raises(anthropic.NotFoundError):
        anthropic.Anthropic(base_url=gateway.base_url, api_key=narrow, max_retries=0).messages.count_tokens(
            model="messages-embedded", messages=HELLO)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.count_tokens(model="messages-embedded", messages=[{"role": "robot", "content": "x"}])
    assert caught.value.body["error"]["param"] == "messages[0].role"
    with pytest.raises(anthropic.BadRequestError) as caught:  # the embedded model refuses what /v1/messages refuses
        client.messages.count_tokens(model="messages-embedded", messages=HELLO,
                                     tools=[{"type": "web_search_20250305", "name": "web_search"}])
    assert caught.value.body["error"]["param"] == "tools[0].type"
    with pytest.raises(anthropic.BadRequestError) as caught:  # over the context window: as /v1/messages says
        client.messages.count_tokens(model="messages-embedded", messages=[{"role": "user", "content": "word " * 3000}])
    assert caught.value.body["error"]["param"] == "messages" and "prompt is too long" in caught.value.message


def test_counting_is_one_request_with_no_tokens_no_slot_held_and_no_ledger_row(gateway, client, double):
    created = gateway.cli("keys", "create", "--name", "counter", "--models", "messages-embedded,messages-claude",
                          "--rpm", "100", "--tpm", "5", "--daily-tokens", "5", "--concurrency", "1").stdout.splitlines()
    secret, key_id = created[-1], next(word for line in created for word in line.split() if word.startswith("key_"))
    counter = anthropic.Anthropic(base_url=gateway.base_url, api_key=secret, max_retries=0)
    long = [{"role": "user", "content": "Tell me everything about the weather in Oslo, Bergen and Trondheim."}]
    assert counter.messages.count_tokens(model="messages-embedded", messages=long).input_tokens > 5
    with pytest.raises(anthropic.BadRequestError):  # over the window: refused before admission, as a message is
        counter.messages.count_tokens(model="messages-embedded", messages=[{"role": "user", "content": "word " * 3000}])
    double.cue(Cue(status=500, body={"type": "error", "error": {"type": "api_error", "message": "down"}}))
    with pytest.raises(anthropic.InternalServerError):  # 502: failed, and its slot is free again
        counter.messages.count_tokens(model="messages-claude", messages=long)
    raw = counter.messages.with_raw_response.count_tokens(model="messages-claude", messages=long)
    assert raw.parse().input_tokens > 5 and raw.headers["x-ratelimit-remaining-requests"] == "97"
    with pytest.raises(anthropic.RateLimitError):  # a message of that prompt is over the token limits
        counter.messages.create(model="messages-claude", max_tokens=1, messages=long)
    admin = {"authorization": "Bearer " + gateway.cli("keys", "create", "--name", "admin", "--admin",
                                                      "--all-models").stdout.splitlines()[-1]}
    standing = httpx.get(f"{gateway.base_url}/v1/admin/keys/{key_id}/limits", headers=admin).json()
    used = {limit["limit"]: limit["used"] for limit in standing["limits"]}
    assert used["tokens_per_minute"] == used["daily_tokens"] == used["concurrent_requests"] == 0
    assert used["requests_per_minute"] == 3  # the three counts, the failed one too (a refused message books none)
    time.sleep(1.5)  # the ledger's flush interval
    rows = httpx.get(f"{gateway.base_url}/v1/organization/requests", params={"start_time": 0, "api_key_ids": key_id},
                     headers=admin).json()
    # The refused message only: a count is no model request and has no spend, as GET /v1/models.
    assert [(row["endpoint"], row["status"]) for row in rows["data"]] == [("/v1/messages", 429)]


def test_a_key_whose_tokens_are_spent_may_still_count(gateway, double):
    """Counting is never against tokens per minute or daily tokens: not even when a message used more than both."""
    secret = gateway.cli("keys", "create", "--name", "spent", "--models", "messages-claude", "--tpm", "5",
                         "--daily-tokens", "5").stdout.splitlines()[-1]
    spender = anthropic.Anthropic(base_url=gateway.base_url, api_key=secret, max_retries=0)
    double.cue(Cue(body={"type": "message", "role": "assistant", "content": [{"type": "text", "text": "x"}],
                         "stop_reason": "end_turn", "usage": {"input_tokens": 10, "output_tokens": 10}}))
    short = [{"role": "user", "content": "hi"}]
    spender.messages.create(model="messages-claude", max_tokens=1, messages=short)  # reserved 2 tokens, used 20
    raw = spender.messages.with_raw_response.count_tokens(model="messages-claude", messages=HELLO)
    assert raw.parse().input_tokens > 0 and raw.headers["x-ratelimit-remaining-tokens"] == "0"
    with pytest.raises(anthropic.RateLimitError):  # a message is still refused
        spender.messages.create(model="messages-claude", max_tokens=1, messages=short)


def test_grpc_callers_count_with_the_typed_rpc(gateway, client):
    expected = client.messages.count_tokens(model="messages-embedded", messages=HELLO).input_tokens
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = message_service_pb2_grpc.MessageServiceStub(channel)
        request = message_tokens_pb2.CountMessageTokensRequest(model="messages-embedded")
        request.messages.add(role="user").content.string_value = HELLO[0]["content"]
        assert stub.CountMessageTokens(request, metadata=bearer(gateway.secret)).input_tokens == expected
        with pytest.raises(grpc.RpcError) as caught:
            stub.CountMessageTokens(message_tokens_pb2.CountMessageTokensRequest(model="messages-embedded"),
                                    metadata=bearer(gateway.secret))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_details(caught.value).error.param == "messages"
