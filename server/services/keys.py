"""KeyService: key administration over gRPC, for admin keys only.

Each write has a typed RPC and a REST one (...Http), which reads the caller's raw JSON body strictly into the typed
request (server/translate/json_to_message.py) after the caller is known to be an admin; both then run the same code.
A typed call holding a field these .proto files do not declare (a stub generated from newer ones: a limit added
later, a listing's filter) is refused as the REST body's unknown member is: stored without it, the caller would
believe it in force; read without it, the answer is not the one asked for. REST reaches the reads and the revoke
through Envoy's transcoder, which makes no such field.
"""

from __future__ import annotations

from collections.abc import Callable

from google.api import httpbody_pb2
from portico.v1 import key_pb2, key_service_pb2_grpc

from server.domain_keys import (
    KEY_LIMIT_NAMES, MAX_COUNT_LIMIT, MAX_GRACE_SECONDS, SPEND_LIMIT_NAMES, ApiKey, KeyLimits, is_key_id,
)
from server.errors import InvalidRequest
from server.keys import Authenticator, KeyAdmin
from server.translate.json_to_message import read_body
from server.translate.values import parse_body, refuse_undeclared
from server.usage.money import micros_to_usd, usd_to_micros


# Answers that carry a new secret (create, rotate): shown once, so no cache on the way (a proxy, a browser's back
# button) may keep a copy.
_SECRET_ANSWER = (("cache-control", "no-store"),)


def _count_limit_bounds(least: int) -> dict[str, tuple[int, int]]:
    """The range the API takes for each count limit, said of one beyond int32 (else its range, which no limit takes):
    from 1 in a new key, from 0 (which removes the key's own) in an update."""
    return {f"limits.{name}": (least, MAX_COUNT_LIMIT) for name in KEY_LIMIT_NAMES if name not in SPEND_LIMIT_NAMES}


