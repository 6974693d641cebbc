"""Key updates and rotation on a running gateway: through the CLI and through REST (/v1/admin/keys)."""

from __future__ import annotations

import struct
import subprocess
import time

import grpc
import httpx
import pytest

from portico.v1 import key_pb2, key_service_pb2_grpc, limit_pb2, limit_service_pb2_grpc
from tests.helpers import bearer, error_details

HI = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


def chat(gateway, secret: str) -> httpx.Response:
    return httpx.post(f"{gateway.base_url}/v1/chat/completions", json=HI, headers={"Authorization": f"Bearer {secret}"}, timeout=60)


def test_cli_update_and_rotate_on_a_running_server(gateway):
    created = gateway.cli("keys", "create", "--name", "cli-managed", "--all-models").stdout
    key_id, old = created.split()[2], created.split()[-1]
    updated = gateway.cli("keys", "update", key_id, "--rpm", "7", "--daily-requests", "100").stdout
    assert "requests_per_minute=7" in updated and "daily_requests=100" in updated
    time.sleep(1.1)  # keys.cache_seconds
    assert chat(gateway, old).headers["x-ratelimit-limit-requests"] == "7"
    rotated = gateway.cli("keys", "rotate", key_id, "--grace", "0").stdout
    new = rotated.split()[-1]
    assert new.startswith("pk-") and new != old and old not in rotated
    time.sleep(1.1)
    assert chat(gateway, old).status_code == 401
    assert chat(gateway, new).status_code == 200


def test_rest_update_and_rotate_with_an_admin_key(gateway):
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    headers = {"Authorization": f"Bearer {admin}"}
    created = gateway.cli("keys", "create", "--name", "rest-managed", "--all-models").stdout
    key_id, old = created.split()[2], created.split()[-1]
    patched = httpx.patch(f"{gateway.base_url}/v1/admin/keys/{key_id}", headers=headers,
                          json={"limits": {"concurrent_requests": 3}, "models": ["family-a-5.4"]})
    assert patched.status_code == 200, patched.text
    key = patched.json()["key"]
    assert key == {"id": key_id, "name": "rest-managed", "all_models": False, "models": ["family-a-5.4"],
                   "limits": {"concurrent_requests": 3}, "env": "", "admin": False, "created": key["created"],
                   "revoked_at": 0}
    patched = httpx.patch(f"{gateway.base_url}/v1/admin/keys/{key_id}", headers=headers,
                          json={"name": None, "limits": {"concurrent_requests": 0}, "all_models": True})
    assert patched.json() == {"key": {**key, "all_models": True, "models": [], "limits": {}}}
    for limit, value in (("requests_per_minute", -1), ("max_spend_day", -1.5)):
        refused = httpx.patch(f"{gateway.base_url}/v1/admin/keys/{key_id}", headers=headers,
                              json={"limits": {limit: value}})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == f"limits.{limit}", refused.text
    rotated = httpx.post(f"{gateway.base_url}/v1/admin/keys/{key_id}/rotate", headers=headers,
                         json={"grace_seconds": 600}, timeout=60)
    assert rotated.status_code == 200, rotated.text
    body = rotated.json()
    assert body["secret"].startswith("pk-") and body["previous_secret_expires"] > time.time() + 590
    refused = httpx.post(f"{gateway.base_url}/v1/admin/keys/{key_id}/rotate",
                         headers={"Authorization": f"Bearer {old}"}, json={}, timeout=60)
    assert refused.status_code == 403 and refused.json()["error"]["code"] == "permission_denied"


def test_rest_update_with_an_empty_models_list_is_refused_not_ignored(gateway):
    """`"models": []` in a PATCH body asks for a key that may call no model: it was answered 200 with the grants
    unchanged, so the caller believed the key shut off while it went on calling its model. Refused as a key made with
    no grants is (`all_models: false` alone, as a typed call says it); leaving `models` out keeps the grants."""
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    created = gateway.cli("keys", "create", "--name", "to-be-shut", "--model", "family-a-5.5").stdout
    key_id = created.split()[2]
    url = f"{gateway.base_url}/v1/admin/keys/{key_id}"
    for body in ({"models": []}, {"models": [], "name": "renamed"}, {"all_models": False}):
        refused = httpx.patch(url, headers=bearer(admin), json=body)
        assert refused.status_code == 400, refused.text
        assert refused.json()["error"]["param"] == "models"
    kept = httpx.patch(url, headers=bearer(admin), json={"name": "renamed"})
    assert (kept.json()["key"]["name"], kept.json()["key"]["models"]) == ("renamed", ["family-a-5.5"])


