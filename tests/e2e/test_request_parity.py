"""One set of request rules for every kind of caller (api.md, Request bodies): each invalid body of the table is
sent over REST (through Envoy), to the REST binding's gRPC RPC (`...HttpUnary`, `...Http`) and, where the proto can
hold it as written, to the typed RPC; all three must give the same status (HTTP <-> gRPC as in api.md's error
table), `code` and `param` path, and REST no gRPC header."""

from __future__ import annotations

import json

import grpc
import httpx
import pytest
from google.api import httpbody_pb2
from google.protobuf import json_format, struct_pb2

from portico.v1 import (
    chat_pb2, chat_service_pb2_grpc, image_pb2, image_service_pb2_grpc, message_pb2, message_service_pb2_grpc,
    anthropic_model_pb2, catalog_pb2, message_tokens_pb2, model_pb2, organization_usage_pb2,
)
from server.translate.values import proto_to_json
from tests.helpers import bearer, chat_request, error_details, internal_headers

GRPC_STATUS = {400: grpc.StatusCode.INVALID_ARGUMENT, 404: grpc.StatusCode.NOT_FOUND}
HI = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f"}}
B_TOOL = {"name": "f", "input_schema": {"type": "object"}}
ENDPOINTS = {  # REST path, REST binding's RPC, typed RPC, typed request, the body every case starts from
    "chat": ("/v1/chat/completions", "ChatService/CreateChatCompletionHttpUnary", "ChatService/CreateChatCompletion",
             chat_pb2.CreateChatCompletionRequest, {"model": "family-a-5.5", "messages": HI, "max_tokens": 4}),
    "chat-stream": ("/v1/chat/completions", "ChatService/CreateChatCompletionHttp", "ChatService/StreamChatCompletion",
                    chat_pb2.CreateChatCompletionRequest,
                    {"model": "family-a-5.5", "messages": HI, "max_tokens": 4, "stream": True}),
    "messages": ("/v1/messages", "MessageService/CreateMessageHttpUnary", "MessageService/CreateMessage",
                 message_pb2.CreateMessageRequest, {"model": "family-b-sonnet-4-6", "messages": HI, "max_tokens": 4}),
    "count": ("/v1/messages/count_tokens", "MessageService/CountMessageTokensHttp", "MessageService/CountMessageTokens",
              message_tokens_pb2.CountMessageTokensRequest, {"model": "family-b-sonnet-4-6", "messages": HI}),
    "images": ("/v1/images/generations", "ImageService/CreateImageHttp", "ImageService/CreateImage",
               image_pb2.CreateImageRequest, {"model": "family-a-image-2", "prompt": "a cat", "size": "256x256"}),
}
DROP = object()  # a case's value that removes the member from the base body

