"""The official anthropic SDK against the running gateway: create, the streaming helpers and typed errors."""

from __future__ import annotations

import functools
import socket

import anthropic
import httpx
import openai
import orjson
import pytest


@pytest.fixture(scope="module")
def client(gateway) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.base_url, api_key=gateway.secret, max_retries=0)


def test_create(client):
    message = client.messages.create(model="family-b-sonnet-4-6", max_tokens=6, extra_body={"temperature": 0},
                                     system="Be brief.", messages=[{"role": "user", "content": "Say hello."}])
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 6 and message.usage.input_tokens > 0


def test_stream_helpers(client):
    # Greedy sampling: at temperature 1 the model sometimes ends its turn within 8 tokens.
    with client.messages.stream(model="family-b-opus-4-8", max_tokens=8, extra_body={"temperature": 0},
                                messages=[{"role": "user", "content": "Count to five."}]) as stream:
        texts = list(stream.text_stream)
        final = stream.get_final_message()
        assert stream.response.headers["cache-control"] == "no-cache"  # as Anthropic's own streams
    assert len(texts) >= 2
    assert final.content[0].text == "".join(texts)
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8 and final.usage.input_tokens > 0


def test_the_sdk_sees_each_request_s_id(client, gateway):
    raw = client.messages.with_raw_response.create(model="family-b-sonnet-4-6", max_tokens=2,
                                                   messages=[{"role": "user", "content": "Hi"}])
    assert raw.headers["request-id"] == raw.headers["x-request-id"] != ""
    assert raw.parse()._request_id == raw.headers["x-request-id"]
    for failing in (lambda: client.messages.create(model="nope", max_tokens=2, messages=[{"role": "user",
                                                                                          "content": "x"}]),
                    lambda: client.get("/v1/nowhere", cast_to=object)):  # the server's error, and Envoy's own
        with pytest.raises(anthropic.NotFoundError) as caught:
            failing()
        assert caught.value.request_id == caught.value.response.headers["x-request-id"] != ""


def test_error_types_are_anthropic_s_for_the_status(client, gateway):
    """Anthropic-shaped errors carry Anthropic's `type` (its errors page): a 404 was `invalid_request_error` and a
    413 `invalid_request_error`, where code written for Anthropic's API looks for `not_found_error` and
    `request_too_large`. The server's errors, and the ones Envoy makes before the server sees a request."""
    hi = [{"role": "user", "content": "x"}]
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="nope", max_tokens=2, messages=hi)  # the server's
    assert caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.get("/v1/messages/nowhere", cast_to=object)  # Envoy's: no such route
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.APIStatusError) as caught:  # Envoy's: over 8 MiB, refused before it is read
        client.messages.create(model="family-b-opus-4-7", max_tokens=2,
                               messages=[{"role": "user", "content": "x" * (9 << 20)}])
    assert caught.value.status_code == 413
    assert (caught.value.body["error"]["type"], caught.value.body["error"]["code"]) == (
        "request_too_large", "request_too_large")
    # The OpenAI shape keeps the table's types: the same 404 on the chat path.
    answer = httpx.post(f"{gateway.base_url}/v1/chat/completions", json={"model": "nope", "messages": hi},
                        headers={"Authorization": f"Bearer {gateway.secret}"}, timeout=30)
    assert answer.status_code == 404 and answer.json()["error"]["type"] == "invalid_request_error"


def test_beta_query_parameter_is_accepted(client):
    message = client.beta.messages.create(model="family-b-haiku-4-5-20251001", max_tokens=2,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert message.content[0].text is not None


def test_typed_errors(client, gateway):
    bad = anthropic.Anthropic(base_url=gateway.base_url, api_key="pk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        bad.messages.create(model="family-b-opus-4-7", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert caught.value.body == {"type": "error", "error": {
        "message": "Incorrect API key provided.", "type": "authentication_error", "param": None,
        "code": "invalid_api_key"}}
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="family-a-5.5", max_tokens=5, messages=[{"role": "user", "content": "x"}])
    assert "/v1/chat/completions" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="family-b-opus-4-7", max_tokens=5, extra_body={"temperature": 1.5},
                               messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["error"]["param"] == "temperature"


@pytest.fixture(scope="module")
def other_secret(gateway) -> str:
    """A second valid key: a request naming two keys is refused even when both would be served."""
    return gateway.cli("keys", "create", "--name", "other", "--all-models").stdout.strip().splitlines()[-1]


