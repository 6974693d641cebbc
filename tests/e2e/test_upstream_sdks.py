"""The official SDKs through the whole stack (real Envoy, `portico serve --config FILE`) for each dialect on each
provider kind: the embedded model, an OpenAI-compatible upstream (python -m llama_cpp.server, and the upstream
double for scripted answers and faults) and an Anthropic upstream (the double)."""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest

from tests.e2e.conftest import upstream_gateway
from tests.llama_server import MODEL_ALIAS
from tests.passthrough_objects import CACHED_ANSWER_CUES
from tests.upstream_double import Cue
from tests.upstream_echo import sse
from tests.upstream_support import FAST_RETRY, UPSTREAM_KEY, UPSTREAM_KEY_ENV

CHATS = ["chat-embedded", "chat-openai", "chat-anthropic"]
MESSAGES = ["messages-embedded", "messages-openai", "messages-anthropic"]
WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}}


def models_yaml(llama_url: str, double_url: str) -> str:
    llama = f"kind: openai, base_url: '{llama_url}', model: {MODEL_ALIAS}"
    echo = f"kind: openai, base_url: '{double_url}', api_key_env: {UPSTREAM_KEY_ENV}, model: gpt-up"
    claude = (f"kind: anthropic, base_url: '{double_url.removesuffix('/v1')}', api_key_env: {UPSTREAM_KEY_ENV}, "
              "model: claude-up")
    rows = [
        ("chat-embedded", "/v1/chat/completions", "{kind: llamacpp}", ""),
        ("chat-openai", "/v1/chat/completions", f"{{{llama}}}", ""),
        ("chat-anthropic", "/v1/chat/completions", f"{{{claude}}}", ""),
        ("chat-echo", "/v1/chat/completions",
         f"{{{echo}, retry: {{attempts: 1}}, timeouts: {{read: 1, answer: 1}}}}", ""),
        ("chat-fallback", "/v1/chat/completions",
         f"{{kind: openai, base_url: 'http://127.0.0.1:9/v1', model: x, retry: {FAST_RETRY}}}", "[chat-echo]"),
        ("messages-embedded", "/v1/messages", "{kind: llamacpp}", ""),
        ("messages-openai", "/v1/messages", f"{{{llama}}}", ""),
        ("messages-anthropic", "/v1/messages", f"{{{claude}, retry: {{attempts: 1}}}}", ""),
        ("messages-echo", "/v1/messages", f"{{{echo}}}", ""),
        ("image-dev", "/v1/images/generations", "{kind: dev-image}", ""),
        ("image-openai", "/v1/images/generations", f"{{{echo}}}", ""),
    ]
    return "".join(f"  - {{id: {i}, endpoint: {e}, provider: {p}{', fallbacks: ' + f if f else ''}}}\n"
                   for i, e, p, f in rows)


@pytest.fixture(scope="module")
def gateway(llama_server, double, tmp_path_factory):
    models = models_yaml(llama_server.url, double.url)
    with upstream_gateway(tmp_path_factory.mktemp("upstream-gateway"), models) as gateway:
        yield gateway
    assert UPSTREAM_KEY not in gateway.log_path.read_text()  # never logged, whatever happened


@pytest.fixture(autouse=True)
def fresh(double):
    double.reset()


@pytest.mark.parametrize("model", CHATS)
def test_openai_sdk_create_and_stream(oai, model):
    completion = oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say hello."}], max_tokens=4, temperature=0)
    assert completion.model == model and completion.choices[0].message.content
    assert completion.usage.completion_tokens >= 1 and completion.usage.prompt_tokens >= 1
    stream = oai.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to ten."}],
                                         max_tokens=3, temperature=0, stream=True,
                                         stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].usage.completion_tokens >= 1


@pytest.mark.parametrize("model", MESSAGES)
def test_anthropic_sdk_create_and_stream(claude, model):
    message = claude.messages.create(model=model, max_tokens=4, system="Be brief.", extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": "Say hello."}])
    assert message.model == model and message.content[0].type == "text" and message.content[0].text
    assert message.usage.output_tokens >= 1
    with claude.messages.stream(model=model, max_tokens=3, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "Count to ten."}]) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == final.content[0].text and final.usage.output_tokens >= 1


