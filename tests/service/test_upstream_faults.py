"""OpenAI-compatible upstreams through the real gRPC server, against a real local HTTP upstream that fails on cue:
retries, retry-after, fallbacks, error rows, timeouts, dropped streams and cut JSON answers, cancellation, and the
limits settled."""

from __future__ import annotations

import asyncio
import json
import time

import grpc
import orjson
import pytest

from gateway.envoy import free_ports
from portico.v1 import chat_service_pb2_grpc
from server.domain_keys import KeyLimits
from tests.helpers import bearer, chat_request, error_details, http_body, schema_and_functions, sse_frames
from tests.upstream_double import Cue
from tests.upstream_echo import sse
from tests.upstream_support import UPSTREAM_KEY, UPSTREAM_KEY_ENV, upstream_models, upstream_server, window_tokens

HELLO = [{"role": "user", "content": "Say hello."}]  # the double answers "echo Say hello." (3 tokens; prompt 2)


@pytest.fixture(scope="module")
async def running(double, tmp_path_factory):
    async with upstream_server(tmp_path_factory.mktemp("upstream"), upstream_models(double.url)) as server:
        yield server


async def ask(chat, secret, model="up-main", **fields):
    return await chat.CreateChatCompletion(chat_request(model=model, messages=HELLO, **fields), metadata=bearer(secret))


async def failure(chat, secret, model="up-main", **fields) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ask(chat, secret, model, **fields)
    return caught.value


async def test_completion_passes_the_request_through_and_settles_real_usage(chat, running, double, key):
    key_id, secret = key
    response = await ask(chat, secret, seed=7, user="u-1", logprobs=True, max_completion_tokens=20,
                         response_format={"type": "json_object"}, metadata={"team": "a"})
    assert response.choices[0].message.content == "echo Say hello."
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (2, 3)
    seen = double.seen[-1]
    assert seen.path == "/v1/chat/completions" and seen.headers["authorization"] == f"Bearer {UPSTREAM_KEY}"
    assert seen.body == {"model": "main-model", "messages": HELLO, "seed": 7, "user": "u-1", "logprobs": True,
                         "response_format": {"type": "json_object"}, "metadata": {"team": "a"}, "max_tokens": 20,
                         "stream": False}  # one JSON answer, with usage, for a caller that does not stream
    assert window_tokens(running, key_id) == 5


async def test_a_streamed_completion_asks_the_upstream_to_stream_with_usage(chat, running, double, key):
    key_id, secret = key
    request = chat_request(model="up-main", messages=HELLO, stream=True)
    frames = sse_frames([b async for b in chat.CreateChatCompletionHttp(http_body(request), metadata=bearer(secret))])
    chunks = [orjson.loads(f.removeprefix(b"data: ")) for f in frames[:-1]]
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "echo Say hello."
    assert double.seen[-1].body == {"model": "main-model", "messages": HELLO, "max_tokens": 8, "stream": True,
                                    "stream_options": {"include_usage": True}}
    assert window_tokens(running, key_id) == 5


async def test_retries_on_503_and_429_then_succeeds(chat, running, double, key):
    key_id, secret = key
    double.cue(Cue(503, {"error": {"message": "busy"}}), Cue(429, {"error": {"message": "slow down"}}))
    response = await ask(chat, secret)
    assert response.choices[0].message.content == "echo Say hello."
    assert [s.body["model"] for s in double.seen] == ["main-model"] * 3
    assert window_tokens(running, key_id) == 5


async def test_retry_after_is_honoured(chat, double, key):
    double.cue(Cue(429, {"error": {"message": "slow down"}}, headers={"retry-after-ms": "400"}))
    started = time.monotonic()
    await ask(chat, key[1], "up-solo")
    assert time.monotonic() - started >= 0.4 and len(double.seen) == 2


