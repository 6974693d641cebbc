"""The usage and costs API through Envoy, as a dashboard script calls OpenAI's: query parameters (repeated and
comma-separated group_by), OpenAI's JSON shape, and the error object for bad parameters."""

from __future__ import annotations

import time

import httpx

HI = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


def test_usage_and_costs_over_rest(gateway):
    created = gateway.cli("keys", "create", "--name", "usage-rest", "--all-models", "--env", "analytics").stdout
    key_id, secret = created.split()[2], created.split()[-1]
    admin = gateway.cli("keys", "create", "--name", "usage-admin", "--all-models", "--admin").stdout.split()[-1]
    start = int(time.time())
    for _ in range(2):
        answer = httpx.post(f"{gateway.base_url}/v1/chat/completions", json=HI,
                            headers={"Authorization": f"Bearer {secret}"}, timeout=60)
        assert answer.status_code == 200, answer.text
    usage = answer.json()["usage"]
    time.sleep(1.5)  # the ledger is written every second

    url = f"{gateway.base_url}/v1/organization/usage/completions"
    params = [("start_time", start), ("bucket_width", "1d"), ("group_by", "model"), ("group_by", "project_id"),
              ("api_key_ids", key_id)]
    page = httpx.get(url, params=params, headers={"Authorization": f"Bearer {admin}"}, timeout=30)
    assert page.status_code == 200, page.text
    assert page.headers["content-type"] == "application/json"
    body = page.json()
    assert body["object"] == "page" and body["has_more"] is False and body["next_page"] is None
    [bucket] = body["data"]
    assert bucket["start_time"] == start - start % 86_400 and bucket["end_time"] == bucket["start_time"] + 86_400
    [result] = bucket["results"]
    assert result["object"] == "organization.usage.completions.result"
    assert (result["model"], result["project_id"], result["api_key_id"]) == ("family-a-5.5", "analytics", None)
    assert result["num_model_requests"] == 2
    assert result["input_tokens"] == 2 * usage["prompt_tokens"]
    assert result["output_tokens"] == 2 * usage["completion_tokens"]

    same = httpx.get(url, params={"start_time": start, "group_by": "model,project_id"},
                     headers={"Authorization": f"Bearer {secret}"}, timeout=30).json()
    assert same["data"][0]["results"] == [result]  # the key's own usage, comma-separated group_by

    costs = httpx.get(f"{gateway.base_url}/v1/organization/costs", params={"start_time": start},
                      headers={"Authorization": f"Bearer {secret}"}, timeout=30)
    assert costs.status_code == 200, costs.text
    assert costs.json()["data"][0]["results"][0]["amount"] == {"value": 0, "currency": "usd"}  # no prices set

    bad = httpx.get(url, params={"start_time": start, "bucket_width": "1w"},
                    headers={"Authorization": f"Bearer {secret}"}, timeout=30)
    assert bad.status_code == 400
    assert bad.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                       "param": "bucket_width", "code": "invalid_request"}
    assert httpx.get(url, params={"start_time": start}, timeout=30).status_code == 401


def test_a_parameter_of_the_wrong_type_is_named_in_the_callers_terms(gateway):
    """Envoy's transcoder refuses these before the server sees them; its wording (TYPE_INT64) is not the caller's."""
    headers = {"Authorization": f"Bearer {gateway.secret}"}
    for path, params, param, expected in (
        ("/v1/organization/usage/completions", {"start_time": "abc"}, "start_time", '"abc"'),
        ("/v1/organization/costs", {"start_time": "1", "limit": "many"}, "limit", '"many"'),
        ("/v1/organization/requests", {"end_time": "1.5"}, "end_time", '"1.5"'),
    ):
        answer = httpx.get(f"{gateway.base_url}{path}", params=params, headers=headers, timeout=30)
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"] == {
            "message": f"Invalid value {expected} for {param}: expected an integer.", "type": "invalid_request_error",
            "param": param, "code": "invalid_request"}
