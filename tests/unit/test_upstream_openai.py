"""OpenAI-compatible upstreams, pure parts: the body sent, literal SSE transcripts and whole (non-streamed) answers
read back into events, the error table, and the retry policy."""

from __future__ import annotations

import random

import orjson
import pytest

from server.domain_answers import FinishReason, Finished, TextDelta, ToolCallDelta, ToolCallStart, Usage
from server.domain_models import RetrySettings
from server.errors import (
    InvalidRequest, RateLimited, ServiceUnavailable, UpstreamError, UpstreamMisconfigured, UpstreamTimeout,
)
from server.providers.retry import backoff_delay
from server.providers.upstream_errors import from_status, from_stream_error, retry_after
from server.translate.internal_to_openai_request import openai_body
from server.translate.openai_chunks_to_internal import OpenAIChunkReader, completion_events
from server.translate.openai_to_internal import chat_request
from tests.helpers import chat_body as chat_pb

TOOL = {"type": "function", "function": {"name": "weather", "description": "Forecast.", "parameters": {
    "type": "object", "properties": {"days": {"type": "integer", "minimum": 1}}}}}


def test_a_chat_request_passes_through_whole():
    request = chat_pb(seed=7, logprobs=True, top_logprobs=2, max_completion_tokens=30, tools=[TOOL],
                      tool_choice="auto", parallel_tool_calls=False, response_format={"type": "json_object"},
                      stream_options={"include_obfuscation": False}, stream=True, user="u", temperature=0.5)
    generation = chat_request(request, default_max_tokens=99).generation
    assert openai_body(generation, model="gpt-up") == {
        "model": "gpt-up", "messages": [{"role": "user", "content": "Say hello."}], "seed": 7, "logprobs": True,
        "top_logprobs": 2, "max_tokens": 30, "tools": [TOOL], "tool_choice": "auto", "parallel_tool_calls": False,
        "response_format": {"type": "json_object"}, "temperature": 0.5, "user": "u", "stream": True,
        "stream_options": {"include_obfuscation": False, "include_usage": True},
    }
    body = openai_body(generation, model="gpt-up", max_tokens_field="max_completion_tokens")
    assert body["max_completion_tokens"] == 30 and "max_tokens" not in body


def test_a_chat_request_that_does_not_stream_asks_for_one_answer():
    request = chat_pb(seed=7, max_completion_tokens=30, user="u", stream=False)
    generation = chat_request(request, default_max_tokens=99).generation
    assert not generation.stream
    assert openai_body(generation, model="gpt-up") == {
        "model": "gpt-up", "messages": [{"role": "user", "content": "Say hello."}], "seed": 7, "max_tokens": 30,
        "user": "u", "stream": False,  # no stream_options: OpenAI refuses them without `stream`
    }
    absent = chat_request(chat_pb(), default_max_tokens=99).generation
    assert openai_body(absent, model="x")["stream"] is False and "stream_options" not in openai_body(absent, model="x")


def test_the_resolved_token_limit_is_always_sent():
    generation = chat_request(chat_pb(max_tokens=None), default_max_tokens=99).generation
    assert openai_body(generation, model="x")["max_tokens"] == 99


def frames(transcript: str) -> list[dict]:
    """A literal SSE transcript -> its JSON chunks (up to [DONE])."""
    events = [block.removeprefix("data: ") for block in transcript.strip().split("\n\n")]
    return [orjson.loads(data) for data in events if data != "[DONE]"]


def read(transcript: str, **options) -> list:
    reader = OpenAIChunkReader(prompt_estimate=options.pop("prompt_estimate", 7), **options)
    return [event for chunk in frames(transcript) for event in reader.feed(chunk)] + [reader.end()]