def test_a_rotated_out_secret_is_refused_from_the_second_its_grace_ends(gateway):
    """It kept working for up to keys.cache_seconds past previous_secret_expires when the gateway had looked it up
    within that time before (and for up to 5 minutes while the key store did not answer)."""
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    created = gateway.cli("keys", "create", "--name", "rotated-soon", "--all-models").stdout
    key_id, old = created.split()[2], created.split()[-1]
    rotated = httpx.post(f"{gateway.base_url}/v1/admin/keys/{key_id}/rotate", json={"grace_seconds": 2},
                         headers={"Authorization": f"Bearer {admin}"}, timeout=60).json()
    ends = rotated["previous_secret_expires"]
    time.sleep(max(0.0, ends - 0.4 - time.time()))
    assert chat(gateway, old).status_code == 200  # looked up (and cached) in the last moments of its grace
    time.sleep(max(0.0, ends - time.time()))
    refused = chat(gateway, old)
    assert refused.status_code == 401, refused.text
    assert refused.json()["error"]["message"] == "Incorrect API key provided."
    assert chat(gateway, rotated["secret"]).status_code == 200


def test_rest_refuses_bad_env_name_and_out_of_range_limits_with_400(gateway):
    """Each was a 500 (a limit beyond 64 bits, NUL on PostgreSQL) or a secret no SDK could send (a non-ASCII env)."""
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    headers = {"Authorization": f"Bearer {admin}"}
    key_id = httpx.post(f"{gateway.base_url}/v1/admin/keys", headers=headers, timeout=60,
                        json={"name": "fine", "all_models": True, "env": "prod-eu_2"}).json()["key"]["id"]
    for fields, param in [({"limits": {"max_spend_day": 1e20}}, "limits.max_spend_day"),
                          ({"limits": {"daily_requests": -3}}, "limits.daily_requests"),
                          ({"env": "東京"}, "env"), ({"env": "my prod"}, "env"), ({"name": "a\u0000b"}, "name")]:
        created = httpx.post(f"{gateway.base_url}/v1/admin/keys", headers=headers, timeout=60,
                             json={"name": "x", "all_models": True, **fields})
        patched = httpx.patch(f"{gateway.base_url}/v1/admin/keys/{key_id}", headers=headers, json=fields, timeout=60)
        for refused in (created, patched):
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == param and refused.json()["error"]["code"] == "invalid_request"


def refusal(response: httpx.Response) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_request" and error["type"] == "invalid_request_error"
    return error


def test_rest_refuses_unknown_fields_at_any_level_naming_their_path(gateway):
    """The transcoder dropped them: a misspelt limit answered 200 with `"limits": {}`, the key had no limit of its own
    and its creator never learnt of the typo."""
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    headers = {"Authorization": f"Bearer {admin}"}
    keys_url = f"{gateway.base_url}/v1/admin/keys"
    typo = {"name": "typo", "all_models": True, "limits": {"request_per_minute": 2, "tokens_per_min": 50}}
    error = refusal(httpx.post(keys_url, headers=headers, json=typo, timeout=60))
    assert error["param"] == "limits.request_per_minute"
    assert "requests_per_minute" in error["message"] and "max_spend_month" in error["message"]
    error = refusal(httpx.post(keys_url, headers=headers, json={"name": "typo", "all_models": True, "limitz": {}}))
    assert error["param"] == "limitz" and "limits" in error["message"]
    assert "typo" not in [key["name"] for key in httpx.get(keys_url, headers=headers).json()["keys"]]

    created = httpx.post(keys_url, headers=headers, timeout=60,
                         json={"name": "patched", "all_models": True, "limits": {"requests_per_minute": 9}}).json()
    key_url = f"{keys_url}/{created['key']['id']}"
    for body, param in [({"limits": {"bogus_limit": 3}}, "limits.bogus_limit"), ({"limitz": {}}, "limitz"),
                        ({"name": "x", "id": "key_other"}, "id")]:
        assert refusal(httpx.patch(key_url, headers=headers, json=body, timeout=60))["param"] == param
    assert httpx.get(key_url, headers=headers).json()["key"] == created["key"]  # nothing half-applied

    error = refusal(httpx.post(f"{key_url}/rotate", headers=headers, json={"grace": 0}, timeout=60))
    assert error["param"] == "grace" and "grace_seconds" in error["message"]
    assert chat(gateway, created["secret"]).status_code == 200  # not rotated


