"""Key administration: the one service behind both the admin KeyService (gRPC and REST) and `portico keys`.

It works over the key store's public methods and adds what both front ends must agree on: a key may only be granted
models of the catalog (a typo would otherwise make a key that can never be used), its env and name are checked
(the env becomes part of its secret), and a rotation without an explicit grace period uses the configured one.
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Collection, Iterable, Mapping

from server.domain_keys import MAX_GRACE_SECONDS, ApiKey, KeyLimits, is_key_id
from server.errors import InvalidRequest, NotFound, holds_secret
from server.keys.store import KeyStore

MAX_ENV_CHARS = 32
MAX_NAME_CHARS = 200
MAX_KEYS_PAGE = 1000  # ListKeys' page_size: ~160 KB of answer

# The env is written into the secret (pk-{env}-...): anything but these would make secrets that SDKs cannot send
# (non-ASCII), that break on whitespace, or that a console cannot sign in with.
_ENV = re.compile(rf"[A-Za-z0-9_-]{{0,{MAX_ENV_CHARS}}}")


def page_size_refusal() -> str:
    """The 400's message for a `page_size` out of 0..MAX_KEYS_PAGE; Envoy's Lua filter says it too, of a whole number
    beyond the request's uint32 or below 0 (gateway/query_ranges.py takes it there)."""
    return f"page_size must be between 1 and {MAX_KEYS_PAGE} (0 or none: every key)."


class KeyAdmin:
    def __init__(self, store: KeyStore, model_ids: Collection[str], *, rotation_grace_seconds: int) -> None:
        self._store = store
        self._model_ids = frozenset(model_ids)
        self._rotation_grace_seconds = rotation_grace_seconds

    async def create(
        self, name: str, *, all_models: bool, models: Iterable[str] = (), limits: KeyLimits = KeyLimits(),
        env: str = "", admin: bool = False,
    ) -> tuple[ApiKey, str]:
        """A new key and its secret, which is not kept anywhere."""
        _check_name(name)
        _check_env(env)
        models = self._granted(all_models, models)
        return await self._store.create(name, all_models=all_models, models=models, limits=limits, env=env, admin=admin)

    async def update(
        self, key_id: str, *, name: str | None = None, grants: tuple[bool, Iterable[str]] | None = None,
        limits: Mapping[str, int | None] | None = None, env: str | None = None,
    ) -> ApiKey:
        """Change only what is given; `grants` is (all_models, models), a limit of None removes the key's own."""
        if name is not None:
            _check_name(name)
        if env is not None:
            _check_env(env)
        if grants is not None:
            grants = (grants[0], self._granted(*grants))
        return await self._store.update(key_id, name=name, grants=grants, limits=limits, env=env)

    async def rotate(self, key_id: str, *, grace_seconds: int | None = None) -> tuple[ApiKey, str, int]:
        """The key, its new secret and when the previous secret stops working."""
        grace = self._rotation_grace_seconds if grace_seconds is None else grace_seconds
        if not 0 <= grace <= MAX_GRACE_SECONDS:
            raise InvalidRequest(f"grace_seconds must be a whole number of seconds from 0 to {MAX_GRACE_SECONDS}.",
                                 param="grace_seconds")
        return await self._store.rotate(key_id, grace_seconds=grace)

    async def revoke(self, id_or_secret: str) -> ApiKey:
        # A leaked secret is often pasted with what came around it (a line's end, a space before it); neither a
        # secret nor an id holds whitespace, so that is not read: else "No key has that secret." while it worked on.
        return await self._store.revoke(id_or_secret.strip())

    async def get(self, key_id: str) -> ApiKey:
        return await self._store.get(key_id)

    async def list(self, *, page_size: int = 0, page_token: str = "") -> tuple[list[ApiKey], str]:
        """A page of keys, oldest first, and the token of the next page ("" on the last): at most `page_size`
        (0: every one), going on after the key the token names (the previous page's last; its id)."""
        if not 0 <= page_size <= MAX_KEYS_PAGE:
            raise InvalidRequest(page_size_refusal(), param="page_size")
        after = None
        if page_token:
            # A token is the id of a page's last key: anything else (a secret pasted in, say) is no token, and is not
            # looked up as an id, whose refusal would name `id`, a parameter ListKeys does not have.
            refused = InvalidRequest("page_token is not a next_page_token ListKeys answered.", param="page_token")
            if not is_key_id(page_token):
                raise refused
            try:
                after = await self._store.get(page_token)
            except NotFound:
                raise refused from None
        keys = await self._store.list(limit=page_size + 1 if page_size else 0, after=after)
        if page_size and len(keys) > page_size:
            return keys[:page_size], keys[page_size - 1].id
        return keys, ""

    def _granted(self, all_models: bool, models: Iterable[str]) -> list[str]:
        models = list(models)
        if all_models and models:
            raise InvalidRequest("Grant either all_models or a list of models, not both: all_models grants every "
                                 "model, models exactly those.", param="models")
        if unknown := sorted(set(models) - self._model_ids):
            raise InvalidRequest(f"Unknown model(s): {', '.join(map(repr, unknown))}. Grant models of the catalog "
                                 "(GET /v1/models with an all-models key lists them).", param="models")
        return models


def _check_env(env: str) -> None:
    if not _ENV.fullmatch(env):
        raise InvalidRequest(f"env must be at most {MAX_ENV_CHARS} characters, each a letter, a digit, '-' or '_' "
                             "(it becomes part of the key's secret).", param="env")


def _check_name(name: str) -> None:
    # Cc: control characters (NUL among them, which PostgreSQL refuses); Cs: lone surrogates, which no store can
    # encode (a command-line argument that is not UTF-8 arrives as them).
    if len(name) > MAX_NAME_CHARS or any(unicodedata.category(c) in ("Cc", "Cs") for c in name):
        raise InvalidRequest(f"name must be at most {MAX_NAME_CHARS} characters, without control characters.",
                             param="name")
    # A name is stored as it comes and shown to every admin: never a secret, which is only kept as its hash (a secret
    # pasted into it, alone or with what came around it, as the console's keys search finds one).
    if holds_secret(name):
        raise InvalidRequest("name must not hold a key's secret (it is stored and listed in plain text): name the "
                             "key by what it is for.", param="name")
