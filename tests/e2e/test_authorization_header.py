"""How the gateway reads `Authorization` (api.md): the scheme in any case, one or more spaces, then the key (RFC 9110's
`auth-scheme 1*SP token68`); a tab there is a malformed header, and is said to be, not taken for a wrong key."""

from __future__ import annotations

import socket

import grpc
import httpx
import openai
import pytest
from google.protobuf import json_format

from portico.v1 import chat_pb2, chat_service_pb2_grpc, model_pb2, model_service_pb2_grpc


HI = [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("scheme", ["Bearer {}", "bearer {}", "BEARER {}", "Bearer   {}"])
def test_the_scheme_in_any_case_and_several_spaces_are_read(gateway, scheme):
    response = httpx.get(f"{gateway.base_url}/v1/models", headers={"authorization": scheme.format(gateway.secret)},
                         timeout=30)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path, body, anthropic", [
    ("/v1/chat/completions", {"model": "family-a-5.5", "messages": HI, "max_tokens": 1}, False),
    ("/v1/messages", {"model": "family-b-haiku-4-5-20251001", "messages": HI, "max_tokens": 1}, True),
])
@pytest.mark.parametrize("separator", ["\t", " \t", "\t "])
def test_a_tab_between_scheme_and_key_is_a_malformed_header_not_an_invalid_key(gateway, path, body, anthropic,
                                                                             separator):
    """The right key after a tab was answered "Invalid API key.": a caller checked, or rotated, a key that was
    fine, where the header's form was wrong."""
    headers = {"authorization": f"Bearer{separator}{gateway.secret}"}
    response = httpx.post(f"{gateway.base_url}{path}", headers=headers, json=body, timeout=30)
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert (error["code"], error["type"]) == ("invalid_api_key", "authentication_error")
    assert error["message"] == ("Malformed Authorization header: a tab separates its scheme from the key, where HTTP "
                                "allows only spaces. Send it as `Authorization: Bearer YOUR_KEY`.")
    assert (response.json().get("type") == "error") == anthropic
    assert response.headers["x-request-id"]


def test_a_wrong_key_is_still_an_invalid_key(gateway):
    response = httpx.get(f"{gateway.base_url}/v1/models", headers={"authorization": "Bearer pk-wrong"}, timeout=30)
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (401, "invalid_api_key") and "Malformed" not in error["message"]


NBSP = "\u00a0".encode()


@pytest.mark.parametrize("path, body, anthropic", [
    ("/v1/chat/completions", {"model": "family-a-5.5", "messages": HI, "max_tokens": 1}, False),
    ("/v1/messages", {"model": "family-b-haiku-4-5-20251001", "messages": HI, "max_tokens": 1}, True),
])
@pytest.mark.parametrize("header, value, message", [
    ("authorization", b"Bearer" + NBSP + b"{}", "Malformed Authorization header: a non-breaking space separates its "
     "scheme from the key, where HTTP allows only spaces. Send it as `Authorization: Bearer YOUR_KEY`."),
    ("authorization", b"Bearer\xa0{}", "Malformed Authorization header: a non-breaking space separates its scheme "
     "from the key, where HTTP allows only spaces. Send it as `Authorization: Bearer YOUR_KEY`."),  # Latin-1
    ("authorization", b"Bearer \xe2\x80\x8b{}", "Malformed Authorization header: a zero-width space separates its "
     "scheme from the key, where HTTP allows only spaces. Send it as `Authorization: Bearer YOUR_KEY`."),
    ("authorization", b"Bearer {}" + NBSP, "Malformed Authorization header: a non-breaking space follows the key. "
     "Send it as `Authorization: Bearer YOUR_KEY`."),
    ("authorization", NBSP + b"Bearer {}", "Malformed Authorization header: a non-breaking space comes before its "
     "scheme. Send it as `Authorization: Bearer YOUR_KEY`."),
])
def test_a_space_copied_from_a_page_around_the_key_is_a_malformed_header_not_an_invalid_key(
        gateway, path, body, anthropic, header, value, message):
    """A key copied from a web page or a document often brings a non-breaking (or zero-width) space with it, which
    HTTP does not take for one: the right key was answered "Invalid API key.", as after a tab."""
    response = httpx.post(f"{gateway.base_url}{path}", headers={header: value.replace(b"{}", gateway.secret.encode())},
                          json=body, timeout=30)
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["message"]) == (401, "invalid_api_key", message)
    assert (response.json().get("type") == "error") == anthropic