def test_a_rotation_grace_beyond_its_wire_type_is_refused_with_the_range_the_api_takes(gateway):
    """A grace of 5,000,000,000 (milliseconds meant as seconds) was told 'from 0 to 4294967295', uint32's range; the
    caller then sent 4294967295 and was told 'from 0 to 315360000'. Both now name the range the API takes."""
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    headers = {**dict(bearer(admin)), "content-type": "application/json"}
    keys_url = f"{gateway.base_url}/v1/admin/keys"
    key = httpx.post(keys_url, headers=headers, json={"name": "grace", "all_models": True}, timeout=60).json()["key"]
    for grace, name in ((5_000_000_000, "grace_seconds"), (4_294_967_295, "grace_seconds"), (-1, "grace_seconds"),
                        (5_000_000_000, "graceSeconds")):  # the JSON mapping's name is read too
        error = refusal(httpx.post(f"{keys_url}/{key['id']}/rotate", headers=headers, timeout=60,
                                   json={name: grace}))
        assert error["param"] == name and "0 to 315360000" in error["message"], error
    assert httpx.get(f"{keys_url}/{key['id']}", headers=headers).json()["key"] == key  # not rotated


def test_a_limit_beyond_its_wire_type_is_refused_with_the_range_the_api_takes(gateway):
    """A daily_tokens of 3,000,000,000 was told 'from -2147483648 to 2147483647', int32's range, which no limit takes
    (the caller then sending -5 was told 'at least 1'). Now the range the API takes: from 1 in a new key, from 0 (which
    removes the key's own limit) in an update, as api.md says of an integer beyond its field."""
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    headers = {**dict(bearer(admin)), "content-type": "application/json"}
    keys_url = f"{gateway.base_url}/v1/admin/keys"
    key = httpx.post(keys_url, headers=headers, json={"name": "wide", "all_models": True}, timeout=60).json()["key"]
    for value, name in ((3_000_000_000, "daily_tokens"), (-3_000_000_000, "daily_tokens"),
                        (3_000_000_000, "dailyTokens")):  # the JSON mapping's name is read too
        limits = {"limits": {name: value}}
        created = refusal(httpx.post(keys_url, headers=headers, json={"name": "x", "all_models": True, **limits},
                                     timeout=60))
        updated = refusal(httpx.patch(f"{keys_url}/{key['id']}", headers=headers, json=limits, timeout=60))
        for error, low in ((created, 1), (updated, 0)):
            assert error["param"] == f"limits.{name}", error
            assert f"from {low} to 2147483647, got {value}" in error["message"], error
    assert httpx.get(f"{keys_url}/{key['id']}", headers=headers).json()["key"] == key  # not changed


