"""The official openai SDK against the running gateway: models, completions (JSON and streamed) and every error row."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import orjson
import pytest

from tests.helpers import internal_headers


@pytest.fixture(scope="module")
def client(gateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.secret, max_retries=0)


def test_models_list_every_model_with_its_endpoint(client):
    models = {m.id: m for m in client.models.list()}
    assert len(models) == 8
    assert models["family-a-5.5"].model_extra["endpoint"] == "/v1/chat/completions"
    assert models["family-b-opus-4-8"].model_extra["endpoint"] == "/v1/messages"
    assert models["family-a-image-2"].model_extra["endpoint"] == "/v1/images/generations"
    assert isinstance(models["family-a-5.5"].created, int)
    assert client.models.retrieve("family-a-5.4").owned_by == "family-a"
    # OpenAI's shape, whatever the anthropic SDK gets on the same path (it sends anthropic-version).
    raw = client.models.with_raw_response.list().http_response.json()
    assert set(raw) == {"object", "data"} and len(raw["data"]) == 8
    assert set(raw["data"][0]) == {"id", "object", "created", "owned_by", "endpoint"}


def test_chat_completion(client):
    completion = client.chat.completions.create(
        model="family-a-5.5", messages=[{"role": "user", "content": "Say hello."}], max_tokens=6, temperature=0
    )
    assert completion.object == "chat.completion"
    assert completion.choices[0].message.content
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 6 and completion.usage.prompt_tokens > 0


def test_streamed_chat_completion_with_usage(client):
    # Greedy: at temperature 1 the model ends "Count to three." within 5 tokens about one time in fifteen.
    stream = client.chat.completions.create(
        model="family-a-5.4", messages=[{"role": "user", "content": "Count to three."}], max_completion_tokens=5,
        stream=True, stream_options={"include_usage": True}, temperature=0,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 5


def test_stream_arrives_token_by_token(gateway):
    body = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Tell a story."}],
            "max_tokens": 30, "stream": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {gateway.secret}"}
    with httpx.stream("POST", f"{gateway.base_url}/v1/chat/completions", json=body, headers=headers, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert not any(h.startswith("grpc-") for h in response.headers)
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert len(events) >= 30 and events[-1] == "data: [DONE]"


def _error(exc: openai.APIStatusError) -> dict:
    return exc.response.json()["error"]


def test_wrong_key_is_401(gateway):
    bad = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="pk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.models.list()
    assert _error(caught.value) == {"message": "Incorrect API key provided.", "type": "authentication_error",
                                    "param": None, "code": "invalid_api_key"}
    assert caught.value.code == "invalid_api_key"
    # The key is judged first, whatever the body: a caller with a bad key learns nothing about its request.
    for path in ("/v1/chat/completions", "/v1/messages", "/v1/images/generations"):
        for body in (b"{not json", b"[]", b'{"model": 5}', b""):
            answer = httpx.post(f"{gateway.base_url}{path}", content=body,
                                headers={"authorization": "Bearer pk-wrong", "content-type": "application/json"})
            assert answer.status_code == 401 and answer.json()["error"]["code"] == "invalid_api_key", (path, body)


def test_callers_without_a_key_cannot_hold_up_the_others(gateway):
    """A body was parsed before its key was looked at: 6 MB of tiny JSON values (800,000 small arrays)
    took the server ~0.4 s to read, during which every other caller's request waited, and a caller needing no key
    for it (none, or a made-up one: both a 401) could send such bodies back to back. The key now goes first."""
    tiny_values = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "x"}],
                   "metadata": {"x": [[0, 0, 0]] * 800_000}}
    body = orjson.dumps(tiny_values)
    assert len(body) > 5_000_000
    answers: list[httpx.Response] = []

    def without_a_key(headers: dict) -> None:
        for _ in range(2):
            answers.append(httpx.post(f"{gateway.base_url}/v1/chat/completions", content=body, timeout=60,
                                      headers={"content-type": "application/json", **headers}))

    senders = [threading.Thread(target=without_a_key, args=(headers,))
               for headers in ({}, {"authorization": "Bearer pk-wrong"}) * 3]
    waits = []
    with httpx.Client(base_url=gateway.base_url, headers={"authorization": f"Bearer {gateway.secret}"}) as client:
        for sender in senders:
            sender.start()
        while any(sender.is_alive() for sender in senders):
            start = time.monotonic()
            assert client.get("/v1/models").status_code == 200
            waits.append(time.monotonic() - start)
            time.sleep(0.01)
    assert [answer.status_code for answer in answers] == [401] * 12
    assert max(waits) < 0.5, f"a keyed caller waited {max(waits):.2f} s behind callers without a key"


def test_unknown_and_family_b_models_are_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert (caught.value.code, caught.value.param) == ("model_not_found", "model")
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="family-b-haiku-4-5-20251001",
                                       messages=[{"role": "user", "content": "x"}])
    assert "/v1/messages" in _error(caught.value)["message"]


@pytest.mark.parametrize(
    ("fields", "param"),
    [({"messages": []}, "messages"), ({"temperature": 2.5}, "temperature"), ({"max_tokens": 0}, "max_tokens"),
     ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role")],
)
def test_invalid_values_are_400(client, fields, param):
    kwargs = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "x"}], **fields}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(**kwargs)
    assert (caught.value.code, caught.value.param, caught.value.type) == (
        "invalid_request", param, "invalid_request_error")
    assert not internal_headers(caught.value.response.headers)


def test_client_that_goes_away_cancels_its_generation(gateway, client):
    """A stream abandoned after a few tokens must not keep the model busy for the rest of its 2000 tokens."""
    # Greedy, this prompt runs to max_tokens, so only cancellation can free the single model instance early.
    body = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Write a very long story."}],
            "max_tokens": 2000, "stream": True, "temperature": 0}
    headers = {"Authorization": f"Bearer {gateway.secret}"}
    stamps = []
    with httpx.stream("POST", f"{gateway.base_url}/v1/chat/completions", json=body, headers=headers,
                      timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                stamps.append(time.monotonic())
                if len(stamps) == 12:
                    break
    seconds_per_token = (stamps[-1] - stamps[2]) / 9  # measured now, so a loaded machine scales both sides
    started = time.monotonic()
    completion = client.chat.completions.create(
        model="family-a-5.5", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, temperature=0)
    assert completion.usage.completion_tokens == 3
    # Without cancellation the follow-up would wait behind ~1,990 more tokens; allow the time of 200.
    assert time.monotonic() - started < 200 * seconds_per_token


@pytest.mark.parametrize("stream", [False, True])
def test_a_character_the_model_leaves_unfinished_is_dropped_not_sent_as_u_fffd(client, stream):
    """With this seed SmolLM2 samples the first two bytes of a CJK character, then starts the next one: those bytes
    are no text (as a character cut off by max_tokens is not), where the answer held U+FFFD, streamed or not."""
    ask = dict(model="family-a-5.5", max_tokens=4, seed=1, messages=[
        {"role": "user", "content": "Write three emoji about cats 🐱🐈 and say 猫 in Chinese: 猫猫猫"}])
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **ask))
    else:
        text = client.chat.completions.create(**ask).choices[0].message.content
    assert text == "这表示"


ASK = {"role": "user", "content": "Weather in Paris?"}
CALL = {"role": "assistant", "content": None, "tool_calls": [
    {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
WEATHER_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


@pytest.mark.parametrize(("messages", "param", "words"), [
    ([ASK, CALL], "messages[1].tool_calls", "did not have response messages: call_1"),
    ([ASK, CALL, {"role": "user", "content": "And?"}], "messages[1].tool_calls", "did not have response messages"),
    ([ASK, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "messages[1].role",
     "must be a response to a preceding message with 'tool_calls'"),
    ([ASK, CALL, {"role": "tool", "tool_call_id": "call_9", "content": "sunny"}], "messages[2].tool_call_id",
     "'call_9' not found in 'tool_calls' of previous message"),
])
def test_tool_traffic_openai_s_api_refuses_is_refused_not_answered(client, messages, param, words):
    """A tool call without its result, or a result without its call, is a 400 on OpenAI's API (and Anthropic's); the
    embedded model answered it, so code that worked against it failed once the model was served upstream."""
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="family-a-5.5", messages=messages, tools=WEATHER_TOOLS, max_tokens=4)
    assert caught.value.param == param and words in caught.value.message


def test_tool_traffic_in_pairs_is_answered(client):
    messages = [ASK, CALL, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    assert client.chat.completions.create(model="family-a-5.5", messages=messages, tools=WEATHER_TOOLS,
                                          max_tokens=4).choices[0].message.content


def test_a_safety_identifier_openai_s_api_refuses_is_refused_not_ignored(client):
    """OpenAI's API takes a `safety_identifier` of at most 64 characters; the embedded model ignored a longer one (a
    raw e-mail address with a long domain, an unhashed session token), so code that worked here failed once the
    model was served by OpenAI."""
    hi = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="family-a-5.5", messages=hi, max_tokens=2, safety_identifier="s" * 65)
    assert caught.value.param == "safety_identifier"
    assert "Expected a string with maximum length 64, but got a string with length 65" in caught.value.message
    assert client.chat.completions.create(model="family-a-5.5", messages=hi, max_tokens=2,
                                          safety_identifier="s" * 64).usage.completion_tokens > 0


@pytest.mark.parametrize(("metadata", "param", "words"), [
    ({f"k{i}": "v" for i in range(17)}, "metadata",
     "Expected an object with at most 16 properties, but got an object with 17 properties"),
    ({"k" * 65: "v"}, "metadata", "Expected a key with maximum length 64, but got a key with length 65"),
    ({"note": "v" * 513}, "metadata.note", "Expected a string with maximum length 512, but got a string with length 513"),
])
def test_metadata_openai_s_api_refuses_is_refused_not_ignored(client, metadata, param, words):
    """OpenAI's API takes at most 16 `metadata` pairs, keys of at most 64 characters and values of at most 512; the
    embedded model ignored more, so code that worked here failed once the model was served by OpenAI."""
    hi = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="family-a-5.5", messages=hi, max_tokens=2, metadata=metadata)
    assert caught.value.param == param and words in caught.value.message
    most = {f"{i:0>64}": "v" * 512 for i in range(16)}
    assert client.chat.completions.create(model="family-a-5.5", messages=hi, max_tokens=2,
                                          metadata=most).usage.completion_tokens > 0


def test_more_tools_than_openai_s_api_takes_are_refused_not_ignored(client):
    """OpenAI's API takes at most 128 tools; the embedded model took more (an agent that gathers every MCP server's
    tools), so code that worked here failed once the model was served by OpenAI."""
    hi = [{"role": "user", "content": "Hi"}]
    tools = [{"type": "function", "function": {"name": f"tool_{i}"}} for i in range(129)]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="family-a-5.5", messages=hi, max_tokens=2, tools=tools)
    assert caught.value.param == "tools"
    assert "Expected an array with maximum length 128, but got an array with length 129" in caught.value.message
    assert client.chat.completions.create(model="family-a-5.5", messages=hi, max_tokens=2,
                                          tools=tools[:128]).usage.completion_tokens > 0


def test_top_logprobs_without_logprobs_is_refused_as_openai_s_api_refuses_it(client):
    """OpenAI's API takes `top_logprobs` only beside `logprobs: true`; the embedded model ignored it alone, so code
    that worked here failed once the model was served by OpenAI."""
    hi = [{"role": "user", "content": "Hi"}]
    for logprobs in (None, False):
        with pytest.raises(openai.BadRequestError) as caught:
            client.chat.completions.create(model="family-a-5.5", messages=hi, max_tokens=2, top_logprobs=3,
                                           **({} if logprobs is None else {"logprobs": logprobs}))
        assert caught.value.param == "top_logprobs"
        assert "only allowed when 'logprobs' is enabled" in caught.value.message
    for fields in ({"logprobs": True, "top_logprobs": 3}, {"top_logprobs": 0}):
        assert client.chat.completions.create(model="family-a-5.5", messages=hi, max_tokens=2,
                                              **fields).usage.completion_tokens > 0
