"""The ledger as operators run it: `portico serve --workers 2` with Redis limits, priced models on a real upstream
that fails on cue. After a mixed load (JSON, streams, abandoned streams, upstream failures, fallbacks, a budget
refusal), the ledger holds one row per admitted request, and its totals equal what the shared limit store settled,
what the metrics count, and what the usage API answers. A budget set with the CLI is a 429 through Envoy."""

from __future__ import annotations

import dataclasses
import os
import time

import httpx
import pytest
import redis
import yaml

from server.limits.core import day_of
from server.db import StoreSettings
from server.usage.stores import open_ledger
from tests.e2e.conftest import Gateway, running_gateway
from tests.e2e.test_operations import scrape, value
from tests.postgres_support import PASSWORD_ENV
from tests.upstream_double import Cue
from tests.upstream_support import FAST_RETRY, UPSTREAM_KEY, UPSTREAM_KEY_ENV

HELLO = [{"role": "user", "content": "Say hello."}]  # the double answers "echo Say hello.": 2 prompt, 3 output


@pytest.fixture(scope="module", params=["sqlite", "postgresql"])
def priced(request, tmp_path_factory, redis_server, double) -> Gateway:
    """Keys and ledger in keys.db, or in a PostgreSQL database (the test reads the ledger through `gateway.ledger`)."""
    common = {"kind": "openai", "base_url": double.url, "api_key_env": UPSTREAM_KEY_ENV}
    retry = yaml.safe_load(FAST_RETRY)
    raw = {
        "limits": {"store": redis_server.url, "defaults": {"requests_per_minute": 600}},
        "usage": {"flush_seconds": 0.2},
        "models": [
            {"id": "up-main", "endpoint": "/v1/chat/completions", "fallbacks": ["up-backup"],
             "provider": {**common, "model": "main-model", "retry": retry}, "price": {"input": 3, "output": 7}},
            {"id": "up-backup", "endpoint": "/v1/chat/completions",
             "provider": {**common, "model": "backup-model", "retry": {"attempts": 1}},
             "price": {"input": 100, "output": 100}},
            {"id": "up-solo", "endpoint": "/v1/chat/completions",
             "provider": {**common, "model": "solo-model", "retry": retry}, "price": {"input": 1000, "output": 1000}},
        ],
    }
    store = StoreSettings()
    if request.param == "postgresql":
        store = StoreSettings(url=request.getfixturevalue("postgres_server").new_database(), password_env=PASSWORD_ENV)
        raw["keys"] = {"store": store.url, "password_env": PASSWORD_ENV}
    config = tmp_path_factory.mktemp("ledger-config") / "portico.yaml"
    config.write_text(yaml.safe_dump(raw))
    os.environ[UPSTREAM_KEY_ENV] = UPSTREAM_KEY
    try:
        with running_gateway(tmp_path_factory.mktemp("ledger-data"), "--workers", "2", config=config) as gateway:
            ledger = open_ledger(store if store.is_postgres else StoreSettings(sqlite_path=gateway.data_dir / "keys.db"))
            yield dataclasses.replace(gateway, config=config), ledger
            ledger.close()
    finally:
        os.environ.pop(UPSTREAM_KEY_ENV, None)


def post(gateway: Gateway, secret: str, timeout: float = 30, **body) -> httpx.Response:
    return httpx.post(f"{gateway.base_url}/v1/chat/completions", headers={"Authorization": f"Bearer {secret}"},
                      json={"model": "up-main", "messages": HELLO, **body}, timeout=timeout)