async def test_a_retry_after_past_the_budget_is_our_429_with_the_hint(chat, double, key):
    double.cue(Cue(429, {"error": {"message": "quota"}}, headers={"retry-after": "30"}))
    error = await failure(chat, key[1], "up-solo")
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    detail = error_details(error)
    assert (detail.http_status, detail.error.code, detail.retry_after_seconds) == (429, "rate_limit_exceeded", 30)
    assert "quota" in detail.error.message and len(double.seen) == 1


@pytest.mark.parametrize("status, code", [(429, grpc.StatusCode.RESOURCE_EXHAUSTED), (503, grpc.StatusCode.UNAVAILABLE)])
async def test_an_upstreams_hint_of_minutes_asks_callers_not_to_retry_but_says_when(chat, double, key, status, code):
    # The anthropic SDK sleeps for any retry-after: its caller would hang for ten minutes.
    double.cue(Cue(status, {"error": {"message": "come back later"}}, headers={"retry-after": "600"}))
    error = await failure(chat, key[1], "up-solo")
    trailing = dict(error.trailing_metadata())
    assert error.code() == code and (trailing["retry-after"], trailing["x-should-retry"]) == ("600", "false")
    double.cue(Cue(status, {"error": {"message": "come back soon"}}, headers={"retry-after": "30"}))
    assert "x-should-retry" not in dict((await failure(chat, key[1], "up-solo")).trailing_metadata())


async def test_upstream_4xx_is_the_matching_error_and_is_not_retried(chat, running, double, key):
    key_id, secret = key
    double.cue(Cue(400, {"error": {"message": "messages: bad role", "param": "messages", "type": "x"}}))
    error = await failure(chat, secret)
    detail = error_details(error)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert (detail.http_status, detail.error.message, detail.error.param) == (400, "messages: bad role", "messages")
    assert len(double.seen) == 1  # neither retried nor sent to the fallback
    assert window_tokens(running, key_id) == 0  # nothing was generated: one request, no tokens


@pytest.mark.parametrize("status", [401, 403, 404])
async def test_an_upstream_refusing_the_gateway_is_a_502_never_the_callers_fault(chat, double, key, status):
    """SDKs would tell the user their key (401/403) or model (404) is bad, and never retry: it is our config."""
    double.cue(Cue(status, {"error": {"message": f"Incorrect API key provided: {UPSTREAM_KEY}"}}))
    error = await failure(chat, key[1], "up-solo")
    detail = error_details(error)
    assert (error.code(), detail.http_status, detail.error.code) == (grpc.StatusCode.UNAVAILABLE, 502,
                                                                     "upstream_error")
    assert "not your key" in detail.error.message and "configuration" in detail.error.message
    assert UPSTREAM_KEY not in str(error.trailing_metadata()) and UPSTREAM_KEY[-8:] not in detail.error.message


async def test_an_upstream_refusing_the_gateway_is_logged_once_while_it_lasts_and_once_when_it_ends(
        chat, double, key, caplog):
    """A revoked upstream key (or a wrong base_url) logged its ERROR at every request: 100 callers, 100 lines, and
    no line when the upstream took the key again. Now one line when it starts, one when it answers again."""
    await ask(chat, key[1], "up-solo")  # answering, whatever tests before left
    caplog.clear()
    double.cue(*[Cue(401, {"error": {"message": "Incorrect API key provided"}})] * 20)
    with caplog.at_level("INFO"):
        for _ in range(20):
            await failure(chat, key[1], "up-solo")
        await ask(chat, key[1], "up-solo")
    lines = [r for r in caplog.records if "up-solo" in r.getMessage()]
    assert [r.levelname for r in lines] == ["ERROR", "WARNING"], [r.getMessage() for r in lines]
    assert "refused Portico's credentials (HTTP 401)" in lines[0].getMessage()
    assert "answers again" in lines[1].getMessage() and "20 requests" in lines[1].getMessage()


