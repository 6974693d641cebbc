"""Two gateway hosts behind one control plane: two `portico serve` (own data dirs, ports and processes, on loopback)
sharing one PostgreSQL (keys) and one Redis (limits), as docs/operations.md "Several hosts" describes.

- a key created through host A's admin API answers on host B; an image link only on the host that made it;
- revoked on B, refused on A within keys.cache_seconds; a limit set on B holds on A within it too;
- a key with rpm=50, 200 requests over both hosts from 32 clients: exactly 50 admitted;
- PostgreSQL stopped mid-load: cached keys keep working, uncached ones get 503, never a 500; restarted: full service;
  after a 20 s outage, within seconds of its return.
- a flood of first lookups on both hosts: PostgreSQL connections stay within keys.pool_size + 2 per server process.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from importlib import resources

import httpx
import pytest
import yaml

from tests.e2e.conftest import running_gateway
from tests.postgres_support import PASSWORD_ENV

CACHE_SECONDS = 1.0
STORE_TIMEOUT_SECONDS = 1
# Readiness is checked every second, and a check waits up to twice the store timeout for PostgreSQL: the change shows
# within two checks.
READINESS_WAIT_SECONDS = 2 * (1.0 + 2 * STORE_TIMEOUT_SECONDS) + 2.0
HI = {"model": "family-a-5.5", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}


@pytest.fixture(scope="module")
def shared(tmp_path_factory, postgres_server, redis_server):
    """The configuration both hosts use, an admin key made with the CLI against PostgreSQL, and the two hosts."""
    directory = tmp_path_factory.mktemp("several-hosts")
    raw = yaml.safe_load((resources.files("server") / "default.yaml").read_text())
    raw["keys"] = {**(raw.get("keys") or {}), "store": postgres_server.new_database(), "password_env": PASSWORD_ENV,
                   "cache_seconds": CACHE_SECONDS, "store_timeout_seconds": STORE_TIMEOUT_SECONDS}
    raw["limits"] = {**(raw.get("limits") or {}), "store": redis_server.url}
    config = directory / "portico.yaml"
    config.write_text(yaml.safe_dump(raw))
    created = subprocess.run(
        [sys.executable, "-m", "server.cli", "--config", str(config), "--data-dir", str(directory / "cli"),
         "keys", "create", "--name", "ops", "--all-models", "--admin"],
        capture_output=True, text=True, timeout=60, check=True,
    )
    admin = created.stdout.strip().splitlines()[-1]
    with contextlib.ExitStack() as stack:
        hosts = [stack.enter_context(running_gateway(directory / name, config=config, dev_key=False))
                 for name in ("host-a", "host-b")]
        yield hosts, admin, config


def chat(host, secret: str, client: httpx.Client | None = None) -> httpx.Response:
    return (client or httpx).post(f"{host.base_url}/v1/chat/completions", json=HI, timeout=60,
                                  headers={"authorization": f"Bearer {secret}"})


def create_key(host, admin: str, **fields) -> dict:
    answer = httpx.post(f"{host.base_url}/v1/admin/keys", json={"name": "shared", "all_models": True, **fields},
                        headers={"authorization": f"Bearer {admin}"}, timeout=30)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_key_created_on_one_host_answers_on_the_other(shared):
    (a, b), admin, _ = shared
    created = create_key(a, admin)
    answer = chat(b, created["secret"])
    assert answer.status_code == 200, answer.text
    listed = httpx.get(f"{b.base_url}/v1/admin/keys", headers={"authorization": f"Bearer {admin}"}).json()
    assert created["key"]["id"] in [key["id"] for key in listed["keys"]]


def test_an_image_link_works_only_on_the_host_that_made_it(shared):
    """operations.md: the image and its signing key are in each host's data_dir, so another host refuses its link."""
    (a, b), admin, _ = shared
    body = {"model": "family-a-image-2", "prompt": "a buoy", "size": "256x256", "response_format": "url"}
    made = httpx.post(f"{a.base_url}/v1/images/generations", json=body, timeout=60,
                      headers={"authorization": f"Bearer {admin}"})
    path = made.json()["data"][0]["url"].removeprefix(a.base_url)
    assert httpx.get(f"{a.base_url}{path}", timeout=30).status_code == 200
    elsewhere = httpx.get(f"{b.base_url}{path}", timeout=30)
    assert (elsewhere.status_code, elsewhere.json()["error"]["message"]) == (404, "This image link is not valid.")


def test_revoked_on_one_host_is_refused_on_the_other_within_cache_seconds(shared):
    (a, b), admin, _ = shared
    created = create_key(a, admin)
    assert chat(a, created["secret"]).status_code == 200  # now cached on A
    revoked = httpx.post(f"{b.base_url}/v1/admin/keys/{created['key']['id']}/revoke", json={},
                         headers={"authorization": f"Bearer {admin}"})
    assert revoked.status_code == 200 and revoked.json()["key"]["revoked_at"] > 0
    started = time.monotonic()
    while (status := chat(a, created["secret"]).status_code) == 200:
        assert time.monotonic() - started < CACHE_SECONDS + 1.0, "A still accepts the key revoked on B"
        time.sleep(0.05)
    assert status == 401


