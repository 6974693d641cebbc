"""The key store against both of its databases (SQLite and a real PostgreSQL), and the authenticator's caches:
hashes only on disk, validation, revocation, rotation, bounded caching, a separate negative cache and the outage
policy (cached keys for a bounded staleness, others 503)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time

import pytest

from server.config import load_config
from server.db import StoreSettings
from server.db.database import StoreUnavailable
from server.domain_keys import KeyLimits
from server.errors import AuthenticationFailed, InvalidRequest, NotFound, PermissionDenied, ServiceUnavailable
from server.keys import Authenticator, KeyAdmin, KeyStore, hash_secret, open_key_store
from server.serving import _first_key as first_key
from tests.helpers import lookups_held_up
from tests.postgres_support import PASSWORD_ENV


@pytest.fixture(params=["sqlite", "postgresql"])
def settings(request, tmp_path) -> StoreSettings:
    if request.param == "sqlite":
        return StoreSettings(sqlite_path=tmp_path / "keys.db")
    return StoreSettings(url=request.getfixturevalue("postgres_url"), password_env=PASSWORD_ENV, timeout_seconds=1)


@pytest.fixture
async def store(settings) -> KeyStore:
    store = await open_key_store(settings)
    yield store
    await store.close()


def bearer(secret: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {secret}"),)


async def test_keys_persist_and_only_hashes_are_stored(store, settings, tmp_path, postgres_server):
    key, secret = await store.create("app", all_models=False, models=["family-a-5.5"], limits=KeyLimits(10, 1000))
    await store.close()
    if settings.is_postgres:
        with postgres_server.connect(settings.url.rsplit("/", 1)[1]) as conn:
            dump = repr(conn.execute("SELECT * FROM api_keys").fetchall())
        assert secret not in dump and hash_secret(secret) in dump
    else:
        for path in tmp_path.iterdir():
            assert secret.encode() not in path.read_bytes()
    reopened = await open_key_store(settings)  # migrations find nothing to do; the key is still there
    assert await reopened.list() == [key]
    assert await reopened.count() == 1
    await reopened.close()


async def test_key_admin_pages_the_listing_in_order_without_repeating_or_skipping_a_key(store):
    """ListKeys' page_size/page_token (api.md, Key administration): keys made in the same second are ordered by id, and
    a page boundary inside that second neither repeats nor skips one."""
    admin = KeyAdmin(store, ["family-a-5.5"], rotation_grace_seconds=0)
    for n in range(7):
        await store.create(f"paged-{n}", all_models=True)
    everything, token = await admin.list()
    assert token == "" and len(everything) == 7
    assert [(k.created, k.id) for k in everything] == sorted((k.created, k.id) for k in everything)
    pages, token = [], ""
    while True:
        page, token = await admin.list(page_size=3, page_token=token)
        pages.append(page)
        if not token:
            break
        assert token == page[-1].id
    assert [len(page) for page in pages] == [3, 3, 1]
    assert [key for page in pages for key in page] == everything
    exact, token = await admin.list(page_size=7)
    assert exact == everything and token == ""  # no empty last page to ask for
    assert await admin.list(page_size=0) == (everything, "")  # proto3's unset page_size: every key, as without it
    for kwargs, param in [({"page_size": 1001}, "page_size"), ({"page_token": "key_nope"}, "page_token"),
                          ({"page_token": "a\x00b"}, "page_token")]:
        with pytest.raises(InvalidRequest) as caught:
            await admin.list(**kwargs)
        assert caught.value.param == param


async def test_create_validates(store):
    with pytest.raises(InvalidRequest):
        await store.create("x", all_models=False)
    with pytest.raises(InvalidRequest):
        await store.create("x", all_models=True, limits=KeyLimits(requests_per_minute=0))


BAD_FIELDS = [  # KeyAdmin arguments -> the param of the 400
    ({"env": "ünï"}, "env"), ({"env": "東京"}, "env"), ({"env": "my prod"}, "env"), ({"env": '<b>x</b>"'}, "env"),
    ({"env": "a\x00b"}, "env"), ({"env": "e" * 33}, "env"),
    ({"name": "a\x00b"}, "name"), ({"name": "two\nlines"}, "name"), ({"name": "n" * 201}, "name"),
    ({"name": "caf\udce9"}, "name"),  # a command-line argument that is not UTF-8
    ({"limits": {"max_spend_day": 10**26}}, "limits.max_spend_day"),  # $1e20
    ({"limits": {"max_spend_month": 10**15 + 1}}, "limits.max_spend_month"),
    ({"limits": {"requests_per_minute": 2**31}}, "limits.requests_per_minute"),
    ({"limits": {"daily_tokens": 10**20}}, "limits.daily_tokens"),
]


@pytest.mark.parametrize("fields, param", BAD_FIELDS, ids=lambda value: repr(value)[:40])
async def test_both_stores_refuse_the_same_bad_env_name_and_limits(store, fields, param):
    """Through KeyAdmin, which the CLI and KeyService share: a 400 naming the field, on create and on update, and
    nothing stored. (NUL was a 500 on PostgreSQL and stored on SQLite; limits beyond 64 bits a 500 on both.)"""
    admin = KeyAdmin(store, ["family-a-5.5"], rotation_grace_seconds=0)
    limits = fields.get("limits", {})
    create = {**fields, "limits": KeyLimits(**limits)} if limits else fields
    with pytest.raises(InvalidRequest) as caught:
        await admin.create(**{"name": "ok", **create}, all_models=True)
    assert caught.value.param == param
    assert await store.list() == []
    top = KeyLimits(requests_per_minute=2**31 - 1, max_spend_day=10**15)  # each bound itself is taken
    key, secret = await admin.create("Café ☕ " + "n" * 193, all_models=True, env="Prod_2-" + "e" * 25, limits=top)
    assert secret.startswith("pk-Prod_2-" + "e" * 25 + "-") and secret.isascii()
    with pytest.raises(InvalidRequest) as caught:
        await admin.update(key.id, **fields)
    assert caught.value.param == param
    assert await store.list() == [key]


async def test_revoke_by_id_or_secret(store):
    _, first = await store.create("a", all_models=True)
    second_key, _ = await store.create("b", all_models=True, admin=True)
    assert (await store.revoke(first)).revoked_at > 0
    assert (await store.revoke(second_key.id)).revoked_at > 0
    assert all(k.revoked_at for k in await store.list())
    with pytest.raises(NotFound):
        await store.revoke("key_missing")


async def test_a_key_id_holding_a_nul_is_no_key_in_either_store(store):
    """`GET /v1/admin/keys/key_%00` (and its PATCH, revoke, rotate, limits): PostgreSQL text holds no NUL and refuses
    to compare with one, which was a 500; like SQLite, no key has that id."""
    for call in (store.get, store.revoke, lambda key_id: store.update(key_id, name="x"),
                 lambda key_id: store.rotate(key_id, grace_seconds=0)):
        with pytest.raises(NotFound):
            await call("key_\x00")


async def test_update_changes_only_what_is_given(store):
    key, secret = await store.create("a", all_models=True,
                                      limits=KeyLimits(requests_per_minute=10, tokens_per_minute=99))
    updated = await store.update(key.id, limits={"requests_per_minute": 20, "tokens_per_minute": None,
                                                 "daily_requests": 5, "max_spend_day": 10**12})
    assert updated.limits == KeyLimits(requests_per_minute=20, daily_requests=5, max_spend_day=10**12)
    assert (updated.name, updated.all_models) == ("a", True)
    narrowed = await store.update(key.id, name="b", grants=(False, ["family-a-5.5"]), env="prod")
    assert (narrowed.name, narrowed.all_models, narrowed.models, narrowed.env) == (
        "b", False, frozenset({"family-a-5.5"}), "prod")
    assert narrowed.limits == updated.limits
    assert await store.find_active(hash_secret(secret)) == narrowed
    for bad in ({"limits": {"requests_per_minute": -1}}, {"grants": (False, [])}, {"name": ""},
                {"limits": {"rpm": 5}}):
        with pytest.raises(InvalidRequest):
            await store.update(key.id, **bad)
    with pytest.raises(NotFound):
        await store.update("key_missing", name="x")


async def test_rotation_keeps_the_old_secret_for_the_grace_period_only(store):
    key, old = await store.create("a", all_models=True, env="prod")
    rotated, new, expires = await store.rotate(key.id, grace_seconds=3600)
    assert new.startswith("pk-prod-") and new != old
    assert expires == pytest.approx(time.time() + 3600, abs=2)
    assert await store.find_active(hash_secret(new)) == rotated == await store.find_active(hash_secret(old))
    _, newest, _ = await store.rotate(key.id, grace_seconds=0)  # 0: the secret being replaced stops now
    assert await store.find_active(hash_secret(new)) is None
    assert await store.find_active(hash_secret(old)) == rotated  # still in its own grace period
    assert await store.find_active(hash_secret(newest)) == rotated
    await store.revoke(old)  # revoking by a rotated-out secret revokes the key, every secret of it
    assert [await store.find_active(hash_secret(s)) for s in (old, newest)] == [None, None]
    with pytest.raises(InvalidRequest, match="revoked"):
        await store.rotate(key.id, grace_seconds=60)


async def test_authenticator_caches_for_a_bounded_time(store):
    key, secret = await store.create("a", all_models=True)
    auth = Authenticator(store, cache_seconds=0.2)
    assert await auth.authenticate(bearer(secret)) == key
    await store.revoke(key.id)
    assert await auth.authenticate(bearer(secret)) == key  # cached: the revocation is not seen yet
    await asyncio.sleep(0.3)
    with pytest.raises(AuthenticationFailed):
        await auth.authenticate(bearer(secret))


async def test_a_cached_rotated_out_secret_stops_working_when_its_grace_ends(store):
    """The previous secret "keeps working until previous_secret_expires": a lookup cached before then went on
    answering it for up to keys.cache_seconds after, and during a key store outage for up to stale_seconds (5 min)."""
    key, old = await store.create("a", all_models=True)
    _, new, expires = await store.rotate(key.id, grace_seconds=2)
    auth = Authenticator(store, cache_seconds=60, stale_seconds=300)
    assert await auth.authenticate(bearer(old)) == key  # in its grace period: cached
    assert await auth.authenticate(bearer(new)) == key
    await asyncio.sleep(max(0.0, expires - time.time()))
    with pytest.raises(AuthenticationFailed, match="Incorrect API key provided"):
        await auth.authenticate(bearer(old))
    await store.close()  # an outage: an ended secret needs no store to be refused, the current one stays cached
    with pytest.raises(AuthenticationFailed, match="Incorrect API key provided"):
        await auth.authenticate(bearer(old))
    assert await auth.authenticate(bearer(new)) == key


async def test_x_api_key_only_where_allowed(store):
    key, secret = await store.create("a", all_models=True)
    auth = Authenticator(store, cache_seconds=1)
    assert await auth.authenticate((("x-api-key", secret),), allow_x_api_key=True) == key
    with pytest.raises(AuthenticationFailed):
        await auth.authenticate((("x-api-key", secret),))
    with pytest.raises(PermissionDenied):
        await auth.authenticate_admin(bearer(secret))


async def test_a_flood_of_unknown_secrets_does_not_evict_valid_keys(store):
    keys = [await store.create(f"k{i}", all_models=True) for i in range(3)]
    auth = Authenticator(store, cache_seconds=60, cache_size=3, negative_cache_size=50)
    for _, secret in keys:
        await auth.authenticate(bearer(secret))
    for i in range(500):
        with pytest.raises(AuthenticationFailed):
            await auth.authenticate(bearer(f"pk-random-{i}"))
    await store.close()  # every valid key must now come from the cache, without the store
    for key, secret in keys:
        assert await auth.authenticate(bearer(secret)) == key


async def test_concurrent_lookups_of_one_secret_share_one_query(store):
    key, secret = await store.create("a", all_models=True)
    queries = []
    find_active = store.find_active

    async def counted(digest):
        queries.append(digest)
        return await find_active(digest)

    store.find_active = counted
    auth = Authenticator(store, cache_seconds=60)
    assert await asyncio.gather(*(auth.authenticate(bearer(secret)) for _ in range(20))) == [key] * 20
    assert len(queries) == 1


async def test_outage_serves_cached_keys_for_a_bounded_staleness_and_503_otherwise(postgres_server):
    """PostgreSQL stops: a key checked before keeps working until stale_seconds, an unchecked one gets 503 with
    retry-after (quickly, not after a hang); once PostgreSQL is back, everything works again without a restart."""
    settings = StoreSettings(url=postgres_server.new_database(), password_env=PASSWORD_ENV, timeout_seconds=1)
    store = await open_key_store(settings)
    now = [1000.0]
    auth = Authenticator(store, cache_seconds=1, stale_seconds=30, clock=lambda: now[0])
    cached, cached_secret = await store.create("cached", all_models=True)
    _, other_secret = await store.create("other", all_models=True)
    assert await auth.authenticate(bearer(cached_secret)) == cached
    postgres_server.stop()
    try:
        now[0] += 10  # past cache_seconds, within stale_seconds
        assert await auth.authenticate(bearer(cached_secret)) == cached
        started = time.monotonic()
        with pytest.raises(ServiceUnavailable) as refused:
            await auth.authenticate(bearer(other_secret))
        assert refused.value.retry_after > 0 and time.monotonic() - started < 5
        now[0] += 30  # past stale_seconds: the cached key is no longer trusted
        with pytest.raises(ServiceUnavailable):
            await auth.authenticate(bearer(cached_secret))
    finally:
        postgres_server.start()
    deadline = time.monotonic() + 10
    while True:  # the pool reconnects by itself
        try:
            assert await auth.authenticate(bearer(other_secret))
            break
        except ServiceUnavailable:
            assert time.monotonic() < deadline, "the key store did not recover"
            await asyncio.sleep(0.2)
    assert await auth.authenticate(bearer(cached_secret)) == cached
    await store.close()


@pytest.mark.parametrize("stale_seconds", [300, 1])
async def test_lost_change_notices_do_not_cost_cached_keys_their_outage_grace(store, stale_seconds):
    """PostgreSQL going down also drops the LISTEN connection, which says "changes may have been missed" (None):
    cached keys must then be checked again at their next use, yet still be served within stale_seconds (never less
    than cache_seconds) while the store is down. Clearing the cache there turned a cached key's requests into 503s
    mid-outage; so did dating its confirmation back by cache_seconds, where stale_seconds was below it (1 < 60)."""
    now = [1000.0]
    auth = Authenticator(store, cache_seconds=60, stale_seconds=stale_seconds, clock=lambda: now[0])
    key, secret = await store.create("cached", all_models=True)
    assert await auth.authenticate(bearer(secret)) == key
    lookups = []
    find_active = store.find_active

    async def down(digest):
        lookups.append(digest)
        raise StoreUnavailable("the store is down")

    store.find_active = down
    auth.forget(None)  # the listener lost its connection
    assert await auth.authenticate(bearer(secret)) == key  # stale, within the bound
    assert lookups, "after a lost notice the key must be checked again"
    store.find_active = find_active
    now[0] += 1
    assert await auth.authenticate(bearer(secret)) == key


async def test_postgres_changes_reach_the_other_hosts_caches_at_once(postgres_url):
    """LISTEN/NOTIFY: a key revoked on host B is refused on host A long before A's cache_seconds."""
    settings = StoreSettings(url=postgres_url, password_env=PASSWORD_ENV, timeout_seconds=1)
    host_a, host_b = await open_key_store(settings), await open_key_store(settings)
    auth_a = Authenticator(host_a, cache_seconds=60)
    auth_a.start()
    try:
        key, secret = await host_b.create("watched", all_models=True)
        await asyncio.sleep(0.5)  # A is listening
        assert await auth_a.authenticate(bearer(secret)) == key
        updated = await host_b.update(key.id, name="renamed")
        await asyncio.sleep(0.5)
        assert await auth_a.authenticate(bearer(secret)) == updated
        await host_b.revoke(key.id)
        started = time.monotonic()
        while time.monotonic() - started < 5:
            try:
                await auth_a.authenticate(bearer(secret))
            except AuthenticationFailed:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("host A still accepts a key revoked on host B")
    finally:
        await auth_a.close()
        await host_a.close()
        await host_b.close()