class KeyServicer(key_service_pb2_grpc.KeyServiceServicer):
    def __init__(self, admin: KeyAdmin, authenticator: Authenticator,
                 acts_on: Callable[[str], None] = lambda key_id: None) -> None:
        """`acts_on(key_id)`: the key a call creates, reads or changes (telemetry puts it in the access log)."""
        self._admin = admin
        self._authenticator = authenticator
        self._acts_on = acts_on

    async def _admit(self, context, key_id: str = "") -> None:
        """The caller must hold an admin key; the key it names is then noted, if it has a key id's shape (a secret
        pasted in its place must not reach the log)."""
        await self._authenticator.authenticate_admin(context.invocation_metadata())
        key_id = key_id.strip()  # an id pasted with space around it is taken as the id (KeyStore.get): named too
        if is_key_id(key_id):
            self._acts_on(key_id)

    async def CreateKey(self, request, context) -> key_pb2.CreateKeyResponse:
        await self._admit(context)
        await context.send_initial_metadata(_SECRET_ANSWER)
        refuse_undeclared(request)
        return await self._create(request)

    async def CreateKeyHttp(self, request: httpbody_pb2.HttpBody, context) -> key_pb2.CreateKeyResponse:
        await self._admit(context)
        await context.send_initial_metadata(_SECRET_ANSWER)
        return await self._create(read_body(request.data, key_pb2.CreateKeyRequest, bounds=_count_limit_bounds(1)))

    async def UpdateKey(self, request, context) -> key_pb2.UpdateKeyResponse:
        await self._admit(context, request.id)
        refuse_undeclared(request)
        return await self._update(request)

    async def UpdateKeyHttp(self, request: key_pb2.UpdateKeyHttpRequest, context) -> key_pb2.UpdateKeyResponse:
        await self._admit(context, request.id)
        update = read_body(request.body.data, key_pb2.UpdateKeyRequest, url={"id": request.id},
                           bounds=_count_limit_bounds(0))
        if not update.models and not update.HasField("all_models") and _lists_no_model(request.body.data):
            update.all_models = False  # `"models": []`: no model, as a typed call says it; refused (KeyAdmin)
        return await self._update(update)

    async def RotateKey(self, request, context) -> key_pb2.RotateKeyResponse:
        await self._admit(context, request.id)
        await context.send_initial_metadata(_SECRET_ANSWER)
        refuse_undeclared(request)
        return await self._rotate(request)

    async def RotateKeyHttp(self, request: key_pb2.RotateKeyHttpRequest, context) -> key_pb2.RotateKeyResponse:
        await self._admit(context, request.id)
        await context.send_initial_metadata(_SECRET_ANSWER)
        return await self._rotate(read_body(request.body.data, key_pb2.RotateKeyRequest, url={"id": request.id},
                                            bounds={"grace_seconds": (0, MAX_GRACE_SECONDS)}))

    async def ListKeys(self, request, context) -> key_pb2.ListKeysResponse:
        await self._admit(context)
        refuse_undeclared(request)
        keys, next_page = await self._admin.list(page_size=request.page_size, page_token=request.page_token)
        return key_pb2.ListKeysResponse(keys=[key_to_pb(key) for key in keys], next_page_token=next_page)

    async def GetKey(self, request, context) -> key_pb2.GetKeyResponse:
        await self._admit(context, request.id)
        refuse_undeclared(request)
        return key_pb2.GetKeyResponse(key=key_to_pb(await self._admin.get(request.id)))

    async def RevokeKey(self, request, context) -> key_pb2.RevokeKeyResponse:
        await self._admit(context, request.id)
        refuse_undeclared(request)
        key = await self._admin.revoke(request.id)
        self._acts_on(key.id)  # revoked by a secret: the key found, never the secret, answers "who revoked X?"
        return key_pb2.RevokeKeyResponse(key=key_to_pb(key))

    # The writes, once for both kinds of caller.

    async def _create(self, request: key_pb2.CreateKeyRequest) -> key_pb2.CreateKeyResponse:
        limits = KeyLimits(**{f: _limit(request.limits, f) if request.limits.HasField(f) else None
                              for f in KEY_LIMIT_NAMES})
        key, secret = await self._admin.create(
            request.name, all_models=request.all_models, models=request.models, limits=limits,
            env=request.env, admin=request.admin,
        )
        self._acts_on(key.id)
        return key_pb2.CreateKeyResponse(key=key_to_pb(key), secret=secret)

    async def _update(self, request: key_pb2.UpdateKeyRequest) -> key_pb2.UpdateKeyResponse:
        grants = None
        if request.HasField("all_models") or request.models:
            grants = (request.all_models, request.models)
        # A limit that is set replaces the key's own; 0 removes it.
        limits = {f: _limit(request.limits, f) or None for f in KEY_LIMIT_NAMES if request.limits.HasField(f)}
        key = await self._admin.update(
            request.id,
            name=request.name if request.HasField("name") else None,
            grants=grants,
            limits=limits,
            env=request.env if request.HasField("env") else None,
        )
        return key_pb2.UpdateKeyResponse(key=key_to_pb(key))

    async def _rotate(self, request: key_pb2.RotateKeyRequest) -> key_pb2.RotateKeyResponse:
        grace = request.grace_seconds if request.HasField("grace_seconds") else None
        key, secret, expires = await self._admin.rotate(request.id, grace_seconds=grace)
        return key_pb2.RotateKeyResponse(key=key_to_pb(key), secret=secret, previous_secret_expires=expires)


def _lists_no_model(body: bytes) -> bool:
    """Whether a REST body gives `models` as an empty list: the caller's "no model", which the typed message cannot
    tell from a field left out (which keeps the grants)."""
    return parse_body(body).get("models", None) == [] if body.strip() else False


def _limit(limits: key_pb2.KeyLimits, name: str) -> int:
    """A limit as the key store holds it: budgets arrive in US dollars and are kept in micro-dollars."""
    value = getattr(limits, name)
    if name not in SPEND_LIMIT_NAMES:
        return value
    try:
        return usd_to_micros(value, f"limits.{name}", signed=True)
    except ValueError as exc:
        raise InvalidRequest(str(exc), param=f"limits.{name}") from None


def limits_to_pb(limits: KeyLimits) -> key_pb2.KeyLimits:
    """Limits as every API shows them: budgets in US dollars."""
    values = {f: getattr(limits, f) for f in KEY_LIMIT_NAMES}
    return key_pb2.KeyLimits(**{f: micros_to_usd(v) if f in SPEND_LIMIT_NAMES and v is not None else v
                                for f, v in values.items()})


def key_to_pb(key: ApiKey) -> key_pb2.ApiKey:
    return key_pb2.ApiKey(
        id=key.id, name=key.name, all_models=key.all_models, models=sorted(key.models),
        limits=limits_to_pb(key.limits),
        env=key.env, admin=key.admin, created=key.created, revoked_at=key.revoked_at,
    )