CASES = [  # endpoint, members over the base body, HTTP status, code, param
    ("chat", {"messages": DROP}, 400, "invalid_request", "messages"),
    ("chat", {"messages": [None]}, 400, "invalid_request", "messages[0]"),
    ("chat", {"messages": [{"role": "robot", "content": "x"}]}, 400, "invalid_request", "messages[0].role"),
    ("chat", {"messages": [*HI, {"role": "assistant", "content": "a"}, {"role": "user", "content": 5}]},
     400, "invalid_request", "messages[2].content"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "video"}]}]},
     400, "invalid_request", "messages[0].content[0].type"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": 5}]}]},
     400, "invalid_request", "messages[0].content[0].text"),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     400, "invalid_request", "messages[0].content[0].type"),
    ("chat", {"messages": [*HI, {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": 5}}]}]},
     400, "invalid_request", "messages[1].tool_calls[0].function.arguments"),
    ("chat", {"messages": [*HI, {"role": "tool", "content": "r"}]}, 400, "invalid_request", "messages[1].tool_call_id"),
    ("chat", {"messages": [*HI, {"role": "assistant", "tool_calls": [{"id": "1", "type": "function"}]}]},
     400, "invalid_request", "messages[1].tool_calls[0].function"),
    ("chat", {"messages": [*HI, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]},
     400, "invalid_request", "messages[1].tool_calls[0].id"),
    ("chat", {"tools": [{"type": "function"}]}, 400, "invalid_request", "tools[0].function"),
    ("chat", {"tools": [{"type": "function", "function": {}}]}, 400, "invalid_request", "tools[0].function.name"),
    ("chat", {"messages": [*HI, {"role": "user", "content": "cut \ud83d"}]}, 400, "invalid_request",
     "messages[1].content"),  # a lone surrogate, as a string cut inside an emoji is escaped by json.dumps
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\udc00"}]}]},
     400, "invalid_request", "messages[0].content[0].text"),
    ("chat", {"temperature": 3}, 400, "invalid_request", "temperature"),
    ("chat", {"temperature": "hot"}, 400, "invalid_request", "temperature"),
    ("chat", {"top_p": 2}, 400, "invalid_request", "top_p"),
    ("chat", {"n": 0}, 400, "invalid_request", "n"),
    ("chat", {"n": 2}, 400, "invalid_request", "n"),
    ("chat", {"max_tokens": 0}, 400, "invalid_request", "max_tokens"),
    ("chat", {"max_tokens": 1.5}, 400, "invalid_request", "max_tokens"),
    ("chat", {"logit_bias": {"5": 200}}, 400, "invalid_request", "logit_bias.5"),
    ("chat", {"logit_bias": {"abc": 1}}, 400, "invalid_request", "logit_bias"),
    ("chat", {"logit_bias": {"\u00b2": 1}}, 400, "invalid_request", "logit_bias"),  # '²'.isdigit(), no token id
    ("chat", {"logit_bias": {"\u0663": 1}}, 400, "invalid_request", "logit_bias"),  # an Arabic-Indic 3
    ("chat", {"stop": 5}, 400, "invalid_request", "stop"),
    ("chat", {"stop": ["a", ""]}, 400, "invalid_request", "stop[1]"),
    ("chat", {"safety_identifier": "s" * 65}, 400, "invalid_request", "safety_identifier"),
    ("chat", {"top_logprobs": 3}, 400, "invalid_request", "top_logprobs"),
    ("chat", {"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
     400, "invalid_request", "tools"),
    ("chat", {"metadata": {f"k{i}": "v" for i in range(17)}}, 400, "invalid_request", "metadata"),
    ("chat", {"metadata": {"note": "v" * 513}}, 400, "invalid_request", "metadata.note"),
    ("chat", {"tools": [{"type": "bogus"}]}, 400, "invalid_request", "tools[0].type"),
    ("chat", {"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]},
     400, "invalid_request", "tools[0].function.parameters"),
    ("chat", {"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "g"}}},
     400, "invalid_request", "tool_choice"),
    ("chat", {"tool_choice": "required"}, 400, "invalid_request", "tool_choice"),
    ("chat", {"response_format": {"type": "yaml"}}, 400, "invalid_request", "response_format.type"),
    ("chat", {"stream_options": {"include_usage": True}}, 400, "invalid_request", "stream_options"),
    ("chat", {"seed": 2**70}, 400, "invalid_request", "seed"),
    ("chat", {"metadata": {"a": 1}}, 400, "invalid_request", "metadata.a"),
    ("chat", {"audio": {"voice": "x"}}, 400, "invalid_request", "audio"),
    ("chat", {"foo": 1}, 400, "invalid_request", "foo"),
    ("chat", {"model": "nope"}, 404, "model_not_found", "model"),
    ("chat", {"model": DROP}, 400, "invalid_request", "model"),
    ("chat-stream", {"temperature": 9}, 400, "invalid_request", "temperature"),
    ("chat-stream", {"messages": [{"role": "user", "content": {"a": 1}}]},
     400, "invalid_request", "messages[0].content"),
    ("messages", {"max_tokens": DROP}, 400, "invalid_request", "max_tokens"),
    ("messages", {"messages": [{"role": "system", "content": "x"}]}, 400, "invalid_request", "messages[0].role"),
    ("messages", {"messages": [{"role": "user", "content": [None]}]}, 400, "invalid_request", "messages[0].content[0]"),
    ("messages", {"messages": [*HI, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": {}}]}, {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image"}]}]}], "tools": [B_TOOL]},
     400, "invalid_request", "messages[2].content[0].content[0].type"),
    ("messages", {"system": [{"type": "text", "text": 5}]}, 400, "invalid_request", "system[0].text"),
    ("messages", {"temperature": 1.5}, 400, "invalid_request", "temperature"),
    ("messages", {"stop_sequences": ["a", 5]}, 400, "invalid_request", "stop_sequences[1]"),
    ("messages", {"tools": [{"name": "f", "input_schema": [1]}]}, 400, "invalid_request", "tools[0].input_schema"),
    ("messages", {"tools": [B_TOOL], "tool_choice": {"type": "tool", "name": "g"}},
     400, "invalid_request", "tool_choice.name"),
    ("messages", {"tool_choice": {"type": "any"}}, 400, "invalid_request", "tool_choice"),
    ("messages", {"thinking": {"type": "enabled", "budget_tokens": "x"}},
     400, "invalid_request", "thinking.budget_tokens"),
    ("messages", {"max_tokens": 2000, "thinking": {"type": "enabled", "budget_tokens": 1024}, "temperature": 0.5},
     400, "invalid_request", "temperature"),
    ("messages", {"thinking": {"type": "adaptive"}, "tools": [B_TOOL], "tool_choice": {"type": "any"}},
     400, "invalid_request", "tool_choice"),
    ("messages", {"model": "family-a-5.5"}, 404, "model_not_found", "model"),
    ("count", {"messages": []}, 400, "invalid_request", "messages"),
    ("count", {"temperature": 3}, 400, "invalid_request", "temperature"),
    ("count", {"tools": [{"type": "web_search_20250305", "name": "web_search"}]},
     400, "invalid_request", "tools[0].type"),
    ("images", {"prompt": DROP}, 400, "invalid_request", "prompt"),
    ("images", {"prompt": "\ud800x"}, 400, "invalid_request", "prompt"),
    ("images", {"n": 11}, 400, "invalid_request", "n"),
    ("images", {"size": "100x100"}, 400, "invalid_request", "size"),
    ("images", {"background": "transparent", "output_format": "jpeg"}, 400, "invalid_request", "background"),
    ("images", {"output_compression": 101}, 400, "invalid_request", "output_compression"),
    ("images", {"stream": True}, 400, "invalid_request", "stream"),
    ("images", {"qualty": "hd"}, 400, "invalid_request", "qualty"),
]