@pytest.mark.parametrize("value, message", [
    (NBSP + b"{}", "Malformed x-api-key header: a non-breaking space comes before the key. Send it as "
     "`x-api-key: YOUR_KEY`."),
    (b"{}" + NBSP, "Malformed x-api-key header: a non-breaking space follows the key. Send it as "
     "`x-api-key: YOUR_KEY`."),
])
def test_an_x_api_key_with_such_a_space_says_so_where_it_is_read(gateway, value, message):
    body = {"model": "family-b-haiku-4-5-20251001", "messages": HI, "max_tokens": 1}
    secret = gateway.secret.encode()
    response = httpx.post(f"{gateway.base_url}/v1/messages", headers={"x-api-key": value.replace(b"{}", secret)},
                          json=body, timeout=30)
    assert (response.status_code, response.json()["error"]["message"]) == (401, message)
    # /v1/chat/completions does not read x-api-key: no advice about it there (Authorization is what it wants).
    response = httpx.post(f"{gateway.base_url}/v1/chat/completions",
                          headers={"x-api-key": value.replace(b"{}", secret)},
                          json={"model": "family-a-5.5", "messages": HI, "max_tokens": 1}, timeout=30)
    assert (response.status_code, response.json()["error"]["message"]) == (
        401, "You didn't provide an API key. Send it as `Authorization: Bearer YOUR_KEY`.")


@pytest.mark.parametrize("value", [b"{}\xc2\xa0", b"pk-\xc3\xa9t\xc3\xa9", b"\xe9"])
def test_an_x_api_key_where_it_is_not_read_does_not_refuse_the_authorization_key(gateway, value):
    """On /v1/chat/completions, which reads only Authorization (api.md), a right `Authorization` key beside an
    x-api-key holding a byte outside printable ASCII was answered 401 "Invalid API key."."""
    headers = {"authorization": f"Bearer {gateway.secret}", "x-api-key": value.replace(b"{}", gateway.secret.encode())}
    response = httpx.post(f"{gateway.base_url}/v1/chat/completions", headers=headers,
                          json={"model": "family-a-5.5", "messages": HI, "max_tokens": 1}, timeout=30)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("value", [b"Bearer pk-\xc3\xa9t\xc3\xa9", b"Bearer pk-ab" + NBSP + b"cd",
                                   b"Bearer\xc3\xa9pk-ab"])
def test_another_byte_in_or_for_the_key_is_still_an_invalid_key(gateway, value):
    response = httpx.get(f"{gateway.base_url}/v1/models", headers={"authorization": value}, timeout=30)
    assert (response.status_code, response.json()["error"]["message"]) == (401, "Invalid API key.")


MESSAGES = {"model": "family-b-haiku-4-5-20251001", "messages": HI, "max_tokens": 1}


@pytest.mark.parametrize("value", ["Bearer {}", "bearer  {}", "Bearer pk-not-a-key-of-ours"])
def test_an_x_api_key_with_the_bearer_scheme_says_the_header_takes_the_key_alone(gateway, value):
    """`x-api-key: Bearer KEY` (the OpenAI-style value in Anthropic's header) was answered "Incorrect API key
    provided.": a caller checked, or rotated, a key that was fine, where the header's form was wrong."""
    sent = value.format(gateway.secret)
    response = httpx.post(f"{gateway.base_url}/v1/messages", headers={"x-api-key": sent}, json=MESSAGES, timeout=30)
    error = response.json()["error"]
    assert (response.status_code, error["type"]) == (401, "authentication_error")
    assert error["message"] == ("Malformed x-api-key header: it takes the key alone, without `Bearer `. Send it as "
                                "`x-api-key: YOUR_KEY`.")
    assert gateway.secret not in response.text


def test_an_authorization_header_holding_a_key_without_its_scheme_says_so(gateway):
    """`Authorization: KEY` was answered "You didn't provide an API key.": the caller did, without `Bearer `."""
    for path, body in [("/v1/chat/completions", {"model": "family-a-5.5", "messages": HI, "max_tokens": 1}),
                       ("/v1/messages", MESSAGES)]:
        response = httpx.post(f"{gateway.base_url}{path}", headers={"authorization": gateway.secret}, json=body,
                              timeout=30)
        error = response.json()["error"]
        assert (response.status_code, error["code"]) == (401, "invalid_api_key")
        assert error["message"] == ("Malformed Authorization header: the key has no scheme before it. Send it as "
                                    "`Authorization: Bearer YOUR_KEY`.")
        assert gateway.secret not in response.text