@pytest.mark.parametrize("status", [400, 500])
@pytest.mark.parametrize("shape", ["json", "text"])
async def test_an_upstream_message_cut_short_keeps_no_part_of_the_upstream_key(chat, double, key, status, shape):
    """A long message quoting the key near its 500th character: cut there first, it kept the key's first half."""
    text = "x" * 460 + f" Authorization: Bearer {UPSTREAM_KEY}"
    double.cue(Cue(status, {"error": {"message": text}} if shape == "json" else text.encode()))
    message = error_details(await failure(chat, key[1], "up-backup")).error.message
    assert "x" * 400 in message  # the upstream's words are still passed on
    assert UPSTREAM_KEY[:8] not in message and "[redacted]" in message, message


async def test_an_upstream_message_with_line_breaks_stays_on_its_log_line(chat, double, key, caplog):
    """The retry's warning quoted the upstream's message: its line break started a line of its own, which a log
    reader took for one of Portico's. It now names only the error's code and reason."""
    forged = "2026-01-01 00:00:00,000 ERROR portico: forged"
    double.cue(Cue(503, f"busy\r\n{forged}".encode()))
    await ask(chat, key[1], "up-solo")  # retried, then answered
    warnings = [record.getMessage() for record in caplog.records if "up-solo" in record.getMessage()]
    assert warnings and all("\n" not in line and "\r" not in line for line in warnings), warnings
    assert not any("forged" in record.getMessage() for record in caplog.records), warnings


def metric(running, name: str, **labels) -> float:
    return running.telemetry.metrics.registry.get_sample_value(name, labels) or 0.0


async def test_exhausted_retries_fall_back_to_the_next_model(chat, running, double, key):
    key_id, secret = key
    retries = metric(running, "portico_upstream_retries_total", model="up-main", reason="500")
    fallbacks = metric(running, "portico_upstream_fallbacks_total", model="up-main", fallback="up-backup")
    double.cue(*[Cue(500, {"error": {"message": "boom"}})] * 3)
    response = await ask(chat, secret)
    assert response.model == "up-main" and response.choices[0].message.content == "echo Say hello."
    assert [s.body["model"] for s in double.seen] == ["main-model"] * 3 + ["backup-model"]
    assert window_tokens(running, key_id) == 5  # the caller's model is charged what the fallback used
    # Reported for the metrics: two retries, then one fallback.
    assert metric(running, "portico_upstream_retries_total", model="up-main", reason="500") == retries + 2
    assert metric(running, "portico_upstream_fallbacks_total", model="up-main", fallback="up-backup") == fallbacks + 1


async def test_a_redirect_is_the_gateway_s_configuration_and_goes_to_the_fallback_at_once(chat, double, key):
    # configuration.md, fallbacks: a base_url that redirects (moved to https, say) would redirect every try.
    double.cue(Cue(301, b"", headers={"location": "https://elsewhere/v1/chat/completions"}))
    response = await ask(chat, key[1])
    assert response.model == "up-main" and response.choices[0].message.content == "echo Say hello."
    assert [s.body["model"] for s in double.seen] == ["main-model", "backup-model"]  # not retried


async def test_an_upstream_that_says_not_to_retry_is_not_retried_but_the_fallback_is_tried(chat, double, key):
    # OpenAI and Anthropic send `x-should-retry: false` on failures that the same request would meet again.
    double.cue(Cue(500, {"error": {"message": "boom"}}, headers={"x-should-retry": "false"}))
    response = await ask(chat, key[1])
    assert response.choices[0].message.content == "echo Say hello."
    assert [s.body["model"] for s in double.seen] == ["main-model", "backup-model"]


