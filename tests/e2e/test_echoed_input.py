"""What a caller sent comes back in error messages (a field's name, a query value): however long, or however broken
its UTF-8, the answer is still the documented 400 error object, never a 5xx, and the body is valid JSON."""

from __future__ import annotations

import json
import re

import httpx
import pytest

from tests.e2e.conftest import Gateway

LONG = "k" * 40_000  # a member name this long once made the server's gRPC trailers too big for Envoy: a 502


@pytest.fixture(scope="module")
def admin_secret(gateway: Gateway) -> str:
    created = gateway.cli("keys", "create", "--name", "echo-admin", "--all-models", "--admin")
    return re.search(r"\b(pk-\S+)", created.stdout).group(1)


@pytest.mark.parametrize("path, body, admin", [
    ("/v1/chat/completions", {"model": "family-a-5.5", "messages": [{"role": "user", "content": "hi"}]}, False),
    ("/v1/images/generations", {"model": "family-a-image-2", "prompt": "a cat"}, False),
    ("/v1/admin/keys", {"name": "k", "all_models": True}, True),
])
def test_a_huge_unknown_member_is_a_400_not_a_5xx(gateway: Gateway, admin_secret: str, path, body, admin):
    secret = admin_secret if admin else gateway.secret
    answer = httpx.post(f"{gateway.base_url}{path}", headers={"authorization": f"Bearer {secret}"},
                        json={**body, LONG: 1}, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["code"] == "invalid_request"
    assert len(error["message"]) < 5_000  # the name is cut short, not echoed whole


@pytest.mark.parametrize("path, body", [
    ("/v1/images/generations", {"model": "family-a-image-2", "prompt": "a cat"}),
    ("/v1/chat/completions", {"model": "family-a-5.5", "messages": [{"role": "user", "content": "hi"}]}),
])
def test_a_member_named_like_a_key_is_not_echoed_in_param(gateway: Gateway, path, body):
    """A key pasted where a member's name belongs: the error names the member without it, in `param` too."""
    pasted = "pk-" + "x7" * 20
    answer = httpx.post(f"{gateway.base_url}{path}", headers={"authorization": f"Bearer {gateway.secret}"},
                        json={**body, pasted: 1}, timeout=30)
    assert answer.status_code == 400, answer.text
    assert pasted not in answer.text
    assert answer.json()["error"]["param"] == "pk-[redacted]"


def test_a_query_parameter_named_like_a_key_is_not_echoed(gateway: Gateway):
    pasted = "pk-" + "x7" * 20
    answer = httpx.get(f"{gateway.base_url}/v1/organization/costs?start_time=1&{pasted}=1",
                       headers={"authorization": f"Bearer {gateway.secret}"}, timeout=30)
    assert answer.status_code == 400, answer.text
    assert pasted not in answer.text
    error = answer.json()["error"]
    assert error["param"] == "pk-[redacted]" and error["message"].startswith("Unknown parameter pk-[redacted] for GET")


@pytest.mark.parametrize("query", ["start_time=%E0%A4%A", "start_time=%ff", "start_time=%ED%A0%80x"])
def test_a_query_value_that_is_not_utf8_gets_a_valid_json_error(gateway: Gateway, query: str):
    answer = httpx.get(f"{gateway.base_url}/v1/organization/costs?{query}",
                       headers={"authorization": f"Bearer {gateway.secret}"}, timeout=30)
    assert answer.status_code == 400
    error = json.loads(answer.content.decode("utf-8"))["error"]  # strict: invalid UTF-8 raises
    assert (error["code"], error["param"]) == ("invalid_request", "start_time")
    assert "\ufffd" in error["message"]


@pytest.mark.parametrize("path", ["/v1/organization/costs?start_time={}", "/v1/organization/requests?errors_only={}"])
def test_a_query_value_shaped_like_a_key_is_not_echoed(gateway: Gateway, path: str):
    """A key pasted as a parameter's value: the 400 names the parameter without quoting the key."""
    pasted = "pk-" + "x7" * 20
    answer = httpx.get(gateway.base_url + path.format(pasted), headers={"authorization": f"Bearer {gateway.secret}"},
                       timeout=30)
    assert answer.status_code == 400, answer.text
    assert pasted[:10] not in answer.text
    assert "pk-[redacted]" in answer.json()["error"]["message"]


def test_a_huge_query_value_is_cut_short_in_the_message(gateway: Gateway):
    answer = httpx.get(f"{gateway.base_url}/v1/organization/costs?start_time={'9' * 40_000}",
                       headers={"authorization": f"Bearer {gateway.secret}"}, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "start_time" and len(error["message"]) < 1_000


def test_a_content_encoding_shaped_like_a_key_is_not_echoed(gateway: Gateway):
    pasted = "pk-" + "x7" * 20
    answer = httpx.post(f"{gateway.base_url}/v1/chat/completions", content=b"{}",
                        headers={"authorization": f"Bearer {gateway.secret}", "content-encoding": pasted}, timeout=30)
    assert answer.status_code == 400, answer.text
    assert pasted[:10] not in answer.text and "Compressed request bodies" in answer.json()["error"]["message"]


def test_a_huge_unknown_query_parameter_is_cut_short_in_message_and_param(gateway: Gateway):
    answer = httpx.get(f"{gateway.base_url}/v1/organization/costs?start_time=1&{'q' * 40_000}=1",
                       headers={"authorization": f"Bearer {gateway.secret}"}, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["message"].startswith("Unknown parameter qqq") and len(error["message"]) < 1_000
    assert len(error["param"]) <= 200


@pytest.mark.parametrize("query", ["%00=1", "a%00b=1"])
def test_an_unknown_query_parameter_holding_a_nul_is_named_as_written(gateway: Gateway, query):
    """A name holding a NUL (`%00`) cut the message at it, "Unknown parameter " and nothing more, and `param` was ""
    or the part before it (Envoy carries both as C text)."""
    answer = httpx.get(f"{gateway.base_url}/v1/organization/requests?{query}",
                       headers={"authorization": f"Bearer {gateway.secret}"}, timeout=30)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    named = query.removesuffix("=1")
    assert error["param"] == named
    assert error["message"] == (f"Unknown parameter {named} for GET /v1/organization/requests: it takes api_key_ids, "
                                "end_time, errors_only, limit, models, page, project_ids, start_time.")