def test_a_limit_set_on_one_host_holds_on_the_other_within_cache_seconds(shared):
    """api.md, Key administration: changes reach running servers within keys.cache_seconds, limits as revocations;
    the window Redis keeps is the key's on both hosts, so the two requests A already admitted count against it."""
    (a, b), admin, _ = shared
    created = create_key(a, admin)
    for _ in range(2):
        assert chat(a, created["secret"]).status_code == 200  # A has the key cached, with the default limits
    patched = httpx.patch(f"{b.base_url}/v1/admin/keys/{created['key']['id']}", timeout=30,
                          json={"limits": {"requests_per_minute": 2}}, headers={"authorization": f"Bearer {admin}"})
    assert patched.status_code == 200 and patched.json()["key"]["limits"] == {"requests_per_minute": 2}
    started = time.monotonic()
    while (answer := chat(a, created["secret"])).status_code == 200:
        assert time.monotonic() - started < CACHE_SECONDS + 1.0, "A still admits past the limit set on B"
        time.sleep(0.05)
    assert answer.status_code == 429 and "limit 2" in answer.json()["error"]["message"], answer.text
    assert chat(b, created["secret"]).status_code == 429


def test_a_secret_rotated_out_on_one_host_ends_on_the_other_at_its_grace(shared):
    """api.md, Key administration: the rotated-out secret works until previous_secret_expires, then every server that
    heard of the rotation refuses it, one that had it cached included; the new secret answers on both hosts."""
    (a, b), admin, _ = shared
    created = create_key(a, admin)
    assert chat(a, created["secret"]).status_code == 200  # cached on A
    rotated = httpx.post(f"{b.base_url}/v1/admin/keys/{created['key']['id']}/rotate", json={"grace_seconds": 3},
                         headers={"authorization": f"Bearer {admin}"}, timeout=30).json()
    assert chat(a, rotated["secret"]).status_code == 200 and chat(b, rotated["secret"]).status_code == 200
    while time.time() < rotated["previous_secret_expires"] - 0.5:
        assert chat(a, created["secret"]).status_code == 200, "the old secret ended before its grace"
        time.sleep(0.2)
    time.sleep(max(0.0, rotated["previous_secret_expires"] - time.time()) + 0.1)
    assert [chat(host, created["secret"]).status_code for host in (a, b)] == [401, 401]


def test_rpm_50_over_both_hosts_admits_exactly_50(shared):
    (a, b), admin, _ = shared
    secret = create_key(a, admin, limits={"requests_per_minute": 50})["secret"]
    # A connection per request: httpx's pool, shared by 32 threads, once read from a socket it had closed in another
    # (httpcore.ReadError "[Errno 9] Bad file descriptor"), a fault of the test's client, not of the gateway.
    with ThreadPoolExecutor(32) as pool:
        statuses = Counter(pool.map(lambda i: chat((a, b)[i % 2], secret).status_code, range(200)))
    assert statuses == {200: 50, 429: 150}


def test_postgres_outage_cached_keys_work_uncached_get_503_then_recovery(shared, postgres_server):
    (a, b), admin, _ = shared
    # The load below runs for several seconds at whatever pace the machine allows: the default 600 requests per
    # minute answered it with 429s once (598 admitted, with the 2 calls before it), not what this test is about.
    cached = create_key(a, admin, limits={"requests_per_minute": 1_000_000})["secret"]
    uncached = create_key(a, admin)["secret"]  # never used: no host has it in its cache
    for host in (a, b):
        assert chat(host, cached).status_code == 200
        assert httpx.get(f"{host.base_url}/v1/admin/keys", headers={"authorization": f"Bearer {admin}"}).is_success
    statuses: Counter[int] = Counter()
    stop = threading.Event()

    def load() -> None:  # the cached key keeps calling both hosts through the outage
        with httpx.Client() as client:
            while not stop.is_set():
                for host in (a, b):
                    statuses[chat(host, cached, client).status_code] += 1

    loader = threading.Thread(target=load)
    loader.start()
    try:
        time.sleep(0.5)
        postgres_server.stop()
        time.sleep(CACHE_SECONDS + 0.5)  # every cache entry is past cache_seconds: the hosts try the store
        for host in (a, b):
            refused = chat(host, uncached)
            assert refused.status_code == 503, refused.text
            assert refused.json()["error"]["code"] == "service_unavailable"
            assert int(refused.headers["retry-after"]) > 0
            listed = httpx.get(f"{host.base_url}/v1/admin/keys", headers={"authorization": f"Bearer {admin}"})
            assert listed.status_code == 503 and listed.json()["error"]["code"] == "service_unavailable"
            deadline = time.monotonic() + READINESS_WAIT_SECONDS
            while (keys := httpx.get(f"{host.base_url}/readyz").json()["checks"]["keys"]) != "unreachable":
                assert time.monotonic() < deadline, keys
                time.sleep(0.2)
        time.sleep(1.0)
    finally:
        postgres_server.start()
        stop.set()
        loader.join()
    assert statuses[200] > 0 and set(statuses) == {200}, statuses  # cached: served throughout, no 500, no 503
    deadline = time.monotonic() + 15
    for host in (a, b):
        while (status := chat(host, uncached).status_code) != 200:
            assert status == 503 and time.monotonic() < deadline, f"no recovery on {host.base_url}: {status}"
            time.sleep(0.2)
        # Readiness is re-checked every second: it may still report the outage just after the first answer.
        ready_by = time.monotonic() + READINESS_WAIT_SECONDS
        while (keys := httpx.get(f"{host.base_url}/readyz").json()["checks"]["keys"]) != "ok":
            assert time.monotonic() < ready_by, keys
            time.sleep(0.2)