@pytest.fixture(scope="module")
def channel(gateway):
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        yield channel


def _body(endpoint: str, members: dict) -> dict:
    body = {**ENDPOINTS[endpoint][4], **members}
    return {name: value for name, value in body.items() if value is not DROP}


def _typed(request_class, body: dict):
    """The typed request holding `body` as written, or None where the proto cannot (a string where it has a number,
    a member it does not declare, ...)."""
    try:
        request = json_format.ParseDict(body, request_class())
    except json_format.ParseError:
        return None
    return request if proto_to_json(request) == body else None


def _refusal(channel, method: str, request: bytes, metadata=()) -> grpc.RpcError:
    """The error `method` answers `request` (serialized) with, its answer read whole."""
    streams = method.endswith(("Http", "/StreamChatCompletion", "/StreamMessage"))
    call = channel.unary_stream if streams else channel.unary_unary
    rpc = call(f"/portico.v1.{method}", request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)
    with pytest.raises(grpc.RpcError) as caught:
        answer = rpc(request, metadata=metadata, timeout=30)
        if streams:
            list(answer)
    return caught.value


def _grpc_error(channel, method: str, request: bytes, secret: str) -> tuple:
    error = _refusal(channel, method, request, bearer(secret))
    detail = error_details(error)
    return error.code(), detail.http_status, detail.error.code, detail.error.param or None


@pytest.mark.parametrize(("endpoint", "members", "status", "code", "param"), CASES,
                         ids=[f"{c[0]}-{c[4]}-{i}" for i, c in enumerate(CASES)])
