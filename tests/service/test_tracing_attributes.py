"""The gen_ai attributes of traces, as the conventions name them and the caller saw them: the finish reasons the
caller received, the sampling settings it set, a prompt over the window, prompt-cache tokens, the answer's id on
the request span, and on each upstream attempt span what its upstream answered."""

from __future__ import annotations

import base64

import grpc
import orjson
import pytest
from google.protobuf import json_format

from portico.v1 import image_pb2, image_service_pb2_grpc
from tests.helpers import bearer, http_body
from tests.service.tracing_support import (  # noqa: F401 - receiver and running are fixtures
    HELLO, ask, caller_context, one, receiver, running, spans_of,
)
from tests.upstream_double import Cue
from tests.upstream_echo import echo_chat, echo_messages, tiny_png


def _received_reasons(bodies) -> list[str]:
    """Every finish_reason / stop_reason the caller was sent, from a JSON answer or the data lines of a stream."""
    found = []

    def walk(value) -> None:
        if isinstance(value, dict):
            for name, item in value.items():
                if name in ("finish_reason", "stop_reason") and isinstance(item, str):
                    found.append(item)
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    for body in bodies:
        data = body.data
        if not data.startswith(b"{"):  # a stream's data lines ([DONE] included)
            data = b"[%s]" % b",".join(line.removeprefix(b"data: ") for line in data.split(b"\n")
                                       if line.startswith(b"data: {"))
        walk(orjson.loads(data))
    return found


def _pause_turn(stream: bool) -> Cue:
    """An Anthropic answer ending with a reason Portico has no name of its own for (a server tool's pause)."""
    answer = echo_messages({"model": "claude-up", "max_tokens": 20, "messages": HELLO, "stream": stream})
    if stream:
        return Cue(frames=[frame.replace(b'"stop_reason":"end_turn"', b'"stop_reason":"pause_turn"')
                           for frame in answer])
    return Cue(body={**answer, "stop_reason": "pause_turn"})


@pytest.mark.parametrize("model, stream, max_tokens, cue, reason", [
    ("up-main", False, 20, None, "stop"),
    ("up-main", True, 20, None, "stop"),
    ("up-main", False, 2, None, "length"),
    ("chat-on-anthropic", False, 20, None, "stop"),
    ("chat-on-anthropic", True, 2, None, "length"),
    ("embedded", True, 2, None, "length"),
    ("messages-on-anthropic", False, 20, None, "end_turn"),
    ("messages-on-anthropic", True, 2, None, "max_tokens"),
    ("messages-on-openai", False, 20, None, "end_turn"),
    ("messages-on-openai", True, 2, None, "max_tokens"),
    ("messages-on-anthropic", False, 20, _pause_turn(False), "pause_turn"),
    ("messages-on-anthropic", True, 20, _pause_turn(True), "pause_turn"),
])
async def test_finish_reasons_are_the_ones_the_caller_received(chat, messages, running, double, receiver, key,
                                                                 model, stream, max_tokens, cue, reason):
    """gen_ai.response.finish_reasons holds the provider's values as the caller got them (`stop`, `length` for a
    chat caller; `end_turn`, `max_tokens`, ... for a Messages caller; an upstream's own value passed through), not
    Portico's internal names."""
    _, secret = key
    if cue is not None:
        double.cue(cue)
    trace_id, _, traceparent = caller_context()
    body = {"model": model, "max_tokens": max_tokens, "messages": HELLO, "stream": stream}
    metadata = (*bearer(secret), traceparent)
    service, name = (messages, "CreateMessage") if model.startswith("messages") else (chat, "CreateChatCompletion")
    if stream:
        bodies = [part async for part in getattr(service, name + "Http")(http_body(body), metadata=metadata)]
    else:
        bodies = [await getattr(service, name + "HttpUnary")(http_body(body), metadata=metadata)]
    assert _received_reasons(bodies) == [reason]

    server = one(await spans_of(receiver, trace_id), kind="server")
    assert server.attributes["gen_ai.response.finish_reasons"] == (reason,)


