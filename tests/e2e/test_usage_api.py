"""The usage and costs API through Envoy, as a dashboard script calls OpenAI's: query parameters (repeated and
comma-separated group_by), OpenAI's JSON shape, and the error object for bad parameters."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import openai
import pytest

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


@pytest.mark.parametrize(("path", "extra", "message"), [
    ("/v1/organization/usage/completions", {}, "limit must be between 1 and 31 for bucket_width 1d."),
    ("/v1/organization/usage/completions", {"bucket_width": "1m"},
     "limit must be between 1 and 1440 for bucket_width 1m."),
    ("/v1/organization/usage/completions", {"bucket_width": "all"},
     "limit must be 1 for bucket_width all (one bucket)."),
    ("/v1/organization/costs", {"bucket_width": "1h"}, "limit must be between 1 and 180 for bucket_width 1h."),
    ("/v1/organization/requests", {}, "limit must be between 1 and 1000."),
])
@pytest.mark.parametrize("limit", ["0", "2147483647", "2147483648", "-2147483649", "1" + "0" * 30])
def test_every_limit_out_of_range_gets_the_documented_range(gateway, path, extra, message, limit):
    """api.md, Usage and costs: each `limit` has its range. One beyond protobuf's int32 (2147483648) was refused in
    protobuf's terms, "expected an integer from -2147483648 to 2147483647", where 0 got the range: now all get it."""
    answer = httpx.get(f"{gateway.base_url}{path}", params={"start_time": 1, "limit": limit} | extra,
                       headers={"Authorization": f"Bearer {gateway.secret}"}, timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == {"message": message, "type": "invalid_request_error", "param": "limit",
                                      "code": "invalid_request"}


@pytest.mark.parametrize("path", ["/v1/organization/usage/completions", "/v1/organization/costs",
                                  "/v1/organization/requests"])
@pytest.mark.parametrize(("param", "value"), [("start_time", "-1"), ("start_time", "9223372036854775808"),
                                              ("end_time", "253402300801"), ("end_time", "1" + "0" * 30)])
def test_every_time_out_of_range_gets_the_documented_range(gateway, path, param, value):
    """api.md, Usage and costs: times are unix seconds from 0 to the year 10000. One beyond protobuf's int64
    (9223372036854775808) was refused in protobuf's terms, where -1 got the range: now all get it."""
    params = {"start_time": 1} | {param: value}
    answer = httpx.get(f"{gateway.base_url}{path}", params=params,
                       headers={"Authorization": f"Bearer {gateway.secret}"}, timeout=30)
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"] == {
        "message": f"{param} must be a unix time in seconds, from 0 to 253402300800 (the year 10000).",
        "type": "invalid_request_error", "param": param, "code": "invalid_request"}


def _usage_on_two_models(gateway, name: str) -> tuple[str, int]:
    """A key of env `sdk` that made one request on each of two models: its id, and a start time before them."""
    created = gateway.cli("keys", "create", "--name", name, "--all-models", "--env", "sdk").stdout
    key_id, secret = created.split()[2], created.split()[-1]
    start = int(time.time())
    for model in ("family-a-5.5", "family-a-5.4"):
        answer = httpx.post(f"{gateway.base_url}/v1/chat/completions", json=HI | {"model": model},
                            headers={"Authorization": f"Bearer {secret}"}, timeout=60)
        assert answer.status_code == 200, answer.text
    time.sleep(1.5)  # the ledger is written every second
    return key_id, start


def _admin_key(gateway, name: str) -> str:
    return gateway.cli("keys", "create", "--name", name, "--all-models", "--admin").stdout.split()[-1]


def test_the_openai_sdks_usage_and_costs_calls_group_and_filter(gateway):
    """The SDK writes lists as `group_by[]=model` (brackets, %-encoded): they group and filter like `group_by=model`."""
    key_id, start = _usage_on_two_models(gateway, "usage-sdk")
    _usage_on_two_models(gateway, "usage-sdk-other")  # usage the filters must leave out
    admin_secret = _admin_key(gateway, "usage-sdk-admin")
    client = openai.OpenAI(base_url=f"{gateway.base_url}/v1", api_key="unused", admin_api_key=admin_secret,
                           max_retries=0)
    usage = client.admin.organization.usage

    page = usage.completions(start_time=start, group_by=["model", "project_id"], api_key_ids=[key_id])
    [bucket] = page.data
    results = sorted(bucket.results, key=lambda r: r.model)
    assert [(r.model, r.project_id, r.num_model_requests) for r in results] == [
        ("family-a-5.4", "sdk", 1), ("family-a-5.5", "sdk", 1)]

    costs = usage.costs(start_time=start, group_by=["line_item"], api_key_ids=[key_id],
                        extra_query={"models": ["family-a-5.4"]})
    [bucket] = costs.data
    assert [(r.line_item, r.amount.value) for r in bucket.results] == [("family-a-5.4", 0)]

    # What Portico cannot honour is refused, naming it, never answered as if it had been applied.
    for call, param in ((lambda: usage.costs(start_time=start, line_items=["family-a-5.4"]), "line_items"),
                        (lambda: usage.costs(start_time=start, group_by=["api_source"]), "group_by"),
                        (lambda: usage.completions(start_time=start, group_by=["service_tier"]), "group_by")):
        with pytest.raises(openai.BadRequestError) as refused:
            call()
        assert refused.value.status_code == 400 and refused.value.body["param"] == param