TEXT = """\
data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"role":"assistant","content":""}}]}

data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"Hel"}}]}

data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"lo"}}]}

data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{},"finish_reason":"length"}]}

data: {"id":"c","object":"chat.completion.chunk","choices":[],"usage":{"prompt_tokens":9,"completion_tokens":2}}

data: [DONE]
"""
TOOL_CALLS = """\
data: {"choices":[{"index":0,"delta":{"role":"assistant","content":null,"tool_calls":[{"index":0,"id":"call_a","type":"function","function":{"name":"weather","arguments":""}}]}}]}

data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\\"days\\":"}}]}}]}

data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"function":{"arguments":"2}"}}]}}]}

data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":1,"id":"call_b","type":"function","function":{"name":"time","arguments":"{}"}}]}}]}

data: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}],"usage":{"prompt_tokens":20,"completion_tokens":11}}

data: [DONE]
"""
NO_USAGE = """\
data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}

data: {"choices":[{"index":0,"delta":{"content":"!"},"finish_reason":"stop"}]}
"""
VLLM_STOP = """\
data: {"choices":[{"index":0,"delta":{"content":"1 2"},"finish_reason":"stop","stop_reason":"3"}]}
"""
# Ollama numbers every call of a parallel batch 0, each with its own id (ollama/ollama#15457).
SAME_INDEX = """\
data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"a","function":{"name":"w","arguments":"{}"}}]}}]}

data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"b","function":{"name":"t","arguments":"{}"}}]}}]}

data: {"choices":[{"index":0,"delta":{"tool_calls":[{"index":0,"id":"c","function":{"arguments":""}}]}}]}

data: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}
"""
# TGI (huggingface/text-generation-inference#2136) and llama.cpp's server (ggml-org/llama.cpp#20198) have sent a
# call's arguments as the JSON object itself, not as its text.
OBJECT_ARGUMENTS = """\
data: {"choices":[{"delta":{"tool_calls":[{"index":0,"id":"a","function":{"name":"w","arguments":{"days":2}}}]}}]}

data: {"choices":[{"index":0,"delta":{},"finish_reason":"tool_calls"}]}
"""
# Gemini's OpenAI compatibility: calls without `index`, a call's arguments split over pieces that name no call, a
# piece carrying only the call's thought signature, and `stop` after the calls (open-webui/computer#224).
SIGNATURE = '"extra_content":{"google":{"thought_signature":"c2ln"}}'
GEMINI = f"""\
data: {{"choices":[{{"delta":{{"tool_calls":[{{"id":"f-1","function":{{"name":"w","arguments":"{{\\"d\\":"}}}}]}}}}]}}

data: {{"choices":[{{"delta":{{"tool_calls":[{{"function":{{"arguments":"2}}"}}}}]}}}}]}}

data: {{"choices":[{{"delta":{{"tool_calls":[{{{SIGNATURE}}}]}}}}]}}

data: {{"choices":[{{"delta":{{"tool_calls":[{{"id":"f-2","function":{{"name":"t","arguments":"{{}}"}}}}]}}}}]}}

data: {{"choices":[{{"delta":{{"tool_calls":[{{"id":"f-2",{SIGNATURE}}}]}}}}]}}

data: {{"choices":[{{"delta":{{}},"finish_reason":"stop"}}]}}
"""
FILTERED = """\
data: {"choices":[{"index":0,"delta":{},"finish_reason":"content_filter"}]}
"""
# Mistral's reasoning models: content as a list of parts, thinking (not the answer) then text.
THINKING_PART = {"type": "thinking", "thinking": [{"type": "text", "text": "Hmm."}]}
PARTS = f"""\
data: {{"choices":[{{"index":0,"delta":{{"content":[{orjson.dumps(THINKING_PART).decode()}]}}}}]}}

data: {{"choices":[{{"index":0,"delta":{{"content":[{{"type":"text","text":"Paris."}}]}},"finish_reason":"stop"}}]}}

data: {{"choices":[],"usage":{{"prompt_tokens":4,"completion_tokens":8}}}}
"""


