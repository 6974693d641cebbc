"""Key store (hashes only on disk), authenticator caching, catalog rules and configuration errors."""

from __future__ import annotations

import time

import pytest

from server.catalog import Catalog
from server.config import ConfigError, load_config
from server.domain import ApiKey, KeyLimits
from server.errors import AuthenticationFailed, InvalidRequest, ModelNotFound, NotFound, PermissionDenied
from server.keys import Authenticator, KeyStore, hash_secret


@pytest.fixture
def store(tmp_path):
    store = KeyStore(tmp_path / "keys.db")
    yield store
    store.close()


def test_secret_never_reaches_disk(store, tmp_path):
    key, secret = store.create("app", all_models=False, models=["family-a-5.5"], limits=KeyLimits(10, 1000))
    store.close()
    for path in tmp_path.iterdir():
        assert secret.encode() not in path.read_bytes()
    reopened = KeyStore(tmp_path / "keys.db")
    assert reopened.list() == [key]
    reopened.close()


def test_create_validates(store):
    with pytest.raises(InvalidRequest):
        store.create("x", all_models=False)
    with pytest.raises(InvalidRequest):
        store.create("x", all_models=True, limits=KeyLimits(requests_per_minute=0))


def test_revoke_by_id_or_secret(store):
    _, first = store.create("a", all_models=True)
    second_key, _ = store.create("b", all_models=True)
    assert store.revoke(first).revoked_at > 0
    assert store.revoke(second_key.id).revoked_at > 0
    assert all(k.revoked_at for k in store.list())


def test_update_changes_only_what_is_given(store):
    key, secret = store.create("a", all_models=True, limits=KeyLimits(requests_per_minute=10, tokens_per_minute=99))
    updated = store.update(key.id, limits={"requests_per_minute": 20, "tokens_per_minute": None,
                                           "daily_requests": 5})
    assert updated.limits == KeyLimits(requests_per_minute=20, daily_requests=5)
    assert (updated.name, updated.all_models) == ("a", True)
    narrowed = store.update(key.id, name="b", grants=(False, ["family-a-5.5"]), env="prod")
    assert (narrowed.name, narrowed.all_models, narrowed.models, narrowed.env) == (
        "b", False, frozenset({"family-a-5.5"}), "prod")
    assert narrowed.limits == updated.limits
    assert store.find_active(hash_secret(secret)) == narrowed
    for bad in ({"limits": {"requests_per_minute": -1}}, {"grants": (False, [])}, {"name": ""},
                {"limits": {"rpm": 5}}):
        with pytest.raises(InvalidRequest):
            store.update(key.id, **bad)
    with pytest.raises(NotFound):
        store.update("key_missing", name="x")


def test_rotation_keeps_the_old_secret_for_the_grace_period_only(store):
    key, old = store.create("a", all_models=True, env="prod")
    rotated, new, expires = store.rotate(key.id, grace_seconds=3600)
    assert new.startswith("pk-prod-") and new != old
    assert expires == pytest.approx(time.time() + 3600, abs=2)
    assert store.find_active(hash_secret(new)) == rotated == store.find_active(hash_secret(old))
    _, newest, _ = store.rotate(key.id, grace_seconds=0)  # 0: the secret being replaced stops now
    assert store.find_active(hash_secret(new)) is None
    assert store.find_active(hash_secret(old)) == rotated  # still in its own grace period
    assert store.find_active(hash_secret(newest)) == rotated
    store.revoke(old)  # revoking by a rotated-out secret revokes the key, every secret of it
    assert all(store.find_active(hash_secret(s)) is None for s in (old, newest))
    with pytest.raises(InvalidRequest, match="revoked"):
        store.rotate(key.id, grace_seconds=60)


def test_authenticator_caches_for_a_bounded_time(store):
    key, secret = store.create("a", all_models=True)
    auth = Authenticator(store, cache_seconds=0.2)
    metadata = (("authorization", f"Bearer {secret}"),)
    assert auth.authenticate(metadata) == key
    store.revoke(key.id)
    time.sleep(0.3)
    with pytest.raises(AuthenticationFailed):
        auth.authenticate(metadata)