@pytest.mark.parametrize("path", ["/v1/organization/usage/completions", "/v1/organization/costs",
                                  "/v1/organization/requests"])
def test_an_unknown_query_parameter_is_refused_naming_it(gateway, path):
    headers = {"Authorization": f"Bearer {gateway.secret}"}
    for query, param, fault in (("bogus=1", "bogus", "Unknown parameter bogus"),
                                ("models%5B%5D=a&Bogus%5B%5D=1", "Bogus", "Unknown parameter Bogus"),
                                ("=1", "", "Unknown parameter "),
                                ("end_time[]=2", "end_time", "Parameter end_time takes one value, not a list,"),
                                ("start_time=2", "start_time", "Parameter start_time takes one value, not a list,")):
        answer = httpx.get(f"{gateway.base_url}{path}?start_time=1&{query}", headers=headers, timeout=30)
        assert answer.status_code == 400, answer.text
        error = answer.json()["error"]
        assert (error["param"], error["code"], error["type"]) == (param, "invalid_request", "invalid_request_error")
        assert error["message"].startswith(f"{fault} for GET {path}: it takes ")
        assert "start_time" in error["message"]


def test_list_parameters_with_brackets_filter_the_requests_list(gateway):
    key_id, start = _usage_on_two_models(gateway, "usage-brackets")
    admin_secret = _admin_key(gateway, "usage-brackets-admin")
    for query in (f"api_key_ids[]={key_id}&models[]=family-a-5.4",
                  f"api_key_ids%5B%5D={key_id}&models%5b%5d=family-a-5.4"):
        answer = httpx.get(f"{gateway.base_url}/v1/organization/requests?start_time={start}&{query}",
                           headers={"Authorization": f"Bearer {admin_secret}"}, timeout=30)
        assert answer.status_code == 200, answer.text
        assert [(r["api_key_id"], r["model"]) for r in answer.json()["data"]] == [(key_id, "family-a-5.4")]


def test_rows_served_in_the_gateway_name_their_deployment(gateway):
    """A plain `provider:` is one deployment named after its kind (api.md): the embedded model's and dev-image's rows
    said `"deployment": null`, as if no deployment had served them."""
    created = gateway.cli("keys", "create", "--name", "usage-deployment", "--all-models").stdout
    key_id, secret = created.split()[2], created.split()[-1]
    headers = {"Authorization": f"Bearer {secret}"}
    start = int(time.time())
    assert httpx.post(f"{gateway.base_url}/v1/chat/completions", json=HI, headers=headers, timeout=60).is_success
    assert httpx.post(f"{gateway.base_url}/v1/images/generations", headers=headers, timeout=60,
                      json={"model": "family-a-image-2", "prompt": "a lighthouse", "size": "256x256"}).is_success
    time.sleep(1.5)  # the ledger is written every second
    rows = httpx.get(f"{gateway.base_url}/v1/organization/requests", params={"start_time": start},
                     headers=headers, timeout=30).json()["data"]
    assert [(r["api_key_id"], r["model"], r["deployment"]) for r in rows] == [
        (key_id, "family-a-image-2", "dev-image"), (key_id, "family-a-5.5", "llamacpp")]


def test_a_plus_in_the_query_is_a_space_as_form_encoding_writes_it(gateway):
    """Python's `requests` (urlencode) writes `group_by="model, project_id"` as `model%2C+project_id`: the `+` stayed a
    plus, so the group `+project_id` was refused as unknown."""
    key_id, start = _usage_on_two_models(gateway, "usage-plus")
    answer = httpx.get(f"{gateway.base_url}/v1/organization/usage/completions?start_time={start}"
                       f"&group_by=model%2C+project_id&api_key_ids={key_id}",
                       headers={"Authorization": f"Bearer {_admin_key(gateway, 'usage-plus-admin')}"}, timeout=30)
    assert answer.status_code == 200, answer.text
    results = answer.json()["data"][0]["results"]
    assert sorted((r["model"], r["project_id"]) for r in results) == [("family-a-5.4", "sdk"), ("family-a-5.5", "sdk")]