async def test_a_change_notice_during_a_lookup_is_not_undone_by_its_answer(store):
    """A lookup that read a key just before another host revoked it can answer after the revocation's notice: cached
    as confirmed when it answered, the revoked key then kept working for cache_seconds after the notice and longer
    after the revocation, beyond the bound operations.md promises."""
    now = [1000.0]
    auth = Authenticator(store, cache_seconds=60, clock=lambda: now[0])
    key, secret = await store.create("revoked-meanwhile", all_models=True)
    find_active, read, answer = store.find_active, asyncio.Event(), asyncio.Event()

    async def slow(digest):  # reads the key, then its answer takes a while to arrive (a busy pool, a slow network)
        found = await find_active(digest)
        read.set()
        await answer.wait()
        return found

    store.find_active = slow
    asked = asyncio.create_task(auth.authenticate(bearer(secret)))
    await read.wait()
    await store.revoke(key.id)
    auth.forget(key.id)  # the notice arrives while the answer is on its way
    now[0] += 5
    answer.set()
    assert await asked == key  # asked before the revocation: served
    store.find_active = find_active
    now[0] += 1
    with pytest.raises(AuthenticationFailed):
        await auth.authenticate(bearer(secret))


async def test_a_change_without_a_notice_takes_at_most_cache_seconds_also_during_a_slow_lookup(store):
    """No notice (SQLite, or one lost): a lookup's answer counts as confirmed when it was asked for, so a revocation
    made while it was on its way is seen within cache_seconds of the revocation, not of the answer."""
    now = [1000.0]
    auth = Authenticator(store, cache_seconds=60, clock=lambda: now[0])
    key, secret = await store.create("revoked-meanwhile", all_models=True)
    find_active = store.find_active

    async def slow(digest):
        found = await find_active(digest)
        await store.revoke(key.id)
        now[0] += 5  # the answer arrives 5 s later
        return found

    store.find_active = slow
    assert await auth.authenticate(bearer(secret)) == key
    store.find_active = find_active
    now[0] += 56  # 61 s after the revocation
    with pytest.raises(AuthenticationFailed):
        await auth.authenticate(bearer(secret))