def test_every_transport_refuses_a_body_alike(gateway, channel, endpoint, members, status, code, param):
    path, http_rpc, typed_rpc, request_class, _ = ENDPOINTS[endpoint]
    body = _body(endpoint, members)
    data = json.dumps(body).encode()
    rest = httpx.post(gateway.base_url + path, content=data, timeout=30,
                      headers={"authorization": f"Bearer {gateway.secret}", "content-type": "application/json"})
    error = rest.json()["error"]
    assert (rest.status_code, error["code"], error["param"]) == (status, code, param), error["message"]
    assert not internal_headers(rest.headers)
    expected = (GRPC_STATUS[status], status, code, param)
    raw = httpbody_pb2.HttpBody(content_type="application/json", data=data).SerializeToString()
    assert _grpc_error(channel, http_rpc, raw, gateway.secret) == expected
    if (typed := _typed(request_class, body)) is not None:
        assert _grpc_error(channel, typed_rpc, typed.SerializeToString(), gateway.secret) == expected


@pytest.mark.parametrize("method", ["ChatService/CreateChatCompletion", "ChatService/StreamChatCompletion"])
def test_a_typed_body_without_a_key_hears_of_the_key_first(channel, method):
    """api.md: a body that cannot be read is refused only once the key is found valid. A typed request with a NaN
    (which JSON cannot hold, so only a typed caller can send) and no key was a 400 about the number, where REST and
    every other typed refusal are the 401."""
    request = chat_request()
    request.temperature = float("nan")
    assert _refusal(channel, method, request.SerializeToString()).code() == grpc.StatusCode.UNAUTHENTICATED


UNKNOWN_99 = bytes([99 << 3 & 0x7F | 0x80 | 2, 99 >> 4]) + b"\x03abc"  # field 99, three bytes


def _message(extra: bytes) -> bytes:
    """A `messages` entry (a user's "hi") with `extra` bytes in it, as a field of the request."""
    message = chat_pb2.ChatMessage(role="user", content=struct_pb2.Value(string_value="hi")).SerializeToString()
    return bytes([2 << 3 | 2, len(message + extra)]) + message + extra


@pytest.mark.parametrize(("method", "request_bytes", "param"), [
    ("ChatService/CreateChatCompletion", chat_request().SerializeToString() + UNKNOWN_99, None),
    ("ChatService/StreamChatCompletion", chat_request(messages=[]).SerializeToString() + _message(UNKNOWN_99),
     "messages[0]"),
    ("ImageService/CreateImage",
     image_pb2.CreateImageRequest(model="family-a-image-2", prompt="a cat").SerializeToString() + UNKNOWN_99, None),
    # A usage query's filter from newer files (a `user_ids` on costs, say), dropped, answered everyone's usage.
    ("UsageService/GetCompletionsUsage",
     organization_usage_pb2.GetCompletionsUsageRequest(start_time=0).SerializeToString() + UNKNOWN_99, None),
    ("UsageService/GetCosts", organization_usage_pb2.GetCostsRequest(start_time=0).SerializeToString() + UNKNOWN_99,
     None),
    ("UsageService/ListRequests",
     organization_usage_pb2.ListRequestsRequest(start_time=0).SerializeToString() + UNKNOWN_99, None),
    # The model listings: a filter from newer files, dropped, answered every model.
    ("ModelService/ListModels", model_pb2.ListModelsRequest().SerializeToString() + UNKNOWN_99, None),
    ("ModelService/GetModel", model_pb2.GetModelRequest(model="family-a-5.5").SerializeToString() + UNKNOWN_99, None),
    ("AnthropicModelService/ListAnthropicModels",
     anthropic_model_pb2.ListAnthropicModelsRequest(limit=2).SerializeToString() + UNKNOWN_99, None),
    ("AnthropicModelService/GetAnthropicModel",
     anthropic_model_pb2.GetAnthropicModelRequest(model_id="family-b-sonnet-4-6").SerializeToString() + UNKNOWN_99,
     None),
    ("ModelAdminService/ListCatalogModels", catalog_pb2.ListCatalogModelsRequest().SerializeToString() + UNKNOWN_99,
     None),
])
def test_a_typed_field_the_gateway_does_not_declare_is_refused_not_dropped(gateway, channel, method, request_bytes,
                                                                          param):
    """A stub generated from newer .proto files sends a field this gateway's files lack: it was dropped without a
    word and the request answered (200), where REST refuses a member it cannot act on (api.md: never silently
    dropped). Its name is unknown here, so it cannot be passed on either: a 400 naming its number."""
    secret = gateway.secret
    if method.startswith("ModelAdminService/"):  # admin keys only
        secret = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    error = _refusal(channel, method, request_bytes, bearer(secret))
    detail = error_details(error)
    assert (error.code(), detail.http_status, detail.error.code) == (grpc.StatusCode.INVALID_ARGUMENT, 400,
                                                                     "invalid_request")
    assert (detail.error.param or None) == param
    assert "field number 99" in detail.error.message


