"""Streamed answers at their edges, through the whole stack (real Envoy, `portico serve`) and the official SDKs: what
an upstream sends that is not a well-formed stream reaches the caller as what it was."""

from __future__ import annotations

import anthropic
import orjson
import openai
import pytest

from tests.e2e.conftest import upstream_gateway
from tests.upstream_double import Cue
from tests.upstream_echo import echo_chat, echo_messages, sse
from tests.upstream_support import cross_dialect_models

HELLO = [{"role": "user", "content": "Hi"}]
ATTEMPTS = 3  # each model's retry.attempts (FAST_RETRY): every attempt gets the same answer


@pytest.fixture(scope="module")
def gateway(double, tmp_path_factory):
    models = cross_dialect_models(double.url, openai_model="gpt-up", anthropic_model="claude-up")
    with upstream_gateway(tmp_path_factory.mktemp("stream-edges-gateway"), models) as gateway:
        yield gateway


@pytest.fixture(autouse=True)
def fresh(double):
    double.reset()


def chat_stream(oai: openai.OpenAI, model: str) -> list:
    return list(oai.chat.completions.create(model=model, messages=HELLO, stream=True))


def message_stream(claude: anthropic.Anthropic, model: str):
    with claude.messages.stream(model=model, max_tokens=20, messages=HELLO) as stream:
        return stream.get_final_message()