@pytest.mark.parametrize(
    ("transcript", "options", "events"),
    [
        (TEXT, {}, [TextDelta("Hel"), TextDelta("lo"), Finished(FinishReason.MAX_TOKENS, Usage(9, 2), None, "length")]),
        (TOOL_CALLS, {}, [ToolCallStart(0, "call_a", "weather"), ToolCallDelta(0, '{"days":'), ToolCallDelta(0, "2}"),
                          ToolCallStart(1, "call_b", "time"), ToolCallDelta(1, "{}"),
                          Finished(FinishReason.TOOL_USE, Usage(20, 11), upstream_reason="tool_calls")]),
        (NO_USAGE, {}, [TextDelta("Hi"), TextDelta("!"), Finished(FinishReason.END_TURN, Usage(7, 2), None, "stop")]),
        (VLLM_STOP, {"stop": ("3",)},
         [TextDelta("1 2"), Finished(FinishReason.STOP_SEQUENCE, Usage(7, 1), "3", "stop")]),
        (FILTERED, {}, [Finished(FinishReason.REFUSAL, Usage(7, 0), upstream_reason="content_filter")]),
        (SAME_INDEX, {}, [ToolCallStart(0, "a", "w"), ToolCallDelta(0, "{}"),
                          ToolCallStart(1, "b", "t"), ToolCallDelta(1, "{}"),
                          Finished(FinishReason.TOOL_USE, Usage(7, 2), upstream_reason="tool_calls")]),
        (OBJECT_ARGUMENTS, {}, [ToolCallStart(0, "a", "w"), ToolCallDelta(0, '{"days":2}'),
                                Finished(FinishReason.TOOL_USE, Usage(7, 1), upstream_reason="tool_calls")]),
        (GEMINI, {}, [ToolCallStart(0, "f-1", "w"), ToolCallDelta(0, '{"d":'), ToolCallDelta(0, "2}"),
                      ToolCallStart(1, "f-2", "t"), ToolCallDelta(1, "{}"),
                      Finished(FinishReason.TOOL_USE, Usage(7, 3), upstream_reason="stop")]),
        (FILTERED.replace("content_filter", "model_length"), {},
         [Finished(FinishReason.CONTEXT_WINDOW, Usage(7, 0), upstream_reason="model_length")]),
    ],
)
def test_transcripts(transcript, options, events):
    assert read(transcript, **options) == events


def completion(message: dict, finish_reason: str | None, usage: dict | None = None, **choice) -> dict:
    """A non-streamed answer as OpenAI-compatible servers send it."""
    answer = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [
        {"index": 0, "message": {"role": "assistant", **message}, "logprobs": None, "finish_reason": finish_reason,
         **choice}]}
    return {**answer, "usage": usage} if usage is not None else answer


def collected(events: list) -> tuple:
    """What the pipeline collects for a non-streamed caller: the text, each call whole, and how it finished."""
    calls: dict[int, list] = {}
    for event in events:
        if isinstance(event, ToolCallStart):
            calls[event.index] = [event.id, event.name, ""]
        elif isinstance(event, ToolCallDelta):
            calls[event.index][2] += event.arguments
    text = "".join(e.text for e in events if isinstance(e, TextDelta))
    return text, [tuple(calls[i]) for i in sorted(calls)], events[-1]


WEATHER_CALLS = [{"id": "call_a", "type": "function", "function": {"name": "weather", "arguments": '{"days":2}'}},
                 {"id": "call_b", "type": "function", "function": {"name": "time", "arguments": "{}"}}]


@pytest.mark.parametrize(
    ("transcript", "answer", "options"),
    [
        (TEXT, completion({"content": "Hello"}, "length", {"prompt_tokens": 9, "completion_tokens": 2}), {}),
        (TOOL_CALLS, completion({"content": None, "tool_calls": WEATHER_CALLS}, "tool_calls",
                                {"prompt_tokens": 20, "completion_tokens": 11, "total_tokens": 31}), {}),
        (VLLM_STOP, completion({"content": "1 2"}, "stop", stop_reason="3"), {"stop": ("3",)}),
        (FILTERED, completion({"content": None}, "content_filter"), {}),
        (OBJECT_ARGUMENTS, completion({"tool_calls": [{"id": "a", "type": "function", "function": {
            "name": "w", "arguments": {"days": 2}}}]}, "tool_calls", {"prompt_tokens": 7, "completion_tokens": 1}), {}),
        (PARTS, completion({"content": [THINKING_PART, {"type": "text", "text": "Paris."}]}, "stop",
                           {"prompt_tokens": 4, "completion_tokens": 8}), {}),
    ],
)
def test_a_whole_completion_gives_what_its_stream_gives(transcript, answer, options):
    events = completion_events(answer, prompt_estimate=7, **options)
    assert collected(events) == collected(read(transcript, **options))
    assert all(isinstance(e, (TextDelta, ToolCallStart, ToolCallDelta)) for e in events[:-1])