def test_a_member_given_twice_in_a_body_is_refused_naming_it_not_the_last_one_taken(gateway):
    """A script that merges JSON templates sent `"limits"` twice: the first (the budget) was dropped without a word,
    and the key was made without it, 200. Refused as `allModels` beside `all_models` is; nothing is stored."""
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    headers = {**dict(bearer(admin)), "content-type": "application/json"}
    keys_url = f"{gateway.base_url}/v1/admin/keys"
    twice = b'{"name": "twice", "all_models": true, "limits": {"max_spend_day": 5}, "limits": {"daily_requests": 9}}'
    error = refusal(httpx.post(keys_url, headers=headers, content=twice, timeout=60))
    assert error["param"] == "limits" and "twice" in error["message"]
    assert "twice" not in [key["name"] for key in httpx.get(keys_url, headers=headers).json()["keys"]]
    key = httpx.post(keys_url, headers=headers, json={"name": "once", "all_models": True}, timeout=60).json()["key"]
    for body, param in [(b'{"name": "a", "name": "b"}', "name"),
                        (b'{"limits": {"max_spend_day": 5, "max_spend_day": 0}}', "limits.max_spend_day")]:
        error = refusal(httpx.patch(f"{keys_url}/{key['id']}", headers=headers, content=body, timeout=60))
        assert error["param"] == param, error
    error = refusal(httpx.post(f"{keys_url}/{key['id']}/rotate", headers=headers, timeout=60,
                               content=b'{"grace_seconds": 600, "grace_seconds": 0}'))
    assert error["param"] == "grace_seconds"
    assert httpx.get(f"{keys_url}/{key['id']}", headers=headers).json()["key"] == key


def _with_field_99(message, inner: str = "") -> bytes:
    """`message` serialized with a field 99 (a double, 5.0) its type does not declare, as a stub generated from newer
    .proto files sends it (say a new budget, `limits.max_spend_week`), in its `inner` message field if named."""
    undeclared = bytes([99 << 3 & 0x7F | 0x80 | 1, 99 >> 4]) + struct.pack("<d", 5.0)
    if not inner:
        return message.SerializeToString() + undeclared
    field = message.DESCRIPTOR.fields_by_name[inner]
    nested = getattr(message, inner).SerializeToString() + undeclared
    message.ClearField(inner)
    return message.SerializeToString() + bytes([field.number << 3 | 2, len(nested)]) + nested


def _refused_as_invalid(channel: grpc.Channel, method: str, request: bytes, admin: str):
    """The error details of a raw (already serialized) call, which the gateway must refuse as a 400."""
    rpc = channel.unary_unary(f"/portico.v1.{method}", request_serializer=lambda raw: raw,
                              response_deserializer=lambda raw: raw)
    with pytest.raises(grpc.RpcError) as caught:
        rpc(request, metadata=bearer(admin), timeout=30)
    detail = error_details(caught.value)
    assert (caught.value.code(), detail.http_status, detail.error.code) == (
        grpc.StatusCode.INVALID_ARGUMENT, 400, "invalid_request"), (method, detail)
    return detail