async def test_the_sampling_settings_asked_for_are_on_the_request_span(chat, messages, running, receiver, key):
    """The gen_ai conventions' request settings, as the caller set them (none it did not set): an operator comparing
    a slow or odd answer with its settings needs them; stop sequences are the caller's text and stay out."""
    _, secret = key
    asked, _, traceparent = caller_context()
    await ask(chat, secret, traceparent, temperature=0.3, top_p=0.9, seed=7, frequency_penalty=0.5,
              presence_penalty=-0.5, stop=["Secret-Stop"])
    plain, _, traceparent = caller_context()
    body = {"model": "messages-on-anthropic", "max_tokens": 8, "messages": HELLO, "top_k": 5, "temperature": 1}
    await messages.CreateMessageHttpUnary(http_body(body), metadata=(*bearer(secret), traceparent))

    attributes = one(await spans_of(receiver, asked), kind="server").attributes
    assert attributes["gen_ai.request.temperature"] == 0.3 and attributes["gen_ai.request.top_p"] == 0.9
    assert attributes["gen_ai.request.seed"] == 7
    assert attributes["gen_ai.request.frequency_penalty"] == 0.5
    assert attributes["gen_ai.request.presence_penalty"] == -0.5
    assert "gen_ai.request.stop_sequences" not in attributes and b"Secret-Stop" not in b"".join(receiver.bodies)
    attributes = one(await spans_of(receiver, plain), kind="server").attributes
    assert attributes["gen_ai.request.top_k"] == 5 and attributes["gen_ai.request.max_tokens"] == 8
    # The conventions' types: a double even when the caller wrote an integer (backends index attributes by type).
    assert isinstance(attributes["gen_ai.request.temperature"], float)
    assert isinstance(attributes["gen_ai.request.top_k"], float)
    assert not {"gen_ai.request.top_p", "gen_ai.request.seed", "gen_ai.output.type"} & set(attributes)
    json_asked, _, traceparent = caller_context()
    await ask(chat, secret, traceparent, response_format={"type": "json_object"})
    assert one(await spans_of(receiver, json_asked), kind="server").attributes["gen_ai.output.type"] == "json"
    json_asked, _, traceparent = caller_context()  # a Messages caller's structured output too
    body = {"model": "messages-on-openai", "max_tokens": 8, "messages": HELLO,
            "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}}
    await messages.CreateMessageHttpUnary(http_body(body), metadata=(*bearer(secret), traceparent))
    assert one(await spans_of(receiver, json_asked), kind="server").attributes["gen_ai.output.type"] == "json"


async def test_a_prompt_over_the_window_says_so_on_its_spans(chat, running, double, receiver, key):
    """error.type is the code the caller was given (the conventions: the provider's error code), so a fallback taken
    for a prompt over a model's context window reads as that, not as a bare invalid_request; portico.error.code
    keeps the error table's row."""
    _, secret = key
    over = {"error": {"message": "This model's maximum context length is 10 tokens", "type": "invalid_request_error",
                      "code": "context_length_exceeded", "param": "messages"}}
    double.cue(Cue(400, over))
    fell_back, _, traceparent = caller_context()
    await ask(chat, secret, traceparent)  # up-main refuses it; up-backup answers
    double.cue(Cue(400, over))
    refused, _, traceparent = caller_context()
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await ask(chat, secret, traceparent, model="up-solo")
    assert '"code":"context_length_exceeded"' in dict(caught.value.trailing_metadata())["portico-error"]

    spans = await spans_of(receiver, fell_back)
    failed, answered = sorted((s for s in spans if s.kind == "client"), key=lambda s: s.start)
    assert failed.error and failed.attributes["error.type"] == "context_length_exceeded"
    assert failed.attributes["portico.error.code"] == "invalid_request"
    assert answered.attributes["portico.fallback"] and "error.type" not in one(spans, kind="server").attributes
    spans = await spans_of(receiver, refused)
    server = one(spans, kind="server")
    assert server.attributes["error.type"] == "context_length_exceeded"
    assert server.attributes["portico.error.code"] == "invalid_request"
    assert one(spans, kind="client").attributes["error.type"] == "context_length_exceeded"


async def test_prompt_cache_tokens_are_on_the_request_span(messages, running, double, receiver, key):
    """The conventions' cache_read / cache_creation input tokens, from an upstream's prompt cache; input_tokens is
    the whole prompt, as the conventions ask."""
    _, secret = key
    answer = echo_messages({"model": "claude-up", "max_tokens": 20, "messages": HELLO})
    usage = {"input_tokens": 2, "cache_read_input_tokens": 100, "cache_creation_input_tokens": 30, "output_tokens": 3}
    double.cue(Cue(body={**answer, "usage": usage}))
    trace_id, _, traceparent = caller_context()
    body = {"model": "messages-on-anthropic", "max_tokens": 20, "messages": HELLO}
    await messages.CreateMessageHttpUnary(http_body(body), metadata=(*bearer(secret), traceparent))

    attributes = one(await spans_of(receiver, trace_id), kind="server").attributes
    assert attributes["gen_ai.usage.input_tokens"] == 132
    assert attributes["gen_ai.usage.cache_read.input_tokens"] == 100
    assert attributes["gen_ai.usage.cache_creation.input_tokens"] == 30


async def test_the_answers_id_is_on_the_request_span(chat, messages, running, receiver, key):
    """gen_ai.response.id is the id the caller's answer carries, so a caller quoting it leads to the trace."""
    _, secret = key
    answered, _, traceparent = caller_context()
    body = {"model": "up-main", "messages": HELLO}
    answer = await chat.CreateChatCompletionHttpUnary(http_body(body), metadata=(*bearer(secret), traceparent))
    streamed, _, traceparent = caller_context()
    body = {"model": "messages-on-openai", "max_tokens": 8, "messages": HELLO, "stream": True}
    parts = [part.data async for part in messages.CreateMessageHttp(http_body(body), metadata=(*bearer(secret),
                                                                                               traceparent))]
    started = next(line for line in b"".join(parts).split(b"\n") if line.startswith(b"data: {\"type\":\"message_start"))

    server = one(await spans_of(receiver, answered), kind="server")
    assert server.attributes["gen_ai.response.id"] == orjson.loads(answer.data)["id"]
    server = one(await spans_of(receiver, streamed), kind="server")
    assert server.attributes["gen_ai.response.id"] == orjson.loads(started[6:])["message"]["id"]
    refused, _, traceparent = caller_context()
    with pytest.raises(grpc.aio.AioRpcError):
        await ask(chat, secret, traceparent, temperature=5)
    assert "gen_ai.response.id" not in one(await spans_of(receiver, refused), kind="server").attributes


def _answered_by_upstream(kind: str, stream: bool) -> tuple[Cue, dict]:
    """An upstream answer with its own id and a dated model name (not the name asked for), and the attributes its
    attempt span must carry: what the upstream said, as it said it (Anthropic's `max_tokens`, its whole prompt)."""
    if kind == "openai":
        asked = {"model": "main-model-2026-01", "max_tokens": 2, "messages": HELLO, "stream": stream,
                 "stream_options": {"include_usage": True}}
        answer, own_id, (prompt, output) = echo_chat(asked), "chatcmpl-own-7", (2, 2)
        reason, renamed = "length", (b"chatcmpl-up", own_id.encode())
    else:
        asked = {"model": "claude-up-2026-01", "max_tokens": 2, "messages": HELLO, "stream": stream}
        answer, own_id, (prompt, output) = echo_messages(asked), "msg_own_7", (2, 2)
        reason, renamed = "max_tokens", (b"msg_up", own_id.encode())
        if not stream:  # the prompt cache's part of the prompt counts too (the conventions: the whole prompt)
            answer["usage"] = {**answer["usage"], "cache_read_input_tokens": 40}
            prompt += 40
    if stream:
        cue = Cue(frames=[frame.replace(*renamed) for frame in answer])
    else:
        cue = Cue(body={**answer, "id": own_id})
    expected = {"gen_ai.response.id": own_id, "gen_ai.response.model": asked["model"],
                "gen_ai.response.finish_reasons": (reason,), "gen_ai.usage.input_tokens": prompt,
                "gen_ai.usage.output_tokens": output}
    return cue, expected


_RESPONSE_ATTRIBUTES = ("gen_ai.response.id", "gen_ai.response.model", "gen_ai.response.finish_reasons",
                        "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens")


@pytest.mark.parametrize("model, kind", [("up-main", "openai"), ("chat-on-anthropic", "anthropic")])
@pytest.mark.parametrize("stream", [False, True])
async def test_each_attempt_says_what_its_upstream_answered(chat, running, double, receiver, key, model, kind,
                                                            stream):
    """The attempt span carries the upstream's own answer (the gen_ai conventions' client span): its id, the model
    it says answered, its finish reason and token counts as it sent them, which may differ from what the caller got
    (a `length` for Anthropic's `max_tokens`, Portico's own id)."""
    _, secret = key
    cue, expected = _answered_by_upstream(kind, stream)
    double.cue(cue)
    trace_id, _, traceparent = caller_context()
    body = {"model": model, "max_tokens": 2, "messages": HELLO, "stream": stream}
    metadata = (*bearer(secret), traceparent)
    if stream:
        [part async for part in chat.CreateChatCompletionHttp(http_body(body), metadata=metadata)]
    else:
        await chat.CreateChatCompletionHttpUnary(http_body(body), metadata=metadata)

    spans = await spans_of(receiver, trace_id)
    attempt = one(spans, kind="client")
    assert {name: attempt.attributes.get(name) for name in _RESPONSE_ATTRIBUTES} == expected
    server = one(spans, kind="server")
    assert server.attributes["gen_ai.response.finish_reasons"] == ("length",)  # as the chat caller was told
    assert server.attributes["gen_ai.response.id"] != expected["gen_ai.response.id"]  # Portico's own id


async def test_a_failed_attempt_says_nothing_of_an_answer(chat, running, double, receiver, key):
    _, secret = key
    double.cue(Cue(status=503, body={"error": {"message": "overloaded"}}),
               Cue(body={"error": {"message": "busy", "type": "server_error"}}))  # an error in a 200 answer
    trace_id, _, traceparent = caller_context()
    await ask(chat, secret, traceparent)

    attempts = sorted((s for s in await spans_of(receiver, trace_id) if s.kind == "client"), key=lambda s: s.start)
    *failed, answered = attempts
    assert len(failed) == 2 and all(s.error for s in failed)  # the 200 carrying an error failed its attempt too
    for span in failed:
        assert not set(_RESPONSE_ATTRIBUTES) & set(span.attributes), span.attributes
    assert answered.attributes["gen_ai.response.id"] == "chatcmpl-up" and not answered.error


async def test_a_token_count_attempt_says_what_its_upstream_counted(messages, running, double, receiver, key):
    """Anthropic's count_tokens answers with input_tokens only: the attempt carries that count (the conventions'
    gen_ai.usage.input_tokens), as a message's attempt carries its usage, and nothing the upstream did not say."""
    _, secret = key
    double.cue(Cue(body={"input_tokens": 37}))
    trace_id, _, traceparent = caller_context()
    body = {"model": "messages-on-anthropic", "max_tokens": 8, "messages": HELLO}
    answer = await messages.CountMessageTokensHttp(http_body(body), metadata=(*bearer(secret), traceparent))
    assert orjson.loads(answer.data)["input_tokens"] == 37

    attempt = one(await spans_of(receiver, trace_id), kind="client")
    assert attempt.attributes["gen_ai.usage.input_tokens"] == 37 and not attempt.error
    assert not {"gen_ai.response.id", "gen_ai.response.model", "gen_ai.response.finish_reasons",
                "gen_ai.usage.output_tokens"} & set(attempt.attributes)


async def test_a_count_its_upstream_has_no_endpoint_for_says_it_was_estimated(messages, running, double, receiver,
                                                                              key):
    """An upstream without count_tokens (404) is answered with Portico's estimate: its attempt said only
    `http.response.status_code` 404, read as a failed count; it now says `portico.count_estimated`, and no count the
    upstream did not make. A count the upstream made says no such thing."""
    _, secret = key
    double.cue(Cue(status=404, body={"type": "error", "error": {"type": "not_found_error", "message": "Not Found"}}))
    trace_id, _, traceparent = caller_context()
    body = {"model": "messages-on-anthropic", "max_tokens": 8, "messages": HELLO}
    answer = await messages.CountMessageTokensHttp(http_body(body), metadata=(*bearer(secret), traceparent))
    assert orjson.loads(answer.data)["input_tokens"] > 0

    attempt = one(await spans_of(receiver, trace_id), kind="client")
    assert attempt.attributes["portico.count_estimated"] is True and not attempt.error
    assert attempt.attributes["http.response.status_code"] == 404
    assert "gen_ai.usage.input_tokens" not in attempt.attributes

    double.cue(Cue(body={"input_tokens": 37}))
    trace_id, _, traceparent = caller_context()
    await messages.CountMessageTokensHttp(http_body(body), metadata=(*bearer(secret), traceparent))
    assert "portico.count_estimated" not in one(await spans_of(receiver, trace_id), kind="client").attributes


@pytest.mark.parametrize("named", [False, True])
async def test_an_image_attempt_says_what_its_upstream_answered(channel, running, double, receiver, key, named):
    """gpt-image models report usage (input and output tokens): the attempt carries it; an id and a model only when
    the upstream names them (OpenAI's answer does not), never made up."""
    _, secret = key
    answer = {"created": 1, "data": [{"b64_json": base64.b64encode(tiny_png(1)).decode()}],
              "usage": {"input_tokens": 12, "output_tokens": 272, "total_tokens": 284}}
    if named:
        answer |= {"id": "img-own-1", "model": "image-up-2026-01"}
    double.cue(Cue(body=answer))
    trace_id, _, traceparent = caller_context()
    request = json_format.ParseDict({"model": "images-up", "prompt": "a lighthouse"}, image_pb2.CreateImageRequest())
    await image_service_pb2_grpc.ImageServiceStub(channel).CreateImage(request, metadata=(*bearer(secret), traceparent))

    attempt = one(await spans_of(receiver, trace_id), kind="client")
    said = {name: attempt.attributes.get(name) for name in _RESPONSE_ATTRIBUTES if name in attempt.attributes}
    expected = {"gen_ai.usage.input_tokens": 12, "gen_ai.usage.output_tokens": 272}
    if named:
        expected |= {"gen_ai.response.id": "img-own-1", "gen_ai.response.model": "image-up-2026-01"}
    assert said == expected and not attempt.error


async def test_an_image_answer_without_images_fails_its_attempt(channel, running, double, receiver, key):
    _, secret = key
    double.cue(Cue(body={"created": 1, "data": [], "model": "image-up-2026-01"}))
    trace_id, _, traceparent = caller_context()
    request = json_format.ParseDict({"model": "images-up", "prompt": "a lighthouse"}, image_pb2.CreateImageRequest())
    with pytest.raises(grpc.aio.AioRpcError):
        await image_service_pb2_grpc.ImageServiceStub(channel).CreateImage(request,
                                                                           metadata=(*bearer(secret), traceparent))

    attempt = one(await spans_of(receiver, trace_id), kind="client")
    assert attempt.error and attempt.attributes["error.type"] == "upstream_error"
    assert "gen_ai.response.model" not in attempt.attributes


@pytest.mark.parametrize("model, rpc, provider", [
    ("up-main", "CreateChatCompletionHttpUnary", "openai"),
    ("chat-on-anthropic", "CreateChatCompletionHttp", "anthropic"),
    ("messages-on-openai", "CreateMessageHttp", "openai"),
    ("embedded", "CreateChatCompletionHttpUnary", "portico.embedded"),
    ("messages-on-anthropic", "CountMessageTokensHttp", "anthropic"),  # Anthropic counts it
    ("messages-on-openai", "CountMessageTokensHttp", None),  # counted by Portico: no upstream answered
])
async def test_the_request_span_names_the_provider_that_answered(chat, messages, running, receiver, key, model, rpc,
                                                                 provider):
    """The conventions require gen_ai.provider.name on an inference span: the request span says who answered, as
    the span of the attempt or generation that answered does."""
    _, secret = key
    trace_id, _, traceparent = caller_context()
    body = {"model": model, "max_tokens": 3, "messages": HELLO, "stream": rpc.endswith("Http")}
    service = messages if model.startswith("messages") else chat
    call = getattr(service, rpc)(http_body(body if rpc.startswith("Create") else {**body, "stream": False}),
                                 metadata=(*bearer(secret), traceparent))
    if rpc in ("CreateChatCompletionHttp", "CreateMessageHttp"):
        [part async for part in call]
    else:
        await call

    spans = await spans_of(receiver, trace_id)
    server = one(spans, kind="server")
    assert server.attributes.get("gen_ai.provider.name") == provider
    answered = [s for s in spans if s.kind != "server" and s.name != "admission"]
    assert [s.attributes["gen_ai.provider.name"] for s in answered] == ([provider] if provider else [])


@pytest.mark.parametrize("model, provider, child", [
    ("images-up", "openai", "generate_content image-up"),
    # The development image provider draws in process, as the embedded model generates: its generation span says
    # where the time went, and the request span who answered (the default configuration's image model is one).
    ("images-dev", "portico.embedded", "generate dev-image"),
])
async def test_the_request_span_of_an_image_names_its_provider(channel, running, receiver, key, model, provider,
                                                               child):
    _, secret = key
    trace_id, _, traceparent = caller_context()
    request = json_format.ParseDict({"model": model, "prompt": "a lighthouse", "n": 2}, image_pb2.CreateImageRequest())
    await image_service_pb2_grpc.ImageServiceStub(channel).CreateImage(request, metadata=(*bearer(secret), traceparent))
    spans = await spans_of(receiver, trace_id)
    server = one(spans, kind="server")
    assert server.attributes["gen_ai.provider.name"] == provider
    answered = one(spans, name=child)
    assert answered.parent_id == server.span_id and not answered.error
    assert answered.attributes["gen_ai.operation.name"] == "generate_content"
    assert answered.attributes["gen_ai.provider.name"] == provider
    assert (answered.attributes["portico.model"], answered.attributes["portico.attempt"]) == (model, 1)