async def test_an_upstreams_x_should_retry_false_reaches_the_caller(chat, double, key):
    # Passed on, the SDK does not send the request twice more to meet the same failure.
    double.cue(Cue(503, {"error": {"message": "overloaded"}}, headers={"x-should-retry": "False"}))
    error = await failure(chat, key[1], "up-solo")
    assert error.code() == grpc.StatusCode.UNAVAILABLE and len(double.seen) == 1
    assert dict(error.trailing_metadata())["x-should-retry"] == "false"
    double.reset()
    again = Cue(503, {"error": {"message": "overloaded"}}, headers={"x-should-retry": "true"})
    double.cue(again, again, again)
    error = await failure(chat, key[1], "up-solo")
    assert len(double.seen) == 3 and "x-should-retry" not in dict(error.trailing_metadata())


async def test_fallbacks_that_cannot_honour_the_request_are_skipped(chat, double, key):
    double.cue(Cue(503, {"error": {"message": "down"}}))
    response = await ask(chat, key[1], "up-chain", max_tokens=3)
    assert response.usage.completion_tokens == 3 and not response.choices[0].message.content.startswith("echo")
    assert len(double.seen) == 1  # the embedded model answered
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    double.reset()
    double.cue(Cue(503, {"error": {"message": "down"}}))
    response = await ask(chat, key[1], "up-chain", tools=[tool], tool_choice="required")
    assert response.choices[0].message.tool_calls[0].function.name == "f"  # the embedded model cannot call tools
    assert [s.body["model"] for s in double.seen] == ["chain-model", "backup-model"]


async def test_an_unreachable_upstream_falls_back(chat, double, key):
    response = await ask(chat, key[1], "up-down")
    assert response.choices[0].message.content == "echo Say hello."
    assert [s.body["model"] for s in double.seen] == ["backup-model"]


async def test_every_fallback_failing_ends_with_the_last_error(chat, double, key):
    double.cue(*[Cue(503, {"error": {"message": "down"}})] * 4)
    error = await failure(chat, key[1])
    assert (error.code(), error_details(error).http_status) == (grpc.StatusCode.UNAVAILABLE, 503)
    assert len(double.seen) == 4


async def test_when_the_model_and_its_fallback_are_rate_limited_the_caller_is_told_the_sooner_hint(chat, double, key):
    # The model says 10 s (past its retry budget: no wait, on to the fallback), the fallback 30 s: in 10 s the
    # request can pass, so a caller told 30 s (the last failure's) would wait for nothing.
    double.cue(Cue(429, {"error": {"message": "busy"}}, headers={"retry-after": "10"}),
               Cue(429, {"error": {"message": "busy"}}, headers={"retry-after": "30"}))
    error = await failure(chat, key[1])
    detail = error_details(error)
    assert (detail.http_status, detail.retry_after_seconds) == (429, 10) and "`up-main`" in detail.error.message
    assert [s.body["model"] for s in double.seen] == ["main-model", "backup-model"]


async def test_a_json_answer_may_take_longer_than_the_first_byte_of_a_stream(chat, double, key):
    double.cue(Cue(delay=0.8))  # past `read` (0.5 s), within `answer` (1 s): a long non-streamed generation
    assert (await ask(chat, key[1], "up-slow")).choices[0].message.content
    double.cue(Cue(delay=0.8))
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await streamed_text(chat, key[1], "up-slow")
    assert error_details(caught.value).error.code == "upstream_timeout"


async def test_a_silent_upstream_is_a_504(chat, running, double, key):
    key_id, secret = key
    double.cue(Cue(delay=1.5))
    error = await failure(chat, secret, "up-slow")
    detail = error_details(error)
    assert (error.code(), detail.http_status, detail.error.code) == (
        grpc.StatusCode.DEADLINE_EXCEEDED, 504, "upstream_timeout")
    assert window_tokens(running, key_id) == 0


async def streamed_text(chat, secret, model="up-solo") -> str:
    request = chat_request(model=model, messages=HELLO, stream=True)
    frames = sse_frames([b async for b in chat.CreateChatCompletionHttp(http_body(request), metadata=bearer(secret))])
    chunks = [orjson.loads(f.removeprefix(b"data: ")) for f in frames[:-1]]
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))