def test_typed_key_writes_refuse_a_field_the_gateway_does_not_declare(gateway):
    """A gRPC caller whose stubs come from newer .proto files sent CreateKey with a limit this gateway lacks: the key
    was made (200) without it, and the caller believed its budget in force, where REST refuses such a field and the
    model RPCs refuse one by its number (api.md). Now a 400 naming the number and where it is, and nothing stored."""
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    created = gateway.cli("keys", "create", "--name", "grpc-managed", "--all-models").stdout
    key_id, secret = created.split()[2], created.split()[-1]
    writes = [
        ("CreateKey", _with_field_99(key_pb2.CreateKeyRequest(name="newer-stub", all_models=True,
                                                             limits=key_pb2.KeyLimits(max_spend_day=1)), "limits"),
         "limits"),
        ("CreateKey", _with_field_99(key_pb2.CreateKeyRequest(name="newer-stub", all_models=True)), None),
        ("UpdateKey", _with_field_99(key_pb2.UpdateKeyRequest(id=key_id, name="renamed",
                                                             limits=key_pb2.KeyLimits(daily_requests=3)), "limits"),
         "limits"),
        ("RotateKey", _with_field_99(key_pb2.RotateKeyRequest(id=key_id, grace_seconds=0)), None),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        for method, request, param in writes:
            detail = _refused_as_invalid(channel, f"KeyService/{method}", request, admin)
            assert (detail.error.param or None) == param and "field number 99" in detail.error.message, detail
        keys = key_service_pb2_grpc.KeyServiceStub(channel).ListKeys(key_pb2.ListKeysRequest(), metadata=bearer(admin))
    assert "newer-stub" not in [key.name for key in keys.keys]
    key = next(key for key in keys.keys if key.id == key_id)
    assert (key.name, key.limits) == ("grpc-managed", key_pb2.KeyLimits())  # nothing half-applied
    assert chat(gateway, secret).status_code == 200  # not rotated


def test_typed_key_reads_and_revoke_refuse_a_field_the_gateway_does_not_declare(gateway):
    """RevokeKey, GetKey, ListKeys and LimitService.GetKeyLimitStatus from stubs generated from newer .proto files
    (a revoke's grace, a listing's filter): the field was dropped without a word, the key revoked at once and the
    listing answered unfiltered, where the key writes refuse it. Now the same 400 naming its number; nothing revoked."""
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    created = gateway.cli("keys", "create", "--name", "kept", "--all-models").stdout
    key_id, secret = created.split()[2], created.split()[-1]
    calls = [
        ("KeyService/RevokeKey", _with_field_99(key_pb2.RevokeKeyRequest(id=key_id))),
        ("KeyService/GetKey", _with_field_99(key_pb2.GetKeyRequest(id=key_id))),
        ("KeyService/ListKeys", _with_field_99(key_pb2.ListKeysRequest())),
        ("LimitService/GetKeyLimitStatus", _with_field_99(limit_pb2.GetKeyLimitStatusRequest(id=key_id))),
    ]
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        for method, request in calls:
            detail = _refused_as_invalid(channel, method, request, admin)
            assert not detail.error.param and "field number 99" in detail.error.message, detail
    time.sleep(1.1)  # keys.cache_seconds
    assert chat(gateway, secret).status_code == 200  # not revoked


def test_a_typed_key_call_without_an_id_is_told_the_id_is_missing(gateway):
    """A stub caller who forgot to set `id` (proto3: "") got 404 "No key with id ''", as if a key were missing."""
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    with grpc.insecure_channel(f"127.0.0.1:{gateway.port}") as channel:
        keys, limits = key_service_pb2_grpc.KeyServiceStub(channel), limit_service_pb2_grpc.LimitServiceStub(channel)
        for rpc, request in ((keys.GetKey, key_pb2.GetKeyRequest()), (keys.RevokeKey, key_pb2.RevokeKeyRequest()),
                             (keys.RotateKey, key_pb2.RotateKeyRequest()), (keys.UpdateKey, key_pb2.UpdateKeyRequest()),
                             (limits.GetKeyLimitStatus, limit_pb2.GetKeyLimitStatusRequest())):
            with pytest.raises(grpc.RpcError) as caught:
                rpc(request, metadata=bearer(admin), timeout=30)
            detail = error_details(caught.value)
            assert (caught.value.code(), detail.error.param) == (grpc.StatusCode.INVALID_ARGUMENT, "id"), detail
            assert detail.error.message == "id is required: the key's id (key_...).", detail


def test_rest_refuses_values_of_the_wrong_json_type_naming_their_path(gateway):
    """The transcoder read "5" as 5; now a string for an integer, a number for a boolean, are 400s."""
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    headers = {"Authorization": f"Bearer {admin}"}
    keys_url = f"{gateway.base_url}/v1/admin/keys"
    key_id = httpx.post(keys_url, headers=headers, json={"name": "typed", "all_models": True}).json()["key"]["id"]
    for body, param in [({"limits": {"requests_per_minute": "5"}}, "limits.requests_per_minute"),
                        ({"all_models": 1}, "all_models"), ({"models": ["family-a-5.5", 7]}, "models[1]"),
                        ({"limits": {"max_spend_day": "5"}}, "limits.max_spend_day"), ({"limits": 3}, "limits")]:
        created = httpx.post(keys_url, headers=headers, json={"name": "x", **body}, timeout=60)
        patched = httpx.patch(f"{keys_url}/{key_id}", headers=headers, json=body, timeout=60)
        for refused in (created, patched):
            assert refusal(refused)["param"] == param
    assert refusal(httpx.post(f"{keys_url}/{key_id}/rotate", headers=headers,
                              json={"grace_seconds": "60"}))["param"] == "grace_seconds"


def test_a_query_parameter_cannot_replace_the_key_the_path_names(gateway):
    """The transcoder let `?id=` replace the path's {id}: PATCH /v1/admin/keys/A?id=B renamed B, .../A/revoke?id=B
    revoked B. Such a parameter is refused on the paths that bind it, and nothing changes."""
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    headers = {"Authorization": f"Bearer {admin}"}
    keys_url = f"{gateway.base_url}/v1/admin/keys"
    a, b = (httpx.post(keys_url, headers=headers, json={"name": n, "all_models": True}).json() for n in "ab")
    a_url, b_id = f"{keys_url}/{a['key']['id']}", b["key"]["id"]
    for answer in (httpx.patch(f"{a_url}?id={b_id}", headers=headers, json={"name": "renamed"}),
                   httpx.post(f"{a_url}/revoke?id={b_id}", headers=headers),
                   httpx.post(f"{a_url}/rotate?i%64={b_id}", headers=headers, json={"grace_seconds": 0}),
                   httpx.get(f"{a_url}?id={b_id}", headers=headers)):
        assert refusal(answer)["param"] == "id"
    assert httpx.get(f"{keys_url}/{b_id}", headers=headers).json()["key"] == b["key"]  # untouched
    assert chat(gateway, a["secret"]).status_code == chat(gateway, b["secret"]).status_code == 200
    models = httpx.get(f"{gateway.base_url}/v1/models/family-a-5.5?model=family-a-5.4", headers=headers)
    assert refusal(models)["param"] == "model"


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/chat/completions?model=family-a-5.4&id=x", {"model": "family-a-5.5", "messages": [{"role": "user",
                                                        "content": "hi"}], "max_tokens": 2}),
    ("/v1/messages?beta=true&name=x&model_id=y", {"model": "family-b-sonnet-4-6", "max_tokens": 2,
                                                  "messages": [{"role": "user", "content": "hi"}]}),
    ("/v1/images/generations?name=x&path=y", {"model": "family-a-image-2", "prompt": "a kite", "size": "256x256"}),
])
def test_query_parameters_on_the_model_paths_are_ignored(gateway, path, body):
    """docs/api.md: "Query parameters are ignored". Names that a template binds elsewhere ({id}, {model}, {name})
    bind nothing on these paths: they were refused with a 400 as if they did."""
    answer = httpx.post(f"{gateway.base_url}{path}", headers={"Authorization": f"Bearer {gateway.secret}"},
                        json=body, timeout=60)
    assert answer.status_code == 200, answer.text