@pytest.mark.usefixtures("no_collector_pauses")
async def test_a_postgresql_that_stops_answering_costs_a_lookup_about_the_store_timeout(postgres_server):
    """A hung database (connections accepted, nothing answered): an uncached key gets its 503 within about
    store_timeout_seconds. Cancelling the query made psycopg ask the server to cancel it and wait for that too, up
    to 10 s more, all of it in the caller's request."""
    settings = StoreSettings(url=postgres_server.new_database(), password_env=PASSWORD_ENV, timeout_seconds=1)
    store = await open_key_store(settings)
    auth = Authenticator(store, cache_seconds=1)
    _, secret = await store.create("unchecked", all_models=True)
    try:
        with postgres_server.paused():
            started = time.monotonic()
            with pytest.raises(ServiceUnavailable):
                await auth.authenticate(bearer(secret))
            assert time.monotonic() - started < 2 * settings.timeout_seconds + 0.5
        deadline = time.monotonic() + 10
        while True:  # answered again once the database is (after a failure, calls fail at once for a second)
            try:
                assert await auth.authenticate(bearer(secret))
                break
            except ServiceUnavailable:
                assert time.monotonic() < deadline, "the key store did not recover"
                await asyncio.sleep(0.2)
    finally:
        await store.close()


async def test_a_cached_key_is_not_held_up_again_and_again_while_postgresql_stays_hung(postgres_server):
    """Past cache_seconds, a cached key asks the store again. With a hung database each such ask waited the store
    timeout before the key was served stale, then calls failed fast for only a second: its requests stalled ~2 s in
    every ~3 s. Once a call has failed, calls fail fast until a check (readiness pings every second) answers."""
    settings = StoreSettings(url=postgres_server.new_database(), password_env=PASSWORD_ENV, timeout_seconds=1)
    store = await open_key_store(settings)
    auth = Authenticator(store, cache_seconds=0.1, stale_seconds=60)
    key, secret = await store.create("cached", all_models=True)
    assert await auth.authenticate(bearer(secret)) == key

    async def readiness() -> None:  # as server/health.py checks the store
        while True:
            with contextlib.suppress(StoreUnavailable):
                await store.ping()
            await asyncio.sleep(1)

    checks = asyncio.create_task(readiness())
    try:
        with postgres_server.paused():
            slow = await lookups_held_up(auth, secret, key, 8)
        assert len(slow) <= 1, f"requests held up at {slow} s"
    finally:
        checks.cancel()
        await store.close()