NOT_FINITE = [  # endpoint, members spliced raw into the base body, the param, the typed request's value (if one)
    ("chat", b'"temperature":NaN', "temperature", float("nan")),
    ("chat-stream", b'"temperature":Infinity', "temperature", float("inf")),
    ("messages", b'"temperature":-Infinity', "temperature", float("-inf")),
    ("count", b'"temperature":1e309', "temperature", None),  # its typed request has no temperature
    ("chat", b'"tools":[{"type":"function","function":{"name":"f","parameters":{"type":"object","maximum":-1e400}}}]',
     "tools[0].function.parameters.maximum", None),
    ("messages", b'"top_p":' + b"9" * 400, "top_p", None),
    # Past Python's 4,300 digits for an int, the json module that finds the path refused the document too: the 400
    # was orjson's "number is infinity when parsed as double: line 1 column 98" again, with `param` null.
    ("chat", b'"top_p":-' + b"9" * 5000, "top_p", None),
]


@pytest.mark.parametrize(("endpoint", "raw", "param", "typed_value"), NOT_FINITE,
                         ids=[f"{c[0]}-{c[1][:24].decode()}" for c in NOT_FINITE])
def test_a_number_json_cannot_hold_is_named_by_its_path(gateway, channel, endpoint, raw, param, typed_value):
    """A typed gRPC request's NaN or Infinity is a 400 naming its field (`temperature`); the same number written in a
    REST body (NaN, Infinity, 1e309, an integer of 400 or 5,000 digits: none a double JSON can pass on) was a 400 with
    `param` null and only a character offset ("unexpected character ... column 98"), found by fuzzing each field."""
    path, http_rpc, typed_rpc, request_class, base = ENDPOINTS[endpoint]
    data = json.dumps(base).encode()[:-1] + b"," + raw + b"}"
    rest = httpx.post(gateway.base_url + path, content=data, timeout=30,
                      headers={"authorization": f"Bearer {gateway.secret}", "content-type": "application/json"})
    document = rest.json()
    assert (rest.status_code, document["error"]["code"], document["error"]["param"]) == (400, "invalid_request", param)
    assert f"`{param}` must be a finite number" in document["error"]["message"]
    assert (document.get("type"), document["error"]["type"]) == (
        ("error", "invalid_request_error") if path.startswith("/v1/messages") else (None, "invalid_request_error"))
    raw_request = httpbody_pb2.HttpBody(content_type="application/json", data=data).SerializeToString()
    assert _grpc_error(channel, http_rpc, raw_request, gateway.secret) == (
        grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request", param)
    if typed_value is not None:
        typed = json_format.ParseDict(base, request_class())
        typed.temperature = typed_value
        assert _grpc_error(channel, typed_rpc, typed.SerializeToString(), gateway.secret) == (
            grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request", param)
    assert httpx.post(gateway.base_url + path, json=base, timeout=60,
                      headers={"authorization": f"Bearer {gateway.secret}"}).status_code == 200


OUT_OF_RANGE = [  # endpoint, members over the base body, the param, how the message must show the value
    ("chat", {"temperature": 2.0000001}, "temperature", "got 2.0000001."),
    ("messages", {"temperature": 1.0000001}, "temperature", "got 1.0000001."),
    ("chat", {"top_p": 1.0000000000000002}, "top_p", "got 1.0000000000000002."),
    ("count", {"top_p": -0.0000001}, "top_p", "got -1e-07."),
    ("chat", {"max_tokens": 1e308}, "max_tokens", "got 1e+308."),
    ("messages", {"max_tokens": 0.0}, "max_tokens", "got 0.0."),
]


@pytest.mark.parametrize(("endpoint", "members", "param", "shown"), OUT_OF_RANGE,
                         ids=[f"{c[0]}-{c[2]}-{i}" for i, c in enumerate(OUT_OF_RANGE)])
def test_a_value_out_of_range_is_shown_as_sent(gateway, endpoint, members, param, shown):
    """A temperature of 2.0000001 was refused with "`temperature` must be between 0 and 2, got 2." (six significant
    digits), a refusal of an allowed value as the caller reads it; a max_tokens of 1e308 was shown as its 309 digits."""
    path, *_, base = ENDPOINTS[endpoint]
    rest = httpx.post(gateway.base_url + path, json={**base, **members}, timeout=30,
                      headers={"authorization": f"Bearer {gateway.secret}"})
    error = rest.json()["error"]
    assert (rest.status_code, error["param"]) == (400, param), error
    assert error["message"].endswith(shown), error["message"]


RICH_BODIES = {  # every kind of member a body holds, at every level, for the test below
    "/v1/chat/completions": {
        "model": "family-a-5.5", "max_tokens": 2, "temperature": 0.5, "stop": ["zzz"], "metadata": {"a": "b"},
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}}}}],
        "messages": [{"role": "system", "content": "be brief"},
                     {"role": "user", "content": [{"type": "text", "text": "hi"}]},
                     {"role": "assistant", "content": None, "tool_calls": [
                         {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
                     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]},
    "/v1/messages": {
        "model": "family-b-sonnet-4-6", "max_tokens": 2, "top_k": 5, "system": [{"type": "text", "text": "be brief"}],
        "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                     {"role": "assistant",
                      "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1",
                                                   "content": [{"type": "text", "text": "sunny"}]}]}]},
}
UNREADABLE = [b"NaN", b"-Infinity", b"1e309", b"-" + b"9" * 320, b'"\\udc00 half"']  # JSON no field can take