def test_a_rotation_grace_too_long_for_its_end_to_be_said_is_a_400_and_nothing_rotates(gateway):
    """grace_seconds 2,500,000,000 rotated the key, then failed with a 500 building the answer (its end does not fit
    previous_secret_expires): the new secret was lost and the old one kept working until 2105."""
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    headers = {"Authorization": f"Bearer {admin}"}
    created = httpx.post(f"{gateway.base_url}/v1/admin/keys", headers=headers,
                         json={"name": "long-grace", "all_models": True}).json()
    rotate_url = f"{gateway.base_url}/v1/admin/keys/{created['key']['id']}/rotate"
    for grace in (2_500_000_000, 4_294_967_295, 315_360_001):
        assert refusal(httpx.post(rotate_url, headers=headers, json={"grace_seconds": grace}))["param"] == \
            "grace_seconds"
    rotated = httpx.post(rotate_url, headers=headers, json={"grace_seconds": 0})
    assert rotated.status_code == 200  # the first rotation there was
    assert chat(gateway, created["secret"]).status_code == 401
    assert chat(gateway, rotated.json()["secret"]).status_code == 200


def test_a_secret_given_where_a_key_id_or_a_model_goes_is_never_echoed(gateway):
    """`keys revoke` takes a secret, so an admin tries one on the other key paths too: each 404 quoted it back (the
    console shows these messages on screen), as a secret pasted into `model` was quoted in model_not_found."""
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    headers = {"Authorization": f"Bearer {admin}"}
    tail = admin.removeprefix("pk-")
    base = gateway.base_url
    answers = [
        httpx.get(f"{base}/v1/admin/keys/{admin}", headers=headers, timeout=60),
        httpx.patch(f"{base}/v1/admin/keys/{admin}", headers=headers, json={"name": "x"}, timeout=60),
        httpx.post(f"{base}/v1/admin/keys/{admin}/rotate", headers=headers, json={}, timeout=60),
        httpx.get(f"{base}/v1/admin/keys/{admin}/limits", headers=headers, timeout=60),
        httpx.get(f"{base}/v1/models/{admin}", headers=headers, timeout=60),
        httpx.post(f"{base}/v1/chat/completions", headers=headers, timeout=60,
                   json={"model": admin, "messages": [{"role": "user", "content": "Hi"}]}),
    ]
    # On the key paths, a 400 that says a key id goes there: a 404 "No key with id" read as "no key has it".
    for answer in answers[:4]:
        error = answer.json()["error"]
        assert (answer.status_code, error["param"]) == (400, "id"), answer.text
        assert error["message"] == ("id takes a key id (key_...), not a key's secret (pk-...); only revoke takes a "
                                    "secret.")
    spaced = [httpx.get(f"{base}/v1/admin/keys/%20{admin}", headers=headers, timeout=60),  # copied from a log line
              httpx.get(f"{base}/v1/admin/keys/%20{admin}/limits", headers=headers, timeout=60)]
    for answer in answers[:4] + spaced:
        assert (answer.status_code, answer.json()["error"]["param"]) == (400, "id"), answer.text
    for answer in answers[4:]:
        assert answer.status_code == 404, answer.text
        assert "pk-[redacted]" in answer.json()["error"]["message"], answer.text
    for answer in answers + spaced:
        assert tail[:8] not in answer.text, answer.text
    with pytest.raises(subprocess.CalledProcessError) as refused:
        gateway.cli("keys", "update", admin, "--rpm", "5")
    assert refused.value.returncode == 2 and tail[:8] not in refused.value.stderr
    assert "not a key's secret (pk-...)" in refused.value.stderr


