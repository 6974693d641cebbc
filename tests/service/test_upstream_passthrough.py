"""Same dialect in and out, through the real gRPC server against the upstream double: a chat completion served by
an OpenAI-compatible upstream and a message served by an Anthropic one reach the caller as the upstream sent them
(logprobs, system_fingerprint, thinking blocks with signatures, ...), JSON and streamed, with only Portico's id and
created and the caller's model id put in; usage only for a caller who asked; a stream dropped before content still
retried; answers across dialects still rendered from the internal events."""

from __future__ import annotations

import grpc
import orjson
import pytest
from google.protobuf import json_format

from tests.helpers import bearer, chat_request, error_details, message_request, sse_frames
from tests.helpers import http_body as raw
from tests.passthrough_objects import CHUNKS, COMPLETION, MESSAGE, THINKING, UPSTREAM_MODEL, chunk
from tests.upstream_double import Cue
from tests.upstream_echo import sse
from tests.upstream_support import cross_dialect_models, upstream_server, window_tokens

CHUNK_FRAMES = [*(sse(c) for c in CHUNKS), b"data: [DONE]\n\n"]

EVENTS = [
    {"type": "message_start", "message": {**MESSAGE, "content": [], "stop_reason": None,
                                          "usage": {"input_tokens": 20, "output_tokens": 1}}},
    {"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}},
    {"type": "ping"},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": "The user wants"}},
    {"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "EqQBCkYIAR"}},
    {"type": "content_block_stop", "index": 0},
    {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
    {"type": "content_block_delta", "index": 1, "delta": {"type": "text_delta", "text": "Checking."}},
    {"type": "content_block_stop", "index": 1},
    {"type": "message_delta", "delta": {"stop_reason": "end_turn", "stop_sequence": None, "container": None},
     "usage": {"output_tokens": 12}},
    {"type": "message_stop"},
]
EVENT_FRAMES = [sse(e, e["type"]) for e in EVENTS]


@pytest.fixture(scope="module")
async def running(double, tmp_path_factory):
    models = cross_dialect_models(double.url, openai_model=UPSTREAM_MODEL, anthropic_model=UPSTREAM_MODEL)
    async with upstream_server(tmp_path_factory.mktemp("passthrough"), models) as server:
        yield server


async def http_body(rpc, request, secret) -> bytes:
    return b"".join([b.data async for b in rpc(raw(request), metadata=bearer(secret))])


def data_of(frames: list[bytes]) -> list:
    return [orjson.loads(f.split(b"data: ", 1)[1]) for f in frames if not f.endswith(b"data: [DONE]\n\n")]


def owned_chat(obj: dict, answer: dict) -> dict:
    """`obj` with the id and created Portico gave `answer`, and the model id the caller asked for."""
    assert answer["id"].startswith("chatcmpl-") and answer["id"] != "chatcmpl-upstream"
    assert answer["created"] > 1
    return {**obj, "id": answer["id"], "created": answer["created"], "model": "chat-on-openai"}


async def test_a_chat_completion_is_the_upstreams_answer_but_for_what_the_gateway_owns(chat, running, double, key):
    key_id, secret = key
    double.cue(Cue(body=COMPLETION))
    body = await http_body(chat.CreateChatCompletionHttp, chat_request(model="chat-on-openai", logprobs=True), secret)
    answer = orjson.loads(body)
    assert answer == owned_chat(COMPLETION, answer)
    assert UPSTREAM_MODEL.encode() not in body
    assert window_tokens(running, key_id) == 13  # settled with the upstream's usage
    double.cue(Cue(body=COMPLETION))  # the typed RPC parses the same object
    typed = await chat.CreateChatCompletion(chat_request(model="chat-on-openai"), metadata=bearer(secret))
    assert (typed.model, typed.system_fingerprint, typed.choices[0].message.tool_calls[0].id) == (
        "chat-on-openai", "fp_0123", "call_abc")


async def test_a_streamed_chat_completion_is_the_upstreams_stream(chat, double, key):
    double.cue(Cue(frames=CHUNK_FRAMES))
    request = chat_request(model="chat-on-openai", stream=True, stream_options={"include_usage": True})
    frames = sse_frames([b async for b in chat.CreateChatCompletionHttp(raw(request), metadata=bearer(key[1]))])
    chunks = data_of(frames)
    assert chunks == [owned_chat(c, chunks[0]) for c in CHUNKS]  # one role chunk: the upstream's
    assert frames[-1] == b"data: [DONE]\n\n" and UPSTREAM_MODEL.encode() not in b"".join(frames)
    assert len({(c["id"], c["created"]) for c in chunks}) == 1


async def test_a_caller_who_did_not_ask_for_usage_gets_none(chat, double, key):
    request = chat_request(model="chat-on-openai", stream=True)
    double.cue(Cue(frames=CHUNK_FRAMES))
    chunks = data_of(sse_frames([b async for b in chat.CreateChatCompletionHttp(raw(request), metadata=bearer(key[1]))]))
    assert double.seen[-1].body["stream_options"] == {"include_usage": True}  # Portico still asks for it
    expected = [owned_chat(c, chunks[0]) for c in CHUNKS[:-1]]
    assert chunks == [{k: v for k, v in c.items() if k != "usage"} for c in expected]
    typed = [c async for c in chat.StreamChatCompletion(request, metadata=bearer(key[1]))]  # the echo model
    assert all(not c.HasField("usage") for c in typed) and typed[-1].choices[0].finish_reason == "stop"
    assert [c.choices[0].delta.role for c in typed].count("assistant") == 1


async def test_a_message_is_the_upstreams_answer_but_for_what_the_gateway_owns(messages, running, double, key):
    key_id, secret = key
    double.cue(Cue(body=MESSAGE))
    body = await http_body(messages.CreateMessageHttp, message_request(model="messages-on-anthropic"), secret)
    answer = orjson.loads(body)
    assert answer["id"].startswith("msg_") and answer["id"] != "msg_upstream"
    assert answer == {**MESSAGE, "id": answer["id"], "model": "messages-on-anthropic"}
    assert answer["content"][0] == THINKING and UPSTREAM_MODEL.encode() not in body
    assert window_tokens(running, key_id) == 32
    double.cue(Cue(body=MESSAGE))
    typed = await messages.CreateMessage(message_request(model="messages-on-anthropic"), metadata=bearer(secret))
    assert [b.type for b in typed.content] == ["thinking", "redacted_thinking", "text", "tool_use"]
    assert typed.model == "messages-on-anthropic"


async def test_a_streamed_message_is_every_event_the_upstream_sent(messages, double, key):
    double.cue(Cue(frames=EVENT_FRAMES))
    request = message_request(model="messages-on-anthropic", stream=True)
    frames = sse_frames([b async for b in messages.CreateMessageHttp(raw(request), metadata=bearer(key[1]))])
    events = data_of(frames)
    started = events[0]["message"]
    assert started["id"].startswith("msg_") and started["id"] != "msg_upstream"
    assert events == [{**EVENTS[0], "message": {**EVENTS[0]["message"], "id": started["id"],
                                                "model": "messages-on-anthropic"}}, *EVENTS[1:]]
    assert [f.split(b"\n", 1)[0] for f in frames] == [f"event: {e['type']}".encode() for e in EVENTS]
    assert UPSTREAM_MODEL.encode() not in b"".join(frames)


async def test_a_stream_dropped_before_content_is_retried(chat, messages, double, key):
    double.cue(Cue(frames=CHUNK_FRAMES, drop_after=1))  # the role chunk, then gone
    request = chat_request(model="chat-on-openai", stream=True)
    chunks = data_of(sse_frames([b async for b in chat.CreateChatCompletionHttp(raw(request), metadata=bearer(key[1]))]))
    assert len(double.seen) == 2 and chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "echo Say hello."
    assert [c["choices"][0]["delta"].get("role") for c in chunks].count("assistant") == 1
    double.reset()
    double.cue(Cue(frames=EVENT_FRAMES, drop_after=3))  # message_start, an empty thinking block, ping, then gone
    request = message_request(model="messages-on-anthropic", stream=True)
    events = data_of(sse_frames([b async for b in messages.CreateMessageHttp(raw(request), metadata=bearer(key[1]))]))
    assert len(double.seen) == 2 and [e["type"] for e in events].count("message_start") == 1
    assert [e["type"] for e in events][-1] == "message_stop"
    text = "".join(e["delta"].get("text", "") for e in events if e["type"] == "content_block_delta")
    assert text == "echo Say hello."


async def test_a_stream_dropped_after_thinking_ends_with_an_error_event(messages, double, key):
    double.cue(Cue(frames=EVENT_FRAMES, drop_after=4))  # a thinking delta reached the caller: not retried
    request = message_request(model="messages-on-anthropic", stream=True)
    frames = sse_frames([b async for b in messages.CreateMessageHttp(raw(request), metadata=bearer(key[1]))])
    assert len(double.seen) == 1 and frames[-1].startswith(b"event: error\n")
    assert [e["type"] for e in data_of(frames[:-1])] == [e["type"] for e in EVENTS[:4]]


async def test_answers_across_dialects_are_rendered_from_the_events(chat, messages, double, key):
    double.cue(Cue(body=MESSAGE))
    answer = orjson.loads(await http_body(chat.CreateChatCompletionHttp, chat_request(model="chat-on-anthropic"),
                                          key[1]))
    assert answer["choices"][0]["message"] == {
        "role": "assistant", "content": "Checking.", "refusal": None,
        "reasoning_content": "The user wants the weather.",
        "thinking_blocks": [{"type": "thinking", "thinking": "The user wants the weather.",
                             "signature": "EqQBCkYIARgCKkA="},
                            {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix/LafPsn4a"}],
        "tool_calls": [
            {"id": "toolu_1", "type": "function", "function": {"name": "weather", "arguments": "{\"city\":\"Oslo\"}"}}]}
    assert (answer["model"], answer["usage"]["total_tokens"]) == ("chat-on-anthropic", 32)
    double.cue(Cue(frames=EVENT_FRAMES))
    request = chat_request(model="chat-on-anthropic", stream=True)
    chunks = data_of(sse_frames([b async for b in chat.CreateChatCompletionHttp(raw(request), metadata=bearer(key[1]))]))
    assert [c["choices"][0]["delta"] for c in chunks] == [
        {"role": "assistant", "content": None}, {"reasoning_content": "The user wants"},
        {"thinking_blocks": [{"index": 0, "type": "thinking", "thinking": "The user wants",
                              "signature": "EqQBCkYIAR"}]},
        {"content": "Checking."}, {}]
    assert all(c["model"] == "chat-on-anthropic" and "system_fingerprint" not in c for c in chunks)
    double.cue(Cue(body=COMPLETION))
    message = orjson.loads(await http_body(messages.CreateMessageHttp, message_request(model="messages-on-openai"),
                                           key[1]))
    assert [b["type"] for b in message["content"]] == ["text", "tool_use"]
    assert (message["model"], message["stop_reason"]) == ("messages-on-openai", "tool_use")
    double.cue(Cue(frames=CHUNK_FRAMES))
    request = message_request(model="messages-on-openai", stream=True)
    frames = sse_frames([b async for b in messages.CreateMessageHttp(raw(request), metadata=bearer(key[1]))])
    assert [e["type"] for e in data_of(frames)] == [
        "message_start", "content_block_start", "ping", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"]
    assert UPSTREAM_MODEL.encode() not in b"".join(frames) and b"fp_0123" not in b"".join(frames)


@pytest.mark.parametrize("kind", [5, ["message_start"], None])
async def test_a_passed_through_event_that_is_not_the_apis_ends_the_stream_with_an_upstream_error(
        messages, double, key, kind):
    """An event whose `type` is no string cannot be named on an `event:` line: it crashed the renderer, a 500
    `internal_error` with a traceback. It is the upstream's fault, and never reaches the caller."""
    bad = {**EVENTS[7], "type": kind}
    double.cue(Cue(frames=[*EVENT_FRAMES[:7], sse(bad, "content_block_delta"), *EVENT_FRAMES[8:]]))
    request = message_request(model="messages-on-anthropic", stream=True)
    frames = sse_frames([b async for b in messages.CreateMessageHttp(raw(request), metadata=bearer(key[1]))])
    assert frames[-1].startswith(b"event: error\n")
    assert data_of(frames[-1:])[0]["error"]["code"] == "upstream_error"
    assert b"Checking." not in b"".join(frames)


async def test_a_passed_through_value_the_typed_answer_cannot_hold_is_an_upstream_error(chat, messages, double, key):
    """REST callers get a same-dialect answer as sent; the typed RPCs must fit it into their messages. A value of
    the wrong type there (a numeric `system_fingerprint`, a string tool `input`) is the upstream's fault: it was a
    500 `internal_error` with a traceback, and is a 502 `upstream_error`, unary and streamed."""
    secret = key[1]
    double.cue(Cue(body={**COMPLETION, "system_fingerprint": 5}))
    with pytest.raises(grpc.RpcError) as unary:
        await chat.CreateChatCompletion(chat_request(model="chat-on-openai"), metadata=bearer(secret))
    double.cue(Cue(frames=[*(sse({**c, "system_fingerprint": 5}) for c in CHUNKS), b"data: [DONE]\n\n"]))
    with pytest.raises(grpc.RpcError) as streamed:
        [c async for c in chat.StreamChatCompletion(chat_request(model="chat-on-openai"), metadata=bearer(secret))]
    tool = {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": "Oslo"}
    double.cue(Cue(body={**MESSAGE, "content": [tool]}))
    with pytest.raises(grpc.RpcError) as message:
        await messages.CreateMessage(message_request(model="messages-on-anthropic"), metadata=bearer(secret))
    for caught in (unary, streamed, message):
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert (error_details(caught.value).http_status, error_details(caught.value).error.code) == (
            502, "upstream_error")


def _meaningful(value):
    """`value` without the members a typed message cannot tell from absent (null, empty, zero), at every level."""
    if isinstance(value, dict):
        return {k: v for k, v in ((k, _meaningful(v)) for k, v in value.items()) if v not in (None, [], {}, "", 0)}
    if isinstance(value, list):
        return [_meaningful(v) for v in value]
    return value


def _as_json(message) -> dict:
    return _meaningful(json_format.MessageToDict(message, preserving_proto_field_name=True))


CITED = {"type": "text", "text": "Oslo is cold.", "citations": [
    {"type": "web_search_result_location", "url": "https://example.org/oslo", "title": "Oslo",
     "encrypted_index": "Eo8BCioI", "cited_text": "Oslo is cold."}]}
SEARCH = [{"type": "server_tool_use", "id": "srvtoolu_1", "name": "web_search", "input": {"query": "oslo weather"}},
          {"type": "web_search_tool_result", "tool_use_id": "srvtoolu_1", "content": [
              {"type": "web_search_result", "url": "https://example.org/oslo", "title": "Oslo",
               "encrypted_content": "EqgfCioI", "page_age": "2 days ago"}]}]
RICH_MESSAGE = {**MESSAGE, "content": [*MESSAGE["content"][:2], *SEARCH, CITED, MESSAGE["content"][3]],
                "usage": {**MESSAGE["usage"], "server_tool_use": {"web_search_requests": 1},
                          "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}}}
RICH_EVENTS = [*EVENTS[:6],
               {"type": "content_block_start", "index": 1, "content_block": {"type": "text", "text": ""}},
               {"type": "content_block_delta", "index": 1, "delta": {"type": "citations_delta",
                                                                     "citation": CITED["citations"][0]}},
               *EVENTS[7:]]
RICH_COMPLETION = {**COMPLETION, "choices": [{**COMPLETION["choices"][0], "message": {
    **COMPLETION["choices"][0]["message"], "reasoning_content": "The weather, then.", "annotations": [
        {"type": "url_citation", "url_citation": {"url": "https://example.org", "title": "Ex", "start_index": 0,
                                                  "end_index": 2}}]}}],
    "usage": {**COMPLETION["usage"], "prompt_tokens_details": {"cached_tokens": 0, "audio_tokens": 0},
              "completion_tokens_details": {"reasoning_tokens": 3, "audio_tokens": 0,
                                            "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}}}
RICH_CHUNKS = [CHUNKS[0], {**chunk({"reasoning_content": "The weather"}, usage=None), "obfuscation": "x1y2"},
               *CHUNKS[1:]]


async def test_typed_callers_get_every_field_rest_callers_get(chat, messages, double, key):
    """Thinking and its signature, redacted thinking, citations, server tools' blocks, reasoning content,
    annotations, logprobs, usage details: typed gRPC callers lost them (their messages had no fields for them), where
    REST callers of the same model got the upstream's object whole."""
    secret = key[1]
    cases = [
        (Cue(body=RICH_COMPLETION), chat.CreateChatCompletionHttp, chat.CreateChatCompletion,
         chat_request(model="chat-on-openai", logprobs=True)),
        (Cue(body=RICH_MESSAGE), messages.CreateMessageHttp, messages.CreateMessage,
         message_request(model="messages-on-anthropic")),
    ]
    for cue, rest, typed, request in cases:
        double.cue(cue)
        answer = orjson.loads(await http_body(rest, request, secret))
        double.cue(cue)
        assert _without_ids(_as_json(await typed(request, metadata=bearer(secret)))) == _without_ids(
            _meaningful(answer))
    streams = [
        ([*(sse(c) for c in RICH_CHUNKS), b"data: [DONE]\n\n"], chat.CreateChatCompletionHttp,
         chat.StreamChatCompletion,
         chat_request(model="chat-on-openai", stream=True, stream_options={"include_usage": True})),
        ([sse(e, e["type"]) for e in RICH_EVENTS], messages.CreateMessageHttp, messages.StreamMessage,
         message_request(model="messages-on-anthropic", stream=True)),
    ]
    for frames, rest, typed, request in streams:
        double.cue(Cue(frames=frames))
        sent = data_of(sse_frames([b async for b in rest(raw(request), metadata=bearer(secret))]))
        double.cue(Cue(frames=frames))
        got = [_as_json(event) async for event in typed(request, metadata=bearer(secret))]
        assert len(got) == len(sent)
        for event, rest_event in zip(got, sent):
            assert _without_ids(event) == _without_ids(_meaningful(rest_event))


async def test_typed_chat_callers_get_newer_servers_reasoning_as_reasoning_content(chat, double, key):
    """Newer vLLM and OpenRouter name it `reasoning`, which the typed messages do not declare: typed callers got
    no reasoning at all, where REST callers got the server's field."""
    reasoned = {**COMPLETION, "choices": [{**COMPLETION["choices"][0], "message": {
        **COMPLETION["choices"][0]["message"], "reasoning": "The weather, then."}}]}
    double.cue(Cue(body=reasoned))
    answer = await chat.CreateChatCompletion(chat_request(model="chat-on-openai"), metadata=bearer(key[1]))
    assert answer.choices[0].message.reasoning_content == "The weather, then."
    double.cue(Cue(frames=[sse(CHUNKS[0]), sse(chunk({"reasoning": "The weather"}, usage=None)),
                           *(sse(c) for c in CHUNKS[1:]), b"data: [DONE]\n\n"]))
    request = chat_request(model="chat-on-openai", stream=True)
    deltas = [c.choices[0].delta async for c in chat.StreamChatCompletion(request, metadata=bearer(key[1]))
              if c.choices]
    assert [d.reasoning_content for d in deltas if d.HasField("reasoning_content")] == ["The weather"]


ANY_ID = "<id>"


def _without_ids(event: dict) -> dict:
    """Portico's own id and created differ between two calls."""
    if "message" in event:
        event = {**event, "message": {**event["message"], "id": ANY_ID}}
    return {k: ANY_ID if k in ("id", "created") else v for k, v in event.items()}


async def test_typed_requests_carry_the_extensions_rest_bodies_do(chat, messages, double, key):
    """`top_k`, `min_p`, `repetition_penalty`, `chat_template_kwargs` (vLLM, llama.cpp, TGI) and
    `prompt_cache_retention`: a typed request could not carry them (the message had no fields), so a gRPC caller had
    to send the JSON itself. Now they reach the upstream as a REST caller's do, and the same refusals apply."""
    secret = key[1]
    extensions = {"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "prompt_cache_retention": "24h",
                  "prompt_cache_options": {"mode": "implicit"},
                  "chat_template_kwargs": {"enable_thinking": False, "depth": 2}}
    sent = []
    for call in (lambda r: http_body(chat.CreateChatCompletionHttp, r, secret),
                 lambda r: chat.CreateChatCompletion(r, metadata=bearer(secret))):
        double.cue(Cue(body=COMPLETION))
        await call(chat_request(model="chat-on-openai", **extensions))
        sent.append(double.seen[-1].body)
    assert sent[0] == sent[1] and {k: sent[1][k] for k in extensions} == extensions
    refusals = [(chat.CreateChatCompletion, chat_request(model="chat-on-anthropic", moderation={"input": True}),
                 "moderation"),
                (messages.CreateMessage, message_request(model="messages-on-openai", thread={"id": "t_1"}),
                 "thread")]
    for rpc, request, param in refusals:
        with pytest.raises(grpc.RpcError) as refused:
            await rpc(request, metadata=bearer(secret))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error_details(refused.value).error.param == param