async def test_hosts_starting_together_on_an_empty_store_make_one_development_key(settings, tmp_path, capsys):
    """`portico serve` on several hosts at once, an empty shared store: one development key between them, printed by
    the host that made it (each host asked "any keys?", then made one: two or more keys, each printed)."""
    config = dataclasses.replace(load_config(), key_store=settings, data_dir=tmp_path)  # SQLite: tmp_path/keys.db
    await asyncio.gather(*(first_key(config, create=True) for _ in range(8)))  # each its own store, as hosts have
    printed = capsys.readouterr().out
    assert printed.count("Created development key") == 1, printed
    store = await open_key_store(settings)
    try:
        assert [key.name for key in await store.list()] == ["development"]
    finally:
        await store.close()
    await first_key(config, create=True)  # a later start: keys exist, none is made
    assert "Created development key" not in capsys.readouterr().out



async def test_a_key_revoked_while_it_is_rotated_is_refused_as_a_revoked_key_is(store, monkeypatch):
    """The rotation read the key, then a revocation (another admin, the console) landed before it wrote: it answered
    200 with a new secret for the revoked key, which never worked; api.md: a revoked key cannot be rotated (400)."""
    key, secret = await store.create("ci", all_models=True)
    read = store.get

    async def read_then_revoked(key_id: str):
        found = await read(key_id)
        monkeypatch.setattr(store, "get", read)
        await store.revoke(key_id)
        return found

    monkeypatch.setattr(store, "get", read_then_revoked)
    with pytest.raises(InvalidRequest, match="revoked") as refused:
        await store.rotate(key.id, grace_seconds=600)
    assert refused.value.param == "id"
    assert (await store.get(key.id)).revoked_at > 0
    assert await store.find_active(hash_secret(secret)) is None


async def test_two_updates_at_once_each_keep_what_the_other_changed(store):
    key, _ = await store.create("ci", all_models=True)
    await asyncio.gather(*(store.update(key.id, name=f"n{n}") for n in range(5)),
                         *(store.update(key.id, limits={"daily_requests": 100 + n}) for n in range(5)),
                         store.update(key.id, grants=(False, ["family-a-5.5"])))
    after = await store.get(key.id)
    assert after.name in {f"n{n}" for n in range(5)} and after.limits.daily_requests in range(100, 105)
    assert (after.all_models, after.models) == (False, frozenset({"family-a-5.5"}))