async def test_the_typed_stream_rpc_asks_the_upstream_to_stream(chat, double, key):
    request = chat_request(model="up-solo", messages=HELLO)  # no `stream`: StreamChatCompletion streams anyway
    chunks = [c async for c in chat.StreamChatCompletion(request, metadata=bearer(key[1]))]
    assert chunks and double.seen[-1].body["stream"] is True


async def test_a_stream_dropped_before_any_content_is_retried(chat, double, key):
    double.cue(Cue(drop_after=1))  # the role chunk, then the connection is gone
    assert await streamed_text(chat, key[1]) == "echo Say hello." and len(double.seen) == 2


async def test_a_stream_refused_with_a_503_is_retried(chat, double, key):
    double.cue(Cue(503, {"error": {"message": "busy"}}))
    assert await streamed_text(chat, key[1]) == "echo Say hello." and len(double.seen) == 2


async def test_a_json_answer_cut_off_is_retried(chat, running, double, key):
    key_id, secret = key
    double.cue(Cue(drop_after=1))  # the first half of the JSON answer, then the connection is gone
    response = await ask(chat, secret, "up-solo")
    assert response.choices[0].message.content == "echo Say hello." and len(double.seen) == 2
    assert window_tokens(running, key_id) == 5


async def test_a_json_answer_cut_off_without_retries_is_a_502(chat, running, double, key):
    key_id, secret = key
    double.cue(Cue(drop_after=1))
    error = await failure(chat, secret, "up-backup")  # one attempt, no fallbacks
    detail = error_details(error)
    assert (detail.http_status, detail.error.code) == (502, "upstream_error") and "broke off" in detail.error.message
    assert len(double.seen) == 1 and window_tokens(running, key_id) == 0


async def test_an_error_in_a_200_json_answer_is_the_matching_error(chat, double, key):
    overloaded = {"error": {"message": "overloaded", "type": "overloaded_error"}}
    double.cue(Cue(body=overloaded))
    response = await ask(chat, key[1], "up-solo")  # a 529 by its type: retried
    assert response.choices[0].message.content == "echo Say hello." and len(double.seen) == 2
    double.reset()
    double.cue(Cue(body=overloaded))
    error = await failure(chat, key[1], "up-backup")
    assert (error.code(), error_details(error).error.message) == (
        grpc.StatusCode.UNAVAILABLE, "The upstream serving `up-backup` is unavailable: overloaded")


async def test_json_that_is_not_a_completion_is_a_502_and_not_retried(chat, double, key):
    double.cue(Cue(body={"object": "list", "data": []}))
    error = await failure(chat, key[1], "up-solo")
    detail = error_details(error)
    assert (detail.http_status, detail.error.code, len(double.seen)) == (502, "upstream_error", 1)
    double.reset()
    double.cue(Cue(body=b"<html>proxy</html>"))
    error = await failure(chat, key[1], "up-solo")
    assert (error_details(error).http_status, len(double.seen)) == (502, 1)



@pytest.mark.parametrize("prompt_tokens", [-1000, "abc", 1e30])
async def test_usage_that_is_no_token_count_is_a_502_settled_from_what_was_sent(chat, running, double, key,
                                                                                  prompt_tokens):
    """-1000 handed quota back (the window went below zero) and answered a bare UNKNOWN; "abc" was a 500; 1e30
    filled the key's minute window. Such usage is not the API: a 502, and the request counts what was sent."""
    key_id, secret = key
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": 3}
    double.cue(Cue(body={"object": "chat.completion", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "hi there"}, "finish_reason": "stop"}],
        "usage": usage}))
    error = await failure(chat, secret, "up-solo")
    assert (error.code(), error_details(error).error.code, len(double.seen)) == (
        grpc.StatusCode.UNAVAILABLE, "upstream_error", 1)
    frames = [sse({"choices": [{"index": 0, "delta": {"content": "hi"}, "finish_reason": "stop"}]}),
              sse({"choices": [], "usage": usage})]
    double.cue(Cue(frames=frames))
    request = chat_request(model="up-solo", messages=HELLO, stream=True)
    frames = sse_frames([b async for b in chat.CreateChatCompletionHttp(http_body(request), metadata=bearer(secret))])
    assert orjson.loads(frames[-1].removeprefix(b"data: "))["error"]["code"] == "upstream_error"
    # The JSON answer, refused whole, sent nothing (as for any answer that is not a completion); the stream its
    # prompt (10 characters / 4) and one delta.
    assert window_tokens(running, key_id) == 3 + 1