def test_a_whole_completion_as_events():
    answer = completion({"content": "On it.", "tool_calls": WEATHER_CALLS}, "tool_calls",
                        {"prompt_tokens": 20, "completion_tokens": 11})
    assert completion_events(answer, prompt_estimate=7) == [
        TextDelta("On it."), ToolCallStart(0, "call_a", "weather"), ToolCallDelta(0, '{"days":2}'),
        ToolCallStart(1, "call_b", "time"), ToolCallDelta(1, "{}"),
        Finished(FinishReason.TOOL_USE, Usage(20, 11), upstream_reason="tool_calls")]
    # No usage (no known server omits it, but then): the prompt estimated, the answer counted by its length.
    assert completion_events(completion({"content": "Hello there, world"}, "stop"), prompt_estimate=7)[-1] == (
        Finished(FinishReason.END_TURN, Usage(7, 5), upstream_reason="stop"))
    # A stop string OpenAI does not name stays end_turn, as in a stream.
    assert completion_events(completion({"content": "1 2"}, "stop"), prompt_estimate=7, stop=("3",))[-1].reason is (
        FinishReason.END_TURN)


@pytest.mark.parametrize(
    "answer",
    [{"object": "list", "data": []}, {"choices": "nope"}, {"choices": [{"index": 0, "text": "Hi"}]},
     {"choices": [{"index": 0, "message": {"content": ["a"]}, "finish_reason": "stop"}]},
     completion({"content": "Hi"}, None)],
)
def test_json_that_is_not_a_whole_completion_is_an_upstream_error(answer):
    with pytest.raises(UpstreamError) as caught:
        completion_events(answer, prompt_estimate=7)
    assert not caught.value.retryable  # a whole answer: asking again would get the same


def test_a_stream_without_a_finish_reason_is_an_upstream_error():
    with pytest.raises(UpstreamError) as caught:
        read('data: {"choices":[{"index":0,"delta":{"content":"Hi"}}]}')
    assert caught.value.retryable


# Mistral's `error` (the generation failed) and vLLM's `abort` (the engine gave the request up: shut down, paused,
# scaled in; vllm-project/vllm#57082): the text so far is not the answer, whatever a 200 and [DONE] say.
FAILED = """\
data: {"choices":[{"index":0,"delta":{"content":"The answer is"}}]}

data: {"choices":[{"index":0,"delta":{},"finish_reason":"abort"}]}

data: {"choices":[],"usage":{"prompt_tokens":9,"completion_tokens":3}}

data: [DONE]
"""


@pytest.mark.parametrize("reason", ["abort", "error"])
def test_a_generation_the_upstream_says_failed_is_an_upstream_error_counted_as_it_reported(reason):
    with pytest.raises(UpstreamError) as caught:
        read(FAILED.replace("abort", reason))
    assert f"`{reason}`" in caught.value.message and caught.value.retryable
    assert caught.value.usage_reported == Usage(9, 3)  # the ledger counts what the upstream spent on it
    answer = completion({"content": "The answer is"}, reason, {"prompt_tokens": 9, "completion_tokens": 3})
    with pytest.raises(UpstreamError) as caught:
        completion_events(answer, prompt_estimate=7)
    assert f"`{reason}`" in caught.value.message and caught.value.usage_reported == Usage(9, 3)


SECRET = "sk-abcdef123456"