def test_x_api_key_only_where_allowed(store):
    key, secret = store.create("a", all_models=True)
    auth = Authenticator(store, cache_seconds=1)
    assert auth.authenticate((("x-api-key", secret),), allow_x_api_key=True) == key
    with pytest.raises(AuthenticationFailed):
        auth.authenticate((("x-api-key", secret),))
    with pytest.raises(PermissionDenied):
        auth.authenticate_admin((("authorization", f"Bearer {secret}"),))


def test_catalog_rules():
    catalog = Catalog(load_config().models)
    key = ApiKey(id="k", name="n", all_models=False, models=frozenset({"family-b-opus-4-8"}))
    assert catalog.resolve(key, "family-b-opus-4-8", "/v1/messages").id == "family-b-opus-4-8"
    with pytest.raises(ModelNotFound, match="/v1/messages"):
        catalog.resolve(key, "family-b-opus-4-8", "/v1/chat/completions")
    with pytest.raises(ModelNotFound, match="does not exist"):
        catalog.resolve(key, "family-a-5.5", "/v1/chat/completions")


ONE_MODEL = "models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}}]"


def test_limits_config():
    limits = load_config().limits
    assert limits.defaults == KeyLimits(requests_per_minute=600, tokens_per_minute=1_000_000, concurrent_requests=32)
    assert limits.store == "memory" and limits.models == {}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("models: []", "non-empty list"),
        ("models: [{id: a, endpoint: /v1/nope, provider: {kind: llamacpp}}]", "endpoint must be one of"),
        ("models: [{id: a, endpoint: /v1/messages, provider: {kind: magic}}]", "kind must be one of"),
        ("models: [{id: a, endpoint: /v1/messages}]", "`provider` is required"),
        ("models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}},"
         " {id: a, endpoint: /v1/messages, provider: {kind: llamacpp}}]", "listed twice"),
        ("listen: {port: http}\nmodels: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}}]", "http"),
        ("models: [", "not valid YAML"),
        (f"{ONE_MODEL}\nlimits: {{defaults: {{rpm: 5}}}}", "unknown limit"),
        (f"{ONE_MODEL}\nlimits: {{defaults: {{requests_per_minute: 0}}}}", "at least 1"),
        (f"{ONE_MODEL}\nlimits: {{models: {{b: {{requests_per_minute: 5}}}}}}", "'b' is not a model"),
        (f"{ONE_MODEL}\nlimits: {{store: sqlite}}", "limits.store"),
        (f"{ONE_MODEL}\nlimits: {{store: 'redis://h/0', on_store_error: maybe}}", "on_store_error"),
        (f"{ONE_MODEL}\nlimits: {{lease_seconds: 0}}", "must be positive"),
        # A typo anywhere is an error naming where it is, never a setting silently ignored.
        (f"{ONE_MODEL}\ndefault_max_token: 64", r"c\.yaml: unknown setting\(s\) default_max_token; known: listen"),
        (f"{ONE_MODEL}\nlisten: {{prot: 9000}}", r"listen: unknown setting\(s\) prot; known: host, port"),
        (f"{ONE_MODEL}\nembedded: {{thread: 4}}", r"embedded: unknown setting\(s\) thread; known: context_size"),
        (f"{ONE_MODEL}\nkeys: {{cache_second: 5}}", r"keys: unknown setting\(s\) cache_second; known: cache_seconds"),
        (f"{ONE_MODEL}\nlimits: {{stor: memory}}", r"limits: unknown setting\(s\) stor"),
        ("models: [{id: a, endpoint: /v1/messages, provider: {kind: llamacpp}, fallback: [b]}]",
         r"models\[0\]: unknown setting\(s\) fallback"),
    ],
)
def test_config_mistakes_are_clear(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(path)