# The key headers of one request: {key} is the gateway's key, {other} other_secret.
MORE_THAN_ONE_KEY = {
    "x-api-key twice": [("x-api-key", "{key}"), ("x-api-key", "{key}")],
    "x-api-key twice, the last one right": [("x-api-key", "pk-wrong"), ("x-api-key", "{key}")],
    "authorization twice": [("authorization", "Bearer {key}"), ("authorization", "Bearer {key}")],
    "authorization and x-api-key, two keys": [("authorization", "Bearer {key}"), ("x-api-key", "{other}")],
    "authorization right, x-api-key wrong": [("authorization", "Bearer {key}"), ("x-api-key", "pk-wrong")],
}


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/models"])
@pytest.mark.parametrize("case", sorted(MORE_THAN_ONE_KEY))
def test_a_request_with_more_than_one_key_is_refused(gateway, other_secret, case, path):
    """Which of two keys a request is served with must not depend on header order: it is a 401 that says why,
    naming neither key."""
    headers = [(name, value.format(key=gateway.secret, other=other_secret)) for name, value in MORE_THAN_ONE_KEY[case]]
    body = {"model": "family-b-opus-4-7", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    response = httpx.request("POST" if path == "/v1/messages" else "GET", gateway.base_url + path,
                             headers=[("anthropic-version", "2023-06-01"), *headers],
                             json=body if path == "/v1/messages" else None, timeout=30)
    assert response.status_code == 401, response.text
    error = response.json()["error"]
    assert response.json()["type"] == "error"
    assert (error["code"], error["type"]) == ("invalid_api_key", "authentication_error")
    assert "only one api key" in error["message"].lower()
    assert gateway.secret not in response.text and other_secret not in response.text


def test_the_same_key_as_x_api_key_and_bearer_is_one_key(gateway):
    """A client that sets both headers of the two dialects to its key sends one key."""
    both = {"x-api-key": gateway.secret, "authorization": f"Bearer {gateway.secret}", "anthropic-version": "2023-06-01"}
    body = {"model": "family-b-opus-4-7", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    assert httpx.post(gateway.base_url + "/v1/messages", headers=both, json=body, timeout=30).status_code == 200
    assert httpx.get(gateway.base_url + "/v1/models", headers=both, timeout=30).status_code == 200


def test_a_missing_key_is_asked_for_in_the_headers_the_path_takes(gateway):
    """An Anthropic-dialect caller without a key is told of x-api-key, the header its SDK sends; a chat caller only
    of Authorization, the one header chat takes."""
    body = {"model": "family-b-opus-4-7", "max_tokens": 2, "messages": [{"role": "user", "content": "Hi"}]}
    messages = httpx.post(gateway.base_url + "/v1/messages", json=body, timeout=30,
                          headers={"anthropic-version": "2023-06-01"})
    chat = httpx.post(gateway.base_url + "/v1/chat/completions", json={**body, "model": "family-a-5.5"}, timeout=30)
    assert (messages.status_code, chat.status_code) == (401, 401)
    assert "x-api-key" in messages.json()["error"]["message"]
    assert "Authorization: Bearer" in messages.json()["error"]["message"]
    assert "x-api-key" not in chat.json()["error"]["message"]


# Newest first, as Anthropic lists them (ties in the catalog's order).
NEWEST_FIRST = ["family-b-opus-4-8", "family-a-5.5", "family-b-opus-4-7", "family-a-image-2", "family-b-opus-4-6",
                "family-b-sonnet-4-6", "family-a-5.4", "family-b-haiku-4-5-20251001"]


def test_models_list_pages_in_anthropics_shape(client):
    page = client.models.list(limit=3)
    assert [m.id for m in page.data] == NEWEST_FIRST[:3]
    assert (page.has_more, page.first_id, page.last_id) == (True, NEWEST_FIRST[0], NEWEST_FIRST[2])
    first = page.data[0]
    assert (first.type, first.display_name, first.lifecycle) == ("model", "family-b-opus-4-8", "active")
    assert (first.created_at.year, first.created_at.month, first.created_at.tzinfo is not None) == (2026, 3, True)
    assert first.model_extra["endpoint"] == "/v1/messages"
    # The SDK follows last_id as after_id until has_more is false.
    assert [m.id for m in client.models.list(limit=3)] == NEWEST_FIRST
    last = client.models.list(limit=3, after_id=NEWEST_FIRST[5])
    assert ([m.id for m in last.data], last.has_more) == (NEWEST_FIRST[6:], False)
    before = client.models.list(limit=2, before_id=NEWEST_FIRST[3])
    assert ([m.id for m in before.data], before.has_more) == (NEWEST_FIRST[1:3], True)
    empty = client.models.list(after_id=NEWEST_FIRST[-1])
    assert (empty.data, empty.has_more, empty.first_id, empty.last_id) == ([], False, None, None)


def test_models_list_filters_by_lifecycle(client):
    """The SDK's `lifecycle` filter (`lifecycle[]=...`): every catalog model is active, so a filter without `active`
    is an empty page rather than the active models under a filter that excludes them; an unknown stage is a 400."""
    assert [m.id for m in client.models.list(lifecycle=["active", "deprecated"])] == NEWEST_FIRST
    assert [m.id for m in client.models.list(lifecycle=["active"], limit=2)] == NEWEST_FIRST
    for stages in (["retired"], ["deprecated", "retired"]):
        page = client.models.list(lifecycle=stages)
        assert (page.data, page.has_more, page.first_id, page.last_id) == ([], False, None, None)
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.models.list(lifecycle=["sunset"])
    assert caught.value.body["error"]["param"] == "lifecycle" and "sunset" in caught.value.body["error"]["message"]


def test_models_retrieve_in_anthropics_shape(client):
    model = client.models.retrieve("family-a-5.5")
    assert (model.type, model.id, model.display_name) == ("model", "family-a-5.5", "family-a-5.5")
    assert model.created_at.isoformat() == "2026-01-01T00:00:00+00:00"
    assert model.model_extra["endpoint"] == "/v1/chat/completions"
    with pytest.raises(anthropic.NotFoundError) as caught:
        client.models.retrieve("family-z")
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["param"] == "model"


@pytest.mark.parametrize("query, param", [
    ({"limit": 0}, "limit"), ({"limit": 1001}, "limit"), ({"limit": "abc"}, "limit"),
    ({"after_id": "family-z"}, "after_id"), ({"before_id": "family-z"}, "before_id"),
    ({"after_id": "family-a-5.5", "before_id": "family-a-5.4"}, "before_id"),
])
def test_models_paging_errors_in_anthropics_shape(client, query, param):
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.models.list(extra_query=query)
    body = caught.value.body
    assert (body["type"], body["error"]["type"], body["error"]["param"]) == ("error", "invalid_request_error", param)


@pytest.mark.parametrize("limit", [0, 1001, 2147483647, 2147483648, -2147483649, 10**30])
def test_every_limit_out_of_range_is_the_documented_400(client, limit):
    """api.md: `limit` is 1 to 1000. One beyond protobuf's int32 (2147483648) was refused in protobuf's terms,
    "expected an integer from -2147483648 to 2147483647", where 1001 got the documented message: now all get it."""
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.models.list(limit=limit)
    body = caught.value.body
    assert (body["type"], body["error"]["type"], body["error"]["param"]) == ("error", "invalid_request_error", "limit")
    assert body["error"]["message"] == f"limit must be between 1 and 1000, got {limit}."


def test_models_with_a_wrong_key_in_anthropics_shape(gateway):
    bad = anthropic.Anthropic(base_url=gateway.base_url, api_key="pk-wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        bad.models.list()
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize("headers, body, status", [
    ({"x-api-key": b"pk-caf\xe9"}, None, 401),  # a key header Envoy refuses unread
    ({}, b'{"limit": 2}', 400),  # a body on a route that takes none
    ({"content-length": str(9 * 2**20)}, None, 413),  # refused on its headers
])
def test_envoys_own_refusals_on_the_models_route_are_in_anthropics_shape(gateway, headers, body, status):
    """api.md: errors of /v1/models asked with `anthropic-version` have Anthropic's shape. Those Envoy made before
    it had marked the route came in OpenAI's (no top-level `"type": "error"`)."""
    request = [b"GET /v1/models HTTP/1.1", b"host: portico", b"anthropic-version: 2023-06-01", b"connection: close"]
    request += [name.encode() + b": " + (value if isinstance(value, bytes) else value.encode())
                for name, value in {"x-api-key": gateway.secret, **headers}.items()]
    if body is not None:
        request.append(b"content-length: %d" % len(body))
    with socket.create_connection(("127.0.0.1", gateway.port), timeout=30) as connection:
        connection.sendall(b"\r\n".join(request) + b"\r\n\r\n" + (body or b""))
        answer = b"".join(iter(lambda: connection.recv(65536), b""))
    head, _, payload = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d " % status), answer
    assert orjson.loads(payload)["type"] == "error"


@pytest.mark.parametrize("query, param", [
    ("limit=1&limit=2", "limit"), ("after_id=family-a-5.5&after_id=family-a-5.4", "after_id"),
    ("before_id=family-a-5.5&limit=2&before_id=family-a-5.4", "before_id"), ("limit[]=2", "limit"),
])
def test_models_paging_parameter_given_twice_is_a_400_naming_it(gateway, query, param):
    """The transcoder kept the last value (or failed in protobuf's words, `param` null): a caller paging with two
    values must not get one page silently. HEAD gets the GET's headers."""
    headers = {"x-api-key": gateway.secret, "anthropic-version": "2023-06-01"}
    with httpx.Client(base_url=gateway.base_url, headers=headers, timeout=30) as client:
        response = client.get(f"/v1/models?{query}")
        head = client.head(f"/v1/models?{query}")
    assert response.status_code == 400, response.text
    assert response.json() == {"type": "error", "error": {
        "message": f"Parameter {param} takes one value, not a list, for GET /v1/models.",
        "type": "invalid_request_error", "param": param, "code": "invalid_request"}}
    assert (head.status_code, head.headers["content-length"]) == (400, response.headers["content-length"])
    # The OpenAI-shaped route takes no parameters: it skips them, as before.
    assert httpx.get(f"{gateway.base_url}/v1/models?{query}", headers={"authorization": f"Bearer {gateway.secret}"},
                     timeout=30).status_code == 200


def test_a_last_assistant_turn_is_a_prefill_the_embedded_model_continues(client):
    """Anthropic's prefill: the answer continues the last assistant turn's text, and holds only what follows it.
    Greedy, a prefill cut from the model's own answer is continued with the rest of that answer (not a new turn
    that starts over); its count is the prompt the model reads."""
    ask = [{"role": "user", "content": "Count from one to ten in words."}]
    whole = client.messages.create(model="family-b-sonnet-4-6", max_tokens=24, extra_body={"temperature": 0},
                                   messages=ask).content[0].text
    prefill = whole[: whole.index("\n", whole.index("\n") + 1)]  # the first two lines, without the newline after
    fields = dict(model="family-b-sonnet-4-6", messages=[*ask, {"role": "assistant", "content": prefill}])
    message = client.messages.create(max_tokens=12, extra_body={"temperature": 0}, **fields)
    assert whole.startswith(prefill + message.content[0].text)
    assert client.messages.count_tokens(**fields).input_tokens == message.usage.input_tokens


@pytest.mark.parametrize("empty", ["", []])
def test_an_empty_last_assistant_turn_is_no_turn_for_the_embedded_model(client, empty):
    """Anthropic's API takes an empty last assistant message (a prefill of nothing): the answer is the one without
    it. The embedded model was shown it as an empty reply of its own (six tokens more) and answered after that."""
    ask = [{"role": "user", "content": "Count from one to ten in words."}]
    fields = dict(model="family-b-sonnet-4-6", max_tokens=8, extra_body={"temperature": 0})
    alone = client.messages.create(messages=ask, **fields)
    with_empty = [*ask, {"role": "assistant", "content": empty}]
    message = client.messages.create(messages=with_empty, **fields)
    assert (message.content[0].text, message.usage.input_tokens) == (alone.content[0].text, alone.usage.input_tokens)
    assert client.messages.count_tokens(model=fields["model"], messages=with_empty).input_tokens == \
        alone.usage.input_tokens


@pytest.mark.parametrize("prefill", ["Sure: ", "One,\n", " "])
def test_a_prefill_ending_in_whitespace_is_refused_as_anthropic_s_api_refuses_it(client, prefill):
    """Anthropic's API refuses it (the answer would go on from a lone space token); the embedded model answered."""
    messages = [{"role": "user", "content": "Count to three."}, {"role": "assistant", "content": prefill}]
    create = functools.partial(client.messages.create, max_tokens=4)
    for call in (create, client.messages.count_tokens):
        with pytest.raises(anthropic.BadRequestError) as caught:
            call(model="family-b-sonnet-4-6", messages=messages)
        assert caught.value.body["error"]["param"] == "messages[1].content"
        assert "final assistant content cannot end with trailing whitespace" in caught.value.message


def test_metadata_is_checked_as_anthropic_s_api_checks_it(client):
    """Ignored by the model, but a `user_id` that is no string is a 400 naming it, as on Anthropic's API (and as a
    chat completion's metadata values are checked), not an answer a real Anthropic upstream would then refuse."""
    hi = [{"role": "user", "content": "Hi"}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="family-b-sonnet-4-6", max_tokens=2, messages=hi, metadata={"user_id": 5})
    assert caught.value.body["error"]["param"] == "metadata.user_id"
    with pytest.raises(anthropic.BadRequestError) as caught:  # count_tokens takes no `metadata` argument
        client.messages.count_tokens(model="family-b-sonnet-4-6", messages=hi, extra_body={"metadata": {"user_id": 5}})
    assert caught.value.body["error"]["param"] == "metadata.user_id"
    assert client.messages.create(model="family-b-sonnet-4-6", max_tokens=2, messages=hi,
                                  metadata={"user_id": "u-42"}).usage.output_tokens > 0


@pytest.mark.parametrize(("metadata", "param", "words"), [
    ({"user_id": "u" * 257}, "metadata.user_id", "metadata.user_id: String should have at most 256 characters"),
    ({"user_id": "u-42", "session_id": "s-1"}, "metadata.session_id",
     "metadata.session_id: Extra inputs are not permitted"),
])
def test_metadata_anthropic_s_api_refuses_is_refused_not_ignored(client, metadata, param, words):
    """Anthropic's API takes only `user_id` in `metadata`, of at most 256 characters; the embedded model ignored a
    longer one and a session id put beside it, so code that worked here failed once the model was served by
    Anthropic."""
    hi = [{"role": "user", "content": "Hi"}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="family-b-sonnet-4-6", max_tokens=2, messages=hi, metadata=metadata)
    assert (caught.value.body["error"]["param"], caught.value.body["error"]["message"]) == (param, words)
    assert client.messages.create(model="family-b-sonnet-4-6", max_tokens=2, messages=hi,
                                  metadata={"user_id": "u" * 256}).usage.output_tokens > 0


def _filling(client, room: int) -> list[dict]:
    """A conversation whose prompt leaves exactly `room` tokens of the embedded model's 2048-token window."""
    start = [{"role": "user", "content": "Go on:"}]
    used = client.messages.count_tokens(model="family-b-opus-4-8", messages=start).input_tokens
    return [{"role": "user", "content": "Go on:" + " x" * (2048 - room - used)}]  # each " x" is one token


def test_an_answer_cut_by_the_context_window_says_so_not_max_tokens(client, gateway):
    """Anthropic's `model_context_window_exceeded`: the window ended the answer before the caller's max_tokens did.
    A chat caller gets OpenAI's `length` for it; max_tokens reached exactly at the window's edge is `max_tokens`."""
    messages = _filling(client, room=3)
    assert client.messages.count_tokens(model="family-b-opus-4-8", messages=messages).input_tokens == 2045
    # top_k 1 is greedy without temperature 0's fresh evaluation of the prompt: the next requests reuse it
    kwargs = dict(model="family-b-opus-4-8", messages=messages, extra_body={"top_k": 1})
    message = client.messages.create(max_tokens=50, **kwargs)
    assert (message.stop_reason, message.usage.output_tokens) == ("model_context_window_exceeded", 3)
    with client.messages.stream(max_tokens=50, **kwargs) as events:
        assert events.get_final_message().stop_reason == "model_context_window_exceeded"
    exact = client.messages.create(max_tokens=3, **kwargs)
    assert (exact.stop_reason, exact.usage.output_tokens) == ("max_tokens", 3)
    oai = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key=gateway.secret, max_retries=0)
    chunks = oai.chat.completions.create(model="family-a-5.5", max_tokens=50, messages=messages, stream=True,
                                         extra_body={"top_k": 1})
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


@pytest.mark.parametrize("call", [
    lambda client: client.beta.files.list(),
    lambda client: client.beta.files.upload(file=("notes.txt", b"hello", "text/plain")),
    lambda client: client.beta.files.delete("file_1"),
    lambda client: client.beta.skills.list(),
    lambda client: client.messages.batches.list(),
    lambda client: client.messages.batches.cancel("msgbatch_1"),
], ids=["files.list", "files.upload", "files.delete", "skills.list", "batches.list", "batches.cancel"])
def test_an_anthropic_api_portico_does_not_serve_is_a_404_in_anthropic_s_shape(client, call):
    """The anthropic SDK's other APIs (files, skills, batches) are not served: a 404 in the shape the SDK's callers
    read (`body["type"] == "error"`, `not_found_error`), as under /v1/messages; /v1/files and /v1/skills were
    answered in OpenAI's shape, without the top-level `type` and with `invalid_request_error`."""
    with pytest.raises(anthropic.NotFoundError) as caught:
        call(client)
    assert caught.value.body["type"] == "error"
    assert caught.value.body["error"]["type"] == "not_found_error"
    assert caught.value.body["error"]["code"] == "not_found"
    assert caught.value.request_id == caught.value.response.headers["x-request-id"] != ""


def test_an_unserved_path_without_anthropic_version_keeps_openai_s_shape(gateway):
    """The openai SDK never sends `anthropic-version`: an unknown path answers it in OpenAI's shape."""
    answer = httpx.get(f"{gateway.base_url}/v1/files", headers={"Authorization": f"Bearer {gateway.secret}"},
                       timeout=30)
    assert answer.status_code == 404
    assert "type" not in answer.json() and answer.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(("thinking", "max_tokens", "words"), [
    ({"type": "enabled", "budget_tokens": 512}, 2000, "greater than or equal to 1024"),
    ({"type": "enabled", "budget_tokens": 2048}, 2048, "`max_tokens` must be greater than `thinking.budget_tokens`"),
    ({"type": "enabled"}, 2000, "Field required"),
    ({"type": "on"}, 2000, "'enabled', 'disabled', 'adaptive'"),
])
def test_a_thinking_setting_anthropic_s_api_refuses_is_refused_not_ignored(client, thinking, max_tokens, words):
    """The embedded model does not think, but a `thinking` that Anthropic's API refuses (a budget under 1024 tokens,
    or not under max_tokens) is a 400 naming it here too: otherwise code the embedded model answers fails once the
    model is served by Anthropic. Counting checks it as a message does."""
    hi = [{"role": "user", "content": "Hi"}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="family-b-sonnet-4-6", max_tokens=max_tokens, messages=hi, thinking=thinking)
    assert caught.value.body["error"]["param"].startswith("thinking") and words in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.count_tokens(model="family-b-sonnet-4-6", messages=hi, thinking=thinking,
                                     extra_body={"max_tokens": max_tokens})
    assert words in caught.value.body["error"]["message"]


def test_a_thinking_setting_anthropic_s_api_takes_is_still_ignored(client):
    hi = [{"role": "user", "content": "Hi"}]
    for thinking in ({"type": "enabled", "budget_tokens": 1024}, {"type": "disabled"}, {"type": "adaptive"}):
        answer = client.messages.create(model="family-b-sonnet-4-6", max_tokens=1025, messages=hi, thinking=thinking)
        assert [block.type for block in answer.content] == ["text"]
    assert client.messages.count_tokens(model="family-b-sonnet-4-6", messages=hi, thinking={
        "type": "enabled", "budget_tokens": 1024}).input_tokens > 0  # count_tokens takes no max_tokens to compare


_THINKING = {"type": "enabled", "budget_tokens": 1024}
_WEATHER = [{"name": "get_weather", "input_schema": {"type": "object"}}]


@pytest.mark.parametrize(("thinking", "fields", "param", "words"), [
    (_THINKING, {"temperature": 0.2}, "temperature", "may only be set to 1 when thinking is enabled"),
    ({"type": "adaptive"}, {"temperature": 0.2}, "temperature", "may only be set to 1 when thinking is enabled"),
    (_THINKING, {"top_k": 40}, "top_k", "when thinking is enabled"),
    (_THINKING, {"top_p": 0.9}, "top_p", "greater than or equal to 0.95 or unset when thinking is enabled"),
    (_THINKING, {"tools": _WEATHER, "tool_choice": {"type": "any"}}, "tool_choice",
     "Thinking may not be enabled when tool_choice forces tool use"),
    (_THINKING, {"tools": _WEATHER, "tool_choice": {"type": "tool", "name": "get_weather"}}, "tool_choice",
     "Thinking may not be enabled when tool_choice forces tool use"),
])
def test_sampling_anthropic_s_api_refuses_beside_thinking_is_refused_not_ignored(client, thinking, fields, param,
                                                                                 words):
    """Anthropic's API takes no temperature but 1, no top_k, no top_p under 0.95 and no tool_choice that forces a
    call while thinking is on: the embedded model answered such a request, so code that worked here failed once the
    model was served by Anthropic."""
    hi = [{"role": "user", "content": "Hi"}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="family-b-sonnet-4-6", max_tokens=1025, messages=hi, thinking=thinking,
                               extra_body=fields)  # the SDK's create() no longer names the sampling parameters
    assert caught.value.body["error"]["param"] == param and words in caught.value.body["error"]["message"]


def test_sampling_anthropic_s_api_takes_beside_thinking_is_answered(client):
    hi = [{"role": "user", "content": "Hi"}]
    for fields in ({"temperature": 1, "top_p": 0.95}, {"tools": _WEATHER, "tool_choice": {"type": "auto"}},
                   {"temperature": 0.2, "top_k": 5, "thinking": {"type": "disabled"}}):
        assert client.messages.create(model="family-b-sonnet-4-6", max_tokens=1025, messages=hi, thinking=_THINKING,
                                      extra_body=fields).usage.output_tokens > 0


_ASK = {"role": "user", "content": "Weather in Paris?"}
_USE = {"role": "assistant", "content": [{"type": "text", "text": "Checking."}, {
    "type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]}
_TOOLS = [{"name": "get_weather", "input_schema": {"type": "object"}}]


def _result(tool_use_id: str) -> dict:
    return {"role": "user", "content": [{"type": "tool_result", "tool_use_id": tool_use_id, "content": "sunny"}]}


def _use(*ids: str) -> dict:
    return {"role": "assistant", "content": [{"type": "tool_use", "id": i, "name": "get_weather", "input": {}}
                                             for i in ids]}


@pytest.mark.parametrize(("messages", "param", "words"), [
    ([_ASK, _USE, {"role": "user", "content": "And?"}], "messages[2].content",
     "`tool_use` ids were found without `tool_result` blocks immediately after: toolu_1"),
    ([_ASK, _USE, {"role": "user", "content": [{"type": "text", "text": "And?"}]}], "messages[2].content",
     "without `tool_result` blocks immediately after"),
    ([_ASK, {"role": "assistant", "content": "Hm."}, _result("toolu_1")], "messages[2].content[0].tool_use_id",
     "unexpected `tool_use_id` found in `tool_result` blocks: toolu_1"),
    ([_ASK, _USE, _result("toolu_9")], "messages[2].content[0].tool_use_id", "unexpected `tool_use_id`"),
    ([_ASK, _USE, {"role": "user", "content": [{"type": "text", "text": "Here:"}, *_result("toolu_1")["content"]]}],
     "messages[2].content[0]", "Did not find 1 `tool_result` block(s) at the beginning of this message"),
    ([_ASK, _use("toolu_1", "toolu_1"), _result("toolu_1")], "messages[1].content[1].id",
     "messages.1.content.1: `tool_use` ids must be unique"),
    ([_ASK, _USE, _result("toolu_1"), _use("toolu_1"), _result("toolu_1")], "messages[3].content[0].id",
     "`tool_use` ids must be unique"),
    ([_ASK, _use("functions.get_weather:0"), _result("functions.get_weather:0")], "messages[1].content[0].id",
     "messages.1.content.0.tool_use.id: String should match pattern '^[a-zA-Z0-9_-]+$'"),
    ([_ASK, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather"}]},
      _result("toolu_1")], "messages[1].content[0].input", "messages.1.content.0.tool_use.input: Field required"),
])
def test_tool_traffic_anthropic_s_api_refuses_is_refused_not_answered(client, messages, param, words):
    """A tool_use without its tool_result right after it, or a tool_result for no tool_use of the message before, is
    a 400 on Anthropic's API; the embedded model answered it, so code that worked against it failed on Anthropic. So
    were a text block written before the tool_result blocks (the next message must begin with them), two tool_use
    blocks with one id, a tool_use without its `input`, and an id outside Anthropic's pattern (as models behind
    OpenAI-compatible servers write them): the embedded model answered these too, and count_tokens counted them."""
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="family-b-sonnet-4-6", max_tokens=4, messages=messages, tools=_TOOLS)
    assert caught.value.body["error"]["param"] == param and words in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.count_tokens(model="family-b-sonnet-4-6", messages=messages, tools=_TOOLS)
    assert caught.value.body["error"]["param"] == param


def test_tool_traffic_in_pairs_is_answered(client):
    messages = [_ASK, _USE, _result("toolu_1")]
    assert client.messages.create(model="family-b-sonnet-4-6", max_tokens=4, messages=messages, tools=_TOOLS).content
    # Text after the results, and two calls answered in another order, are what Anthropic's API takes.
    results = [*_result("toolu_b")["content"], *_result("toolu_a")["content"], {"type": "text", "text": "And?"}]
    messages = [_ASK, _use("toolu_a", "toolu_b"), {"role": "user", "content": results}]
    assert client.messages.create(model="family-b-sonnet-4-6", max_tokens=4, messages=messages, tools=_TOOLS).content


@pytest.mark.parametrize(("messages", "param", "words"), [
    ([{"role": "user", "content": ""}], "messages[0].content", "all messages must have non-empty content"),
    ([{"role": "user", "content": []}], "messages[0].content", "all messages must have non-empty content"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": ""}],
     "messages[2].content", "except for the optional final assistant message"),
    ([{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": ""}]}],
     "messages[0].content[1].text", "text content blocks must be non-empty"),
    ([{"role": "user", "content": " \n"}], "messages[0].content",
     "messages: text content blocks must contain non-whitespace text"),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": [{"type": "text", "text": "\n"}]},
      {"role": "user", "content": "Hi?"}], "messages[1].content", "must contain non-whitespace text"),
])
def test_an_empty_message_anthropic_s_api_refuses_is_refused_not_answered(client, messages, param, words):
    """Anthropic's API refuses an empty message (but a last assistant one) and an empty text block; the embedded
    model answered them, so a chat UI's empty turn worked here and failed on Anthropic."""
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="family-b-sonnet-4-6", max_tokens=4, messages=messages)
    assert caught.value.body["error"]["param"] == param and words in caught.value.body["error"]["message"]


def test_an_empty_system_block_anthropic_s_api_refuses_is_refused_not_answered(client):
    """Anthropic's API refuses `system` holding an empty text block (an app whose system prompt has an empty slot);
    the embedded model answered it, and count_tokens counted it. An empty string is no system prompt, and is taken."""
    hi = [{"role": "user", "content": "Hi"}]
    system = [{"type": "text", "text": "Be brief."},
              {"type": "text", "text": "", "cache_control": {"type": "ephemeral"}}]
    for call in (lambda: client.messages.create(model="family-b-sonnet-4-6", max_tokens=4, system=system, messages=hi),
                 lambda: client.messages.count_tokens(model="family-b-sonnet-4-6", system=system, messages=hi)):
        with pytest.raises(anthropic.BadRequestError) as caught:
            call()
        assert caught.value.body["error"]["param"] == "system[1].text"
        assert caught.value.body["error"]["message"] == "system: text content blocks must be non-empty"
    assert client.messages.create(model="family-b-sonnet-4-6", max_tokens=4, system="", messages=hi).content


@pytest.mark.parametrize("stop", [["\n"], ["END", " \t"]])
def test_a_whitespace_stop_sequence_anthropic_s_api_refuses_is_refused_not_answered(client, stop):
    """Anthropic's API refuses a stop sequence of whitespace only (`"\n"`, to stop at a line's end); the embedded
    model stopped at it, so code that worked here failed once the model was served by Anthropic."""
    hi = [{"role": "user", "content": "Hi"}]
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model="family-b-sonnet-4-6", max_tokens=4, messages=hi, stop_sequences=stop)
    assert caught.value.body["error"]["param"] == f"stop_sequences[{len(stop) - 1}]"
    assert "each stop sequence must contain non-whitespace" in caught.value.body["error"]["message"]
    assert client.messages.create(model="family-b-sonnet-4-6", max_tokens=4, messages=hi, stop_sequences=[" END\n"])


def test_an_empty_last_assistant_message_is_no_prefill_and_is_answered(client):
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": ""}]
    assert client.messages.create(model="family-b-sonnet-4-6", max_tokens=4, messages=messages).content
    # A whitespace block beside one with text is what Anthropic's API takes.
    messages = [{"role": "user", "content": [{"type": "text", "text": "Hi"}, {"type": "text", "text": "\n"}]}]
    assert client.messages.create(model="family-b-sonnet-4-6", max_tokens=4, messages=messages).content