@pytest.mark.parametrize("scheme", ["Token", "token", "Basic", "Api-Key"])
def test_a_key_after_another_scheme_says_the_scheme_is_wrong(gateway, scheme):
    """`Authorization: Token KEY` (Django REST's and GitHub's form) was answered "You didn't provide an API key.": the
    caller did, under another scheme than Bearer."""
    response = httpx.post(f"{gateway.base_url}/v1/chat/completions", json={"model": "family-a-5.5", "messages": HI},
                          headers={"authorization": f"{scheme} {gateway.secret}"}, timeout=30)
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (401, "invalid_api_key")
    assert error["message"] == ("Malformed Authorization header: the key's scheme is not Bearer. Send it as "
                                "`Authorization: Bearer YOUR_KEY`.")
    assert gateway.secret not in response.text


def test_what_holds_no_key_is_still_no_key_and_a_bare_x_api_key_still_works(gateway):
    response = httpx.get(f"{gateway.base_url}/v1/models", headers={"authorization": "Basic dXNlcjpwYXNz"}, timeout=30)
    assert response.json()["error"]["message"].startswith("You didn't provide an API key.")
    response = httpx.post(f"{gateway.base_url}/v1/messages", headers={"x-api-key": "Bearer"}, json=MESSAGES,
                          timeout=30)
    assert (response.status_code, response.json()["error"]["message"]) == (401, "Incorrect API key provided.")
    response = httpx.post(f"{gateway.base_url}/v1/messages", headers={"x-api-key": gateway.secret}, json=MESSAGES,
                          timeout=30)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("value", [" Bearer {}", "  bearer {} "])
def test_spaces_around_the_header_value_over_grpc_are_read_as_over_rest(gateway, value):
    """A gRPC caller (HTTP/2: nothing strips a value's leading space, as HTTP/1.1's parser does) that sent
    `authorization: " Bearer KEY"` was told "You didn't provide an API key", where a REST caller's same header
    was read; HTTP counts no space around a field's value as part of it (RFC 9110, 5.5)."""
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as rest:
        rest.sendall(f"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization:{value.format(gateway.secret)}\r\n"
                     "Connection: close\r\n\r\n".encode())
        assert rest.recv(64).startswith(b"HTTP/1.1 200 "), "REST reads it"
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        models = model_service_pb2_grpc.ModelServiceStub(channel).ListModels(
            model_pb2.ListModelsRequest(), metadata=[("authorization", value.format(gateway.secret))], timeout=30)
    assert models.data


X_API_KEY_NOT_READ = ("x-api-key is read only on /v1/messages and /v1/models (the Anthropic SDK's paths): send the "
                      "key here as `Authorization: Bearer YOUR_KEY`.")


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {"model": "family-a-5.5", "messages": HI, "max_tokens": 1}),
    ("/v1/admin/keys", None),
    ("/v1/organization/costs?start_time=0", None),
])
def test_a_key_in_x_api_key_where_it_is_not_read_is_told_so_not_that_no_key_came(gateway, path, body):
    """A key sent as `x-api-key` to /v1/chat/completions (a client written for Anthropic's header, or LiteLLM's, which
    takes it on every path) was told "You didn't provide an API key.": the caller did, in a header that path does
    not read. The key is still not read there (Authorization is the path's one key header), and never quoted."""
    url = gateway.base_url + path
    headers = {"x-api-key": gateway.secret}
    response = httpx.post(url, headers=headers, json=body, timeout=30) if body else httpx.get(url, headers=headers,
                                                                                              timeout=30)
    assert (response.status_code, response.json()["error"]["message"]) == (401, X_API_KEY_NOT_READ)
    assert response.json()["error"]["code"] == "invalid_api_key"
    assert gateway.secret not in response.text