async def test_a_stream_dropped_mid_answer_ends_with_an_sse_error_and_settles_what_was_sent(chat, running, double,
                                                                                              key):
    key_id, secret = key
    double.cue(Cue(drop_after=3))  # role, "echo", " Say", then gone
    request = chat_request(model="up-main", messages=HELLO, stream=True)
    frames = sse_frames([b async for b in chat.CreateChatCompletionHttp(http_body(request), metadata=bearer(secret))])
    events = [orjson.loads(f.removeprefix(b"data: ")) for f in frames]
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events[:-1]) == "echo Say"
    assert events[-1]["error"]["code"] == "upstream_error" and len(double.seen) == 1  # never retried
    assert window_tokens(running, key_id) == 3 + 2  # estimated: the prompt (10 characters / 4) and two deltas


async def test_a_stream_cut_short_counts_at_most_its_token_limit(chat, running, double, key):
    """Estimated at four characters a token, a cut answer of long words counted more output than the request's
    token limit lets a model write (a 200k-token echo was counted as 257,342)."""
    key_id, secret = key
    words = [sse({"choices": [{"index": 0, "delta": {"content": "x" * 400}}]}) for _ in range(3)]
    double.cue(Cue(frames=words, drop_after=3))
    request = chat_request(model="up-main", messages=HELLO, stream=True, max_tokens=50)
    frames = sse_frames([b async for b in chat.CreateChatCompletionHttp(http_body(request), metadata=bearer(secret))])
    assert orjson.loads(frames[-1].removeprefix(b"data: "))["error"]["code"] == "upstream_error"
    assert window_tokens(running, key_id) == 3 + 50  # the prompt (10 characters / 4), and 50 rather than 300


async def test_an_error_chunk_mid_stream_is_passed_on(chat, double, key):
    frames = [sse({"choices": [{"index": 0, "delta": {"content": "Hi"}}]}),
              sse({"error": {"message": "overloaded", "type": "overloaded_error"}})]
    double.cue(Cue(frames=frames))
    request = chat_request(model="up-solo", messages=HELLO, stream=True)
    frames = sse_frames([b async for b in chat.CreateChatCompletionHttp(http_body(request), metadata=bearer(key[1]))])
    error = orjson.loads(frames[-1].removeprefix(b"data: "))["error"]
    assert (error["code"], error["message"]) == ("service_unavailable",
                                                 "The upstream serving `up-solo` is unavailable: overloaded")


async def test_a_caller_that_goes_away_cancels_the_upstream_request(chat, running, double, key):
    key_id, secret = key
    double.cue(Cue(frame_delay=0.2))
    request = chat_request(model="up-solo", messages=HELLO, stream=True)
    call = chat.StreamChatCompletion(request, metadata=bearer(secret))
    await call.read()  # the role chunk
    await call.read()  # "echo": the upstream is mid-answer
    call.cancel()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 3
    while double.gone == 0 or await running.limiter.store.in_flight(key_id):
        assert loop.time() < deadline, "the upstream request was not cancelled"
        await asyncio.sleep(0.05)
    assert 0 < window_tokens(running, key_id) < 10