def test_a_secret_pasted_into_a_key_name_is_refused_and_never_stored(gateway):
    """A name is kept in plain text in the key store and shown to every admin (the console, `portico keys list`):
    a secret pasted there (`ci bot pk-...`, its own key's for bookkeeping) was stored and listed as it came."""
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    headers = {"Authorization": f"Bearer {admin}"}
    key_id = gateway.cli("keys", "create", "--name", "named", "--all-models").stdout.split()[2]
    tail = admin.removeprefix("pk-")
    answers = [
        httpx.post(f"{gateway.base_url}/v1/admin/keys", headers=headers, timeout=60,
                   json={"name": f"ci bot {admin}", "all_models": True}),
        httpx.patch(f"{gateway.base_url}/v1/admin/keys/{key_id}", headers=headers, timeout=60,
                    json={"name": f"OPENAI_API_KEY={admin}"}),
    ]
    for answer in answers:
        assert answer.status_code == 400 and answer.json()["error"]["param"] == "name", answer.text
        assert tail[:8] not in answer.text
    with pytest.raises(subprocess.CalledProcessError) as refused:
        gateway.cli("keys", "create", "--name", admin, "--all-models")
    assert refused.value.returncode == 2 and "--name: name must not hold" in refused.value.stderr  # a bad argument
    assert tail[:8] not in refused.value.stderr
    listed = httpx.get(f"{gateway.base_url}/v1/admin/keys", headers=headers, timeout=60).text
    assert tail[:8] not in listed and '"name":"named"' in listed.replace(" ", "")
    assert all(tail[:8].encode() not in path.read_bytes() for path in gateway.data_dir.glob("keys.db*"))


def test_list_keys_holds_revoked_keys_oldest_first_and_never_a_secret(gateway):
    """api.md, Key administration: what ListKeys answers, what revoking twice and revoking by secret do."""
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    headers = {"Authorization": f"Bearer {admin}"}
    keys_url = f"{gateway.base_url}/v1/admin/keys"
    made = [httpx.post(keys_url, headers=headers, json={"name": f"listed-{n}", "all_models": True}).json()
            for n in range(2)]
    revoked = httpx.post(f"{keys_url}/{made[0]['secret']}/revoke", headers=headers).json()["key"]
    assert revoked["id"] == made[0]["key"]["id"] and revoked["revoked_at"] > 0
    again = httpx.post(f"{keys_url}/{revoked['id']}/revoke", headers=headers)
    assert again.status_code == 200 and again.json()["key"] == revoked
    listing = httpx.get(f"{keys_url}?limit=1", headers=headers)  # not a parameter of ListKeys: ignored
    keys = listing.json()["keys"]
    assert [(key["created"], key["id"]) for key in keys] == sorted((key["created"], key["id"]) for key in keys)
    assert revoked in keys and made[1]["key"] in keys
    assert all(set(key) == set(revoked) for key in keys)
    assert not any(m["secret"].removeprefix("pk-")[:12] in listing.text for m in made)