def test_a_comma_separated_filter_filters_as_its_values_repeated(gateway):
    """`group_by=model,project_id` groups by both, but `models=family-a-5.5,family-a-5.4` matched no model (no id
    holds a comma) and answered an empty page, as if nothing had been used: a dashboard read it as no spend."""
    key_id, start = _usage_on_two_models(gateway, "usage-comma")
    other_id, _ = _usage_on_two_models(gateway, "usage-comma-other")
    headers = {"Authorization": f"Bearer {_admin_key(gateway, 'usage-comma-admin')}"}
    for path, field in (("/v1/organization/usage/completions", "model"), ("/v1/organization/costs", "line_item")):
        group = "model,api_key_id" if field == "model" else "line_item,api_key_id"
        answer = httpx.get(f"{gateway.base_url}{path}?start_time={start}&group_by={group}"
                           f"&models=family-a-5.5,family-a-5.4&api_key_ids={key_id},{other_id}&project_ids=sdk,x",
                           headers=headers, timeout=30)
        assert answer.status_code == 200, answer.text
        results = answer.json()["data"][0]["results"]
        assert sorted((r[field], r["api_key_id"]) for r in results) == sorted(
            (model, key) for model in ("family-a-5.4", "family-a-5.5") for key in (key_id, other_id))
    rows = httpx.get(f"{gateway.base_url}/v1/organization/requests?start_time={start}"
                     f"&models=family-a-5.4,no-such-model&api_key_ids={key_id},{other_id}", headers=headers,
                     timeout=30).json()["data"]
    assert sorted(r["api_key_id"] for r in rows) == sorted([key_id, other_id])


def test_a_key_asking_for_its_own_usage_with_an_empty_filter_value_is_not_refused(gateway):
    """`api_key_ids=key_x,` (a list joined with a trailing comma, or an empty value beside the key's own id) asks for
    no other key's usage: an empty value matches no key. A key that is not an admin got a 403 saying it "can only
    read its own usage", which is all it had asked for."""
    created = gateway.cli("keys", "create", "--name", "usage-own-comma", "--all-models", "--env", "sdk").stdout
    key_id, secret = created.split()[2], created.split()[-1]
    start = int(time.time())
    answer = httpx.post(f"{gateway.base_url}/v1/chat/completions", json=HI,
                        headers={"Authorization": f"Bearer {secret}"}, timeout=60)
    assert answer.status_code == 200, answer.text
    time.sleep(1.5)  # the ledger is written every second
    headers = {"Authorization": f"Bearer {secret}"}
    for filters in (f"api_key_ids={key_id},", f"api_key_ids={key_id}&api_key_ids=", f"api_key_ids=,{key_id}"):
        page = httpx.get(f"{gateway.base_url}/v1/organization/usage/completions?start_time={start}&{filters}",
                         headers=headers, timeout=30)
        assert page.status_code == 200, (filters, page.text)
        assert [r["num_requests"] for r in page.json()["data"][0]["results"]] == [1], filters
        rows = httpx.get(f"{gateway.base_url}/v1/organization/requests?start_time={start}&{filters}",
                         headers=headers, timeout=30)
        assert rows.status_code == 200, (filters, rows.text)
        assert [r["api_key_id"] for r in rows.json()["data"]] == [key_id], filters
    # An empty value alone names no key: nothing, as for an admin key (not every key's usage, nor a 403).
    page = httpx.get(f"{gateway.base_url}/v1/organization/usage/completions?start_time={start}&api_key_ids=",
                     headers=headers, timeout=30)
    assert page.status_code == 200 and page.json()["data"][0]["results"] == [], page.text
    # Another key's id is still refused.
    other = httpx.get(f"{gateway.base_url}/v1/organization/usage/completions?start_time={start}"
                      f"&api_key_ids={key_id},key_0000000000000000", headers=headers, timeout=30)
    assert other.status_code == 403 and other.json()["error"]["param"] == "api_key_ids", other.text


@pytest.mark.parametrize("path", ["/v1/organization/usage/completions", "/v1/organization/costs",
                                  "/v1/organization/requests"])
def test_a_secret_where_a_key_id_goes_is_refused_not_answered_with_no_usage(gateway, path):
    """An operator looking into a leaked secret asked `api_key_ids=pk-...` (or `portico usage --key pk-...`): an
    admin key got an empty answer, which read as "this key was never used", though it had been; another key a 403.
    Now a 400 naming api_key_ids and saying a key id goes there, never quoting the secret."""
    created = gateway.cli("keys", "create", "--name", "leak-hunt", "--all-models").stdout
    secret = created.split()[-1]
    admin = gateway.cli("keys", "create", "--name", "leak-admin", "--all-models", "--admin").stdout.split()[-1]
    for caller in (admin, secret):
        answer = httpx.get(f"{gateway.base_url}{path}", params={"start_time": 1, "api_key_ids": secret},
                           headers={"Authorization": f"Bearer {caller}"}, timeout=30)
        error = answer.json()["error"]
        assert (answer.status_code, error["param"]) == (400, "api_key_ids"), answer.text
        assert error["message"] == "api_key_ids takes key ids (key_...), not a key's secret (pk-...)."
        assert secret[5:] not in answer.text
    done = subprocess.run([sys.executable, "-m", "server.cli", "--data-dir", str(gateway.data_dir), "usage",
                           "--key", secret], capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stderr) == (2, "portico: --key takes key ids (key_...), not a key's secret "
                                                 "(pk-...).\n")