@pytest.mark.parametrize(
    ("status", "body", "headers", "kind", "retryable"),
    [
        (400, b'{"error":{"message":"bad","param":"messages"}}', {}, InvalidRequest, False),
        (422, b'{"detail":"nope"}', {}, InvalidRequest, False),
        (401, b'{"error":{"message":"Incorrect API key provided: sk-abc***456"}}', {}, UpstreamMisconfigured, False),
        (403, b'{"error":{"message":"Project does not have access"}}', {}, UpstreamMisconfigured, False),
        (404, b'{"error":{"message":"The model up-m-2025 does not exist"}}', {}, UpstreamMisconfigured, False),
        (429, b'{"type":"error","error":{"type":"rate_limit_error","message":"slow"}}', {"retry-after": "7"},
         RateLimited, True),
        (500, b"<html>oops</html>", {}, UpstreamError, True),
        (502, b"", {}, UpstreamError, True),
        (503, b'{"error":{"message":"busy ' + SECRET.encode() + b'"}}', {}, ServiceUnavailable, True),
        (504, b"", {}, UpstreamTimeout, False),
        (529, b'{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"}}', {},
         ServiceUnavailable, True),
    ],
)
def test_upstream_statuses_become_rows_of_the_table(status, body, headers, kind, retryable):
    error = from_status(status, body, headers, retry_on=(429, 500, 502, 503, 529), upstream="m", secret=SECRET)
    assert type(error) is kind and error.retryable is retryable
    assert SECRET not in error.message and "sk-abc" not in error.message
    if status == 400:
        assert (error.message, error.param) == ("bad", "messages")
    if status == 429:
        assert error.retry_after == 7 and "slow" in error.message
    if status in (401, 403, 404):  # the gateway's configuration, not the caller's key or model: a 502 saying so
        assert error.kind.http_status == 502 and "configuration" in error.message and "up-m" not in error.message


@pytest.mark.parametrize(
    ("body", "message", "param"),
    [
        (b'{"object":"error","message":"vLLM says no","type":"BadRequestError","param":"top_k","code":400}',
         "vLLM says no", "top_k"),
        (b'{"message":"plain message"}', "plain message", None),
        (b'{"detail":[{"type":"int_parsing","loc":["body","messages",0,"content"],"msg":"Input should be a valid '
         b'string"},{"loc":["body","n"],"msg":"too big"}]}',
         "messages[0].content: Input should be a valid string; n: too big", "messages[0].content"),
        (b'{"error":"TGI says no","error_type":"validation"}', "TGI says no", None),
        # Shapes no convention names are passed on as the JSON they are, not as Python's repr of it
        (b'{"reason": "quota", "retry": false}', '{"reason":"quota","retry":false}', None),
        (b'["bad", "input"]', '["bad","input"]', None),
        (b'{"detail": {"why": "no"}}', '{"why":"no"}', None),
        (b'{"error": {"message": {"text": "nested"}}}', '{"text":"nested"}', None),
        (b'{"error": {"message": null}}', "HTTP 400", None),
    ],
)
def test_the_shapes_of_upstream_errors_keep_their_message_and_param(body, message, param):
    error = from_status(400, body, {}, retry_on=(), upstream="m", secret=None)
    assert (error.message, error.param) == (message, param)


NGINX_502 = (b"<html>\r\n<head><title>502 Bad Gateway</title></head>\r\n<body>\r\n<center><h1>502 Bad Gateway</h1>"
             b"</center>\r\n<hr><center>nginx/1.25.3</center>\r\n</body>\r\n</html>\r\n")


@pytest.mark.parametrize(("body", "message"), [
    (NGINX_502, "502 Bad Gateway"),
    (b"<!DOCTYPE html><html><body><h1 class='x'>Service &amp; API\n unavailable</h1><p>Try later</p></body></html>",
     "Service & API unavailable"),
    (b"<!doctype html><html><body><p>no heading</p></body></html>", "HTTP 502"),
    (b"upstream connect error <not html>", "upstream connect error <not html>"),
])
def test_an_html_error_page_is_told_by_its_title_not_its_markup(body, message):
    """A proxy's error page reached callers as up to 500 characters of markup, its footer naming the proxy and its
    version (`nginx/1.25.3`)."""
    error = from_status(502, body, {"content-type": "text/html"}, retry_on=(), upstream="m", secret=None)
    assert error.message.endswith(message) and "<" not in error.message.replace("<not html>", "")
    assert "nginx" not in error.message


def test_the_upstream_name_of_the_model_never_reaches_the_caller():
    body = b'{"error":{"message":"Rate limit reached for up-gpt-55-20250414 in organization org-x"}}'
    error = from_status(429, body, {}, retry_on=(), upstream="family-a-5.5", secret=None,
                        upstream_model="up-gpt-55-20250414")
    assert "up-gpt-55" not in error.message and "Rate limit reached for family-a-5.5" in error.message
    streamed = from_stream_error({"error": {"type": "api_error", "message": "up-gpt-55-20250414 broke"}},
                                 retry_on=(), upstream="family-a-5.5", secret=None, upstream_model="up-gpt-55-20250414")
    assert "up-gpt-55" not in streamed.message