def test_ledger_totals_equal_limits_metrics_and_usage_api_across_two_workers(priced, double, redis_server):
    priced, ledger = priced
    double.reset()
    created = priced.cli("keys", "create", "--name", "mixed", "--all-models", "--env", "team-x").stdout
    key_id, secret = created.split()[2], created.split()[-1]
    statuses = []
    for _ in range(3):
        statuses.append(post(priced, secret).status_code)  # JSON
        with httpx.stream("POST", f"{priced.base_url}/v1/chat/completions", json={
                "model": "up-main", "messages": HELLO, "stream": True},
                headers={"Authorization": f"Bearer {secret}"}, timeout=30) as streamed:
            statuses.append(streamed.status_code)
            assert b"[DONE]" in b"".join(streamed.iter_bytes())
    for _ in range(2):  # abandoned: the caller leaves after the first bytes
        double.cue(Cue(frame_delay=0.3))
        with httpx.stream("POST", f"{priced.base_url}/v1/chat/completions", json={
                "model": "up-solo", "messages": HELLO, "stream": True},
                headers={"Authorization": f"Bearer {secret}"}, timeout=30) as abandoned:
            next(abandoned.iter_bytes())
    # Abandoned before any byte: a JSON request (Envoy's unary twin), whose exchange runs on and is counted with the
    # answer's usage, as the upstream bills it (api.md, Rate limits).
    double.cue(Cue(delay=1.5))
    with pytest.raises(httpx.ReadTimeout):
        post(priced, secret, timeout=0.3)
    double.cue(*[Cue(500, {"error": {"message": "boom"}})] * 3)  # up-main fails, up-backup answers
    statuses.append(post(priced, secret).status_code)
    double.cue(*[Cue(500, {"error": {"message": "boom"}})] * 3)  # up-solo fails: 502
    statuses.append(post(priced, secret, model="up-solo").status_code)
    assert statuses == [200] * 7 + [502]

    time.sleep(2)  # the abandoned streams settle, and every worker writes its rows (flush_seconds 0.2)
    rows = [r for r in ledger.rows() if r.key_id == key_id]
    assert len(rows) == 11
    assert sorted(r.status for r in rows) == [200] * 7 + [499] * 3 + [502]
    assert {r.upstream for r in rows if r.model == "up-main"} == {"up-main", "up-backup"}
    cost = sum(r.cost_micros for r in rows)
    tokens = sum(r.input_tokens + r.output_tokens for r in rows)
    # up-main's seven answers at its price (2 x 3 + 3 x 7), the one up-backup gave at up-backup's (2 x 100 + 3 x 100).
    assert sorted(r.cost_micros for r in rows if r.model == "up-main") == [27] * 7 + [500]
    assert cost == 7 * 27 + 500 + sum(r.cost_micros for r in rows if r.model == "up-solo") and cost > 7 * 27 + 500

    # The shared limit store settled the same tokens (and, for budgets, the same spend) ...
    day = redis.Redis.from_url(redis_server.url).hgetall(f"portico:limits:{key_id}:day:{day_of(time.time())}")
    # Every request that reached a model counts, the abandoned JSON one and the 502 included.
    assert int(day[b"tokens"]) == tokens and int(day[b"spend"]) == cost and int(day[b"requests"]) == 11
    # ... the metrics (summed over both workers) count the same ...
    samples = scrape(priced)
    for model in ("up-main", "up-solo"):
        mine = [r for r in rows if r.model == model]
        assert value(samples, "portico_spend_microdollars_total", model=model, key_id=key_id) == sum(
            r.cost_micros for r in mine)
        assert value(samples, "portico_output_tokens_total", model=model, key_id=key_id) == sum(
            r.output_tokens for r in mine)
    # ... and the usage API's buckets sum to the ledger.
    start = min(r.at_ms for r in rows) // 1000
    usage = httpx.get(f"{priced.base_url}/v1/organization/usage/completions", headers={
        "Authorization": f"Bearer {secret}"}, params={"start_time": start, "bucket_width": "1m"}, timeout=30).json()
    results = [r for bucket in usage["data"] for r in bucket["results"]]
    assert sum(r["num_requests"] for r in results) == 11
    assert sum(r["input_tokens"] + r["output_tokens"] for r in results) == tokens
    costs = httpx.get(f"{priced.base_url}/v1/organization/costs", headers={"Authorization": f"Bearer {secret}"},
                      params={"start_time": start, "bucket_width": "1m"}, timeout=30).json()
    assert sum(r["amount_microdollars"] for b in costs["data"] for r in b["results"]) == cost


def test_a_budget_set_with_the_cli_is_a_429_with_retry_after_through_envoy(priced, double):
    priced, _ = priced
    double.reset()
    created = priced.cli("keys", "create", "--name", "budget", "--all-models").stdout
    key_id, secret = created.split()[2], created.split()[-1]
    updated = priced.cli("keys", "update", key_id, "--max-spend-day", "0.00017").stdout
    assert "max_spend_day=$0.00017" in updated
    time.sleep(1.1)  # keys.cache_seconds
    # Each request may cost 26*3 + 8*7 = 134 micro-dollars (a prompt of at most 10 bytes + 16 template tokens,
    # max_tokens 8) and really costs 2*3 + 3*7 = 27: a budget of 170 admits two (27 + 134 fits, 54 + 134 does not).
    assert [post(priced, secret, max_tokens=8).status_code for _ in range(2)] == [200, 200]
    refused = post(priced, secret, max_tokens=8)
    assert refused.status_code == 429
    error = refused.json()["error"]
    assert (error["code"], error["type"], error["param"]) == ("rate_limit_exceeded", "rate_limit_error", None)
    assert f"spend per UTC day budget of key {key_id}" in error["message"] and "resets at" in error["message"]
    assert 0 < int(refused.headers["retry-after"]) <= 86_400
