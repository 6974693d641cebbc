"""Key updates and rotation on a running gateway: through the CLI and through REST (/v1/admin/keys)."""

from __future__ import annotations

import time

import httpx

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
    assert key["limits"]["concurrent_requests"] == 3 and key["models"] == ["family-a-5.4"]
    assert key["all_models"] is False
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