def test_an_x_api_key_where_it_is_not_read_leaves_a_missing_key_missing_over_grpc_too(gateway):
    """The same over native gRPC: ChatService reads `authorization` only, and says where the key belongs."""
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        stub = chat_service_pb2_grpc.ChatServiceStub(channel)
        request = json_format.ParseDict({"model": "family-a-5.5", "max_tokens": 1, "messages": HI},
                                        chat_pb2.CreateChatCompletionRequest())
        with pytest.raises(grpc.RpcError) as caught:
            stub.CreateChatCompletion(request, metadata=[("x-api-key", gateway.secret)], timeout=30)
    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert caught.value.details() == X_API_KEY_NOT_READ


@pytest.mark.parametrize(("header", "value", "message"), [
    ("authorization", 'Bearer "{}"', "Malformed Authorization header: quotes surround the key. Send it as "
                                     "`Authorization: Bearer YOUR_KEY`."),
    ("authorization", "Bearer '{}'", "Malformed Authorization header: quotes surround the key. Send it as "
                                     "`Authorization: Bearer YOUR_KEY`."),
    ("x-api-key", '"{}"', "Malformed x-api-key header: quotes surround the key. Send it as `x-api-key: YOUR_KEY`."),
])
def test_a_key_in_quotes_says_so_not_that_it_is_wrong(gateway, header, value, message):
    """A key read with its quotes (`OPENAI_API_KEY="pk-..."` in a file `docker run --env-file` reads, which keeps
    them) was answered "Incorrect API key provided.": the caller checked, or rotated, a key that was right. Said so,
    over REST and gRPC, whether the key is right or not, never quoting it."""
    response = httpx.post(f"{gateway.base_url}/v1/messages", headers={header: value.format(gateway.secret)},
                          json=MESSAGES, timeout=30)
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["message"]) == (401, "invalid_api_key", message)
    assert gateway.secret[5:] not in response.text
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        with pytest.raises(grpc.RpcError) as caught:
            model_service_pb2_grpc.ModelServiceStub(channel).ListModels(
                model_pb2.ListModelsRequest(), metadata=((header, value.format(gateway.secret)),), timeout=30)
    assert (caught.value.code(), caught.value.details()) == (grpc.StatusCode.UNAUTHENTICATED, message)


@pytest.mark.parametrize("api_key", ["Bearer {}", "bearer  {}", "Bearer pk-not-a-key-of-ours"])
def test_the_bearer_scheme_given_as_part_of_the_key_says_so_not_that_the_key_is_wrong(gateway, api_key):
    """The openai SDK given `api_key="Bearer pk-..."` (OPENAI_API_KEY copied from a curl line) sends
    `Authorization: Bearer Bearer pk-...`, answered "Incorrect API key provided.": the caller checked, or rotated, a
    key that was fine, where `x-api-key: Bearer KEY` is said to be malformed. Said so too, never quoting the key."""
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=api_key.format(gateway.secret), max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        client.models.list()
    assert caught.value.body["message"] == ("Malformed Authorization header: `Bearer ` is written twice, the second "
                                            "as part of the key. Send it as `Authorization: Bearer YOUR_KEY`.")
    assert gateway.secret[5:] not in str(caught.value.body)
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        with pytest.raises(grpc.RpcError) as refused:
            model_service_pb2_grpc.ModelServiceStub(channel).ListModels(
                model_pb2.ListModelsRequest(), timeout=30,
                metadata=(("authorization", f"Bearer {api_key.format(gateway.secret)}"),))
    assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert refused.value.details() == caught.value.body["message"]


@pytest.mark.parametrize("value", ["Bearer:{}", "Bearer: {}", "bearer={}", "Bearer{}", "Bearer:pk-not-a-key-of-ours"])
def test_a_key_glued_to_its_scheme_says_so_not_that_no_key_came(gateway, value):
    """`Authorization: Bearer:KEY` (a header written as `name: value` once too often, or `=` as in an env file) was
    answered "You didn't provide an API key.": the caller did, without the space after `Bearer`."""
    response = httpx.post(f"{gateway.base_url}/v1/chat/completions", json={"model": "family-a-5.5", "messages": HI},
                          headers={"authorization": value.format(gateway.secret)}, timeout=30)
    error = response.json()["error"]
    assert (response.status_code, error["code"]) == (401, "invalid_api_key")
    assert error["message"] == ("Malformed Authorization header: no space separates `Bearer` from the key. Send it "
                                "as `Authorization: Bearer YOUR_KEY`.")
    assert gateway.secret[5:] not in response.text