async def test_a_caller_gone_during_the_retry_wait_leaves_no_retry_counted(chat, running, double, key):
    """The retry was counted (metrics, the access log's upstream_attempts) before its wait, so a caller that left
    during the wait was recorded with an attempt that never happened."""
    retries = metric(running, "portico_upstream_retries_total", model="up-solo", reason="429")
    double.cue(Cue(429, {"error": {"message": "slow down"}}, headers={"retry-after-ms": "1500"}))
    with pytest.raises(grpc.aio.AioRpcError) as gone:
        await chat.CreateChatCompletion(chat_request(model="up-solo", messages=HELLO), metadata=bearer(key[1]),
                                        timeout=0.4)
    assert gone.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    await asyncio.sleep(1.6)  # past the wait: a retry that were still made would be seen by now
    assert len(double.seen) == 1
    assert metric(running, "portico_upstream_retries_total", model="up-solo", reason="429") == retries


@pytest.mark.parametrize("limit", ["daily_requests", "requests_per_minute"])
async def test_requests_that_reached_the_upstream_count_against_the_request_limits(chat, running, double, limit):
    """An upstream failure (502) and a call its caller gave up on were sent to a paid model: each counts as a
    request, as in the ledger. A request refused before any upstream call does not."""
    key, secret = await running.store.create("counted", all_models=True,
                                             limits=KeyLimits(**{limit: 2}, tokens_per_minute=50))
    double.reset()
    too_large = await failure(chat, secret, max_tokens=100)  # over the tokens per minute: no upstream call
    assert "Request too large" in error_details(too_large).error.message
    double.cue(*[Cue(500, {"error": {"message": "boom"}})] * 3)
    assert error_details(await failure(chat, secret, "up-solo")).http_status == 502
    double.cue(Cue(delay=1.5))
    with pytest.raises(grpc.aio.AioRpcError) as abandoned:
        await chat.CreateChatCompletion(chat_request(model="up-solo", messages=HELLO), metadata=bearer(secret),
                                        timeout=0.3)
    assert abandoned.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 3
    while await running.limiter.store.in_flight(key.id):  # the server hears of the caller's departure
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    refused = error_details(await failure(chat, secret))
    assert refused.http_status == 429 and limit.replace("_", " ") in refused.error.message  # "daily requests"
    assert len(double.seen) == 4  # three tries of the first, one of the second; never the third


@pytest.mark.parametrize("where", ["refused", "unresolvable"])
async def test_an_upstream_that_cannot_be_reached_is_logged_once_naming_it_and_why(tmp_path, caplog, where):
    """An upstream that refuses connections (down, a wrong port) or whose host does not resolve (a typo in base_url),
    on a model tried once without a fallback: callers got a 503 that names no host (rightly), and the log had no line
    at all, so the operator learned nothing but the access log's `service_unavailable`. Now one line a minute names
    the server, the model and why, however many requests meet it."""
    base = {"refused": f"http://127.0.0.1:{free_ports(1)[0]}/v1", "unresolvable": "http://upstream.invalid/v1"}[where]
    models = (f"  - {{id: up-gone, endpoint: /v1/chat/completions, provider: {{kind: openai, base_url: '{base}', "
              f"api_key_env: {UPSTREAM_KEY_ENV}, model: m, retry: {{attempts: 1}}}}}}\n")
    async with upstream_server(tmp_path, models) as server:
        secret = (await server.store.create("gone", all_models=True))[1]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = chat_service_pb2_grpc.ChatServiceStub(channel)
            with caplog.at_level("INFO"):
                for _ in range(5):
                    assert (await failure(stub, secret, "up-gone")).code() == grpc.StatusCode.UNAVAILABLE
    lines = [r.getMessage() for r in caplog.records
             if r.levelname in ("WARNING", "ERROR") and "up-gone" in r.getMessage()]
    assert len(lines) == 1, lines
    why = {"refused": "refused the connection", "unresolvable": "does not resolve"}[where]
    assert base.removesuffix("/v1") in lines[0] and why in lines[0], lines[0]