def test_list_keys_pages_over_rest_and_names_a_bad_page_parameter(gateway):
    """api.md, Key administration: `page_size` and `next_page_token` walk every key once, oldest first; a bad or
    repeated page parameter is a 400 naming it, never a listing that silently ignores it."""
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    headers = {"Authorization": f"Bearer {admin}"}
    keys_url = f"{gateway.base_url}/v1/admin/keys"
    for n in range(3):
        httpx.post(keys_url, headers=headers, json={"name": f"paged-{n}", "all_models": True})
    everything = httpx.get(keys_url, headers=headers).json()
    assert everything["next_page_token"] == "" and len(everything["keys"]) >= 5
    walked, token = [], ""
    while True:
        page = httpx.get(keys_url, headers=headers, params={"page_size": 2, "page_token": token}).json()
        assert len(page["keys"]) <= 2
        walked += page["keys"]
        token = page["next_page_token"]
        if not token:
            break
    assert walked == everything["keys"]
    for query, param in [("page_size=abc", "page_size"), ("page_size=-1", "page_size"), ("page_size=1001", "page_size"),
                         ("page_size=2&page_size=3", "page_size"), ("page_size[]=2", "page_size"),
                         ("page_token=key_0000000000000000", "page_token"), (f"page_token={admin}", "page_token"),
                         ("page_token=%00", "page_token"), ("page_size=2&page_token=" + "k" * 5000, "page_token")]:
        refused = httpx.get(f"{keys_url}?{query}", headers=headers)
        assert refused.status_code == 400, (query, refused.text)
        assert refused.json()["error"]["param"] == param, (query, refused.text)
        assert admin[3:15] not in refused.text and param in refused.json()["error"]["message"]


@pytest.mark.parametrize("page_size", ["1001", "-1", "2147483648", "4294967296", "-2147483649", "1" + "0" * 30])
def test_every_page_size_out_of_range_gets_the_documented_range(gateway, page_size):
    """api.md, Key administration: `page_size` is 1 to 1000 (0: every key). One beyond protobuf's uint32 (4294967296)
    or below 0 was refused in protobuf's terms ("expected an integer from 0 to 4294967295"), where 1001 got the
    range: now all get it."""
    admin = gateway.cli("keys", "create", "--name", "page-size-admin", "--all-models", "--admin").stdout.split()[-1]
    refused = httpx.get(f"{gateway.base_url}/v1/admin/keys?page_size={page_size}",
                        headers={"Authorization": f"Bearer {admin}"})
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"] == {"message": "page_size must be between 1 and 1000 (0 or none: every key).",
                                       "type": "invalid_request_error", "param": "page_size",
                                       "code": "invalid_request"}


def test_answers_that_carry_a_secret_are_never_cached(gateway):
    """A created or rotated key's secret is shown once: no cache between the admin tool and the gateway (a proxy, the
    browser's back button) may keep a copy of the answer."""
    admin = gateway.cli("keys", "create", "--name", "admin", "--all-models", "--admin").stdout.split()[-1]
    headers = {"Authorization": f"Bearer {admin}"}
    created = httpx.post(f"{gateway.base_url}/v1/admin/keys", headers=headers, json={"name": "n", "all_models": True},
                         timeout=60)
    assert created.status_code == 200 and created.headers.get("cache-control") == "no-store", created.headers
    rotated = httpx.post(f"{gateway.base_url}/v1/admin/keys/{created.json()['key']['id']}/rotate", headers=headers,
                         json={}, timeout=60)
    assert rotated.status_code == 200 and rotated.headers.get("cache-control") == "no-store", rotated.headers
