"""How the gateway reads `Authorization` (api.md): the scheme in any case, one or more spaces, then the key (RFC 9110's
`auth-scheme 1*SP token68`); a tab there is a malformed header, and is said to be, not taken for a wrong key."""

from __future__ import annotations

import httpx
import pytest


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