def test_an_anthropic_upstreams_error_details_are_passed_on_without_its_key_or_model_name():
    details = {"error_code": "tool_name_conflict", "names": ["claude-up-1 tool", "sk-upstream-secret"]}
    body = orjson.dumps({"type": "error", "error": {"type": "invalid_request_error", "message": "no",
                                                    "details": details}})
    error = from_status(400, body, {}, retry_on=(), upstream="family-b", secret="sk-upstream-secret",
                        upstream_model="claude-up-1")
    assert error.details == {"error_code": "tool_name_conflict", "names": ["family-b tool", "[redacted]"]}
    no_code = orjson.dumps({"error": {"message": "no", "details": {"why": "x"}}})
    assert from_status(400, no_code, {}, retry_on=(), upstream="m", secret=None).details is None
    too_long = orjson.dumps({"error": {"message": "no", "details": {"error_code": "x", "more": "y" * 600}}})
    assert from_status(400, too_long, {}, retry_on=(), upstream="m", secret=None).details is None

@pytest.mark.parametrize(("upstream_model", "message", "shown"), [
    ("e", "The object is bad", "The object is bad"),  # inside a word: not the model
    ("gpt-4", "Use gpt-4o-mini or gpt-4.1, not gpt-4.", "Use gpt-4o-mini or gpt-4.1, not family-a-5.5."),
    ("gpt-3.5", "The model `gpt-3.5` does not exist", "The model `family-a-5.5` does not exist"),
    ("llama3", "models/llama3:8b is loading; llama3 too", "models/family-a-5.5:8b is loading; family-a-5.5 too"),
    # Names are case-insensitive on some servers (Ollama), which quote them in their own case.
    ("Qwen/Qwen2.5-7B", "model 'qwen/qwen2.5-7b' not found", "model 'family-a-5.5' not found"),
])
def test_the_upstream_name_is_replaced_where_it_stands_alone_not_inside_other_words(upstream_model, message, shown):
    body = orjson.dumps({"error": {"message": message}})
    error = from_status(400, body, {}, retry_on=(), upstream="family-a-5.5", secret=None, upstream_model=upstream_model)
    assert error.message == shown


def test_retry_after_forms():
    assert retry_after({"retry-after-ms": "1500", "retry-after": "9"}) == 1.5
    assert retry_after({"retry-after": "2"}) == 2
    assert 50 < retry_after({"retry-after": "Wed, 21 Oct 2099 07:28:00 GMT"}) <= 3600
    assert retry_after({"retry-after": "soon"}) == retry_after({}) == 0


@pytest.mark.parametrize(("headers", "seconds"), [
    ({"retry-after": "86400"}, 3600),  # a day would keep a deployment out of rotation that long
    ({"retry-after": "inf"}, 0), ({"retry-after": "nan"}, 0), ({"retry-after-ms": "1e400"}, 0),
    ({"retry-after": "-5"}, 0),
])
def test_retry_after_is_a_finite_wait_of_at_most_an_hour(headers, seconds):
    assert retry_after(headers) == seconds


SETTINGS = RetrySettings(attempts=3, initial_backoff=1.0, max_backoff=3.0, total_seconds=10.0)


def test_backoff_grows_exponentially_with_full_jitter_and_a_cap():
    retryable = UpstreamError("x", retry_reason="500")
    top = lambda: 0.999999  # noqa: E731
    assert [round(backoff_delay(SETTINGS, n, retryable, 0, top), 3) for n in (1, 2)] == [1.0, 2.0]
    capped = RetrySettings(attempts=9, initial_backoff=1.0, max_backoff=3.0, total_seconds=99)
    assert round(backoff_delay(capped, 5, retryable, 0, top), 3) == 3.0
    rng = random.Random(1)
    assert all(0 <= backoff_delay(SETTINGS, 2, retryable, 0, rng.random) < 2 for _ in range(100))


