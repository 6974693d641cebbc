"""Envoy sends a REST body that does not ask for a stream to the endpoint's unary twin RPC (gateway/lua/request.lua),
and every other body to the streaming one: the caller sees the same answers either way, whichever way the body is
written, and the access log names the RPC that served it."""

from __future__ import annotations

import httpx
import orjson
import pytest

from tests.e2e.conftest import Gateway
from tests.e2e.test_operations import wait_for_line
from tests.e2e.test_rate_limits import HEADERS as RATE_LIMIT_HEADERS
from tests.helpers import internal_headers

HI = [{"role": "user", "content": "Hi"}]


def post(gateway: Gateway, path: str, body: bytes, **headers: str) -> httpx.Response:
    return httpx.post(f"{gateway.base_url}{path}", content=body, timeout=60,
                      headers={"Authorization": f"Bearer {gateway.secret}", "content-type": "application/json",
                               **headers})


def served_by(gateway: Gateway, response: httpx.Response) -> str:
    return wait_for_line(gateway, response.headers["x-request-id"])["rpc"]


def chat(**fields) -> dict:
    return {"model": "family-a-5.5", "messages": HI, "max_tokens": 2, **fields}


@pytest.mark.parametrize(("path", "body", "rpc"), [
    ("/v1/chat/completions", chat(), "ChatService/CreateChatCompletionHttpUnary"),
    ("/v1/chat/completions", chat(stream=False), "ChatService/CreateChatCompletionHttpUnary"),
    ("/v1/messages?beta=true", {"model": "family-b-sonnet-4-6", "messages": HI, "max_tokens": 2},
     "MessageService/CreateMessageHttpUnary"),
])
def test_a_json_answer_is_served_by_the_unary_twin(gateway, path, body, rpc):
    response = post(gateway, path, orjson.dumps(body))
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    assert response.json()["usage"]["output_tokens" if "messages" in path else "completion_tokens"] == 2
    # Sent as trailing metadata by the twin; Envoy's Lua filter makes them headers, and no gRPC metadata leaks.
    assert RATE_LIMIT_HEADERS <= set(response.headers)
    assert int(response.headers["x-ratelimit-remaining-requests"]) < int(response.headers["x-ratelimit-limit-requests"])
    assert not internal_headers(response.headers)
    assert served_by(gateway, response) == rpc


def test_a_stream_is_served_by_the_streaming_rpc(gateway):
    response = post(gateway, "/v1/chat/completions", orjson.dumps(chat(stream=True)))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    assert response.text.rstrip().endswith("data: [DONE]")
    assert response.headers["cache-control"] == "no-cache"  # as OpenAI's own streams
    assert served_by(gateway, response) == "ChatService/CreateChatCompletionHttp"


def test_a_stream_key_spelt_with_escapes_still_streams(gateway):
    """Valid JSON that Envoy's scan cannot read as `"stream": true`: the unary twin answers it as SSE, whole."""
    body = orjson.dumps(chat()).replace(b'"max_tokens"', b'"\\u0073tream": true, "max_tokens"')
    response = post(gateway, "/v1/chat/completions", body)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    frames = [line for line in response.text.splitlines() if line.startswith("data: ")]
    assert frames[-1] == "data: [DONE]" and orjson.loads(frames[0][6:])["object"] == "chat.completion.chunk"
    assert RATE_LIMIT_HEADERS <= set(response.headers) and response.headers["cache-control"] == "no-cache"
    assert served_by(gateway, response) == "ChatService/CreateChatCompletionHttpUnary"


@pytest.mark.parametrize("body", [
    # "stream": true below the top level: the streaming RPC, which answers JSON all the same
    orjson.dumps(chat(metadata={"stream": "true"}, response_format={"type": "text", "stream": True})),
    # beyond the bytes Envoy reads: the streaming RPC
    orjson.dumps(chat()) + b" " * 70_000,
])
def test_bodies_envoy_does_not_route_get_the_same_json_answer(gateway, body):
    response = post(gateway, "/v1/chat/completions", body)
    assert response.status_code == 200 and response.headers["content-type"] == "application/json"
    assert response.json()["object"] == "chat.completion"
    assert served_by(gateway, response) == "ChatService/CreateChatCompletionHttp"


def test_errors_from_the_unary_twin_keep_the_dialect_shape(gateway):
    chat_error = post(gateway, "/v1/chat/completions", orjson.dumps(chat(model="no-such-model")))
    assert chat_error.status_code == 404 and chat_error.json()["error"]["param"] == "model"
    message_error = post(gateway, "/v1/messages", orjson.dumps({"model": "family-b-sonnet-4-6", "messages": HI,
                                                                 "max_tokens": "two"}))
    assert message_error.status_code == 400 and message_error.json()["type"] == "error"
    assert message_error.json()["error"]["param"] == "max_tokens"
    for response in (chat_error, message_error):
        assert not internal_headers(response.headers)
        assert served_by(gateway, response).endswith("HttpUnary")


def test_the_twins_paths_called_directly_answer_as_their_endpoints_do(gateway):
    """The unary paths are public (the transcoder binds them); called directly they behave as the endpoint does,
    Envoy's own errors included."""
    answer = post(gateway, "/v1/messages:unary", orjson.dumps({"model": "family-b-sonnet-4-6", "messages": HI,
                                                                "max_tokens": 2}))
    assert answer.status_code == 200 and answer.json()["type"] == "message"
    assert RATE_LIMIT_HEADERS <= set(answer.headers)
    unknown = httpx.get(f"{gateway.base_url}/v1/messages:unary", timeout=60)  # no such method: Envoy's own 404
    assert unknown.status_code == 404 and unknown.json()["type"] == "error"  # the Anthropic shape
    assert unknown.json()["error"]["code"] == "not_found"