def test_openai_sdk_tool_calls_from_an_anthropic_upstream(oai):
    tools = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}}]
    completion = oai.chat.completions.create(model="chat-anthropic", tools=tools, tool_choice="required",
                                             messages=[{"role": "user", "content": "Oslo"}])
    (call,) = completion.choices[0].message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments), completion.choices[0].finish_reason) == (
        "weather", {"echo": "Oslo"}, "tool_calls")
    follow_up = oai.chat.completions.create(model="chat-anthropic", tools=tools, messages=[
        {"role": "user", "content": "Oslo"}, completion.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "4 C"}])
    assert follow_up.choices[0].finish_reason == "stop"


def test_a_tool_without_parameters_has_arguments_of_json_from_an_anthropic_upstream(oai, double):
    """Anthropic streams a parameterless call's input {} as one empty input_json_delta: the chat caller's arguments
    must still be "{}" (as OpenAI sends them, and as the JSON answer has them), never "" that json.loads refuses."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "now", "input": {}}
    answer = {"id": "msg_up", "type": "message", "role": "assistant", "model": "claude-up", "content": [call],
              "stop_reason": "tool_use", "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 5}}
    events = [{"type": "message_start", "message": {**answer, "content": [], "stop_reason": None}},
              {"type": "content_block_start", "index": 0, "content_block": call},
              {"type": "content_block_delta", "index": 0, "delta": {"type": "input_json_delta", "partial_json": ""}},
              {"type": "content_block_stop", "index": 0},
              {"type": "message_delta", "delta": {"stop_reason": "tool_use", "stop_sequence": None},
               "usage": {"output_tokens": 5}},
              {"type": "message_stop"}]
    double.cue(Cue(body=answer), Cue(frames=[sse(e, e["type"]) for e in events]))
    tools = [{"type": "function", "function": {"name": "now", "parameters": {"type": "object", "properties": {}}}}]
    asked = {"model": "chat-anthropic", "tools": tools, "messages": [{"role": "user", "content": "Time?"}]}
    completion = oai.chat.completions.create(**asked)
    with oai.chat.completions.stream(**asked) as stream:
        final = stream.get_final_completion()
    for message in (completion.choices[0].message, final.choices[0].message):
        (tool_call,) = message.tool_calls
        assert (tool_call.function.name, tool_call.function.arguments) == ("now", "{}")
        assert message.content is None  # nothing but the call, streamed or not


def test_anthropic_sdk_tool_use_from_an_openai_upstream(claude):
    tools = [{"name": "weather", "input_schema": WEATHER}]
    with claude.messages.stream(model="messages-echo", max_tokens=50, tools=tools, tool_choice={"type": "any"},
                                messages=[{"role": "user", "content": "Oslo"}]) as stream:
        final = stream.get_final_message()
    (block,) = final.content
    assert (block.type, block.name, block.input, final.stop_reason) == ("tool_use", "weather", {"echo": "Oslo"},
                                                                        "tool_use")


def test_upstream_errors_reach_the_sdks_as_their_own_types(oai, claude, double):
    double.cue(Cue(429, {"error": {"message": "quota"}}, headers={"retry-after": "30"}),
               Cue(400, {"error": {"message": "bad messages", "param": "messages"}}),
               Cue(delay=3))
    hello = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.RateLimitError) as limited:
        oai.chat.completions.create(model="chat-echo", messages=hello)
    assert limited.value.response.headers["retry-after"] == "30"
    with pytest.raises(openai.BadRequestError) as bad:
        oai.chat.completions.create(model="chat-echo", messages=hello)
    assert (bad.value.param, bad.value.code) == ("messages", "invalid_request")
    with pytest.raises(openai.InternalServerError) as slow:
        oai.chat.completions.create(model="chat-echo", messages=hello)
    assert (slow.value.status_code, slow.value.code) == (504, "upstream_timeout")
    double.cue(Cue(529, {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}))
    with pytest.raises(anthropic.APIStatusError) as overloaded:
        claude.messages.create(model="messages-anthropic", max_tokens=5, messages=hello)
    assert overloaded.value.status_code == 503 and overloaded.value.body["type"] == "error"


@pytest.mark.parametrize("status", [401, 403, 404])
def test_the_sdks_do_not_retry_an_upstream_that_refuses_the_gateways_configuration(gateway, double, status):
    """A wrong upstream key or model name is no failure a retry can mend: one attempt each, at once."""
    refusal = Cue(status, {"error": {"message": "no", "type": "authentication_error"}})
    double.cue(*[refusal] * 6)
    oai = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.secret)  # the default 2 retries
    with pytest.raises(openai.InternalServerError) as caught:
        oai.chat.completions.create(model="chat-echo", messages=[{"role": "user", "content": "Hi"}])
    assert caught.value.status_code == 502 and caught.value.response.headers["x-should-retry"] == "false"
    claude = anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.secret)
    with pytest.raises(anthropic.InternalServerError):
        claude.messages.create(model="messages-anthropic", max_tokens=5, messages=[{"role": "user", "content": "Hi"}])
    assert len(double.seen) == 2


def test_an_answer_that_breaks_off_is_a_502(oai, double):
    double.cue(Cue(drop_after=1))  # the upstream's JSON answer cut in the middle
    with pytest.raises(openai.APIStatusError) as caught:
        oai.chat.completions.create(model="chat-echo", messages=[{"role": "user", "content": "a b c"}])
    assert (caught.value.status_code, caught.value.code) == (502, "upstream_error")


def test_a_stream_that_breaks_ends_with_the_dialects_error_event(oai, claude, double):
    double.cue(Cue(drop_after=3), Cue(drop_after=5))
    stream = oai.chat.completions.create(model="chat-echo", messages=[{"role": "user", "content": "a b c"}],
                                         stream=True)
    with pytest.raises(openai.APIError, match="broke off"):
        list(stream)
    with pytest.raises(anthropic.APIStatusError, match="broke off"):
        with claude.messages.stream(model="messages-anthropic", max_tokens=20,
                                    messages=[{"role": "user", "content": "a b c"}]) as events:
            list(events.text_stream)


LOGPROBS = {"content": [{"token": "Hi", "logprob": -0.25, "bytes": [72, 105], "top_logprobs": []}], "refusal": None}


def test_the_openai_sdk_gets_what_an_openai_upstream_sent(oai, double):
    def chunk(delta: dict | None, **extra) -> dict:
        choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": LOGPROBS, "finish_reason": None}]
        return {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "gpt-up",
                "system_fingerprint": "fp_0123", "choices": choices, **extra}

    answer = {**chunk({}), "object": "chat.completion", "choices": [{"index": 0, "logprobs": LOGPROBS,
              "finish_reason": "stop", "message": {"role": "assistant", "content": "Hi", "refusal": None}}],
              "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
    finish = {**chunk(None), "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
    frames = [sse(chunk({"role": "assistant", "content": ""})), sse(chunk({"content": "Hi"})), sse(finish),
              sse(chunk(None, usage={"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2})),
              b"data: [DONE]\n\n"]
    double.cue(Cue(body=answer), Cue(frames=frames))
    hello = [{"role": "user", "content": "Hi"}]
    completion = oai.chat.completions.create(model="chat-echo", messages=hello, logprobs=True)
    assert (completion.model, completion.system_fingerprint) == ("chat-echo", "fp_0123")
    assert completion.choices[0].logprobs.content[0].model_dump() == LOGPROBS["content"][0]
    chunks = list(oai.chat.completions.create(model="chat-echo", messages=hello, logprobs=True, stream=True))
    assert [c.choices[0].logprobs.content[0].token for c in chunks[:2]] == ["Hi", "Hi"]
    assert all(c.model == "chat-echo" and c.system_fingerprint == "fp_0123" and c.usage is None for c in chunks)
    assert len(chunks) == 3  # the caller did not ask for usage: no usage chunk


def test_the_anthropic_sdk_gets_thinking_from_an_anthropic_upstream(claude, double):
    thinking = {"type": "thinking", "thinking": "Greet back.", "signature": "EqQBCkYIARgCKkA="}
    answer = {"id": "msg_up", "type": "message", "role": "assistant", "model": "claude-up", "stop_sequence": None,
              "content": [thinking, {"type": "text", "text": "Hi"}], "stop_reason": "end_turn",
              "usage": {"input_tokens": 3, "output_tokens": 5}}
    events = [{"type": "message_start", "message": {**answer, "content": [], "stop_reason": None}},
              {"type": "content_block_start", "index": 0,
               "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
              {"type": "content_block_delta", "index": 0,
               "delta": {"type": "thinking_delta", "thinking": "Greet back."}},
              {"type": "content_block_delta", "index": 0,
               "delta": {"type": "signature_delta", "signature": "EqQBCkYIARgCKkA="}},
              {"type": "content_block_stop", "index": 0},
              {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
              {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Hi"}},
              {"type": "content_block_stop", "index": 1},
              {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None},
               "usage": {"output_tokens": 5}},
              {"type": "message_stop"}]
    double.cue(Cue(body=answer), Cue(frames=[sse(e, e["type"]) for e in events]))
    hello = [{"role": "user", "content": "Hi"}]
    thinks = {"type": "enabled", "budget_tokens": 1024}
    message = claude.messages.create(model="messages-anthropic", max_tokens=2048, thinking=thinks, messages=hello)
    assert message.model == "messages-anthropic" and message.content[0].model_dump() == thinking
    with claude.messages.stream(model="messages-anthropic", max_tokens=2048, thinking=thinks,
                                messages=hello) as stream:
        final = stream.get_final_message()
    assert final.model == "messages-anthropic" and [b.model_dump() for b in final.content] == [
        thinking, {"type": "text", "text": "Hi", "citations": None}]


def test_fallback_through_the_gateway(oai):
    completion = oai.chat.completions.create(model="chat-fallback", messages=[{"role": "user", "content": "Hi"}])
    assert completion.choices[0].message.content == "echo Hi" and completion.model == "chat-fallback"


def test_a_client_that_disconnects_cancels_the_upstream_request(gateway, double):
    double.cue(Cue(frame_delay=0.3))
    body = {"model": "chat-echo", "messages": [{"role": "user", "content": "one two three four five six"}],
            "stream": True}
    with httpx.stream("POST", f"{gateway.base_url}/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {gateway.secret}"}, timeout=60) as response:
        for number, _ in enumerate(response.iter_lines()):
            if number > 2:
                break
    deadline = time.monotonic() + 5
    while double.gone == 0:
        assert time.monotonic() < deadline, "the upstream request went on after the client left"
        time.sleep(0.05)


@pytest.mark.parametrize("model", ["image-dev", "image-openai"])
def test_images_on_each_provider(oai, model):
    b64 = oai.images.generate(model=model, prompt="a lighthouse", size="256x256")
    assert b64.data[0].b64_json
    linked = oai.images.generate(model=model, prompt="a lighthouse", size="256x256", response_format="url")
    assert httpx.get(linked.data[0].url, timeout=60).content.startswith(b"\x89PNG")


def _openai_chunk(delta: dict, finish_reason: str | None = None, **extra) -> bytes:
    return sse({"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "gpt-up",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}], **extra})


def _calls(*calls: dict) -> bytes:
    return _openai_chunk({"tool_calls": list(calls)})


def test_the_anthropic_sdk_reads_interleaved_parallel_calls_from_an_openai_upstream(claude, double):
    start = [{"index": i, "id": f"call_{i}", "type": "function", "function": {"name": "weather", "arguments": ""}}
             for i in (0, 1)]
    pieces = [(0, '{"city":'), (1, '{"city":'), (0, '"Oslo"}'), (1, '"Rome"}')]
    frames = [_calls(*start), *[_calls({"index": i, "function": {"arguments": a}}) for i, a in pieces],
              _openai_chunk({}, "tool_calls"), b"data: [DONE]\n\n"]
    whole = {"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "gpt-up",
             "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                 "role": "assistant", "content": None, "tool_calls": [
                     {**call, "function": {"name": "weather", "arguments": f'{{"city":"{city}"}}'}}
                     for call, city in zip(start, ("Oslo", "Rome"))]}}],
             "usage": {"prompt_tokens": 5, "completion_tokens": 20, "total_tokens": 25}}
    double.cue(Cue(frames=frames), Cue(body=whole))
    tools = [{"name": "weather", "input_schema": WEATHER}]
    asked = {"model": "messages-echo", "max_tokens": 50, "tools": tools,
             "messages": [{"role": "user", "content": "Oslo and Rome"}]}
    with claude.messages.stream(**asked) as stream:
        # The raw order, and each block's input as the SDK's accumulator holds it when the block stops.
        raw = [(e.type, e.index, dict(e.content_block.input) if e.type == "content_block_stop" else None)
               for e in stream if e.type.startswith("content_block")]
        final = stream.get_final_message()
    assert raw == [("content_block_start", 0, None), ("content_block_delta", 0, None),
                   ("content_block_delta", 0, None), ("content_block_stop", 0, {"city": "Oslo"}),
                   ("content_block_start", 1, None), ("content_block_delta", 1, None),
                   ("content_block_delta", 1, None), ("content_block_stop", 1, {"city": "Rome"})]
    expected = [("call_0", {"city": "Oslo"}), ("call_1", {"city": "Rome"})]
    assert [(b.id, b.input) for b in final.content] == expected and final.stop_reason == "tool_use"
    message = claude.messages.create(**asked)  # the whole answer: every call, its arguments whole
    assert [(b.id, b.input) for b in message.content] == expected


def test_an_openai_upstreams_refusal_reaches_an_anthropic_caller(claude, oai, double):
    said = "I can't help with that."
    whole = {"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "gpt-up",
             "choices": [{"index": 0, "finish_reason": "stop",
                          "message": {"role": "assistant", "content": None, "refusal": said}}],
             "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}}
    frames = [_openai_chunk({"role": "assistant", "content": None, "refusal": ""}),
              _openai_chunk({"refusal": "I can't "}), _openai_chunk({"refusal": "help with that."}),
              _openai_chunk({}, "stop"), b"data: [DONE]\n\n"]
    double.cue(Cue(body=whole), Cue(frames=frames), Cue(body=whole))
    asked = {"model": "messages-echo", "max_tokens": 50, "messages": [{"role": "user", "content": "Do it."}]}
    message = claude.messages.create(**asked)
    assert ([b.text for b in message.content], message.stop_reason) == ([said], "refusal")
    with claude.messages.stream(**asked) as stream:
        final = stream.get_final_message()
    assert ([b.text for b in final.content], final.stop_reason) == ([said], "refusal")
    completion = oai.chat.completions.create(model="chat-echo", messages=asked["messages"])
    assert (completion.choices[0].message.refusal, completion.choices[0].finish_reason) == (said, "stop")
    # An Anthropic upstream's refusal, for an OpenAI caller:
    double.cue(Cue(body={"id": "msg_up", "type": "message", "role": "assistant", "model": "claude-up",
                         "content": [{"type": "text", "text": "No."}], "stop_reason": "refusal",
                         "stop_sequence": None, "usage": {"input_tokens": 3, "output_tokens": 1}}))
    completion = oai.chat.completions.create(model="chat-anthropic", messages=asked["messages"])
    assert (completion.choices[0].message.content, completion.choices[0].finish_reason) == ("No.", "content_filter")


def test_prompt_cache_counts_cross_dialects(claude, oai, double):
    double.cue(*CACHED_ANSWER_CUES)  # a JSON answer, then a stream
    hello = [{"role": "user", "content": "Hi"}]
    completion = oai.chat.completions.create(model="chat-anthropic", messages=hello)
    assert (completion.usage.prompt_tokens, completion.usage.prompt_tokens_details.cached_tokens) == (2110, 2000)
    chunks = list(oai.chat.completions.create(model="chat-anthropic", messages=hello, stream=True,
                                              stream_options={"include_usage": True}))
    assert (chunks[-1].usage.prompt_tokens, chunks[-1].usage.prompt_tokens_details.cached_tokens) == (2110, 2000)

    openai_usage = {"prompt_tokens": 1200, "completion_tokens": 1, "total_tokens": 1201,
                    "prompt_tokens_details": {"cached_tokens": 1024}}
    whole = {"id": "chatcmpl-up", "object": "chat.completion", "created": 1, "model": "gpt-up", "usage": openai_usage,
             "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant", "content": "Hi"}}]}
    frames = [_openai_chunk({"role": "assistant", "content": "Hi"}), _openai_chunk({}, "stop"),
              sse({"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "gpt-up",
                   "choices": [], "usage": openai_usage}), b"data: [DONE]\n\n"]
    double.cue(Cue(body=whole), Cue(frames=frames))
    answer = claude.messages.create(model="messages-echo", max_tokens=5, messages=hello)
    assert (answer.usage.input_tokens, answer.usage.cache_read_input_tokens) == (176, 1024)
    with claude.messages.stream(model="messages-echo", max_tokens=5, messages=hello) as stream:
        final = stream.get_final_message()
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (176, 1024)


def test_a_tool_error_reaches_an_openai_upstream_marked(claude, double):
    claude.messages.create(model="messages-echo", max_tokens=5, messages=[
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "is_error": True,
                                      "content": "city not found"}]}])
    (tool,) = [m for m in double.seen[-1].body["messages"] if m["role"] == "tool"]
    assert tool == {"role": "tool", "tool_call_id": "toolu_1", "content": "Error: city not found"}