def test_after_a_long_postgres_outage_the_hosts_answer_within_seconds_of_its_return(shared, postgres_server):
    """operations.md: when PostgreSQL is back the pool reconnects by itself. The pool's attempts backed off ever
    longer (1, 2, 4, 8, 16 s... apart) through an outage, so after one of 20 s a key no host had cached was refused
    503 for another 7 to 12 s, and after an outage of minutes, for minutes; readiness asks every second, so the
    first answer should come about a second after the database's."""
    (a, b), admin, _ = shared
    uncached = create_key(a, admin)["secret"]
    postgres_server.stop()
    try:
        for host in (a, b):
            assert chat(host, uncached).status_code == 503  # the hosts find the outage, and their pools retry
        time.sleep(20)
    finally:
        postgres_server.start()
    back = time.monotonic()
    for host in (a, b):
        while (status := chat(host, uncached).status_code) != 200:
            assert status == 503 and time.monotonic() - back < 4, f"{host.base_url}: {status}"
            time.sleep(0.1)


def test_a_nul_in_a_key_id_a_usage_filter_or_a_cursor_is_answered_not_a_500(shared):
    """PostgreSQL text holds no NUL and refuses to compare with one: each of these was a 500 on PostgreSQL, where
    SQLite answered it (api.md: every status a caller can receive is in the error table, a 500 being a bug)."""
    (a, _), admin, _ = shared
    auth = {"authorization": f"Bearer {admin}"}
    for method in ("GET", "PATCH"):
        answer = httpx.request(method, f"{a.base_url}/v1/admin/keys/key_%00", headers=auth, json={"name": "x"}
                               if method == "PATCH" else None, timeout=30)
        assert (answer.status_code, answer.json()["error"]["code"]) == (404, "not_found"), answer.text
    revoked = httpx.post(f"{a.base_url}/v1/admin/keys/key_%00/revoke", headers=auth, json={}, timeout=30)
    assert revoked.status_code == 404, revoked.text
    for path in ("/v1/organization/usage/completions", "/v1/organization/costs"):
        answer = httpx.get(f"{a.base_url}{path}", headers=auth, params={"start_time": 1, "models": "\x00"}, timeout=30)
        assert answer.status_code == 200 and all(not b["results"] for b in answer.json()["data"]), answer.text
    rows = httpx.get(f"{a.base_url}/v1/organization/requests", headers=auth, timeout=30,
                     params={"api_key_ids": ["\x00"], "project_ids": "\x00"})
    assert (rows.status_code, rows.json()["data"]) == (200, []), rows.text
    forged = httpx.get(f"{a.base_url}/v1/organization/requests?page=page_MToA", headers=auth, timeout=30)
    assert (forged.status_code, forged.json()["error"]["param"]) == (400, "page"), forged.text


def test_a_host_holds_at_most_pool_size_plus_two_postgresql_connections(shared, postgres_server):
    """configuration.md keys.pool_size: a server process holds its key pool, one connection listening for key changes
    and one for the usage ledger, so PostgreSQL's max_connections is sized as hosts x workers x (pool_size + 2). A
    flood of first lookups (keys no host has cached) on both hosts fills the pools."""
    (a, b), admin, config = shared
    database = yaml.safe_load(config.read_text())["keys"]["store"].rsplit("/", 1)[1]
    pool_size = 4  # the default: the configuration sets none
    secrets = [create_key(a, admin, limits={"requests_per_minute": 1_000_000})["secret"] for _ in range(32)]
    peak, done = [0], threading.Event()

    def watch() -> None:
        with postgres_server.connect() as conn:
            while not done.is_set():
                count = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = %s "
                                     "AND application_name = 'portico'", (database,)).fetchone()[0]
                peak[0] = max(peak[0], count)
                time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with httpx.Client(limits=httpx.Limits(max_connections=64)) as client, ThreadPoolExecutor(64) as pool:
            statuses = Counter(pool.map(lambda i: chat((a, b)[i % 2], secrets[i // 2], client).status_code,
                                        range(2 * len(secrets))))
    finally:
        done.set()
        watcher.join()
    assert statuses == {200: 2 * len(secrets)}
    assert 2 * 3 < peak[0] <= 2 * (pool_size + 2), peak[0]  # above a pool of 1 each: the flood filled them