def test_when_retries_stop():
    retryable = UpstreamError("x", retry_reason="500")
    assert backoff_delay(SETTINGS, 3, retryable, 0, random.random) is None  # attempts used up
    assert backoff_delay(SETTINGS, 1, UpstreamError("x"), 0, random.random) is None  # not retryable
    assert backoff_delay(SETTINGS, 1, retryable, 9.5, lambda: 0.9) is None  # would end past total_seconds
    hinted = RateLimited("x", retry_after=4.0, retry_reason="429")
    assert backoff_delay(SETTINGS, 1, hinted, 0, lambda: 0.1) == 4.0  # retry-after wins over a shorter backoff
    assert backoff_delay(SETTINGS, 1, RateLimited("x", retry_after=60, retry_reason="429"), 0, random.random) is None


@pytest.mark.parametrize(
    ("status", "body", "code", "param"),
    [
        (400, b'{"error":{"message":"m","param":"messages","code":"context_length_exceeded"}}',
         "context_length_exceeded", "messages"),
        (422, b'{"message":"m","code":"unsupported_parameter"}', "unsupported_parameter", None),  # vLLM's older shape
        (400, b'{"error":{"message":"m","code":400}}', "invalid_request", None),
        (400, b'{"error":{"message":"This model\'s maximum context length is 4096 tokens. However, you requested 5000 '
              b'tokens.","code":400}}', "context_length_exceeded", "messages"),  # vLLM's
        (400, b'{"error":{"message":"This model\'s maximum context length is 4096 tokens.","code":"too_long"}}',
         "too_long", None),  # the upstream's own code wins
        (400, b'{"error":{"message":"m","code":"up_m_secret"}}', "invalid_request", None),  # it quotes the model
        (400, b'{"error":{"message":"m","code":"request_too_large"}}', "invalid_request", None),  # another row's
        (413, b'{"error":{"message":"m","code":"context_length_exceeded"}}', "request_too_large", None),
        (502, b'{"error":{"message":"m","code":"context_length_exceeded"}}', "upstream_error", None),
        (400, b'{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 9 tokens > 8 '
              b'maximum"}}', "context_length_exceeded", "messages"),
        (400, b'{"type":"error","error":{"type":"invalid_request_error","message":"input length and `max_tokens` '
              b'exceed context limit: 5 + 5 > 8, decrease input length or `max_tokens` and try again"}}',
         "context_length_exceeded", "messages"),
    ],
)
def test_an_upstream_4xx_keeps_its_own_code_only_where_it_is_a_plain_identifier(status, body, code, param):
    error = from_status(status, body, {}, retry_on=(), upstream="m", secret=None, upstream_model="up_m_secret")
    assert (error.code, error.param) == (code, param)
    assert error.kind.code in {"invalid_request", "request_too_large", "upstream_error"}  # the row stays the table's


@pytest.mark.parametrize(("status", "body"), [
    (402, b'{"type":"error","error":{"type":"billing_error","message":"Your credit balance is too low."}}'),
    (429, b'{"error":{"message":"You exceeded your current quota, please check your plan and billing details.",'
          b'"type":"insufficient_quota","param":null,"code":"insufficient_quota"}}'),
])
def test_an_upstream_refusing_the_gateways_account_is_the_gateways_problem_not_the_callers(status, body):
    """Anthropic's 402 billing_error and OpenAI's 429 insufficient_quota are about the gateway's account with the
    upstream: not a 400 telling the caller their request is wrong, nor a 429 their SDK retries in vain."""
    error = from_status(status, body, {}, retry_on=(429,), upstream="m", secret=None)
    assert type(error) is UpstreamMisconfigured and error.kind.http_status == 502
    assert ("x-should-retry", "false") in error.trailing_metadata()
    assert "account" in error.message and "not your key or request" in error.message
    # Retried as its status is (`retry.on_status`): another deployment or fallback may bill another account.
    assert error.retry_reason == ("429" if status == 429 else None)


def test_an_upstream_404_points_the_operator_at_base_url_as_well_as_the_model(caplog):
    """A base_url without /v1 (Ollama's http://127.0.0.1:11434) answers 404 for the path, not the model: the log
    said only "does not know the configured model", sending the operator to check a name that was right."""
    with caplog.at_level("ERROR"):
        error = from_status(404, b'{"error":"no route"}', {}, retry_on=(), upstream="m", secret=None)
    assert "configured model or path" in error.message
    assert "check the provider's `model` and `base_url`" in caplog.text