async def test_an_outage_logs_one_line_per_kind_of_retry_and_fallback_not_one_per_request(double, tmp_path, caplog):
    """An upstream down at 500 requests a second logged a line for each retry and each fallback: a thousand lines a
    second of the same two, burying every other line. Now each kind is logged when it starts and counted for a
    minute (tests/unit/test_retry_log.py), while the metrics still count every one."""
    down = f"http://127.0.0.1:{free_ports(1)[0]}/v1"  # nothing listens: every attempt fails to connect
    common = f"kind: openai, api_key_env: {UPSTREAM_KEY_ENV}"
    retry = "{attempts: 3, initial_backoff: 0.01, max_backoff: 0.02}"
    models = (f"  - {{id: up-down, endpoint: /v1/chat/completions, fallbacks: [up-backup], provider: {{{common}, "
              f"base_url: '{down}', model: nowhere, retry: {retry}}}}}\n"
              f"  - {{id: up-backup, endpoint: /v1/chat/completions, provider: {{{common}, base_url: '{double.url}', "
              f"model: backup-model, retry: {{attempts: 1}}}}}}\n")
    double.reset()
    async with upstream_server(tmp_path, models) as server:
        secret = (await server.store.create("outage", all_models=True))[1]
        async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = chat_service_pb2_grpc.ChatServiceStub(channel)
            with caplog.at_level("INFO"):
                answers = await asyncio.gather(*(ask(stub, secret, "up-down") for _ in range(60)))
        assert all(answer.choices[0].message.content == "echo Say hello." for answer in answers)
        assert metric(server, "portico_upstream_retries_total", model="up-down", reason="connect") == 120
        assert metric(server, "portico_upstream_fallbacks_total", model="up-down", fallback="up-backup") == 60
    lines = [r.getMessage() for r in caplog.records if r.name == "server.providers.router"]
    assert sorted(lines) == ["up-down failed (service_unavailable, connect); falling back to up-backup",
                             "up-down/openai failed (service_unavailable, connect); trying up-down/openai"], lines


async def test_token_limits_reserve_the_json_schema_and_functions_an_upstream_reads_as_prompt(chat, running, double):
    """An upstream reads `response_format`'s JSON schema and the deprecated `functions` as prompt tokens, though the
    gateway passes them through unread. The token limits reserved only the words of the messages: a request with a
    34 kB schema (about 8,500 tokens) was admitted under a 2,000 tokens-per-minute limit, its x-ratelimit-remaining
    -tokens said nearly all of it was left, and an upstream that reports no usage was settled as a few tokens."""
    double.reset()
    schema, functions = schema_and_functions(200, 5)
    read_as_prompt = len(json.dumps(schema, separators=(",", ":"))) // 4  # characters / 4, as a prompt is estimated
    assert read_as_prompt > 8_000
    _, small = await running.store.create("schema-small", all_models=True, limits=KeyLimits(tokens_per_minute=2_000))
    for extra in ({"response_format": schema}, {"functions": functions}):
        error = await failure(chat, small, max_tokens=1, **extra)
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert error_details(error).error.message.startswith("Request too large for tokens per minute"), error
    assert not double.seen  # no upstream was asked to read (and bill) it
    key, big = await running.store.create("schema-big", all_models=True, limits=KeyLimits(tokens_per_minute=100_000))
    double.cue(Cue(body={"id": "c", "object": "chat.completion", "created": 1, "model": "main-model", "choices": [
        {"index": 0, "message": {"role": "assistant", "content": "{}"}, "finish_reason": "stop"}]}))  # no usage
    call = chat.CreateChatCompletion(chat_request(model="up-main", messages=HELLO, max_tokens=1,
                                                  response_format=schema), metadata=bearer(big))
    assert int(dict(await call.initial_metadata())["x-ratelimit-remaining-tokens"]) < 100_000 - read_as_prompt
    await call
    assert window_tokens(running, key.id) > read_as_prompt