OPENAI_ERROR = {"error": {"message": "The engine is currently overloaded.", "type": "server_error", "code": None}}
ANTHROPIC_ERROR = {"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}}


@pytest.mark.parametrize("model", ["chat-on-openai", "messages-on-openai"])
def test_an_error_object_answered_to_a_stream_reaches_the_caller(oai, claude, double, model):
    """Some OpenAI-compatible servers answer a failure as a JSON error object with status 200, also when asked for
    a stream: the caller gets the upstream's message, not a stream that "ended before the answer was complete"."""
    double.cue(*[Cue(body=OPENAI_ERROR)] * ATTEMPTS)
    with pytest.raises((openai.APIStatusError, anthropic.APIStatusError)) as caught:
        chat_stream(oai, model) if model.startswith("chat") else message_stream(claude, model)
    assert caught.value.status_code == 502
    assert "The engine is currently overloaded." in str(caught.value)
    assert "HTTP 500" not in str(caught.value)  # the upstream answered 200: no status of its own to quote


@pytest.mark.parametrize("model", ["chat-on-anthropic", "messages-on-anthropic"])
def test_an_anthropic_error_object_answered_to_a_stream_keeps_its_type(oai, claude, double, model):
    double.cue(*[Cue(body=ANTHROPIC_ERROR)] * ATTEMPTS)
    with pytest.raises((openai.APIStatusError, anthropic.APIStatusError)) as caught:
        chat_stream(oai, model) if model.startswith("chat") else message_stream(claude, model)
    assert caught.value.status_code == 503 and "Overloaded" in str(caught.value)


@pytest.mark.parametrize("model", ["chat-on-openai", "messages-on-anthropic"])
def test_a_json_answer_to_a_stream_is_called_so(oai, claude, double, model):
    """A server that ignores `stream: true` and sends one JSON answer: a 502 that says what came back."""
    double.cue(Cue(body={"id": "x", "object": "chat.completion", "choices": []}))
    with pytest.raises((openai.APIStatusError, anthropic.APIStatusError)) as caught:
        chat_stream(oai, model) if model.startswith("chat") else message_stream(claude, model)
    assert caught.value.status_code == 502
    assert "answered a streamed request with application/json, not an event stream" in str(caught.value)
    assert len(double.seen) == 1  # asking again would get the same


def chunk(delta: dict, finish_reason: str | None = None) -> bytes:
    return sse({"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "gpt-up",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish_reason}]})


def test_a_byte_order_mark_before_the_first_event_loses_no_event(oai, double):
    """The SSE standard skips a UTF-8 byte order mark at the start of a stream; read as part of the first line, it
    made the first event's `data:` line unknown, and the chunk with it (here the first words) was lost."""
    frames = [b"\xef\xbb\xbf" + chunk({"role": "assistant", "content": "Hello"}), chunk({"content": " there"}),
              chunk({}, "stop"), b"data: [DONE]\n\n"]
    double.cue(Cue(frames=frames))
    chunks = chat_stream(oai, "chat-on-openai")
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Hello there"
    assert chunks[0].choices[0].delta.role == "assistant"


VLLM_ERROR = {"error": {"object": "error", "message": "This model's maximum context length is 4096 tokens.",
                        "type": "BadRequestError", "param": None, "code": 400}}


@pytest.mark.parametrize("model", ["chat-on-openai", "messages-on-openai"])
def test_an_error_event_keeps_the_http_status_its_code_names(oai, claude, double, model):
    """vLLM reports a failure found after its answer began (a prompt over the context window) as an error event
    whose `code` is the HTTP status: a 400 is the caller's to fix, not a 502 sent again by the gateway and SDKs."""
    double.cue(Cue(frames=[chunk({"role": "assistant", "content": ""}), sse(VLLM_ERROR)]))
    with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as caught:
        chat_stream(oai, model) if model.startswith("chat") else message_stream(claude, model)
    assert "maximum context length is 4096 tokens" in str(caught.value)
    assert len(double.seen) == 1


def test_an_error_event_mid_stream_quotes_no_status_the_upstream_never_sent(oai, double):
    double.cue(Cue(frames=[chunk({"role": "assistant", "content": "Hel"}), sse(OPENAI_ERROR)]))
    with pytest.raises(openai.APIError) as caught:
        chat_stream(oai, "chat-on-openai")
    assert caught.value.message == "The upstream serving `chat-on-openai` failed: The engine is currently overloaded."
    assert (caught.value.code, caught.value.type) == ("upstream_error", "api_error")


LLAMA_CPP_ERROR = (b'error: {"code":400,"message":"the request exceeds the available context size, try increasing it",'
                   b'"type":"exceed_context_size_error","n_prompt_tokens":5000,"n_ctx":4096}\n\n')


@pytest.mark.parametrize("model", ["chat-on-openai", "messages-on-openai"])
def test_llama_cpp_s_error_field_is_the_upstream_s_error(oai, claude, double, model):
    """llama.cpp's server (builds before its streamed errors moved into `data:`) writes a failure met while streaming
    as an SSE `error:` field, then `data: [DONE]`. Read as an unknown field and dropped, it left a stream that "ended
    before the answer was complete": a 502, sent twice more, instead of the prompt's 400 context_length_exceeded."""
    double.cue(Cue(frames=[LLAMA_CPP_ERROR, b"data: [DONE]\n\n"]))
    with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as caught:
        chat_stream(oai, model) if model.startswith("chat") else message_stream(claude, model)
    assert "exceeds the available context size" in str(caught.value)
    error = caught.value.body if model.startswith("chat") else caught.value.body["error"]
    assert error["code"] == "context_length_exceeded", error
    assert len(double.seen) == 1


def test_llama_cpp_s_error_field_mid_stream_ends_the_stream_with_its_message(oai, double):
    error = b'error: {"code":500,"message":"slot unavailable","type":"server_error"}\n\n'
    double.cue(Cue(frames=[chunk({"role": "assistant", "content": "Hel"}), error, b"data: [DONE]\n\n"]))
    with pytest.raises(openai.APIError) as caught:
        chat_stream(oai, "chat-on-openai")
    assert "slot unavailable" in caught.value.message, caught.value.message


def test_a_usage_chunk_split_in_two_never_reaches_a_caller_who_did_not_ask_for_usage(oai, double):
    """Portico asks every OpenAI-compatible upstream for usage, so the chunks it adds for that are its own to remove.
    Some servers (xAI's Grok, BerriAI/litellm#17136) put the usage on the finish chunk and end with one more chunk of
    empty `choices`: passed on to a caller who never asked for usage, OpenAI's own loop (`chunk.choices[0].delta`)
    raised IndexError on it."""
    base = {"id": "chatcmpl-up", "object": "chat.completion.chunk", "created": 1, "model": "gpt-up"}
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    frames = [sse({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": "Hi"}}]}),
              sse({**base, "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}], "usage": usage}),
              sse({**base, "choices": [], "usage": None}), sse({**base, "choices": []}), b"data: [DONE]\n\n"]
    double.cue(Cue(frames=frames), Cue(frames=frames))
    chunks = chat_stream(oai, "chat-on-openai")
    assert [chunk.choices[0].delta.content for chunk in chunks] == ["Hi", None]
    assert all(chunk.usage is None for chunk in chunks)
    # A caller who asked for usage gets the upstream's chunks as they came (its usage where it put it).
    asked = list(oai.chat.completions.create(model="chat-on-openai", messages=HELLO, stream=True,
                                             stream_options={"include_usage": True}))
    assert len(asked) == 4 and asked[1].usage.total_tokens == 5


def _cut_in_its_first_content_event(model: str) -> list[bytes]:
    """The echo stream of `model`'s upstream, ended cleanly (no reset: a body delimited by the connection's close,
    or a proxy's last chunk) in the middle of its first content event: no content has been sent."""
    frames = echo_chat({"messages": HELLO, "stream": True}) if model.endswith("openai") else echo_messages(
        {"messages": HELLO, "max_tokens": 20, "stream": True})
    first = 1 if model.endswith("openai") else 3  # after the role chunk; after message_start, block start and ping
    return [*frames[:first], frames[first][:len(frames[first]) // 2]]


@pytest.mark.parametrize("model", ["chat-on-openai", "chat-on-anthropic", "messages-on-anthropic",
                                   "messages-on-openai"])
def test_a_stream_that_ends_in_the_middle_of_its_first_content_event_is_retried(oai, claude, double, model):
    """The event's half is no event (the SSE standard drops an event its stream ends in): the stream broke off
    before any content, which is retried. Read as an event, it was a 502 "sent an event that is not a JSON object",
    never retried, where the next attempt answered."""
    double.cue(Cue(frames=_cut_in_its_first_content_event(model)))
    if model.startswith("chat"):
        assert "".join(c.choices[0].delta.content or "" for c in chat_stream(oai, model) if c.choices) == "echo Hi"
    else:
        assert message_stream(claude, model).content[0].text == "echo Hi"
    assert len(double.seen) == 2


def test_a_stream_that_ends_in_the_middle_of_an_event_after_content_says_it_broke_off(oai, double):
    double.cue(Cue(frames=[chunk({"role": "assistant", "content": "Hel"}), chunk({"content": "lo"})[:20]]))
    with pytest.raises(openai.APIError) as caught:
        chat_stream(oai, "chat-on-openai")
    assert "not a JSON object" not in caught.value.message and "broke off" in caught.value.message
    assert len(double.seen) == 1


OPENAI_TOO_LONG = {"error": {"message": "This model's maximum context length is 4096 tokens. However, you requested "
                             "5000 tokens.", "type": "invalid_request_error", "param": "messages",
                             "code": "context_length_exceeded"}}
ANTHROPIC_TOO_LONG = {"type": "error", "error": {"type": "invalid_request_error",
                                                 "message": "prompt is too long: 300000 tokens > 200000 maximum"}}


@pytest.mark.parametrize("model", ["chat-on-openai", "chat-on-anthropic", "messages-on-anthropic",
                                   "messages-on-openai"])
def test_an_error_object_sent_as_the_whole_event_stream_is_that_error(oai, claude, double, model):
    """Some OpenAI-compatible servers answer a failure to a streamed request as their JSON error object, with status
    200 and `content-type: text/event-stream`. Holding no `data:` line, it read as a stream that "ended before the
    answer was complete": a 502 sent twice more, the upstream's message lost, where a prompt too long is the
    caller's 400 context_length_exceeded."""
    error = OPENAI_TOO_LONG if model.endswith("openai") else ANTHROPIC_TOO_LONG
    double.cue(*[Cue(frames=[orjson.dumps(error)])] * ATTEMPTS)
    with pytest.raises((openai.BadRequestError, anthropic.BadRequestError)) as caught:
        chat_stream(oai, model) if model.startswith("chat") else message_stream(claude, model)
    assert caught.value.status_code == 400
    assert error["error"]["message"] in str(caught.value)
    body = caught.value.body if model.startswith("chat") else caught.value.body["error"]
    assert body["code"] == "context_length_exceeded", body
    assert len(double.seen) == 1


@pytest.mark.parametrize("model", ["chat-on-openai", "messages-on-openai"])
@pytest.mark.parametrize("stream", [False, True])
def test_an_error_member_that_is_null_is_no_error(oai, claude, double, model, stream):
    """Some OpenAI-compatible servers put `"error": null` in every answer and chunk (an optional member of their
    answer model): the openai SDK reads only a truthy `error` as a failure. Portico read the member's presence: a
    whole answer was a 502 that quoted it, asked for three times, and the SDKs sent it twice more."""
    answer = echo_chat({"messages": HELLO, "stream": stream})
    if stream:
        answer = [frame.replace(b'"object":"chat.completion.chunk"', b'"object":"chat.completion.chunk","error":null')
                  for frame in answer]
        assert all(b'"error":null' in frame for frame in answer[:-1])
    double.cue(Cue(frames=answer) if stream else Cue(body={**answer, "error": None}))
    if model.startswith("chat"):
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in chat_stream(oai, model) if c.choices)
        else:
            text = oai.chat.completions.create(model=model, messages=HELLO).choices[0].message.content
    else:
        text = (message_stream(claude, model) if stream else claude.messages.create(
            model=model, max_tokens=20, messages=HELLO)).content[0].text
    assert text == "echo Hi" and len(double.seen) == 1