def _member_paths(value, path: str = ""):
    """(path, its parent container and key) of every member and item below the body's top."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
        yield where, value, key
        yield from _member_paths(child, where)


def test_a_value_no_field_can_take_is_named_by_its_path_wherever_it_is(gateway):
    """A field-by-field fuzz of every level of a chat and a messages body: NaN, Infinity, a number beyond a double and
    half a surrogate pair, put in place of each member in turn, are each a 400 naming that member's path (api.md,
    Request bodies), in Anthropic's shape on /v1/messages; and a valid body is answered after them."""
    marker = "\u0001unreadable\u0001"
    wrong = []
    with httpx.Client(base_url=gateway.base_url, timeout=30,
                      headers={"authorization": f"Bearer {gateway.secret}"}) as client:
        for path, body in RICH_BODIES.items():
            for i, (where, parent, key) in enumerate(list(_member_paths(body))):
                value, parent[key] = parent[key], marker
                template = json.dumps(body).encode()
                parent[key] = value
                token = UNREADABLE[i % len(UNREADABLE)]
                answer = client.post(path, content=template.replace(json.dumps(marker).encode(), token))
                document = answer.json()
                got = (answer.status_code, document["error"]["param"], document.get("type"))
                if got != (400, where, "error" if path == "/v1/messages" else None):
                    wrong.append(f"{path} {where} = {token[:12]!r}: {got} {document['error']['message'][:120]}")
            assert client.post(path, json=body).status_code == 200
    assert not wrong, "\n".join(wrong)


@pytest.mark.parametrize("role", ["Assistant", "asistant", ""])
def test_a_tool_call_turn_with_its_role_misspelt_names_the_role(gateway, role):
    """An assistant turn holding tool calls and `content: null`, its role misspelt, was refused with "`messages[1].
    content` is required." (param `messages[1].content`): the caller looked at the content, which is as the API has
    it; the role is what is wrong."""
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {"model": "family-a-5.5", "max_tokens": 2, "messages": [
        {"role": "user", "content": "hi"}, {"role": role, "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "r"}]}
    answer = httpx.post(gateway.base_url + "/v1/chat/completions", json=body, timeout=30,
                        headers={"authorization": f"Bearer {gateway.secret}"})
    error = answer.json()["error"]
    assert (answer.status_code, error["param"]) == (400, "messages[1].role"), error
    assert repr(role) in error["message"]
    body["messages"][1]["role"] = "assistant"
    assert httpx.post(gateway.base_url + "/v1/chat/completions", json=body, timeout=60,
                      headers={"authorization": f"Bearer {gateway.secret}"}).status_code == 200
